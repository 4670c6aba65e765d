#include "core/model/config.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace rolloutd::core {

Status ModelConfig::validate() const {
  auto positive = [](int64_t v, const char* field) -> Status {
    if (v <= 0) return Status(ErrorCode::kInvalidArgument, "must be positive", field);
    return Status::Ok();
  };
  RD_RETURN_IF_ERROR(positive(vocab_size, "vocab_size"));
  RD_RETURN_IF_ERROR(positive(hidden_size, "hidden_size"));
  RD_RETURN_IF_ERROR(positive(num_hidden_layers, "num_hidden_layers"));
  RD_RETURN_IF_ERROR(positive(num_attention_heads, "num_attention_heads"));
  RD_RETURN_IF_ERROR(positive(num_key_value_heads, "num_key_value_heads"));
  RD_RETURN_IF_ERROR(positive(head_dim, "head_dim"));
  RD_RETURN_IF_ERROR(positive(num_experts, "num_experts"));
  RD_RETURN_IF_ERROR(positive(num_experts_per_tok, "num_experts_per_tok"));
  RD_RETURN_IF_ERROR(positive(moe_intermediate_size, "moe_intermediate_size"));
  RD_RETURN_IF_ERROR(positive(max_position_embeddings, "max_position_embeddings"));
  if (num_attention_heads % num_key_value_heads != 0)
    return Status(ErrorCode::kInvalidArgument,
                  "num_attention_heads must be a multiple of num_key_value_heads",
                  "num_key_value_heads");
  if (head_dim % 2 != 0)
    return Status(ErrorCode::kInvalidArgument, "rotary embedding needs an even head_dim", "head_dim");
  if (num_experts_per_tok > num_experts)
    return Status(ErrorCode::kInvalidArgument, "top_k exceeds the number of experts",
                  "num_experts_per_tok");
  if (vocab_size > (int64_t{1} << 31) - 1)
    return Status(ErrorCode::kInvalidArgument, "vocab does not fit int32 token ids", "vocab_size");
  if (synthetic_param_bytes < 0 || synthetic_param_bytes > (int64_t{1} << 40))
    return Status(ErrorCode::kInvalidArgument, "must be in [0, 1 TiB]", "synthetic_param_bytes");
  if (synthetic_mxfp4_bytes < 0 || synthetic_mxfp4_bytes > (int64_t{1} << 40))
    return Status(ErrorCode::kInvalidArgument, "must be in [0, 1 TiB]", "synthetic_mxfp4_bytes");
  if (synthetic_fp8_bytes < 0 || synthetic_fp8_bytes > (int64_t{1} << 40))
    return Status(ErrorCode::kInvalidArgument, "must be in [0, 1 TiB]", "synthetic_fp8_bytes");
  if (synthetic_small_params < 0 || synthetic_small_params > 1000000)
    return Status(ErrorCode::kInvalidArgument, "must be in [0, 1e6]", "synthetic_small_params");
  if (!(rope_theta > 0.0)) return Status(ErrorCode::kInvalidArgument, "must be positive", "rope_theta");
  if (!(rms_norm_eps > 0.0)) return Status(ErrorCode::kInvalidArgument, "must be positive", "rms_norm_eps");
  if (decoder_sparse_step < 1)
    return Status(ErrorCode::kInvalidArgument, "must be at least 1", "decoder_sparse_step");
  if (intermediate_size < 0) return Status(ErrorCode::kInvalidArgument, "must not be negative", "intermediate_size");
  if (num_moe_layers() < num_hidden_layers && intermediate_size <= 0)
    return Status(ErrorCode::kInvalidArgument, "dense layers (mlp_only_layers, decoder_sparse_step) need it",
                  "intermediate_size");
  if (num_moe_layers() == 0)
    return Status(ErrorCode::kInvalidArgument, "no layer is MoE (mlp_only_layers, decoder_sparse_step)",
                  "decoder_sparse_step");
  if (!layer_types.empty() && static_cast<int64_t>(layer_types.size()) != num_hidden_layers)
    return Status(ErrorCode::kInvalidArgument, "must list one type per layer", "layer_types");
  for (const auto& t : layer_types)
    if (t == "sliding_attention" && sliding_window <= 0)
      return Status(ErrorCode::kInvalidArgument, "sliding-attention layers need a positive window", "sliding_window");
  if (experts_mxfp4) {
    for (const auto& [v, field] : {std::pair<int64_t, const char*>{hidden_size, "hidden_size"},
                                   {moe_intermediate_size, "moe_intermediate_size"}})
      if (v % 32 != 0)
        return Status(ErrorCode::kInvalidArgument,
                      "MXFP4 experts quantize blocks of 32 values along " + std::string(field) + ", which is " +
                          std::to_string(v) + ", not a multiple of 32",
                      field);
    if (moe_layout == MoeLayout::kOutputMajor && gate_up_checkpoint_interleaved)
      return Status(ErrorCode::kUnimplemented,
                    "MXFP4 output-major experts (" + family + ") keep gate rows then up rows: an interleaved fused "
                    "gate_up_proj is not supported with them",
                    "gate_up_checkpoint_interleaved");
  }
  return Status::Ok();
}

Result<ExpertQuantization> parse_expert_quantization(const std::string& name) {
  if (name == "none") return ExpertQuantization::kNone;
  if (name == "mxfp4") return ExpertQuantization::kMxfp4;
  return Status(ErrorCode::kInvalidArgument, "quantize_experts must be none or mxfp4, not '" + name + "'",
                "quantize_experts");
}

const char* expert_quantization_name(ExpertQuantization q) {
  return q == ExpertQuantization::kMxfp4 ? "mxfp4" : "none";
}

Status apply_expert_quantization(ModelConfig& c, ExpertQuantization q) {
  if (q == ExpertQuantization::kNone) return Status::Ok();
  // Input-major experts (gpt-oss) already MXFP4 as published are served as they are; BF16/FP32
  // ones are transposed per expert and quantized on load (WeightRegistry::add_mxfp4_input_major).
  if (c.moe_layout == MoeLayout::kInputMajorBiased && c.experts_mxfp4) return Status::Ok();
  ModelConfig want = c;
  want.experts_mxfp4 = true;
  if (Status s = want.validate(); !s.ok())
    return Status(s.code(), "--quantize-experts mxfp4: " + s.message(), s.field());
  c = std::move(want);
  return Status::Ok();
}

RopeFrequencies rope_frequencies(const ModelConfig& c) {
  // FP32 where transformers computes in float32 tensors, double where it uses Python floats.
  const int64_t dim = c.head_dim, half = dim / 2;
  const double base = c.rope_theta;
  RopeFrequencies r;
  r.inv_freq.resize(static_cast<size_t>(half));
  std::vector<float> pos_freqs(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    pos_freqs[static_cast<size_t>(i)] =
        static_cast<float>(std::pow(base, static_cast<double>(static_cast<float>(2 * i) / static_cast<float>(dim))));
  if (c.rope_type != "yarn") {
    for (int64_t i = 0; i < half; ++i) r.inv_freq[static_cast<size_t>(i)] = 1.0f / pos_freqs[static_cast<size_t>(i)];
    return r;
  }
  // transformers: original_max_position_embeddings defaults to max_position_embeddings, and an
  // absent factor is their ratio.
  const double orig = static_cast<double>(c.rope_original_max_position_embeddings > 0
                                              ? c.rope_original_max_position_embeddings
                                              : c.max_position_embeddings);
  const double factor = c.rope_factor > 0 ? c.rope_factor : static_cast<double>(c.max_position_embeddings) / orig;
  auto get_mscale = [](double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; };
  double attention = c.rope_attention_factor;
  if (attention <= 0)
    attention = c.rope_mscale > 0 && c.rope_mscale_all_dim > 0
                    ? get_mscale(factor, c.rope_mscale) / get_mscale(factor, c.rope_mscale_all_dim)
                    : get_mscale(factor, 1.0);
  r.attention_factor = static_cast<float>(attention);
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(dim) * std::log(orig / (rotations * 2 * M_PI)) / (2 * std::log(base));
  };
  double low = correction_dim(c.rope_beta_fast), high = correction_dim(c.rope_beta_slow);
  if (c.rope_truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // transformers: "prevent singularity"
  for (int64_t i = 0; i < half; ++i) {
    const float ramp = std::clamp(static_cast<float>((static_cast<float>(i) - low) / (high - low)), 0.0f, 1.0f);
    const float extrapolation = 1.0f - ramp;
    const float pf = pos_freqs[static_cast<size_t>(i)];
    const float inv_extra = 1.0f / pf;
    const float inv_inter = 1.0f / (static_cast<float>(factor) * pf);
    r.inv_freq[static_cast<size_t>(i)] = inv_inter * (1.0f - extrapolation) + inv_extra * extrapolation;
  }
  return r;
}

std::string routed_experts_dtype_for(int64_t num_experts) {
  if (num_experts <= 256) return "uint8";
  if (num_experts <= 65536) return "uint16";
  return "int32";
}

}  // namespace rolloutd::core
