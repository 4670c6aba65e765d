#include "core/sampling/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <map>
#include <vector>

#include <gtest/gtest.h>

namespace rolloutd::core {
namespace {

std::vector<float> logits_of(std::initializer_list<float> l) { return std::vector<float>(l); }

double log_softmax_at(const std::vector<float>& l, int i) {
  double m = -1e30, z = 0;
  for (float v : l) m = std::max(m, static_cast<double>(v));
  for (float v : l) z += std::exp(v - m);
  return l[static_cast<size_t>(i)] - m - std::log(z);
}

TEST(Sampler, GreedyTakesArgmaxLowestIdOnTies) {
  Sampler s;
  SamplingParams p;
  p.temperature = 0.0f;
  auto l = logits_of({0.5f, 2.0f, 2.0f, -1.0f});
  auto r = s.sample(l, p, 0);
  EXPECT_EQ(r.token, 1);
  EXPECT_NEAR(r.logprob, log_softmax_at(l, 1), 1e-6);
}

TEST(Sampler, LogprobIsUnderTheUnmodifiedDistribution) {
  Sampler s;
  SamplingParams p;
  p.temperature = 0.3f;
  p.top_k = 2;
  p.seed = 7;
  auto l = logits_of({1.0f, 3.0f, 2.5f, 0.0f, -2.0f});
  for (uint64_t i = 0; i < 50; ++i) {
    auto r = s.sample(l, p, i);
    ASSERT_TRUE(r.token == 1 || r.token == 2) << "top_k=2 keeps the two largest";
    EXPECT_NEAR(r.logprob, log_softmax_at(l, r.token), 1e-6) << "not the tempered/filtered log-prob";
  }
}

TEST(Sampler, SameSeedSameTokensDifferentSeedsDiffer) {
  Sampler s;
  std::vector<float> l(64);
  for (size_t i = 0; i < l.size(); ++i) l[i] = static_cast<float>(std::sin(static_cast<double>(i)));
  SamplingParams a;
  a.seed = 123;
  SamplingParams b = a;
  b.seed = 124;
  std::vector<int32_t> ta, ta2, tb;
  for (uint64_t i = 0; i < 64; ++i) {
    ta.push_back(s.sample(l, a, i).token);
    ta2.push_back(s.sample(l, a, i).token);
    tb.push_back(s.sample(l, b, i).token);
  }
  EXPECT_EQ(ta, ta2);
  EXPECT_NE(ta, tb);
}

TEST(Sampler, FiltersKeepTheRightSets) {
  Sampler s;
  auto l = logits_of({0.0f, 1.0f, 2.0f, 3.0f});  // probs ~ 0.032, 0.087, 0.237, 0.644
  SamplingParams p;
  p.seed = 99;
  // top_p = 0.5: the smallest prefix reaching 0.5 is {3}.
  p.top_p = 0.5f;
  for (uint64_t i = 0; i < 30; ++i) EXPECT_EQ(s.sample(l, p, i).token, 3);
  // top_p = 0.85: {3, 2}.
  p.top_p = 0.85f;
  std::map<int32_t, int> seen;
  for (uint64_t i = 0; i < 300; ++i) ++seen[s.sample(l, p, i).token];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_TRUE(seen.count(3) && seen.count(2));
  // min_p = 0.3: keeps p >= 0.3 * 0.644 = 0.193 -> {3, 2}.
  p.top_p = 1.0f;
  p.min_p = 0.3f;
  seen.clear();
  for (uint64_t i = 0; i < 300; ++i) ++seen[s.sample(l, p, i).token];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_FALSE(seen.count(0) || seen.count(1));
}

TEST(Sampler, EmpiricalFrequenciesFollowTheDistribution) {
  Sampler s;
  auto l = logits_of({0.0f, 1.0f, 2.0f, 0.5f});
  SamplingParams p;
  p.seed = 2026;
  const int n = 20000;
  std::vector<int> count(4);
  for (int i = 0; i < n; ++i) ++count[static_cast<size_t>(s.sample(l, p, static_cast<uint64_t>(i)).token)];
  for (int t = 0; t < 4; ++t) {
    const double expected = std::exp(log_softmax_at(l, t));
    const double sd = std::sqrt(expected * (1 - expected) / n);
    EXPECT_NEAR(static_cast<double>(count[static_cast<size_t>(t)]) / n, expected, 5 * sd) << "token " << t;
  }
}

TEST(Sampler, TemperatureSharpens) {
  Sampler s;
  auto l = logits_of({0.0f, 1.0f});
  SamplingParams cold, hot;
  cold.temperature = 0.2f;
  hot.temperature = 5.0f;
  cold.seed = hot.seed = 5;
  int cold1 = 0, hot1 = 0;
  for (uint64_t i = 0; i < 4000; ++i) {
    cold1 += s.sample(l, cold, i).token;
    hot1 += s.sample(l, hot, i).token;
  }
  EXPECT_GT(cold1, 3900);       // p(1) = 0.993 at T=0.2
  EXPECT_NEAR(hot1, 2200, 150);  // p(1) = 0.55 at T=5
}

TEST(Sampler, ValidateRejectsOutOfRange) {
  SamplingParams p;
  p.temperature = -1.0f;
  EXPECT_EQ(validate(p).code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(validate(p).field(), "temperature");
  p = {};
  p.top_p = 0.0f;
  EXPECT_EQ(validate(p).field(), "top_p");
  p = {};
  p.top_k = -2;
  EXPECT_EQ(validate(p).field(), "top_k");
  p = {};
  p.min_p = 1.5f;
  EXPECT_EQ(validate(p).field(), "min_p");
  p = {};
  p.temperature = NAN;
  EXPECT_FALSE(validate(p).ok());
  EXPECT_TRUE(validate(SamplingParams{}).ok());
}

TEST(Sampler, UniformDrawIsInUnitIntervalAndIndependentOfCallOrder) {
  const double a = Sampler::uniform_draw(1, 5);
  for (uint64_t i = 0; i < 100; ++i) {
    const double u = Sampler::uniform_draw(1, i);
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
  }
  EXPECT_EQ(a, Sampler::uniform_draw(1, 5));
}

// The sampler orders only the prefix of the vocabulary its filters and draw reach. A plain
// full-sort sampler (written here, the textbook way) must pick the same token for every seed
// and filter combination; the kept mass with nothing filtered is summed in id order by both.
int32_t full_sort_sample(const std::vector<float>& logits, const SamplingParams& p, uint64_t draw) {
  const size_t V = logits.size();
  const float mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> e(V);
  double z = 0;
  for (size_t i = 0; i < V; ++i) z += e[i] = std::exp((double(logits[i]) - mx) / double(p.temperature));
  std::vector<float> pr(V);
  for (size_t i = 0; i < V; ++i) pr[i] = float(float(e[i]) / z);
  std::vector<int32_t> ord(V);
  std::iota(ord.begin(), ord.end(), 0);
  std::sort(ord.begin(), ord.end(), [&](int32_t a, int32_t b) { return pr[a] != pr[b] ? pr[a] > pr[b] : a < b; });
  size_t keep = p.top_k > 0 ? std::min<size_t>(V, size_t(p.top_k)) : V;
  if (p.top_p < 1.0f) {
    double cum = 0;
    size_t n = 0;
    while (n < keep) {
      cum += pr[ord[n++]];
      if (cum >= double(p.top_p)) break;
    }
    keep = std::max<size_t>(n, 1);
  }
  if (p.min_p > 0.0f) {
    size_t n = 1;
    while (n < keep && pr[ord[n]] >= p.min_p * pr[ord[0]]) ++n;
    keep = n;
  }
  double mass = 0;
  if (keep == V)
    for (size_t i = 0; i < V; ++i) mass += pr[i];
  else
    for (size_t i = 0; i < keep; ++i) mass += pr[ord[i]];
  const double u = Sampler::uniform_draw(p.seed, draw) * mass;
  double cum = 0;
  for (size_t i = 0; i < keep; ++i)
    if (u < (cum += pr[ord[i]])) return ord[i];
  return ord[keep - 1];
}

TEST(Sampler, PrefixOrderingPicksWhatAFullSortPicks) {
  std::vector<float> logits(5000);
  uint64_t x = 12345;
  for (auto& l : logits) {  // a peaked distribution with a long tail and some exact ties
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    l = float((x >> 40) % 4000) / 400.0f - 5.0f;
  }
  Sampler s;
  for (const SamplingParams base : {SamplingParams{1.0f, 1.0f, 0, 0.0f, 0}, SamplingParams{0.7f, 0.9f, 0, 0.0f, 0},
                                    SamplingParams{1.3f, 1.0f, 300, 0.0f, 0}, SamplingParams{1.0f, 0.95f, 1000, 0.05f, 0},
                                    SamplingParams{2.0f, 1.0f, 0, 0.01f, 0}}) {
    for (uint64_t seed = 0; seed < 40; ++seed) {
      SamplingParams p = base;
      p.seed = seed;
      for (uint64_t draw = 0; draw < 5; ++draw)
        ASSERT_EQ(s.sample(logits, p, draw).token, full_sort_sample(logits, p, draw))
            << "T " << p.temperature << " top_p " << p.top_p << " top_k " << p.top_k << " min_p " << p.min_p
            << " seed " << seed << " draw " << draw;
    }
  }
}

}  // namespace
}  // namespace rolloutd::core
