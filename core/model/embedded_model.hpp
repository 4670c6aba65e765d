#pragma once
// The embedded default model: a tiny MoE decoder whose weights come from a fixed
// seed, so the daemon, the demo and the tests run with no model files at all.
// tests/reference/tiny_moe_reference.py re-implements the initialisation and the
// forward pass in NumPy; its goldens keep this honest.
#include <cstdint>
#include <string_view>

#include "core/model/config.hpp"
#include "core/model/moe_decoder.hpp"

namespace rolloutd::core {

inline constexpr std::string_view kEmbeddedModelName = "embedded:tiny-moe";
inline constexpr uint64_t kEmbeddedModelSeed = 20261130;

// vocab 256, hidden 64, 4 layers, 4 query / 2 KV heads of 16, 16 experts, top-4,
// expert intermediate 32.
ModelConfig embedded_model_config();

// Fills every registered parameter from (seed, parameter name):
// norms ~ 1 + U(-0.1, 0.1); embedding ~ U(-1, 1); other matrices ~ U(-g, g)/sqrt(fan_in)
// with gain g = 2 for routers, 4 for the LM head, 1 otherwise.
Status init_random_weights(MoeDecoder& model, uint64_t seed);

}  // namespace rolloutd::core
