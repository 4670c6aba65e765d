#pragma once
// Reading config.json keys, shared by the model families (core/model/families/*.cpp). Each
// getter leaves `out` alone when the key is absent or null (the family's default stays), checks
// the JSON type and the range otherwise, and fails with kInvalidArgument naming the key.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/model/config.hpp"
#include "kernels/status.hpp"

namespace rolloutd::core::hf_keys {

constexpr int64_t kMaxDim = int64_t{1} << 20;  // hidden, intermediate, heads x head_dim
constexpr int64_t kMaxVocab = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = 1 << 16;

Status bad(const std::string& key, std::string message);
// An integer in [lo, hi]; `required`: absent is an error.
Status get_int(const nlohmann::json& j, const std::string& key, int64_t& out, int64_t lo, int64_t hi, bool required);
Status get_double(const nlohmann::json& j, const std::string& key, double& out, bool positive);
Status get_bool(const nlohmann::json& j, const std::string& key, bool& out);
Status get_string(const nlohmann::json& j, const std::string& key, std::string& out);
// The keys every family shares: sizes, heads, norms, rotary (rope_parameters / rope_scaling),
// dtype, tie_word_embeddings, attention_bias, hidden_act (silu only).
Status parse_common(const nlohmann::json& j, ModelConfig& c);
// `layer_types` (one "sliding_attention" | "full_attention" per layer), if present.
Status parse_layer_types(const nlohmann::json& j, ModelConfig& c);

}  // namespace rolloutd::core::hf_keys
