#include "core/model/test_model.hpp"

#include "kernels/quant/quant_ops.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/model/family.hpp"
#include "core/model/hf_config.hpp"
#include "core/model/random_init.hpp"
#include "core/model/safetensors.hpp"
#include "kernels/bf16.hpp"

namespace rolloutd::core {

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
  const ModelFamily* family = find_model_family(s.family);
  if (family == nullptr)
    return Status(ErrorCode::kInvalidArgument, "family must be one of " + model_family_list(), "family");
  RD_RETURN_IF_ERROR(family->test_config(s, c));
  // Round-trip through config.json: what a reader of the written checkpoint gets (the expert
  // format is read from the tensors, not from config.json).
  RD_ASSIGN_OR_RETURN(ModelConfig back, model_config_from_hf(model_config_to_hf(c)));
  // Published MXFP4 experts (*_blocks / *_scales) exist for input-major experts (gpt-oss);
  // output-major families quantize on load instead (--quantize-experts mxfp4).
  if (s.experts_mxfp4 && back.moe_layout != MoeLayout::kInputMajorBiased)
    return Status(ErrorCode::kInvalidArgument,
                  "MXFP4 experts are written as published for input-major experts (gpt_oss); " + s.family +
                      " quantizes on load instead (--quantize-experts mxfp4)",
                  "experts_mxfp4");
  back.experts_mxfp4 = s.experts_mxfp4;
  return back;
}

Result<std::vector<TestTensor>> make_test_tensors(const ModelConfig& c, uint64_t seed) {
  const ModelFamily* family = find_model_family(c.family);
  if (family == nullptr)
    return Status(ErrorCode::kInvalidArgument, "family must be one of " + model_family_list(), "family");
  std::vector<TestTensorSpec> specs = {{"model.embed_tokens.weight", {c.vocab_size, c.hidden_size}, TestInit::kEmbedding}};
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    // The attention block as every family's decoder layer names it, from the traits.
    const int64_t H = c.hidden_size, D = c.head_dim, QH = c.num_attention_heads, KVH = c.num_key_value_heads;
    const std::string p = "model.layers." + std::to_string(l) + ".";
    specs.push_back({p + "input_layernorm.weight", {H}, TestInit::kNorm});
    struct Proj {
      const char* name;
      int64_t out, in;
    };
    for (const Proj& j : {Proj{"q_proj", QH * D, H}, Proj{"k_proj", KVH * D, H}, Proj{"v_proj", KVH * D, H},
                          Proj{"o_proj", H, QH * D}}) {
      specs.push_back({p + "self_attn." + j.name + ".weight", {j.out, j.in}, TestInit::kMatrix});
      if (c.attention_bias) specs.push_back({p + "self_attn." + j.name + ".bias", {j.out}, TestInit::kSmall});
    }
    if (c.attention_sinks) specs.push_back({p + "self_attn.sinks", {QH}, TestInit::kSmall});
    if (c.qk_norm) {
      specs.push_back({p + "self_attn.q_norm.weight", {D}, TestInit::kNorm});
      specs.push_back({p + "self_attn.k_norm.weight", {D}, TestInit::kNorm});
    }
    specs.push_back({p + "post_attention_layernorm.weight", {H}, TestInit::kNorm});
    std::vector<TestTensorSpec> mlp = family->test_mlp_tensors(c, l);
    specs.insert(specs.end(), std::make_move_iterator(mlp.begin()), std::make_move_iterator(mlp.end()));
  }
  specs.push_back({"model.norm.weight", {c.hidden_size}, TestInit::kNorm});
  specs.push_back({"lm_head.weight", {c.vocab_size, c.hidden_size}, TestInit::kLmHead});
  const DType dt = c.checkpoint_dtype == "float32" ? DType::kF32 : DType::kBF16;
  std::vector<TestTensor> out;
  std::vector<float> v;
  for (const TestTensorSpec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    if (n > (int64_t{1} << 32))
      return Status(ErrorCode::kInvalidArgument, "tensor too large for a test model", s.name);
    v.resize(static_cast<size_t>(n));
    // fan_in: the input dimension of the matrix as the forward pass multiplies it.
    int64_t fan_in = s.shape.back();
    if (c.moe_layout == MoeLayout::kInputMajorBiased && s.shape.size() == 3) fan_in = s.shape[1];  // [E, in, out]
    switch (s.init) {
      case TestInit::kNorm: fill_uniform(v, seed, s.name, 0.1f, 1.0f); break;
      case TestInit::kEmbedding: fill_uniform(v, seed, s.name, 1.0f); break;
      case TestInit::kSmall: fill_uniform(v, seed, s.name, 0.1f); break;
      case TestInit::kMatrix:
      case TestInit::kRouter:
      case TestInit::kLmHead: {
        const float gain = s.init == TestInit::kRouter ? 2.0f : s.init == TestInit::kLmHead ? 4.0f : 1.0f;
        fill_uniform(v, seed, s.name, gain / std::sqrt(static_cast<float>(fan_in)));
        break;
      }
    }
    if (c.experts_mxfp4 && s.shape.size() == 3 && s.name.find("mlp.experts.") != std::string::npos) {
      // [E, in, out] -> [E, out, in] (BF16-rounded like the BF16 checkpoint), then MXFP4 along `in`.
      const int64_t E = s.shape[0], in = s.shape[1], outd = s.shape[2];
      // In 64 x 64 tiles: element by element, one side of the transpose strides by a whole row
      // (minutes for the 3 GB h2880 checkpoint of tests/gpu/bench-engine-gpt-oss.sh).
      std::vector<float> tr(static_cast<size_t>(n));
      constexpr int64_t kTile = 64;
      for (int64_t e = 0; e < E; ++e)
        for (int64_t i0 = 0; i0 < in; i0 += kTile)
          for (int64_t o0 = 0; o0 < outd; o0 += kTile)
            for (int64_t i = i0; i < std::min(in, i0 + kTile); ++i)
              for (int64_t o = o0; o < std::min(outd, o0 + kTile); ++o)
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
