#include "core/sampling/sampler.hpp"

#include <algorithm>

namespace rolloutd::core {

SamplingRow sampling_row(const SamplingParams& p, uint64_t draw_index) {
  SamplingRow r;
  r.temperature = p.temperature;
  r.top_p = p.top_p;
  r.min_p = p.min_p;
  r.top_k = p.top_k;
  r.seed = p.seed;
  r.draw_index = draw_index;
  return r;
}

Status validate(const SamplingParams& p) { return cpu::check_sampling_row(sampling_row(p, 0)); }

double Sampler::uniform_draw(uint64_t seed, uint64_t draw_index) {
  return cpu::sampling_uniform(seed, draw_index);
}

SampledToken Sampler::sample(std::span<const float> logits, const SamplingParams& p, uint64_t draw_index,
                             int64_t top_n, TopLogprobs* top) {
  const auto V = static_cast<int64_t>(logits.size());
  const cpu::SampledRow r = cpu::sample_row(logits.data(), V, sampling_row(p, draw_index), scratch_);
  if (top != nullptr) {
    const int64_t n = std::clamp<int64_t>(top_n, 0, V);
    top->ids.resize(static_cast<size_t>(n));
    top->logprobs.resize(static_cast<size_t>(n));
    if (n > 0) cpu::top_logprobs_row(logits.data(), V, r.log_z, n, top->ids.data(), top->logprobs.data(), scratch_);
  }
  return SampledToken{r.token, r.logprob};
}

}  // namespace rolloutd::core
