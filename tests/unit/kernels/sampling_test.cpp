// The sampling op (Backend::sample) on every backend, against expectations computed here from
// first principles (never by the code under test):
// - greedy is the argmax with the lowest id on ties; top_k = 1 is greedy at any temperature;
// - the log-prob is log_softmax of the raw logits (an independent double-precision one);
// - every sampled token lies in the kept set, computed here by a full sort in the order the op
//   defines (p descending, id ascending) with top-k, top-p, min-p applied as prefixes, for
//   random logits (some with many exact ties) and parameters, at Qwen3's vocabulary too;
// - the same (seed, draw index) gives the same token and log-prob wherever the row sits and
//   whatever rows share the batch;
// - the frequencies over many draws match the filtered softmax (chi-square, fixed seeds, with a
//   check that the same statistic rejects a slightly wrong distribution);
// - bad parameters: the CPU op refuses them (kOutOfRange naming the row and field), the CUDA op
//   never reads or writes out of bounds and returns a token in [0, V).
// The CPU cases run everywhere; the CUDA ones skip without a CUDA build or a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/backend.hpp"

namespace rolloutd {
namespace {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  double normal() {  // Box-Muller
    const double u1 = (static_cast<double>(next() >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * uniform());
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

struct Target {
  const Backend* backend;
  ExecContext ctx;
};

std::optional<Target> target(DeviceKind kind) {
  if (kind == DeviceKind::kCpu) return Target{&cpu_backend(), ExecContext{}};
  if (cuda_backend() == nullptr || cuda_device_count() == 0) return std::nullopt;
  return Target{cuda_backend(), ExecContext{Device::cuda(0), nullptr}};
}

struct Sampled {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<int32_t> top_ids;      // [R, top_n] when asked
  std::vector<float> top_logprobs;
};

// Runs the op over host logits [R, V] and rows (and top_n top log-probs per row when > 0);
// buffers on the target's device.
Status run_sample(const Target& t, const std::vector<float>& logits, int64_t V, const std::vector<SamplingRow>& rows,
                  Sampled& out, int64_t top_n = 0) {
  const Backend& b = *t.backend;
  const auto R = static_cast<int64_t>(rows.size());
  const bool cpu = t.ctx.device.kind == DeviceKind::kCpu;
  const CopyKind h2d = cpu ? CopyKind::kHostToHost : CopyKind::kHostToDevice;
  const CopyKind d2h = cpu ? CopyKind::kHostToHost : CopyKind::kDeviceToHost;
  void *dl = nullptr, *dr = nullptr, *dt = nullptr, *dp = nullptr, *di = nullptr, *dq = nullptr;
  const size_t lb = std::max<size_t>(logits.size() * 4, 4), rb = std::max<size_t>(rows.size() * 32, 32);
  const size_t ob = std::max<size_t>(rows.size() * 4, 4);
  const size_t tb = std::max<size_t>(rows.size() * static_cast<size_t>(top_n) * 4, 4);
  RD_RETURN_IF_ERROR(b.alloc(t.ctx, lb, &dl));
  RD_RETURN_IF_ERROR(b.alloc(t.ctx, rb, &dr));
  RD_RETURN_IF_ERROR(b.alloc(t.ctx, ob, &dt));
  RD_RETURN_IF_ERROR(b.alloc(t.ctx, ob, &dp));
  RD_RETURN_IF_ERROR(b.alloc(t.ctx, tb, &di));
  RD_RETURN_IF_ERROR(b.alloc(t.ctx, tb, &dq));
  // Poison the outputs: a row the op skips shows.
  std::vector<int32_t> poison(rows.size(), std::numeric_limits<int32_t>::min());
  Status st = b.copy(t.ctx, dl, logits.data(), logits.size() * 4, h2d);
  if (st.ok()) st = b.copy(t.ctx, dr, rows.data(), rows.size() * 32, h2d);
  if (st.ok()) st = b.copy(t.ctx, dt, poison.data(), poison.size() * 4, h2d);
  if (st.ok()) st = b.copy(t.ctx, dp, poison.data(), poison.size() * 4, h2d);
  Status op = st;
  if (st.ok()) {
    SampleArgs a;
    a.logits = TensorView::contiguous(dl, DType::kF32, Shape{R, V}, t.ctx.device);
    a.rows = TensorView::contiguous(dr, DType::kU8, Shape{R, 32}, t.ctx.device);
    a.tokens = TensorView::contiguous(dt, DType::kI32, Shape{R}, t.ctx.device);
    a.logprobs = TensorView::contiguous(dp, DType::kF32, Shape{R}, t.ctx.device);
    if (top_n > 0) {
      a.top_ids = TensorView::contiguous(di, DType::kI32, Shape{R, top_n}, t.ctx.device);
      a.top_logprobs = TensorView::contiguous(dq, DType::kF32, Shape{R, top_n}, t.ctx.device);
    }
    op = b.sample(t.ctx, a);
  }
  // Read back even after a refusal: the outputs must then still hold the poison.
  out.tokens.assign(rows.size(), 0);
  out.logprobs.assign(rows.size(), 0);
  out.top_ids.assign(rows.size() * static_cast<size_t>(top_n), 0);
  out.top_logprobs.assign(out.top_ids.size(), 0);
  if (st.ok()) st = b.copy(t.ctx, out.tokens.data(), dt, rows.size() * 4, d2h);
  if (st.ok()) st = b.copy(t.ctx, out.logprobs.data(), dp, rows.size() * 4, d2h);
  if (st.ok() && top_n > 0) st = b.copy(t.ctx, out.top_ids.data(), di, out.top_ids.size() * 4, d2h);
  if (st.ok() && top_n > 0) st = b.copy(t.ctx, out.top_logprobs.data(), dq, out.top_ids.size() * 4, d2h);
  const Status sync = b.synchronize(t.ctx);
  for (void* p : {dl, dr, dt, dp, di, dq}) (void)b.free(t.ctx, p);
  if (!op.ok()) return op;
  return st.ok() ? sync : st;
}

SamplingRow row(float temperature, int32_t top_k = 0, float top_p = 1.0f, float min_p = 0.0f, uint64_t seed = 1,
                uint64_t draw = 0) {
  SamplingRow r;
  r.temperature = temperature;
  r.top_k = top_k;
  r.top_p = top_p;
  r.min_p = min_p;
  r.seed = seed;
  r.draw_index = draw;
  return r;
}

// ---- independent references ---------------------------------------------------------------

double log_softmax_at(const float* l, int64_t V, int64_t i) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < V; ++j) m = std::max(m, static_cast<double>(l[j]));
  double z = 0;
  for (int64_t j = 0; j < V; ++j) z += std::exp(static_cast<double>(l[j]) - m);
  return static_cast<double>(l[i]) - m - std::log(z);
}

int64_t argmax_lowest(const float* l, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (l[i] > l[best]) best = i;
  return best;
}

// The probabilities as the op defines them: float(float(exp((l - max) / T)) / z), z the
// double sum of the double exps.
std::vector<float> probs_of(const float* l, int64_t V, float T) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) m = std::max(m, l[i]);
  std::vector<double> e(static_cast<size_t>(V));
  double z = 0;
  const double inv_t = 1.0 / static_cast<double>(T);
  for (int64_t i = 0; i < V; ++i) z += e[i] = std::exp((static_cast<double>(l[i]) - m) * inv_t);
  std::vector<float> p(static_cast<size_t>(V));
  for (int64_t i = 0; i < V; ++i) p[i] = static_cast<float>(static_cast<double>(static_cast<float>(e[i])) / z);
  return p;
}

// The kept set: a full sort (p descending, id ascending), then top-k, top-p and min-p as prefixes.
std::vector<int32_t> kept_set(const float* l, int64_t V, const SamplingRow& r) {
  const std::vector<float> p = probs_of(l, V, r.temperature);
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] != p[b] ? p[a] > p[b] : a < b; });
  size_t n = static_cast<size_t>(V);
  if (r.top_k > 0) n = std::min(n, static_cast<size_t>(r.top_k));
  if (r.top_p < 1.0f) {
    double cum = 0;
    size_t k = 0;
    while (k < n && cum < static_cast<double>(r.top_p)) cum += p[order[k++]];
    n = std::max<size_t>(k, 1);
  }
  if (r.min_p > 0.0f) {
    const float thr = r.min_p * p[order[0]];
    size_t k = 0;
    while (k < n && p[order[k]] >= thr) ++k;
    n = std::max<size_t>(k, 1);
  }
  order.resize(n);
  return order;
}

// ---- cases ----------------------------------------------------------------------------------

void greedy_is_argmax_lowest_id_on_ties(DeviceKind kind) {
  auto t = target(kind);
  if (!t) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  for (int64_t V : {1, 7, 1000, 151936}) {
    Rng rng(static_cast<uint64_t>(V));
    const int64_t R = 6;
    std::vector<float> logits(static_cast<size_t>(R * V));
    for (auto& x : logits) x = static_cast<float>(3.0 * rng.normal());
    // Row 1: the maximum at three ids; row 2: every logit equal; row 3: the maximum at the end;
    // row 4: quantised logits (ties everywhere); row 5: as row 1, sampled with top_k = 1 at T = 1.
    for (int64_t r : {1, 5})
      for (int64_t i : {V - 1, V / 2, V / 3}) logits[r * V + i] = 50.0f;
    std::fill(logits.begin() + 2 * V, logits.begin() + 3 * V, 0.25f);
    logits[3 * V + V - 1] = 60.0f;
    for (int64_t i = 0; i < V; ++i) logits[4 * V + i] = std::round(logits[4 * V + i]);
    std::vector<SamplingRow> rows(R, row(0.0f));
    rows[5] = row(1.0f, 1, 1.0f, 0.0f, 77, 3);
    Sampled s;
    ASSERT_TRUE(run_sample(*t, logits, V, rows, s).ok());
    for (int64_t r = 0; r < R; ++r) {
      const float* l = logits.data() + r * V;
      EXPECT_EQ(s.tokens[r], argmax_lowest(l, V)) << "V " << V << " row " << r;
      EXPECT_NEAR(s.logprobs[r], log_softmax_at(l, V, argmax_lowest(l, V)), 1e-5) << "V " << V << " row " << r;
    }
  }
}

void top_k_one_is_greedy(DeviceKind kind) {
  auto t = target(kind);
  if (!t) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const int64_t V = 5000, R = 64;
  Rng rng(5);
  std::vector<float> logits(static_cast<size_t>(R * V));
  for (auto& x : logits) x = static_cast<float>(std::round(4.0 * rng.normal()) / 2.0);  // many ties
  std::vector<SamplingRow> rows;
  for (int64_t r = 0; r < R; ++r)
    rows.push_back(row(0.1f + 0.05f * static_cast<float>(r), 1, r % 2 ? 0.9f : 1.0f, r % 3 ? 0.0f : 0.2f, 1000 + r, r));
  Sampled s;
  ASSERT_TRUE(run_sample(*t, logits, V, rows, s).ok());
  for (int64_t r = 0; r < R; ++r) EXPECT_EQ(s.tokens[r], argmax_lowest(logits.data() + r * V, V)) << "row " << r;
}

// Random logits and parameters; every token must be in the independently computed kept set
// and carry the raw log-softmax.
void tokens_lie_in_the_kept_set(DeviceKind kind, int64_t V, int64_t R, uint64_t seed) {
  auto t = target(kind);
  if (!t) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  Rng rng(seed);
  std::vector<float> logits(static_cast<size_t>(R * V));
  std::vector<SamplingRow> rows;
  const float temps[] = {0.0f, 0.3f, 0.7f, 1.0f, 1.0f, 1.5f};
  const int32_t ks[] = {0, 0, 1, 2, 5, 50, 1000};
  const float ps[] = {1.0f, 1.0f, 0.95f, 0.9f, 0.5f, 0.1f, 1e-6f};
  const float mps[] = {0.0f, 0.0f, 0.0f, 0.01f, 0.1f, 0.5f, 1.0f};
  for (int64_t r = 0; r < R; ++r) {
    const double scale = r % 4 == 0 ? 1.0 : (r % 4 == 1 ? 3.0 : (r % 4 == 2 ? 8.0 : 2.0));
    for (int64_t i = 0; i < V; ++i) {
      double x = scale * rng.normal();
      if (r % 4 == 3) x = std::round(x * 2.0) / 2.0;  // exact ties in p: the id order decides
      logits[static_cast<size_t>(r * V + i)] = static_cast<float>(x);
    }
    rows.push_back(row(temps[rng.below(6)], ks[rng.below(7)], ps[rng.below(7)], mps[rng.below(7)], rng.next(),
                       static_cast<uint64_t>(rng.below(1000))));
  }
  Sampled s;
  ASSERT_TRUE(run_sample(*t, logits, V, rows, s).ok());
  for (int64_t r = 0; r < R; ++r) {
    const float* l = logits.data() + r * V;
    const SamplingRow& p = rows[static_cast<size_t>(r)];
    const int32_t tok = s.tokens[r];
    ASSERT_TRUE(tok >= 0 && tok < V) << "row " << r << " token " << tok;
    if (p.temperature == 0.0f) {
      EXPECT_EQ(tok, argmax_lowest(l, V)) << "row " << r;
    } else {
      const auto kept = kept_set(l, V, p);
      EXPECT_NE(std::find(kept.begin(), kept.end(), tok), kept.end())
          << "row " << r << " token " << tok << " outside the kept set of " << kept.size() << " (T " << p.temperature
          << ", top_k " << p.top_k << ", top_p " << p.top_p << ", min_p " << p.min_p << ")";
    }
    EXPECT_NEAR(s.logprobs[r], log_softmax_at(l, V, tok), 1e-5) << "row " << r;
  }
}

// A row's token and log-prob depend on its logits and parameters alone: alone, at another
// position, among other rows, and run again.
void batch_position_does_not_matter(DeviceKind kind) {
  auto t = target(kind);
  if (!t) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const int64_t V = 20000, N = 24;
  Rng rng(11);
  std::vector<std::vector<float>> l(N, std::vector<float>(V));
  std::vector<SamplingRow> p;
  for (int64_t n = 0; n < N; ++n) {
    for (auto& x : l[n]) x = static_cast<float>(2.0 * rng.normal());
    p.push_back(row(n % 3 == 0 ? 1.0f : 0.8f, n % 4 == 1 ? 40 : 0, n % 2 ? 0.9f : 1.0f, n % 5 == 2 ? 0.05f : 0.0f,
                    500 + n, 7 * n));
  }
  auto run = [&](const std::vector<int64_t>& which) {
    std::vector<float> logits;
    std::vector<SamplingRow> rows;
    for (int64_t n : which) {
      logits.insert(logits.end(), l[n].begin(), l[n].end());
      rows.push_back(p[n]);
    }
    Sampled s;
    EXPECT_TRUE(run_sample(*t, logits, V, rows, s).ok());
    return s;
  };
  std::vector<int64_t> all(N);
  std::iota(all.begin(), all.end(), 0);
  const Sampled base = run(all);
  std::vector<int64_t> reversed(all.rbegin(), all.rend());
  const Sampled rev = run(reversed);
  for (int64_t n = 0; n < N; ++n) {
    const Sampled alone = run({n});
    EXPECT_EQ(alone.tokens[0], base.tokens[n]) << "request " << n;
    EXPECT_EQ(alone.logprobs[0], base.logprobs[n]) << "request " << n;
    EXPECT_EQ(rev.tokens[N - 1 - n], base.tokens[n]) << "request " << n;
    const Sampled with_others = run({(n + 1) % N, n, n, (n + 5) % N});
    EXPECT_EQ(with_others.tokens[1], base.tokens[n]);
    EXPECT_EQ(with_others.tokens[2], base.tokens[n]);
  }
  // And the draw does move with the seed: not every request gives the same token under 24 seeds.
  std::set<int32_t> seen;
  for (uint64_t seed = 0; seed < 24; ++seed) {
    std::vector<SamplingRow> rows = {row(1.0f, 0, 1.0f, 0.0f, seed, 0)};
    Sampled s;
    ASSERT_TRUE(run_sample(*t, l[0], V, rows, s).ok());
    seen.insert(s.tokens[0]);
  }
  EXPECT_GT(seen.size(), 12u);
}

double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& expected_p, int64_t n) {
  double x2 = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expected_p[i] <= 0) continue;
    const double e = expected_p[i] * static_cast<double>(n);
    x2 += (static_cast<double>(counts[i]) - e) * (static_cast<double>(counts[i]) - e) / e;
  }
  return x2;
}

// The filtered softmax, computed here in double from the kept set.
std::vector<double> filtered_softmax(const std::vector<float>& l, const SamplingRow& r) {
  const auto kept = kept_set(l.data(), static_cast<int64_t>(l.size()), r);
  double m = *std::max_element(l.begin(), l.end());
  std::vector<double> q(l.size(), 0.0);
  double z = 0;
  for (int32_t i : kept) z += q[i] = std::exp((static_cast<double>(l[i]) - m) / r.temperature);
  for (double& x : q) x /= z;
  return q;
}

// Frequencies over `n` draws (draw indices 0..n-1 of one seed) against the filtered softmax.
// The critical value 37.0 is p ~ 2.6e-5 at 9 degrees of freedom (4.7e-6 at 7); the seeds are
// fixed, so the outcome is deterministic (a change to the draw re-rolls it), and the same counts tested
// against a distribution with the temperature off by the factor `off_by` must fail (the
// statistic's power at n draws).
void frequencies_match(DeviceKind kind, const std::vector<float>& l, const SamplingRow& p, int64_t n,
                       float off_by) {
  auto t = target(kind);
  if (!t) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const int64_t V = static_cast<int64_t>(l.size());
  std::vector<int64_t> counts(static_cast<size_t>(V), 0);
  // Rows per call: up to 8,192, fewer for large vocabularies (about 128 MB of logits per call).
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(8192, (int64_t{1} << 25) / V));
  for (int64_t done = 0; done < n; done += chunk) {
    const int64_t R = std::min(chunk, n - done);
    std::vector<float> logits;
    logits.reserve(static_cast<size_t>(R * V));
    std::vector<SamplingRow> rows;
    for (int64_t r = 0; r < R; ++r) {
      logits.insert(logits.end(), l.begin(), l.end());
      SamplingRow x = p;
      x.draw_index = static_cast<uint64_t>(done + r);
      rows.push_back(x);
    }
    Sampled s;
    ASSERT_TRUE(run_sample(*t, logits, V, rows, s).ok());
    for (int32_t tok : s.tokens) {
      ASSERT_TRUE(tok >= 0 && tok < V);
      ++counts[tok];
    }
  }
  const std::vector<double> want = filtered_softmax(l, p);
  // Categories below 1e-6 (the spread rows' far tail) are too rare to test and are left out.
  int64_t outside = 0, dof = -1;
  std::vector<double> tested(want.size(), 0.0);
  for (int64_t i = 0; i < V; ++i) {
    if (want[i] == 0) outside += counts[i];
    if (want[i] >= 1e-6) ++dof, tested[i] = want[i];
  }
  EXPECT_EQ(outside, 0) << "draws outside the kept set";
  ASSERT_LE(dof, 9);
  const double x2 = chi_square(counts, tested, n);
  EXPECT_LT(x2, 37.0) << "chi-square " << x2 << " at " << dof << " degrees of freedom";
  SamplingRow off = p;
  off.temperature *= off_by;
  EXPECT_GT(chi_square(counts, filtered_softmax(l, off), n), 37.0)
      << "the test cannot tell a temperature off by " << off_by;
}

std::vector<float> small_logits() { return {1.0f, 2.5f, 0.3f, 2.0f, -1.0f, 1.7f, 0.9f, 2.4f}; }

// Ten likely tokens spread over a 5,000-token row (tiles far apart), the rest far below.
std::vector<float> spread_logits() {
  std::vector<float> l(5000, -40.0f);
  const int64_t at[] = {3, 97, 640, 1201, 1999, 2500, 3071, 3900, 4444, 4999};
  for (int i = 0; i < 10; ++i) l[at[i]] = 0.5f * static_cast<float>(i);
  return l;
}

void bad_rows_are_safe_on_cuda() {
  auto t = target(DeviceKind::kCuda);
  if (!t) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int64_t V = 3000;
  Rng rng(3);
  std::vector<SamplingRow> rows = {
      row(nan), row(-1.0f), row(inf), row(1.0f, -5), row(1.0f, 1 << 30), row(1.0f, 0, nan), row(1.0f, 0, -1.0f),
      row(1.0f, 0, 2.0f), row(1.0f, 0, 0.0f), row(1.0f, 0, 1.0f, nan), row(1.0f, 0, 1.0f, -1.0f),
      row(1.0f, 0, 1.0f, 7.0f), row(1e-30f), row(1e30f), row(1.0f), row(1.0f), row(1.0f), row(1.0f), row(0.0f),
      row(0.0f)};
  const int64_t R = static_cast<int64_t>(rows.size());
  std::vector<float> logits(static_cast<size_t>(R * V));
  for (auto& x : logits) x = static_cast<float>(rng.normal());
  float* l = logits.data();
  std::fill(l + 14 * V, l + 15 * V, nan);                       // every logit NaN
  std::fill(l + 15 * V, l + 16 * V, -inf);                      // every logit -inf
  l[16 * V + 17] = inf;                                         // a +inf logit
  for (int64_t i = 0; i < V; i += 3) l[17 * V + i] = nan;       // NaN among finite logits
  l[18 * V + 5] = nan;                                          // greedy with a NaN
  std::fill(l + 19 * V, l + 20 * V, -inf);                      // greedy, every logit -inf
  Sampled s;
  ASSERT_TRUE(run_sample(*t, logits, V, rows, s).ok()) << "a bad row must not fault the device";
  for (int64_t r = 0; r < R; ++r) EXPECT_TRUE(s.tokens[r] >= 0 && s.tokens[r] < V) << "row " << r;
  // Documented treatments: NaN, negative and infinite temperatures are greedy; top_p <= 0 keeps
  // one token; min_p above 1 keeps the maximum alone; a +inf logit is taken.
  for (int64_t r : {0, 1, 2, 6, 8, 11}) EXPECT_EQ(s.tokens[r], argmax_lowest(l + r * V, V)) << "row " << r;
  EXPECT_EQ(s.tokens[16], 17);
  EXPECT_FALSE(std::isnan(l[17 * V + s.tokens[17]])) << "a NaN logit was drawn";
  // Out-of-range filters that mean "off" keep the draw inside the whole row (no crash, no -1).
  SUCCEED();
}

TEST(SampleOp, CpuGreedyIsArgmaxLowestIdOnTies) { greedy_is_argmax_lowest_id_on_ties(DeviceKind::kCpu); }
TEST(SampleOp, CudaGreedyIsArgmaxLowestIdOnTies) { greedy_is_argmax_lowest_id_on_ties(DeviceKind::kCuda); }
TEST(SampleOp, CpuTopKOneIsGreedy) { top_k_one_is_greedy(DeviceKind::kCpu); }
TEST(SampleOp, CudaTopKOneIsGreedy) { top_k_one_is_greedy(DeviceKind::kCuda); }
TEST(SampleOp, CpuTokensLieInTheKeptSet) { tokens_lie_in_the_kept_set(DeviceKind::kCpu, 3000, 96, 21); }
TEST(SampleOp, CudaTokensLieInTheKeptSet) { tokens_lie_in_the_kept_set(DeviceKind::kCuda, 3000, 512, 21); }
TEST(SampleOp, CudaTokensLieInTheKeptSetAtQwenVocabulary) {
  tokens_lie_in_the_kept_set(DeviceKind::kCuda, 151936, 48, 22);
}
TEST(SampleOp, CpuBatchPositionDoesNotMatter) { batch_position_does_not_matter(DeviceKind::kCpu); }
TEST(SampleOp, CudaBatchPositionDoesNotMatter) { batch_position_does_not_matter(DeviceKind::kCuda); }

struct FreqCase {
  const char* name;
  bool spread;
  SamplingRow p;
};
const FreqCase kFreqCases[] = {
    {"t1", false, row(1.0f, 0, 1.0f, 0.0f, 42)},
    {"t07_topk5", false, row(0.7f, 5, 1.0f, 0.0f, 43)},
    {"topp08", false, row(1.0f, 0, 0.8f, 0.0f, 44)},
    {"minp02_t13", false, row(1.3f, 0, 1.0f, 0.2f, 45)},
    {"spread_t1", true, row(1.0f, 0, 1.0f, 0.0f, 46)},
    {"spread_topk7_topp09", true, row(1.0f, 7, 0.9f, 0.0f, 47)},
};
TEST(SampleOp, CpuFrequenciesMatchTheFilteredSoftmax) {
  for (const FreqCase& c : kFreqCases) {
    SCOPED_TRACE(c.name);
    // Fewer draws on the host (a 5,000-token row costs ~50 us there): power against a 25% error.
    frequencies_match(DeviceKind::kCpu, c.spread ? spread_logits() : small_logits(), c.p, c.spread ? 8000 : 60000,
                      1.25f);
  }
}
TEST(SampleOp, CudaFrequenciesMatchTheFilteredSoftmax) {
  for (const FreqCase& c : kFreqCases) {
    SCOPED_TRACE(c.name);
    frequencies_match(DeviceKind::kCuda, c.spread ? spread_logits() : small_logits(), c.p, 200000, 1.1f);
  }
}

// Qwen3's vocabulary: the draw's tiles hold 96 ids (3 rows of 32), so the walk inside a tile
// crosses rows. Likely tokens in every row of tile 0, in the middle of the row and at its end.
TEST(SampleOp, CudaFrequenciesMatchAtAFullVocabulary) {
  std::vector<float> l(151936, -40.0f);
  const int64_t at[] = {5, 40, 70, 129, 65000, 65031, 65090, 100000, 151900, 151935};
  for (int i = 0; i < 10; ++i) l[static_cast<size_t>(at[i])] = 0.4f * static_cast<float>(i % 5) + 0.1f * i;
  frequencies_match(DeviceKind::kCuda, l, row(1.0f, 0, 1.0f, 0.0f, 48), 30000, 1.25f);
  frequencies_match(DeviceKind::kCuda, l, row(0.8f, 6, 0.95f, 0.0f, 49), 30000, 1.25f);
}

TEST(SampleOp, CudaBadRowsAreSafe) { bad_rows_are_safe_on_cuda(); }

TEST(SampleOp, CpuRefusesBadParametersNamingRowAndField) {
  auto t = target(DeviceKind::kCpu);
  const int64_t V = 10;
  std::vector<float> logits(2 * V, 0.5f);
  const std::pair<SamplingRow, const char*> bad[] = {
      {row(-1.0f), "rows[1].temperature"},
      {row(std::numeric_limits<float>::quiet_NaN()), "rows[1].temperature"},
      {row(1.0f, -1), "rows[1].top_k"},
      {row(1.0f, 0, 0.0f), "rows[1].top_p"},
      {row(1.0f, 0, 1.5f), "rows[1].top_p"},
      {row(1.0f, 0, 1.0f, 1.5f), "rows[1].min_p"},
  };
  for (const auto& [b, field] : bad) {
    Sampled s;
    const Status st = run_sample(*t, logits, V, {row(0.0f), b}, s);
    EXPECT_EQ(st.code(), ErrorCode::kOutOfRange) << field;
    EXPECT_EQ(st.field(), field);
    EXPECT_EQ(s.tokens[0], std::numeric_limits<int32_t>::min()) << "outputs untouched: " << field;
  }
}

// ---- top log-probs ---------------------------------------------------------------------------

// The n most likely ids by a plain full sort: logit descending, id ascending, NaN last (a float
// comparison, so -0.0 and +0.0 tie and the id decides).
std::vector<int32_t> top_reference(const float* l, int64_t V, int64_t n) {
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    const float la = l[a], lb = l[b];
    if (std::isnan(la) || std::isnan(lb)) return !std::isnan(la) && std::isnan(lb);
    return la > lb;
  });
  ids.resize(static_cast<size_t>(n));
  return ids;
}

// Rows of every kind (smooth, tied, NaN and -inf, signed zeros, constant) under greedy and
// sampled parameters: the ids equal the full sort's, the log-probs the raw log-softmax, the
// sampled token's entry (when listed) its log-prob bit for bit, and asking for the lists changes
// no token.
void top_logprobs_match_a_full_sort(DeviceKind kind) {
  auto t = target(kind);
  if (!t) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  for (int64_t V : {20, 1000, 151936}) {
    for (int64_t n : {1, 5, 20}) {
      Rng rng(static_cast<uint64_t>(V * 31 + n));
      const int64_t R = 8;
      std::vector<float> logits(static_cast<size_t>(R * V));
      for (auto& x : logits) x = static_cast<float>(2.0 * rng.normal());
      float* row1 = logits.data() + V;  // ties everywhere
      for (int64_t i = 0; i < V; ++i) row1[i] = std::round(row1[i]);
      float* row2 = logits.data() + 2 * V;  // NaN and -inf among them, the first logit NaN
      for (int64_t i = 0; i < V; i += 3) row2[i] = std::numeric_limits<float>::quiet_NaN();
      for (int64_t i = 1; i < V; i += 7) row2[i] = -std::numeric_limits<float>::infinity();
      float* row3 = logits.data() + 3 * V;  // signed zeros at the top
      for (int64_t i = 0; i < V; ++i) row3[i] = -1.0f - std::abs(row3[i]);
      for (int64_t i = 0; i < V; i += 2) row3[i] = (i / 2) % 2 ? -0.0f : 0.0f;
      std::fill(logits.begin() + 4 * V, logits.begin() + 5 * V, 0.5f);  // constant
      float* row5 = logits.data() + 5 * V;  // mostly -inf: the list reaches into it
      for (int64_t i = 0; i < V; ++i) row5[i] = i % 9 == 4 ? row5[i] : -std::numeric_limits<float>::infinity();
      std::vector<SamplingRow> rows;
      for (int64_t r = 0; r < R; ++r) rows.push_back(r % 2 ? row(1.0f, 0, 0.9f, 0.0f, 11 + r, r) : row(0.0f));
      Sampled with_top, plain;
      ASSERT_TRUE(run_sample(*t, logits, V, rows, with_top, n).ok()) << "V " << V << " n " << n;
      ASSERT_TRUE(run_sample(*t, logits, V, rows, plain).ok());
      EXPECT_EQ(with_top.tokens, plain.tokens) << "V " << V << " n " << n;
      for (int64_t r = 0; r < R; ++r) {
        SCOPED_TRACE("V " + std::to_string(V) + " n " + std::to_string(n) + " row " + std::to_string(r));
        const float* l = logits.data() + r * V;
        const std::vector<int32_t> want = top_reference(l, V, n);
        const std::vector<int32_t> got(with_top.top_ids.begin() + r * n, with_top.top_ids.begin() + (r + 1) * n);
        EXPECT_EQ(got, want);
        EXPECT_EQ(std::memcmp(&with_top.logprobs[r], &plain.logprobs[r], 4), 0) << "the token's log-prob changed";
        for (int64_t j = 0; j < n; ++j) {
          const int32_t id = got[static_cast<size_t>(j)];
          if (id < 0 || id >= V) continue;  // reported by the comparison above
          const float lp = with_top.top_logprobs[static_cast<size_t>(r * n + j)];
          if (id == with_top.tokens[r]) {
            EXPECT_EQ(std::memcmp(&lp, &with_top.logprobs[r], 4), 0) << "entry " << j << " is the sampled token";
          }
          if (r == 2) continue;  // NaN rows: the CPU's log-sum-exp is NaN, CUDA's skips NaN
          if (std::isinf(l[id])) {
            EXPECT_TRUE(std::isinf(lp) && lp < 0) << "entry " << j;
          } else {
            EXPECT_NEAR(lp, log_softmax_at(l, V, id), 1e-5) << "entry " << j;
          }
        }
      }
    }
  }
}

TEST(SampleOp, CpuTopLogprobsMatchAFullSort) { top_logprobs_match_a_full_sort(DeviceKind::kCpu); }
TEST(SampleOp, CudaTopLogprobsMatchAFullSort) { top_logprobs_match_a_full_sort(DeviceKind::kCuda); }

// CUDA's lists equal the CPU's: the same ids, log-probs within FP32 rounding of the log-sum-exp.
TEST(SampleOp, CudaTopLogprobsEqualTheCpus) {
  auto gpu = target(DeviceKind::kCuda);
  if (!gpu) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const auto cpu = target(DeviceKind::kCpu);
  const int64_t V = 151936, R = 64, n = 20;
  Rng rng(99);
  std::vector<float> logits(static_cast<size_t>(R * V));
  for (auto& x : logits) x = static_cast<float>(4.0 * rng.normal());
  std::vector<SamplingRow> rows;
  for (int64_t r = 0; r < R; ++r) rows.push_back(row(0.0f));
  Sampled a, b;
  ASSERT_TRUE(run_sample(*cpu, logits, V, rows, a, n).ok());
  ASSERT_TRUE(run_sample(*gpu, logits, V, rows, b, n).ok());
  EXPECT_EQ(a.top_ids, b.top_ids);
  for (size_t i = 0; i < a.top_logprobs.size(); ++i)
    EXPECT_NEAR(a.top_logprobs[i], b.top_logprobs[i], 1e-6 * std::max(1.0f, std::abs(a.top_logprobs[i]))) << i;
}

TEST(SampleOp, TopLogprobShapeErrorsAreTyped) {
  for (DeviceKind kind : {DeviceKind::kCpu, DeviceKind::kCuda}) {
    auto t = target(kind);
    if (!t) continue;
    // Device buffers: the CUDA op must refuse before it touches any.
    void* buf = nullptr;
    ASSERT_TRUE(t->backend->alloc(t->ctx, 4096, &buf).ok());
    auto* base = static_cast<char*>(buf);
    SampleArgs a;
    a.logits = TensorView::contiguous(base, DType::kF32, Shape{2, 24}, t->ctx.device);        // bytes [0, 192)
    a.rows = TensorView::contiguous(base + 256, DType::kU8, Shape{2, 32}, t->ctx.device);     // [256, 320)
    a.tokens = TensorView::contiguous(base + 384, DType::kI32, Shape{2}, t->ctx.device);      // [384, 392)
    a.logprobs = TensorView::contiguous(base + 448, DType::kF32, Shape{2}, t->ctx.device);    // [448, 456)
    const auto top = [&](int64_t n, int64_t rows_ids = 2, int64_t n_lps = -1) {
      a.top_ids = TensorView::contiguous(base + 512, DType::kI32, Shape{rows_ids, n}, t->ctx.device);
      a.top_logprobs = TensorView::contiguous(base + 1024, DType::kF32, Shape{2, n_lps < 0 ? n : n_lps}, t->ctx.device);
      return t->backend->sample(t->ctx, a);
    };
    for (auto [n, rows_ids, n_lps, field] :
         {std::tuple{int64_t{21}, int64_t{2}, int64_t{-1}, "top_ids"}, std::tuple{int64_t{0}, int64_t{2}, int64_t{-1}, "top_ids"},
          std::tuple{int64_t{3}, int64_t{1}, int64_t{-1}, "top_ids"}, std::tuple{int64_t{3}, int64_t{2}, int64_t{4}, "top_logprobs"}}) {
      const Status st = top(n, rows_ids, n_lps);
      EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument) << t->backend->name << " " << st.to_string();
      EXPECT_EQ(st.field(), field) << t->backend->name << " " << st.to_string();
    }
    a.logits = TensorView::contiguous(base, DType::kF32, Shape{2, 4}, t->ctx.device);  // N above V
    EXPECT_EQ(top(5).field(), "top_ids") << t->backend->name;
    a.logits = TensorView::contiguous(base, DType::kF32, Shape{2, 24}, t->ctx.device);
    a.top_logprobs = TensorView{};  // one of the pair alone
    a.top_ids = TensorView::contiguous(base + 512, DType::kI32, Shape{2, 3}, t->ctx.device);
    EXPECT_EQ(t->backend->sample(t->ctx, a).field(), "top_logprobs") << t->backend->name;
    a.top_logprobs = TensorView::contiguous(base + 512, DType::kF32, Shape{2, 3}, t->ctx.device);  // aliases top_ids
    const Status overlap = t->backend->sample(t->ctx, a);
    EXPECT_EQ(overlap.code(), ErrorCode::kInvalidArgument) << t->backend->name;
    EXPECT_NE(overlap.message().find("overlaps"), std::string::npos) << overlap.to_string();
    EXPECT_TRUE(t->backend->synchronize(t->ctx).ok());
    (void)t->backend->free(t->ctx, buf);
  }
}

TEST(SampleOp, ShapeErrorsAreTypedOnEveryBackend) {
  for (DeviceKind kind : {DeviceKind::kCpu, DeviceKind::kCuda}) {
    auto t = target(kind);
    if (!t) continue;
    std::vector<float> host(64);
    SampleArgs a;
    a.logits = TensorView::contiguous(host.data(), DType::kF32, Shape{4, 16}, t->ctx.device);
    a.rows = TensorView::contiguous(host.data(), DType::kU8, Shape{4, 16}, t->ctx.device);  // 16 bytes a row
    a.tokens = TensorView::contiguous(host.data(), DType::kI32, Shape{4}, t->ctx.device);
    a.logprobs = TensorView::contiguous(host.data(), DType::kF32, Shape{4}, t->ctx.device);
    const Status st = t->backend->sample(t->ctx, a);
    EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument) << t->backend->name;
    EXPECT_EQ(st.field(), "rows") << t->backend->name;
    a.rows.shape = Shape{3, 32};
    a.rows.strides = Shape{32, 1};
    EXPECT_EQ(t->backend->sample(t->ctx, a).field(), "rows") << t->backend->name;
    a.rows = TensorView::contiguous(host.data(), DType::kU8, Shape{4, 32}, t->ctx.device);
    a.tokens = TensorView::contiguous(host.data(), DType::kI32, Shape{3}, t->ctx.device);
    EXPECT_EQ(t->backend->sample(t->ctx, a).field(), "tokens") << t->backend->name;
    a.tokens = TensorView::contiguous(host.data(), DType::kI32, Shape{4}, t->ctx.device);
    EXPECT_EQ(t->backend->sample(t->ctx, a).field(), "tokens") << "tokens overlapping the logits: " << t->backend->name;
  }
}

}  // namespace
}  // namespace rolloutd
