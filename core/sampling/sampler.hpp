#pragma once
// Token sampling from one row of logits. Deterministic by construction: the
// random draw for a request's n-th sampled token depends only on (seed, n), not
// on which other requests share the batch, so the same seed gives the same
// tokens however the scheduler groups requests.
//
// Log-probabilities are reported under the *unmodified* distribution
// (log_softmax of the raw logits, temperature 1, no filtering): the quantity an
// RL trainer compares against its own forward pass.
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/cpu/cpu_sampling.hpp"
#include "kernels/status.hpp"

namespace rolloutd::core {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy (argmax, lowest id on ties)
  float top_p = 1.0f;        // (0, 1]
  int32_t top_k = 0;         // 0 = disabled
  float min_p = 0.0f;        // [0, 1]: drop tokens with p < min_p * p_max
  uint64_t seed = 0;
};

struct SampledToken {
  int32_t token = -1;
  float logprob = 0.0f;      // log_softmax(logits)[token]
};

// The n most likely tokens of a row and their log-probs (SampleArgs::top_ids' order).
struct TopLogprobs {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
};

Status validate(const SamplingParams& p);

// The sampling op's row for a request's n-th sampled token (Backend::sample).
SamplingRow sampling_row(const SamplingParams& p, uint64_t draw_index);

// Host sampling: the CPU backend's `sample` op over one row (kernels/cpu/cpu_sampling.hpp), with
// reusable scratch so the engine does not allocate per token.
class Sampler {
 public:
  // With top_n > 0 (at most the row's length) `top` receives the row's top_n most likely tokens,
  // computed with the same log-sum-exp as the token's log-prob.
  SampledToken sample(std::span<const float> logits, const SamplingParams& params, uint64_t draw_index,
                      int64_t top_n = 0, TopLogprobs* top = nullptr);

  // The uniform [0, 1) draw used for (seed, draw_index); exposed for tests.
  static double uniform_draw(uint64_t seed, uint64_t draw_index);

 private:
  cpu::SamplingScratch scratch_;
};

}  // namespace rolloutd::core
