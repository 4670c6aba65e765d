// gpt-oss (transformers' GptOssForCausalLM): projection biases, learned attention sinks,
// alternating sliding-window (layer_types) and full layers, YaRN rotary scaling, a router with a
// bias whose top-k logits are softmaxed (softmax + renormalisation: the same experts and
// weights), input-major experts with biases and the clamped SwiGLU; experts as MXFP4
// `*_blocks` / `*_scales` as OpenAI publishes them, or BF16/FP32 as transformers saves them.
#include "core/model/family.hpp"
#include "core/model/hf_keys.hpp"
#include "core/model/test_model.hpp"

namespace rolloutd::core {
namespace {

using nlohmann::json;
using namespace hf_keys;

void traits(ModelConfig& c) {
  c.moe_layout = MoeLayout::kInputMajorBiased;
  c.attention_sinks = true;
  c.expert_activation = ExpertActivation::kClampedSwiGLU;
  c.swiglu_alpha = 1.702;  // GptOssExperts.alpha (not a config key)
}

Status parse(const json& j, ModelConfig& c) {
  // GptOssConfig defaults where a key may be absent.
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 150000.0;
  c.attention_bias = true;
  c.norm_topk_prob = true;  // softmax over the top-k logits
  c.sliding_window = 128;
  c.swiglu_limit = 7.0;
  c.gate_up_checkpoint_interleaved = true;
  traits(c);
  RD_RETURN_IF_ERROR(parse_common(j, c));
  RD_RETURN_IF_ERROR(get_int(j, "num_local_experts", c.num_experts, 1, kMaxExperts, true));
  RD_RETURN_IF_ERROR(get_int(j, "num_experts_per_tok", c.num_experts_per_tok, 1, kMaxExperts, false));
  if (!j.contains("num_experts_per_tok"))
    RD_RETURN_IF_ERROR(get_int(j, "experts_per_token", c.num_experts_per_tok, 1, kMaxExperts, true));
  RD_RETURN_IF_ERROR(get_int(j, "intermediate_size", c.moe_intermediate_size, 1, kMaxDim, true));
  c.intermediate_size = c.moe_intermediate_size;
  RD_RETURN_IF_ERROR(get_int(j, "sliding_window", c.sliding_window, 1, kMaxVocab, false));
  RD_RETURN_IF_ERROR(get_double(j, "swiglu_limit", c.swiglu_limit, true));
  RD_RETURN_IF_ERROR(parse_layer_types(j, c));
  if (c.layer_types.empty()) {
    // GptOssConfig: sliding on even layers, full on odd ones.
    for (int64_t l = 0; l < c.num_hidden_layers; ++l)
      c.layer_types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
  }
  if (c.moe_intermediate_size % 32 != 0 || c.hidden_size % 32 != 0)
    return bad("intermediate_size", "gpt_oss MXFP4 experts need hidden_size and intermediate_size multiples of 32");
  return Status::Ok();
}

void write(const ModelConfig& c, json& j) {
  j["architectures"] = {"GptOssForCausalLM"};
  j["num_local_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["experts_per_token"] = c.num_experts_per_tok;
  j["intermediate_size"] = c.moe_intermediate_size;
  j["sliding_window"] = c.sliding_window;
  j["layer_types"] = c.layer_types;
  j["swiglu_limit"] = c.swiglu_limit;
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = 0.9;
}

Status check(const ModelConfig&) { return Status::Ok(); }

Status test_config(const TestModelSpec& s, ModelConfig& c) {
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
  return Status::Ok();
}

// The MLP of transformers' GptOssForCausalLM state dict in BF16 (save_pretrained of a model
// built from a config; the published checkpoints hold the experts as MXFP4 *_blocks/*_scales
// instead, which make_test_tensors writes from these when the spec asks).
std::vector<TestTensorSpec> mlp_tensors(const ModelConfig& c, int64_t l) {
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  const std::string p = "model.layers." + std::to_string(l) + ".mlp.";
  return {{p + "router.weight", {E, H}, TestInit::kRouter},
          {p + "router.bias", {E}, TestInit::kSmall},
          {p + "experts.gate_up_proj", {E, H, 2 * I}, TestInit::kMatrix},
          {p + "experts.gate_up_proj_bias", {E, 2 * I}, TestInit::kSmall},
          {p + "experts.down_proj", {E, I, H}, TestInit::kMatrix},
          {p + "experts.down_proj_bias", {E, H}, TestInit::kSmall}};
}

}  // namespace

const ModelFamily& model_family_gpt_oss() {
  static const ModelFamily f{"gpt_oss", traits, parse, write, check, test_config, mlp_tensors};
  return f;
}

}  // namespace rolloutd::core
