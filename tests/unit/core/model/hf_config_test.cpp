// core/model/hf_config: Hugging Face config.json of qwen3_moe and gpt_oss into ModelConfig.
#include "core/model/hf_config.hpp"

#include "core/model/family.hpp"

#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

namespace rolloutd {
namespace {

using nlohmann::json;

// Qwen/Qwen3-30B-A3B's config.json (transformers 4.51 spelling: rope_theta at the top).
json qwen3_30b() {
  return json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": true,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
}

// openai/gpt-oss-20b's config.json (layer_types shortened to the default pattern).
json gpt_oss_20b() {
  json j = json::parse(R"({
    "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false,
    "pad_token_id": 199999, "quantization_config": {"quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": false, "use_cache": true, "vocab_size": 201088})");
  j["layer_types"] = json::array();
  for (int l = 0; l < 24; ++l) j["layer_types"].push_back(l % 2 ? "full_attention" : "sliding_attention");
  return j;
}

TEST(HfConfig, Qwen3Moe) {
  auto c = core::model_config_from_hf(qwen3_30b());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->family, "qwen3_moe");
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_EQ(c->hidden_size, 2048);
  EXPECT_EQ(c->num_hidden_layers, 48);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_EQ(c->moe_intermediate_size, 768);
  EXPECT_EQ(c->intermediate_size, 6144);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->checkpoint_dtype, "bfloat16");
  EXPECT_TRUE(core::check_decoder_supports(*c).ok());
}

TEST(HfConfig, Transformers5RopeParametersAndDefaults) {
  json j = qwen3_30b();
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j.erase("norm_topk_prob");
  j.erase("head_dim");
  j.erase("torch_dtype");
  j["dtype"] = "float32";
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5000.0}};
  auto c = core::model_config_from_hf(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_DOUBLE_EQ(c->rope_theta, 5000.0);
  EXPECT_FALSE(c->norm_topk_prob) << "Qwen3MoeConfig's default";
  EXPECT_EQ(c->head_dim, 2048 / 32);
  EXPECT_EQ(c->checkpoint_dtype, "float32");
}

TEST(HfConfig, RefusalsNameTheKey) {
  struct Case {
    const char* key;
    json value;
    ErrorCode code;
  };
  const Case cases[] = {
      {"hidden_size", "2048", ErrorCode::kInvalidArgument},
      {"hidden_size", 0, ErrorCode::kInvalidArgument},
      {"num_experts", -1, ErrorCode::kInvalidArgument},
      {"num_experts_per_tok", 1.5, ErrorCode::kInvalidArgument},
      {"norm_topk_prob", 1, ErrorCode::kInvalidArgument},
      {"rms_norm_eps", -1.0, ErrorCode::kInvalidArgument},
      {"hidden_act", "gelu", ErrorCode::kUnimplemented},
      {"use_sliding_window", true, ErrorCode::kUnimplemented},
      {"mlp_only_layers", json::array({48}), ErrorCode::kInvalidArgument},
      {"model_type", "llama", ErrorCode::kUnimplemented},
      {"torch_dtype", "int8", ErrorCode::kInvalidArgument},
  };
  for (const auto& c : cases) {
    json j = qwen3_30b();
    j[c.key] = c.value;
    auto r = core::model_config_from_hf(j);
    EXPECT_EQ(r.status().code(), c.code) << c.key << " = " << c.value.dump() << ": " << r.status().to_string();
    EXPECT_EQ(r.status().field(), c.key) << r.status().to_string();
  }
  json j = qwen3_30b();
  j.erase("num_experts");
  EXPECT_EQ(core::model_config_from_hf(j).status().field(), "num_experts") << "required key";
  j = qwen3_30b();
  j["num_experts_per_tok"] = 200;
  EXPECT_EQ(core::model_config_from_hf(j).status().field(), "num_experts_per_tok") << "top_k > experts";
  EXPECT_FALSE(core::model_config_from_hf(json::array()).ok());
}

TEST(HfConfig, DenseLayers) {
  json j = qwen3_30b();
  j["mlp_only_layers"] = {0, 3};
  j["decoder_sparse_step"] = 2;
  auto c = core::model_config_from_hf(j);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->mlp_only_layers, (std::vector<int64_t>{0, 3}));
  // Qwen3MoeDecoderLayer: MoE iff not in mlp_only_layers and (l + 1) % step == 0.
  EXPECT_FALSE(c->is_moe_layer(0));
  EXPECT_TRUE(c->is_moe_layer(1));
  EXPECT_FALSE(c->is_moe_layer(2));
  EXPECT_FALSE(c->is_moe_layer(3));
  EXPECT_TRUE(c->is_moe_layer(5));
  EXPECT_EQ(c->num_moe_layers(), 23);
  EXPECT_TRUE(core::check_decoder_supports(*c).ok());
  j["mlp_only_layers"] = json::array();
  j["decoder_sparse_step"] = 49;
  EXPECT_EQ(core::model_config_from_hf(j).status().field(), "decoder_sparse_step") << "no MoE layer left";
}

TEST(HfConfig, TiedEmbeddingsAreRefusedByTheDecoder) {
  json j = qwen3_30b();
  j["tie_word_embeddings"] = true;
  Status s = core::check_decoder_supports(*core::model_config_from_hf(j));
  EXPECT_EQ(s.code(), ErrorCode::kUnimplemented);
  EXPECT_EQ(s.field(), "tie_word_embeddings");
}

TEST(HfConfig, GptOssIsParsedAndServed) {
  auto c = core::model_config_from_hf(gpt_oss_20b());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->family, "gpt_oss");
  EXPECT_EQ(c->num_experts, 32);
  EXPECT_EQ(c->num_experts_per_tok, 4);
  EXPECT_EQ(c->moe_intermediate_size, 2880);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->rope_type, "yarn");
  EXPECT_DOUBLE_EQ(c->rope_factor, 32.0);
  EXPECT_EQ(c->rope_original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c->rope_theta, 150000.0);
  EXPECT_EQ(c->sliding_window, 128);
  EXPECT_DOUBLE_EQ(c->swiglu_limit, 7.0);
  ASSERT_EQ(c->layer_types.size(), 24u);
  EXPECT_EQ(c->layer_types[0], "sliding_attention");
  EXPECT_TRUE(c->attention_bias);
  EXPECT_FALSE(c->rope_truncate);
  EXPECT_TRUE(core::check_decoder_supports(*c).ok()) << core::check_decoder_supports(*c).to_string();
  // YaRN's attention factor: 0.1 * ln(32) + 1 (no mscale keys); the highest-frequency pair
  // (i = 0) is pure extrapolation (inv_freq 1), the lowest pure interpolation (/ factor).
  const core::RopeFrequencies rf = core::rope_frequencies(*c);
  ASSERT_EQ(rf.inv_freq.size(), 32u);
  EXPECT_FLOAT_EQ(rf.attention_factor, static_cast<float>(0.1 * std::log(32.0) + 1.0));
  EXPECT_FLOAT_EQ(rf.inv_freq[0], 1.0f);
  EXPECT_FLOAT_EQ(rf.inv_freq[31], static_cast<float>(1.0 / std::pow(150000.0, 62.0 / 64.0) / 32.0));
  // Without "factor", transformers derives it from the two context lengths (131072 / 4096 = 32).
  json nf = gpt_oss_20b();
  nf["rope_scaling"].erase("factor");
  auto derived = core::model_config_from_hf(nf);
  ASSERT_TRUE(derived.ok());
  EXPECT_TRUE(core::check_decoder_supports(*derived).ok()) << core::check_decoder_supports(*derived).to_string();
  EXPECT_EQ(core::rope_frequencies(*derived).inv_freq, rf.inv_freq);
  // Without either, the original length is max_position_embeddings: factor 1, no scaling.
  nf["rope_scaling"].erase("original_max_position_embeddings");
  auto plain = core::model_config_from_hf(nf);
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(core::check_decoder_supports(*plain).ok()) << core::check_decoder_supports(*plain).to_string();
  const core::RopeFrequencies pf = core::rope_frequencies(*plain);
  EXPECT_FLOAT_EQ(pf.attention_factor, 1.0f);
  for (size_t i = 0; i < pf.inv_freq.size(); ++i)
    EXPECT_NEAR(pf.inv_freq[i], 1.0 / std::pow(150000.0, 2.0 * static_cast<double>(i) / 64.0),
                2e-7 * pf.inv_freq[i]) << i;

  json j = gpt_oss_20b();
  j["layer_types"] = {"full_attention"};
  EXPECT_EQ(core::model_config_from_hf(j).status().field(), "layer_types");
  j = gpt_oss_20b();
  j["rope_scaling"]["rope_type"] = "longrope";
  EXPECT_EQ(core::model_config_from_hf(j).status().code(), ErrorCode::kUnimplemented);
}

TEST(HfConfig, WriterRoundTrips) {
  for (json src : {qwen3_30b(), gpt_oss_20b()}) {
    auto c = core::model_config_from_hf(src);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    auto back = core::model_config_from_hf(core::model_config_to_hf(*c));
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(core::model_config_to_hf(*back), core::model_config_to_hf(*c));
  }
}

// The families come from core/model/families/ (one file each): the registry finds them by
// model_type, refuses the others naming the known ones, and each family's parser sets the
// architecture traits the decoder reads (the reference models' facts: gpt-oss has sinks, biased
// input-major experts and the clamped SwiGLU; Qwen3-MoE none of them).
TEST(HfConfig, FamiliesAreFoundByModelTypeAndSetTheTraits) {
  const std::vector<std::string> names = core::model_family_names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  for (const char* known : {"gpt_oss", "qwen3_moe"})
    EXPECT_NE(std::find(names.begin(), names.end(), known), names.end()) << known;
  for (const std::string& name : core::model_family_names()) {
    const core::ModelFamily* f = core::find_model_family(name);
    ASSERT_NE(f, nullptr) << name;
    EXPECT_EQ(f->model_type, name);
  }
  EXPECT_EQ(core::find_model_family("mixtral"), nullptr);
  EXPECT_EQ(core::find_model_family(""), nullptr);
  json j = qwen3_30b();
  j["model_type"] = "mixtral";
  auto unknown = core::model_config_from_hf(j);
  EXPECT_EQ(unknown.status().code(), ErrorCode::kUnimplemented);
  EXPECT_EQ(unknown.status().field(), "model_type");
  EXPECT_NE(unknown.status().message().find("gpt_oss, qwen3_moe"), std::string::npos) << unknown.status().to_string();
  core::ModelConfig unknown_family;
  unknown_family.family = "mixtral";
  EXPECT_EQ(core::check_decoder_supports(unknown_family).field(), "model_type");

  auto q = core::model_config_from_hf(qwen3_30b());
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->moe_layout, core::MoeLayout::kOutputMajor);
  EXPECT_FALSE(q->attention_sinks);
  EXPECT_EQ(q->expert_activation, core::ExpertActivation::kSiLU);
  auto g = core::model_config_from_hf(gpt_oss_20b());
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->moe_layout, core::MoeLayout::kInputMajorBiased);
  EXPECT_TRUE(g->attention_sinks);
  EXPECT_EQ(g->expert_activation, core::ExpertActivation::kClampedSwiGLU);
  EXPECT_FLOAT_EQ(static_cast<float>(g->swiglu_alpha), 1.702f);
  EXPECT_TRUE(g->norm_topk_prob);  // top-k logits softmaxed = softmax top-k renormalised
  EXPECT_TRUE(core::check_decoder_supports(*g).ok());
  // gpt-oss's router renormalises whatever a stray key says (GptOssConfig has no such key).
  json stray = gpt_oss_20b();
  stray["norm_topk_prob"] = false;
  EXPECT_TRUE(core::model_config_from_hf(stray)->norm_topk_prob);
  // A config built in code under gpt_oss's name but with the default (Qwen3) traits is refused
  // before a decoder would run it with the wrong layout; so are traits of another family.
  core::ModelConfig in_code = *q;
  in_code.family = "gpt_oss";
  in_code.swiglu_limit = 7.0;
  in_code.attention_bias = true;
  const Status s = core::check_decoder_supports(in_code);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_EQ(s.field(), "model_type");
  core::ModelConfig sinks = *q;
  sinks.attention_sinks = true;
  EXPECT_EQ(core::check_decoder_supports(sinks).field(), "model_type");
  EXPECT_TRUE(core::check_decoder_supports(*q).ok());
  // The check compares traits, not a config.json round trip: keys a writer leaves out (YaRN
  // without original_max_position_embeddings) do not refuse a config that parsed.
  json yarn = qwen3_30b();
  yarn["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
  auto y = core::model_config_from_hf(yarn);
  ASSERT_TRUE(y.ok()) << y.status().to_string();
  EXPECT_TRUE(core::check_decoder_supports(*y).ok()) << core::check_decoder_supports(*y).to_string();
}

}  // namespace
}  // namespace rolloutd
