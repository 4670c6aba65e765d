#pragma once
// Deterministic, portable random weights for the embedded default model and
// test models. Each tensor draws from its own stream, seeded by the model seed
// and the FNV-1a hash of the tensor's name, so the values do not depend on
// build order, platform or standard library (std::*_distribution is
// implementation-defined and is never used here). tests/reference/ re-implements
// this in NumPy to check the forward pass independently.
#include <cstdint>
#include <span>
#include <string_view>

namespace rolloutd::core {

uint64_t fnv1a64(std::string_view s);

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 24 bits: exactly representable in float32.
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }

 private:
  uint64_t state_;
};

// out[i] = center + scale * (2u - 1), u from the stream of (seed, name).
void fill_uniform(std::span<float> out, uint64_t seed, std::string_view name, float scale,
                  float center = 0.0f);

}  // namespace rolloutd::core
