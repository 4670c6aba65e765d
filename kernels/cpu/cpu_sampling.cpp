#include "kernels/cpu/cpu_sampling.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

namespace rolloutd::cpu {

Status check_sampling_row(const SamplingRow& p) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f)
    return Status(ErrorCode::kOutOfRange, "temperature must be finite and >= 0", "temperature");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    return Status(ErrorCode::kOutOfRange, "top_p must be in (0, 1]", "top_p");
  if (p.top_k < 0) return Status(ErrorCode::kOutOfRange, "top_k must be >= 0", "top_k");
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f))
    return Status(ErrorCode::kOutOfRange, "min_p must be in [0, 1]", "min_p");
  return Status::Ok();
}

double sampling_uniform(uint64_t seed, uint64_t draw_index) {
  // Counter-based: hash (seed, index) through two SplitMix64 rounds (core::SplitMix64's steps).
  uint64_t state = seed ^ (draw_index * 0xD1B54A32D192ED03ull);
  uint64_t bits = 0;
  for (int round = 0; round < 2; ++round) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    bits = z ^ (z >> 31);
  }
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);  // 53 bits
}

namespace {
// A total order on (logit, id) as one integer, larger = more likely: the logit's bits made
// monotonic (negative floats flipped, positive ones offset), NaN at 0 and -0.0 as +0.0, then
// the id inverted so the lower id wins a tie. The CUDA op builds the same key.
uint64_t top_key(float l, int64_t id) {
  uint32_t u = 0;  // NaN
  if (!std::isnan(l)) {
    uint32_t bits = 0;
    if (l != 0.0f) std::memcpy(&bits, &l, sizeof bits);
    u = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  return (static_cast<uint64_t>(u) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(id));
}
}  // namespace

void top_logprobs_row(const float* logits, int64_t V, double log_z, int64_t n, int32_t* ids, float* logprobs,
                      SamplingScratch& scratch) {
  std::vector<uint64_t>& keys = scratch.keys;
  keys.resize(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) keys[static_cast<size_t>(i)] = top_key(logits[i], i);
  const auto first = keys.begin(), nth = keys.begin() + n;
  std::nth_element(first, nth - 1, keys.end(), std::greater<>());
  std::sort(first, nth, std::greater<>());
  for (int64_t j = 0; j < n; ++j) {
    const auto id = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(keys[static_cast<size_t>(j)]));
    ids[j] = id;
    logprobs[j] = static_cast<float>(static_cast<double>(logits[id]) - log_z);
  }
}

SampledRow sample_row(const float* logits_data, int64_t V_signed, const SamplingRow& p, SamplingScratch& scratch) {
  SampledRow out;
  if (V_signed <= 0) return out;
  const size_t V = static_cast<size_t>(V_signed);
  const float* logits = logits_data;
  std::vector<float>& probs_ = scratch.probs;
  std::vector<int32_t>& order_ = scratch.order;

  // log_softmax of the raw logits, for the reported log-prob.
  float max_logit = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < V; ++i) max_logit = std::max(max_logit, logits[i]);
  double sum = 0.0;
  for (size_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(logits[i] - max_logit));
  const double log_z = static_cast<double>(max_logit) + std::log(sum);
  auto logprob_of = [&](int32_t t) {
    return static_cast<float>(static_cast<double>(logits[static_cast<size_t>(t)]) - log_z);
  };
  out.log_z = log_z;

  if (p.temperature == 0.0f) {
    int32_t best = 0;
    for (size_t i = 1; i < V; ++i)
      if (logits[i] > logits[static_cast<size_t>(best)]) best = static_cast<int32_t>(i);
    out.token = best;
    out.logprob = logprob_of(best);
    return out;
  }

  // Probabilities at the request's temperature, then the filters, in the order
  // top-k -> top-p -> min-p (the order SGLang and vLLM apply them).
  probs_.resize(V);
  order_.resize(V);
  const double inv_t = 1.0 / static_cast<double>(p.temperature);
  double z = 0.0;
  for (size_t i = 0; i < V; ++i) {
    const double e = std::exp((static_cast<double>(logits[i]) - max_logit) * inv_t);
    probs_[i] = static_cast<float>(e);
    z += e;
  }
  for (size_t i = 0; i < V; ++i) probs_[i] = static_cast<float>(probs_[i] / z);
  std::iota(order_.begin(), order_.end(), 0);
  // Descending probability, ties by lower id: a total order, so the kept set is deterministic.
  // Only the prefix the filters and the draw reach is ordered (a full sort of a 150k vocabulary
  // costs milliseconds per token): each extension selects the next block with nth_element and
  // sorts it, which gives exactly the full sort's prefix.
  const auto before = [&](int32_t a, int32_t b) {
    const float pa = probs_[static_cast<size_t>(a)], pb = probs_[static_cast<size_t>(b)];
    return pa != pb ? pa > pb : a < b;
  };
  size_t sorted = 0;
  auto ensure_sorted = [&](size_t n) {
    if (n <= sorted) return;
    const size_t to = std::min(V, std::max({n, 2 * sorted, size_t{256}}));
    if (to < V) std::nth_element(order_.begin() + sorted, order_.begin() + to, order_.end(), before);
    std::sort(order_.begin() + sorted, order_.begin() + to, before);
    sorted = to;
  };
  size_t keep = V;
  if (p.top_k > 0) keep = std::min(keep, static_cast<size_t>(p.top_k));
  if (p.top_p < 1.0f) {
    double cum = 0.0;
    size_t n = 0;
    while (n < keep) {
      ensure_sorted(n + 1);
      cum += probs_[static_cast<size_t>(order_[n])];
      ++n;
      if (cum >= static_cast<double>(p.top_p)) break;
    }
    keep = std::max<size_t>(n, 1);
  }
  if (p.min_p > 0.0f) {
    ensure_sorted(1);
    const float threshold = p.min_p * probs_[static_cast<size_t>(order_[0])];
    size_t n = 1;
    while (n < keep) {
      ensure_sorted(n + 1);
      if (probs_[static_cast<size_t>(order_[n])] < threshold) break;
      ++n;
    }
    keep = n;
  }
  double kept_mass = 0.0;
  if (keep == V) {
    for (size_t i = 0; i < V; ++i) kept_mass += probs_[i];  // nothing filtered: the whole mass
  } else {
    ensure_sorted(keep);
    for (size_t i = 0; i < keep; ++i) kept_mass += probs_[static_cast<size_t>(order_[i])];
  }
  const double u = sampling_uniform(p.seed, p.draw_index) * kept_mass;
  double cum = 0.0;
  int32_t chosen = -1;
  for (size_t i = 0; i < keep; ++i) {
    ensure_sorted(i + 1);
    cum += probs_[static_cast<size_t>(order_[i])];
    if (u < cum) {
      chosen = order_[i];
      break;
    }
  }
  if (chosen < 0) {  // rounding left u at or past the last cumulative sum
    ensure_sorted(keep);
    chosen = order_[keep - 1];
  }
  out.token = chosen;
  out.logprob = logprob_of(chosen);
  return out;
}

}  // namespace rolloutd::cpu
