#include "core/model/test_model.hpp"

#include "kernels/quant/quant_ops.hpp"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/model/hf_config.hpp"
#include "core/model/random_init.hpp"
#include "core/model/safetensors.hpp"
#include "kernels/bf16.hpp"

namespace rolloutd::core {
namespace {

enum class Init { kNorm, kEmbedding, kMatrix, kRouter, kLmHead, kSmall };

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  Init init;
};

std::vector<Spec> qwen3_moe_tensors(const ModelConfig& c) {
  const int64_t H = c.hidden_size, D = c.head_dim, QH = c.num_attention_heads, KVH = c.num_key_value_heads,
                E = c.num_experts, I = c.moe_intermediate_size;
  std::vector<Spec> t;
  t.push_back({"model.embed_tokens.weight", {c.vocab_size, H}, Init::kEmbedding});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {H}, Init::kNorm});
    t.push_back({p + "self_attn.q_proj.weight", {QH * D, H}, Init::kMatrix});
    t.push_back({p + "self_attn.k_proj.weight", {KVH * D, H}, Init::kMatrix});
    t.push_back({p + "self_attn.v_proj.weight", {KVH * D, H}, Init::kMatrix});
    t.push_back({p + "self_attn.o_proj.weight", {H, QH * D}, Init::kMatrix});
    t.push_back({p + "self_attn.q_norm.weight", {D}, Init::kNorm});
    t.push_back({p + "self_attn.k_norm.weight", {D}, Init::kNorm});
    t.push_back({p + "post_attention_layernorm.weight", {H}, Init::kNorm});
    if (!c.is_moe_layer(l)) {
      const int64_t Id = c.intermediate_size;
      t.push_back({p + "mlp.gate_proj.weight", {Id, H}, Init::kMatrix});
      t.push_back({p + "mlp.up_proj.weight", {Id, H}, Init::kMatrix});
      t.push_back({p + "mlp.down_proj.weight", {H, Id}, Init::kMatrix});
      continue;
    }
    t.push_back({p + "mlp.gate.weight", {E, H}, Init::kRouter});
    // Per-expert tensors: what transformers 5 saves (it fuses them into
    // mlp.experts.gate_up_proj / down_proj in memory and splits them again on save), and what
    // the published Qwen3-MoE checkpoints hold.
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      t.push_back({x + "gate_proj.weight", {I, H}, Init::kMatrix});
      t.push_back({x + "up_proj.weight", {I, H}, Init::kMatrix});
      t.push_back({x + "down_proj.weight", {H, I}, Init::kMatrix});
    }
  }
  t.push_back({"model.norm.weight", {H}, Init::kNorm});
  t.push_back({"lm_head.weight", {c.vocab_size, H}, Init::kLmHead});
  return t;
}

// transformers' GptOssForCausalLM state dict in BF16 (save_pretrained of a model built from
// a config; the published checkpoints hold the experts as MXFP4 *_blocks/*_scales instead).
std::vector<Spec> gpt_oss_tensors(const ModelConfig& c) {
  const int64_t H = c.hidden_size, D = c.head_dim, QH = c.num_attention_heads, KVH = c.num_key_value_heads,
                E = c.num_experts, I = c.moe_intermediate_size;
  std::vector<Spec> t;
  t.push_back({"model.embed_tokens.weight", {c.vocab_size, H}, Init::kEmbedding});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {H}, Init::kNorm});
    for (const auto& [n, rows] : {std::pair<const char*, int64_t>{"q_proj", QH * D}, {"k_proj", KVH * D}, {"v_proj", KVH * D}}) {
      t.push_back({p + "self_attn." + n + ".weight", {rows, H}, Init::kMatrix});
      t.push_back({p + "self_attn." + n + ".bias", {rows}, Init::kSmall});
    }
    t.push_back({p + "self_attn.o_proj.weight", {H, QH * D}, Init::kMatrix});
    t.push_back({p + "self_attn.o_proj.bias", {H}, Init::kSmall});
    t.push_back({p + "self_attn.sinks", {QH}, Init::kSmall});
    t.push_back({p + "post_attention_layernorm.weight", {H}, Init::kNorm});
    t.push_back({p + "mlp.router.weight", {E, H}, Init::kRouter});
    t.push_back({p + "mlp.router.bias", {E}, Init::kSmall});
    t.push_back({p + "mlp.experts.gate_up_proj", {E, H, 2 * I}, Init::kMatrix});
    t.push_back({p + "mlp.experts.gate_up_proj_bias", {E, 2 * I}, Init::kSmall});
    t.push_back({p + "mlp.experts.down_proj", {E, I, H}, Init::kMatrix});
    t.push_back({p + "mlp.experts.down_proj_bias", {E, H}, Init::kSmall});
  }
  t.push_back({"model.norm.weight", {H}, Init::kNorm});
  t.push_back({"lm_head.weight", {c.vocab_size, H}, Init::kLmHead});
  return t;
}

}  // namespace

Result<ModelConfig> test_model_config(const TestModelSpec& s) {
  ModelConfig c;
  c.family = s.family;
  c.name = "rolloutd-test-" + s.family;
  c.vocab_size = s.vocab;
  c.hidden_size = s.hidden;
  c.num_hidden_layers = s.layers;
  c.num_attention_heads = s.heads;
  c.num_key_value_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.num_experts = s.experts;
  c.num_experts_per_tok = s.top_k;
  c.moe_intermediate_size = s.intermediate;
  c.intermediate_size = 3 * s.intermediate;
  c.max_position_embeddings = 4096;
  c.checkpoint_dtype = s.dtype;
  if (s.dtype != "bfloat16" && s.dtype != "float32")
    return Status(ErrorCode::kInvalidArgument, "dtype must be bfloat16 or float32", "dtype");
  if (s.family == "qwen3_moe") {
    c.mlp_only_layers = s.mlp_only_layers;
    c.decoder_sparse_step = s.decoder_sparse_step;
    c.qk_norm = true;
    c.norm_topk_prob = true;
    c.rope_theta = 1000000.0;
    c.rms_norm_eps = 1e-6;
  } else if (s.family == "gpt_oss") {
    c.attention_bias = true;
    c.rope_theta = 150000.0;
    c.rms_norm_eps = 1e-5;
    c.sliding_window = s.sliding_window;
    c.swiglu_limit = 7.0;
    c.rope_type = "yarn";
    c.rope_factor = 32.0;
    c.rope_original_max_position_embeddings = 4096;
    c.rope_truncate = false;
    c.gate_up_checkpoint_interleaved = true;
    for (int64_t l = 0; l < s.layers; ++l) c.layer_types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
  } else {
    return Status(ErrorCode::kInvalidArgument, "family must be qwen3_moe or gpt_oss", "family");
  }
  if (s.experts_mxfp4 && s.family != "gpt_oss")
    return Status(ErrorCode::kInvalidArgument, "MXFP4 experts are a gpt_oss option", "experts_mxfp4");
  // Round-trip through config.json: what a reader of the written checkpoint gets (the expert
  // format is read from the tensors, not from config.json).
  RD_ASSIGN_OR_RETURN(ModelConfig back, model_config_from_hf(model_config_to_hf(c)));
  back.experts_mxfp4 = s.experts_mxfp4;
  return back;
}

Result<std::vector<TestTensor>> make_test_tensors(const ModelConfig& c, uint64_t seed) {
  const std::vector<Spec> specs = c.family == "gpt_oss" ? gpt_oss_tensors(c) : qwen3_moe_tensors(c);
  const DType dt = c.checkpoint_dtype == "float32" ? DType::kF32 : DType::kBF16;
  std::vector<TestTensor> out;
  std::vector<float> v;
  for (const Spec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    if (n > (int64_t{1} << 32))
      return Status(ErrorCode::kInvalidArgument, "tensor too large for a test model", s.name);
    v.resize(static_cast<size_t>(n));
    // fan_in: the input dimension of the matrix as the forward pass multiplies it.
    int64_t fan_in = s.shape.back();
    if (c.family == "gpt_oss" && s.shape.size() == 3) fan_in = s.shape[1];  // [E, in, out]
    switch (s.init) {
      case Init::kNorm: fill_uniform(v, seed, s.name, 0.1f, 1.0f); break;
      case Init::kEmbedding: fill_uniform(v, seed, s.name, 1.0f); break;
      case Init::kSmall: fill_uniform(v, seed, s.name, 0.1f); break;
      case Init::kMatrix:
      case Init::kRouter:
      case Init::kLmHead: {
        const float gain = s.init == Init::kRouter ? 2.0f : s.init == Init::kLmHead ? 4.0f : 1.0f;
        fill_uniform(v, seed, s.name, gain / std::sqrt(static_cast<float>(fan_in)));
        break;
      }
    }
    if (c.experts_mxfp4 && s.shape.size() == 3 && s.name.find("mlp.experts.") != std::string::npos) {
      // [E, in, out] -> [E, out, in] (BF16-rounded like the BF16 checkpoint), then MXFP4 along `in`.
      const int64_t E = s.shape[0], in = s.shape[1], outd = s.shape[2];
      std::vector<float> tr(static_cast<size_t>(n));
      for (int64_t e = 0; e < E; ++e)
        for (int64_t i = 0; i < in; ++i)
          for (int64_t o = 0; o < outd; ++o)
            tr[static_cast<size_t>((e * outd + o) * in + i)] =
                bf16_bits_to_f32(f32_to_bf16_bits(v[static_cast<size_t>((e * in + i) * outd + o)]));
      TestTensor blocks{s.name + "_blocks", {E, outd, in / 32, 16}, DType::kU8, {}};
      TestTensor scales{s.name + "_scales", {E, outd, in / 32}, DType::kU8, {}};
      blocks.bytes.resize(static_cast<size_t>(E * outd * in / 2));
      scales.bytes.resize(static_cast<size_t>(E * outd * in / 32));
      const ExecContext host{};
      RD_RETURN_IF_ERROR(quant::quantize_mxfp4(
          host, TensorView::contiguous(tr.data(), DType::kF32, Shape{E, outd, in}),
          TensorView::contiguous(blocks.bytes.data(), DType::kU8, Shape{E, outd, in / 32, 16}),
          TensorView::contiguous(scales.bytes.data(), DType::kU8, Shape{E, outd, in / 32})));
      out.push_back(std::move(blocks));
      out.push_back(std::move(scales));
      continue;
    }
    TestTensor t{s.name, s.shape, dt, {}};
    t.bytes.resize(static_cast<size_t>(n) * dtype_size(dt));
    if (dt == DType::kF32) {
      std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
    } else {
      for (size_t i = 0; i < v.size(); ++i) {
        const uint16_t b = f32_to_bf16_bits(v[i]);
        t.bytes[2 * i] = static_cast<uint8_t>(b & 0xFF);
        t.bytes[2 * i + 1] = static_cast<uint8_t>(b >> 8);
      }
    }
    out.push_back(std::move(t));
  }
  return out;
}

Status write_test_model(const TestModelSpec& spec, const std::string& dir) {
  RD_ASSIGN_OR_RETURN(ModelConfig c, test_model_config(spec));
  RD_ASSIGN_OR_RETURN(std::vector<TestTensor> tensors, make_test_tensors(c, spec.seed));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status(ErrorCode::kUnavailable, "cannot create " + dir + ": " + ec.message(), "out");
  std::vector<SafetensorsTensorIn> in;
  for (const auto& t : tensors) in.push_back({t.name, t.dtype, t.shape, t.bytes});
  RD_RETURN_IF_ERROR(write_safetensors(dir + "/model.safetensors", in, {{"format", "pt"}}));
  nlohmann::json cfg = model_config_to_hf(c);
  cfg["rolloutd_test_model"] = {{"seed", spec.seed}};
  if (c.experts_mxfp4)  // what transformers reads to load the *_blocks / *_scales experts
    cfg["quantization_config"] = {{"quant_method", "mxfp4"},
                                  {"modules_to_not_convert", {"model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"}}};
  std::ofstream f(dir + "/config.json", std::ios::trunc);
  f << cfg.dump(2) << "\n";
  if (!f.flush()) return Status(ErrorCode::kUnavailable, "cannot write " + dir + "/config.json", "out");
  return Status::Ok();
}

}  // namespace rolloutd::core
