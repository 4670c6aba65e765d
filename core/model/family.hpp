#pragma once
// Model families: what distinguishes qwen3_moe from gpt_oss from the next one, in one place each.
//
// A family is one file, core/model/families/<model_type>.cpp, defining
// `const ModelFamily& model_family_<model_type>()` in rolloutd::core. The build lists every file
// of that folder (core/CMakeLists.txt generates the registry), so adding a family is adding that
// file: its architecture traits (set_traits), its config.json keys and defaults (parse_config /
// write_config: the writer must write back every key the parser needs), the settings of its
// config the decoder cannot run (check_supported), and its random test checkpoint (test_config /
// test_mlp_tensors, for `rolloutctl make-test-model`). Every .cpp in that folder is a family:
// shared helpers live outside it (hf_keys.hpp). What the decoder runs is described by the
// architecture traits of ModelConfig that parse_config sets (moe_layout, attention_sinks,
// expert_activation, qk_norm, attention_bias, layer_types, ...): the decoder, the checkpoint
// loader and the quantization options read those traits, never a family's name.
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/model/config.hpp"
#include "kernels/status.hpp"

namespace rolloutd::core {

struct TestModelSpec;  // core/model/test_model.hpp

// How make-test-model fills a tensor (values in core/model/test_model.hpp's header comment).
enum class TestInit { kNorm, kEmbedding, kMatrix, kRouter, kLmHead, kSmall };

struct TestTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  TestInit init;
};

struct ModelFamily {
  // config.json's model_type (and the file's name).
  std::string_view model_type;
  // Sets the family's architecture traits (moe_layout, attention_sinks, expert_activation,
  // swiglu_alpha): what the decoder reads instead of the family's name. parse_config calls it;
  // check_decoder_supports compares a config's traits with it.
  void (*set_traits)(ModelConfig& c);
  // config.json -> ModelConfig: the family's config class defaults and traits, hf_keys::parse_common
  // for the keys every family shares, then its own keys.
  Status (*parse_config)(const nlohmann::json& j, ModelConfig& c);
  // ModelConfig -> the family's own keys of config.json (model_config_to_hf writes the shared ones).
  void (*write_config)(const ModelConfig& c, nlohmann::json& j);
  // kUnimplemented for a setting of this family the decoder cannot run (the shared checks are in
  // check_decoder_supports).
  Status (*check_supported)(const ModelConfig& c);
  // make-test-model: the family's conventions on top of the spec's sizes in `c`; kInvalidArgument
  // for a spec option the family does not have.
  Status (*test_config)(const TestModelSpec& s, ModelConfig& c);
  // make-test-model: the checkpoint tensors of layer l's MLP (`model.layers.{l}.mlp.*`), in the
  // order transformers lists them. make_test_tensors writes the rest from the traits: the
  // embedding, each layer's norms and attention (projection biases with attention_bias, sinks
  // with attention_sinks, q/k norms with qk_norm), the final norm and the LM head.
  std::vector<TestTensorSpec> (*test_mlp_tensors)(const ModelConfig& c, int64_t l);
};

// The family of a model_type, or nullptr.
const ModelFamily* find_model_family(std::string_view model_type);
// Every family's model_type, sorted.
std::vector<std::string> model_family_names();
// "a, b, c": for messages.
std::string model_family_list();

}  // namespace rolloutd::core
