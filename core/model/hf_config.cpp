#include "core/model/hf_config.hpp"

#include <algorithm>
#include <fstream>

#include "core/model/family.hpp"
#include "core/model/hf_keys.hpp"

namespace rolloutd::core {
namespace hf_keys {

using nlohmann::json;

Status bad(const std::string& key, std::string message) {
  return Status(ErrorCode::kInvalidArgument, key + ": " + message, key);
}

// Reads config[key] as an integer in [lo, hi]; `def` when absent (or null) and not required.
Status get_int(const json& j, const std::string& key, int64_t& out, int64_t lo, int64_t hi, bool required) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return bad(key, "missing (required for " + j.value("model_type", std::string("?")) + ")");
    return Status::Ok();
  }
  if (!it->is_number_integer()) return bad(key, "must be an integer, got " + it->dump());
  const int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) return bad(key, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(v));
  out = v;
  return Status::Ok();
}

Status get_double(const json& j, const std::string& key, double& out, bool positive) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number()) return bad(key, "must be a number, got " + it->dump());
  const double v = it->get<double>();
  if (!(v == v) || (positive && !(v > 0)) || v > 1e30) return bad(key, "must be a positive finite number");
  out = v;
  return Status::Ok();
}

Status get_bool(const json& j, const std::string& key, bool& out) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean()) return bad(key, "must be true or false, got " + it->dump());
  out = it->get<bool>();
  return Status::Ok();
}

Status get_string(const json& j, const std::string& key, std::string& out) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_string()) return bad(key, "must be a string, got " + it->dump());
  out = it->get<std::string>();
  return Status::Ok();
}

namespace {

// Rotary settings: transformers 5 writes `rope_parameters` {rope_type, rope_theta, ...};
// earlier versions `rope_theta` at the top and `rope_scaling` (null or {rope_type|type, ...}).
Status parse_rope(const json& j, ModelConfig& c) {
  RD_RETURN_IF_ERROR(get_double(j, "rope_theta", c.rope_theta, true));
  const json* scaling = nullptr;
  std::string key;
  for (const char* k : {"rope_parameters", "rope_scaling"}) {
    const auto it = j.find(k);
    if (it != j.end() && !it->is_null()) {
      if (!it->is_object()) return bad(k, "must be an object or null");
      scaling = &*it;
      key = k;
      break;
    }
  }
  if (!scaling) return Status::Ok();
  RD_RETURN_IF_ERROR(get_double(*scaling, "rope_theta", c.rope_theta, true).with_field_prefix(key));
  std::string type = "default";
  for (const char* k : {"rope_type", "type"})
    if (scaling->contains(k)) RD_RETURN_IF_ERROR(get_string(*scaling, k, type).with_field_prefix(key));
  if (type == "default") {
    c.rope_type = type;
    return Status::Ok();
  }
  if (type != "yarn")
    return Status(ErrorCode::kUnimplemented, key + ".rope_type '" + type + "' is not supported (default, yarn)",
                  key + ".rope_type");
  c.rope_type = type;
  c.rope_factor = 0.0;  // absent: transformers derives it (max_position_embeddings / original)
  RD_RETURN_IF_ERROR(get_double(*scaling, "factor", c.rope_factor, true).with_field_prefix(key));
  RD_RETURN_IF_ERROR(get_double(*scaling, "beta_fast", c.rope_beta_fast, true).with_field_prefix(key));
  RD_RETURN_IF_ERROR(get_double(*scaling, "beta_slow", c.rope_beta_slow, true).with_field_prefix(key));
  RD_RETURN_IF_ERROR(get_int(*scaling, "original_max_position_embeddings", c.rope_original_max_position_embeddings,
                             1, kMaxVocab, false)
                         .with_field_prefix(key));
  RD_RETURN_IF_ERROR(get_bool(*scaling, "truncate", c.rope_truncate).with_field_prefix(key));
  for (auto [name, out] : {std::pair<const char*, double*>{"attention_factor", &c.rope_attention_factor},
                           {"mscale", &c.rope_mscale},
                           {"mscale_all_dim", &c.rope_mscale_all_dim}})
    if (scaling->contains(name) && !(*scaling)[name].is_null())
      RD_RETURN_IF_ERROR(get_double(*scaling, name, *out, true).with_field_prefix(key));
  return Status::Ok();
}

Status parse_dtype(const json& j, ModelConfig& c) {
  // transformers 5 writes "dtype", earlier versions "torch_dtype".
  for (const char* k : {"dtype", "torch_dtype"}) {
    if (!j.contains(k) || j[k].is_null()) continue;
    RD_RETURN_IF_ERROR(get_string(j, k, c.checkpoint_dtype));
    if (c.checkpoint_dtype != "bfloat16" && c.checkpoint_dtype != "float32" && c.checkpoint_dtype != "float16")
      return bad(k, "'" + c.checkpoint_dtype + "' is not a checkpoint dtype (bfloat16, float16, float32)");
    return Status::Ok();
  }
  return Status::Ok();
}

}  // namespace

Status parse_common(const json& j, ModelConfig& c) {
  RD_RETURN_IF_ERROR(get_int(j, "vocab_size", c.vocab_size, 1, kMaxVocab, true));
  RD_RETURN_IF_ERROR(get_int(j, "hidden_size", c.hidden_size, 1, kMaxDim, true));
  RD_RETURN_IF_ERROR(get_int(j, "num_hidden_layers", c.num_hidden_layers, 1, kMaxLayers, true));
  RD_RETURN_IF_ERROR(get_int(j, "num_attention_heads", c.num_attention_heads, 1, 4096, true));
  c.num_key_value_heads = c.num_attention_heads;
  RD_RETURN_IF_ERROR(get_int(j, "num_key_value_heads", c.num_key_value_heads, 1, 4096, false));
  c.head_dim = c.hidden_size / c.num_attention_heads;
  RD_RETURN_IF_ERROR(get_int(j, "head_dim", c.head_dim, 1, 4096, false));
  if (c.head_dim <= 0) return bad("head_dim", "hidden_size / num_attention_heads is 0; give head_dim");
  RD_RETURN_IF_ERROR(get_int(j, "max_position_embeddings", c.max_position_embeddings, 1, kMaxVocab, false));
  RD_RETURN_IF_ERROR(get_double(j, "rms_norm_eps", c.rms_norm_eps, true));
  RD_RETURN_IF_ERROR(get_bool(j, "tie_word_embeddings", c.tie_word_embeddings));
  RD_RETURN_IF_ERROR(get_bool(j, "attention_bias", c.attention_bias));
  std::string act = "silu";
  RD_RETURN_IF_ERROR(get_string(j, "hidden_act", act));
  if (act != "silu") return Status(ErrorCode::kUnimplemented, "hidden_act '" + act + "' is not supported (silu)", "hidden_act");
  RD_RETURN_IF_ERROR(parse_rope(j, c));
  RD_RETURN_IF_ERROR(parse_dtype(j, c));
  if (c.num_attention_heads * c.head_dim > kMaxDim) return bad("head_dim", "num_attention_heads x head_dim is too large");
  return Status::Ok();
}

Status parse_layer_types(const json& j, ModelConfig& c) {
  if (!j.contains("layer_types") || j["layer_types"].is_null()) return Status::Ok();
  const json& t = j["layer_types"];
  if (!t.is_array() || static_cast<int64_t>(t.size()) != c.num_hidden_layers)
    return bad("layer_types", "must list one type per layer (num_hidden_layers)");
  c.layer_types.clear();
  for (const auto& v : t) {
    if (!v.is_string() || (v != "sliding_attention" && v != "full_attention"))
      return bad("layer_types", "entries must be \"sliding_attention\" or \"full_attention\"");
    c.layer_types.push_back(v.get<std::string>());
  }
  return Status::Ok();
}

}  // namespace hf_keys

using nlohmann::json;
using hf_keys::bad;
using hf_keys::get_string;

Result<ModelConfig> model_config_from_hf(const json& j) {
  if (!j.is_object()) return bad("config", "config.json is not a JSON object");
  std::string type;
  RD_RETURN_IF_ERROR(get_string(j, "model_type", type));
  ModelConfig c;
  c.family = type;
  c.synthetic_param_bytes = 0;
  const ModelFamily* family = find_model_family(type);
  if (family == nullptr)
    return Status(ErrorCode::kUnimplemented,
                  "model_type '" + type + "' is not supported (" + model_family_list() + ")", "model_type");
  RD_RETURN_IF_ERROR(family->parse_config(j, c));
  c.name = type;
  if (j.contains("_name_or_path") && j["_name_or_path"].is_string() && !j["_name_or_path"].get<std::string>().empty())
    c.name = j["_name_or_path"].get<std::string>();
  RD_RETURN_IF_ERROR(c.validate());
  return c;
}

Result<ModelConfig> load_hf_config(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status(ErrorCode::kNotFound, "cannot open " + path, path);
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    return Status(ErrorCode::kInvalidArgument, path + " is not valid JSON: " + e.what(), path);
  }
  auto c = model_config_from_hf(j);
  if (!c.ok()) return Status(c.status().code(), path + ": " + c.status().message(), c.status().field());
  return c;
}

json model_config_to_hf(const ModelConfig& c) {
  json j = {
      {"model_type", c.family},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"attention_bias", c.attention_bias},
      {"attention_dropout", 0.0},
      {"hidden_act", "silu"},
      {"initializer_range", 0.02},
      {"use_cache", true},
      {"dtype", c.checkpoint_dtype},
      {"bos_token_id", nullptr},
      {"eos_token_id", nullptr},
      {"pad_token_id", nullptr},
  };
  json rope = {{"rope_type", c.rope_type}, {"rope_theta", c.rope_theta}};
  if (c.rope_type == "yarn") {
    rope["factor"] = c.rope_factor;
    rope["beta_fast"] = c.rope_beta_fast;
    rope["beta_slow"] = c.rope_beta_slow;
    rope["original_max_position_embeddings"] = c.rope_original_max_position_embeddings;
    rope["truncate"] = c.rope_truncate;
  }
  j["rope_parameters"] = rope;
  if (const ModelFamily* family = find_model_family(c.family)) family->write_config(c, j);
  return j;
}

Status check_decoder_supports(const ModelConfig& c) {
  auto no = [&](const std::string& what, const std::string& field) {
    return Status(ErrorCode::kUnimplemented,
                  "model family " + c.family + " is not supported yet by the decoder: " + what, field);
  };
  const ModelFamily* family = find_model_family(c.family);
  if (family == nullptr) return no("unknown family (" + model_family_list() + ")", "model_type");
  if (c.tie_word_embeddings) return no("tie_word_embeddings = true (lm_head shared with embed_tokens)", "tie_word_embeddings");
  if (c.rope_type != "default" && c.rope_type != "yarn") return no("rope_type '" + c.rope_type + "'", "rope_parameters");
  if (c.expert_activation == ExpertActivation::kClampedSwiGLU && !(c.swiglu_limit > 0))
    return no("swiglu_limit must be positive (the clamped SwiGLU)", "swiglu_limit");
  // The traits the decoder reads must be the family's: a config built in code with another
  // family's name and the default traits would otherwise run the wrong layout quietly.
  ModelConfig own;
  family->set_traits(own);
  if (own.moe_layout != c.moe_layout || own.attention_sinks != c.attention_sinks ||
      own.expert_activation != c.expert_activation || own.swiglu_alpha != c.swiglu_alpha)
    return Status(ErrorCode::kInvalidArgument,
                  "the config's architecture traits (moe_layout, attention_sinks, expert_activation) are not those "
                  "of model_type " + c.family + ": build it with that family's parser (model_config_from_hf) or set_traits",
                  "model_type");
  return family->check_supported(c);
}

}  // namespace rolloutd::core
