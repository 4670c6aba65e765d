#pragma once
// Hugging Face `config.json` <-> ModelConfig. The keys every family shares are read by
// hf_keys::parse_common (core/model/hf_keys.hpp); each family's own keys, defaults and
// architecture traits by its file under core/model/families/ (core/model/family.hpp), found by
// `model_type`:
//
//  - qwen3_moe: QK-norm, softmax top-k with norm_topk_prob, dense layers from mlp_only_layers /
//    decoder_sparse_step, output-major experts.
//  - gpt_oss: projection/router/expert biases, learned sinks, sliding-window layers
//    (layer_types), YaRN rotary scaling, the clamped SwiGLU; input-major experts from BF16/FP32
//    tensors (transformers' layout) or MXFP4 `*_blocks`/`*_scales` as published.
//
// Absent keys take the transformers defaults of that family's config class; present keys
// must have the right JSON type and a sane range. Errors are kInvalidArgument (kUnimplemented
// for a valid setting the decoder cannot run) with the config key as the field.
#include <string>

#include <nlohmann/json.hpp>

#include "core/model/config.hpp"
#include "kernels/status.hpp"

namespace rolloutd::core {

Result<ModelConfig> model_config_from_hf(const nlohmann::json& config);
// Reads and parses `path` (a config.json); messages name the file.
Result<ModelConfig> load_hf_config(const std::string& path);
// The config.json transformers writes for `c` (make-test-model).
nlohmann::json model_config_to_hf(const ModelConfig& c);
// Ok when MoeDecoder can run `c`; kUnimplemented naming what it lacks otherwise.
Status check_decoder_supports(const ModelConfig& c);

}  // namespace rolloutd::core
