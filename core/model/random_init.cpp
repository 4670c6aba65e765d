#include "core/model/random_init.hpp"

namespace rolloutd::core {

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

void fill_uniform(std::span<float> out, uint64_t seed, std::string_view name, float scale,
                  float center) {
  SplitMix64 rng(seed ^ fnv1a64(name));
  for (float& v : out) v = center + scale * (2.0f * rng.uniform() - 1.0f);
}

}  // namespace rolloutd::core
