#pragma once
// The reference sampler over one row of logits: the CPU backend's `sample` op and
// core::Sampler both run it, so the engine's host path and the op agree token for token.
// See Backend::sample for what it computes.
#include <cstdint>
#include <vector>

#include "kernels/backend.hpp"

namespace rolloutd::cpu {

struct SampledRow {
  int32_t token = -1;
  float logprob = 0.0f;  // log_softmax(logits)[token] = float(double(logits[token]) - log_z)
  double log_z = 0.0;    // the row's log-sum-exp, for top_logprobs_row
};

// Scratch reused across rows, so a caller sampling many tokens does not allocate per token.
struct SamplingScratch {
  std::vector<float> probs;
  std::vector<int32_t> order;
  std::vector<uint64_t> keys;
};

// kOutOfRange naming the parameter when `p` is outside core::validate's ranges.
Status check_sampling_row(const SamplingRow& p);

// One row; `p` must pass check_sampling_row. V == 0 gives token -1.
SampledRow sample_row(const float* logits, int64_t V, const SamplingRow& p, SamplingScratch& scratch);

// The n (1 <= n <= V) most likely tokens of the row and their log-probs, with sample_row's
// log_z: ids by logit descending, then id ascending; NaN ranks last; -0.0 equals +0.0
// (SampleArgs::top_ids).
void top_logprobs_row(const float* logits, int64_t V, double log_z, int64_t n, int32_t* ids, float* logprobs,
                      SamplingScratch& scratch);

// The uniform [0, 1) draw of (seed, draw_index): two SplitMix64 rounds of a hash of both.
double sampling_uniform(uint64_t seed, uint64_t draw_index);

}  // namespace rolloutd::cpu
