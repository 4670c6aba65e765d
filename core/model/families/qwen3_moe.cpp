// Qwen3-MoE (transformers' Qwen3MoeForCausalLM): QK-norm, softmax top-k with norm_topk_prob,
// dense SwiGLU layers from mlp_only_layers / decoder_sparse_step, output-major experts under
// `mlp.experts.*` (per expert as published, stacked as transformers 5 holds them), BF16/FP32 or
// MXFP4 on arrival (--quantize-experts mxfp4).
#include "core/model/family.hpp"
#include "core/model/hf_keys.hpp"
#include "core/model/test_model.hpp"

namespace rolloutd::core {
namespace {

using nlohmann::json;
using namespace hf_keys;

void traits(ModelConfig& c) {
  c.moe_layout = MoeLayout::kOutputMajor;
  c.attention_sinks = false;
  c.expert_activation = ExpertActivation::kSiLU;
}

Status parse(const json& j, ModelConfig& c) {
  // Qwen3MoeConfig defaults where a key may be absent.
  c.norm_topk_prob = false;
  c.rms_norm_eps = 1e-6;
  c.qk_norm = true;
  traits(c);
  RD_RETURN_IF_ERROR(parse_common(j, c));
  RD_RETURN_IF_ERROR(get_int(j, "num_experts", c.num_experts, 1, kMaxExperts, true));
  RD_RETURN_IF_ERROR(get_int(j, "num_experts_per_tok", c.num_experts_per_tok, 1, kMaxExperts, true));
  RD_RETURN_IF_ERROR(get_int(j, "moe_intermediate_size", c.moe_intermediate_size, 1, kMaxDim, true));
  c.intermediate_size = 6144;  // Qwen3MoeConfig's default: only dense layers use it
  RD_RETURN_IF_ERROR(get_int(j, "intermediate_size", c.intermediate_size, 1, kMaxDim, false));
  RD_RETURN_IF_ERROR(get_bool(j, "norm_topk_prob", c.norm_topk_prob));
  RD_RETURN_IF_ERROR(get_int(j, "decoder_sparse_step", c.decoder_sparse_step, 1, kMaxLayers, false));
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    const json& m = j["mlp_only_layers"];
    if (!m.is_array()) return bad("mlp_only_layers", "must be a list of layer indices");
    for (const auto& v : m) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_hidden_layers)
        return bad("mlp_only_layers", "entries must be layer indices in [0, num_hidden_layers)");
      c.mlp_only_layers.push_back(v.get<int64_t>());
    }
  }
  bool sliding = false;
  RD_RETURN_IF_ERROR(get_bool(j, "use_sliding_window", sliding));
  if (sliding)
    return Status(ErrorCode::kUnimplemented, "use_sliding_window: sliding-window attention is not supported for qwen3_moe yet",
                  "use_sliding_window");
  return Status::Ok();
}

void write(const ModelConfig& c, json& j) {
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["num_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["intermediate_size"] = c.intermediate_size > 0 ? c.intermediate_size : c.moe_intermediate_size * 3;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["decoder_sparse_step"] = c.decoder_sparse_step;
  j["mlp_only_layers"] = c.mlp_only_layers;
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = c.num_hidden_layers;
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = 0.001;
}

Status check(const ModelConfig& c) {
  if (c.attention_bias)
    return Status(ErrorCode::kUnimplemented,
                  "model family qwen3_moe is not supported yet by the decoder: attention_bias = true", "attention_bias");
  return Status::Ok();
}

Status test_config(const TestModelSpec& s, ModelConfig& c) {
  c.mlp_only_layers = s.mlp_only_layers;
  c.decoder_sparse_step = s.decoder_sparse_step;
  c.qk_norm = true;
  c.norm_topk_prob = true;
  c.rope_theta = 1000000.0;
  c.rms_norm_eps = 1e-6;
  return Status::Ok();
}

// A layer's MLP as transformers saves it: a dense SwiGLU for mlp_only_layers, else the router
// and per-expert tensors (what transformers 5 saves: it fuses them into mlp.experts.gate_up_proj
// / down_proj in memory and splits them again on save, and what the published checkpoints hold).
std::vector<TestTensorSpec> mlp_tensors(const ModelConfig& c, int64_t l) {
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  const std::string p = "model.layers." + std::to_string(l) + ".mlp.";
  if (!c.is_moe_layer(l)) {
    const int64_t Id = c.intermediate_size;
    return {{p + "gate_proj.weight", {Id, H}, TestInit::kMatrix},
            {p + "up_proj.weight", {Id, H}, TestInit::kMatrix},
            {p + "down_proj.weight", {H, Id}, TestInit::kMatrix}};
  }
  std::vector<TestTensorSpec> t = {{p + "gate.weight", {E, H}, TestInit::kRouter}};
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = p + "experts." + std::to_string(e) + ".";
    t.push_back({x + "gate_proj.weight", {I, H}, TestInit::kMatrix});
    t.push_back({x + "up_proj.weight", {I, H}, TestInit::kMatrix});
    t.push_back({x + "down_proj.weight", {H, I}, TestInit::kMatrix});
  }
  return t;
}

}  // namespace

const ModelFamily& model_family_qwen3_moe() {
  static const ModelFamily f{"qwen3_moe", traits, parse, write, check, test_config, mlp_tensors};
  return f;
}

}  // namespace rolloutd::core
