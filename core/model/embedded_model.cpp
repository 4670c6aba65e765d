#include "core/model/embedded_model.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "core/model/random_init.hpp"

namespace rolloutd::core {
namespace {
bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}
}  // namespace

ModelConfig embedded_model_config() {
  ModelConfig c;
  c.name = std::string(kEmbeddedModelName);
  c.family = "qwen3_moe";
  c.vocab_size = 256;
  c.hidden_size = 64;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.num_experts = 16;
  c.num_experts_per_tok = 4;
  c.moe_intermediate_size = 32;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6;
  c.max_position_embeddings = 4096;
  c.norm_topk_prob = true;
  return c;
}

Status init_random_weights(MoeDecoder& model, uint64_t seed) {
  std::vector<float> host;
  WeightRegistry& reg = model.weights();
  for (const RegisteredParameter& p : reg.parameters()) {
    if (p.name.rfind("synthetic", 0) == 0) continue;  // benchmark-only: written by updates
    if (p.storage.dtype == DType::kU8) {
      // MXFP4 experts: random element codes, scales 2^-7 .. 2^0 (magnitudes below 6).
      std::vector<uint8_t> bytes(static_cast<size_t>(p.storage.numel()));
      SplitMix64 rng(seed ^ fnv1a64(p.name));
      const bool scales = ends_with(p.name, "_scales");
      for (auto& b : bytes) b = static_cast<uint8_t>(scales ? 120 + rng.next() % 8 : rng.next() & 0xff);
      const CheckpointTensor* t = reg.resolve(p.name);
      if (!t) return Status(ErrorCode::kInternal, "no whole-tensor checkpoint name", p.name);
      const std::vector<int64_t> shape(p.storage.shape.data(), p.storage.shape.data() + p.storage.rank());
      RD_RETURN_IF_ERROR(reg.load(*t, DType::kU8, shape, bytes));
      continue;
    }
    // BF16 parameters (dense projections on CUDA, ModelConfig::dense_bf16) take the FP32 values
    // rounded by the registry, as a checkpoint's FP32 tensors would be.
    if (p.storage.dtype != DType::kF32 && p.storage.dtype != DType::kBF16)
      return Status(ErrorCode::kInternal, "random init expects FP32 or BF16 parameters", p.name);
    host.resize(static_cast<size_t>(p.storage.numel()));
    const int64_t fan_in = p.storage.size(p.storage.rank() - 1);
    if (ends_with(p.name, "norm.weight")) {
      fill_uniform(host, seed, p.name, 0.1f, 1.0f);
    } else if (p.name == "model.embed_tokens.weight") {
      fill_uniform(host, seed, p.name, 1.0f);
    } else {
      float gain = 1.0f;
      if (ends_with(p.name, "mlp.gate.weight")) gain = 2.0f;
      if (p.name == "lm_head.weight") gain = 4.0f;
      fill_uniform(host, seed, p.name, gain / std::sqrt(static_cast<float>(fan_in)));
    }
    // The values are in checkpoint layout; write them through the registry like any loader.
    const CheckpointTensor* t = reg.resolve(p.name);
    if (!t) return Status(ErrorCode::kInternal, "no whole-tensor checkpoint name", p.name);
    const std::vector<int64_t> shape(p.storage.shape.data(), p.storage.shape.data() + p.storage.rank());
    RD_RETURN_IF_ERROR(reg.load(*t, DType::kF32, shape,
                                {reinterpret_cast<const uint8_t*>(host.data()), host.size() * sizeof(float)}));
  }
  return reg.postprocess_all();
}

}  // namespace rolloutd::core
