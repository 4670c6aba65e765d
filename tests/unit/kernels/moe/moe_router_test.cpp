// The CPU reference routers against hand-computed cases, one per family, plus the tie policy,
// NaN handling and argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/moe/moe_math.hpp"
#include "tests/unit/kernels/moe/moe_test_util.hpp"

namespace rolloutd::moe {
namespace {

using test::kCpu;

struct Routed {
  Status status;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Runs one router on the CPU over logits [T, E] with K picks.
Routed run(const RouterParams& prm, std::vector<float> logits, int64_t e, int64_t k,
           std::vector<float> logit_bias = {}, std::vector<float> corr = {},
           std::vector<int32_t> token_ids = {}, std::vector<int32_t> tid2eid = {}) {
  const int64_t t = static_cast<int64_t>(logits.size()) / e;
  Routed r;
  r.ids.assign(static_cast<size_t>(t * k), -7);
  r.weights.assign(static_cast<size_t>(t * k), -7.0f);
  RouterArgs a;
  a.ids = TensorView::contiguous(r.ids.data(), DType::kI32, Shape{t, k});
  a.weights = TensorView::contiguous(r.weights.data(), DType::kF32, Shape{t, k});
  a.logits = TensorView::contiguous(logits.data(), DType::kF32, Shape{t, e});
  if (!logit_bias.empty()) a.logit_bias = TensorView::contiguous(logit_bias.data(), DType::kF32, Shape{e});
  if (!corr.empty()) a.correction_bias = TensorView::contiguous(corr.data(), DType::kF32, Shape{e});
  if (!tid2eid.empty()) {
    a.tid2eid = TensorView::contiguous(tid2eid.data(), DType::kI32,
                                       Shape{static_cast<int64_t>(tid2eid.size()) / k, k});
    a.token_ids = TensorView::contiguous(token_ids.data(), DType::kI32, Shape{t});
  }
  r.status = route(kCpu, prm, a);
  return r;
}

void expect_weights(const std::vector<float>& got, const std::vector<double>& want, double tol = 2e-6) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol * (1 + std::fabs(want[i]))) << i;
}

TEST(MoeRouter, SoftmaxTopKTiesLowerIdFirst) {
  RouterParams p;
  p.kind = RouterKind::kSoftmaxTopK;
  p.renormalize = false;
  // max 3; sum = 2 + e^-1 + e^-2; experts 1 and 2 tie: lower id first.
  Routed r = run(p, {1, 3, 3, 2}, 4, 2);
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  expect_weights(r.weights, {0.39948630465030277, 0.39948630465030277});
  p.renormalize = true;  // Qwen3-MoE norm_topk_prob
  r = run(p, {1, 3, 3, 2}, 4, 2);
  expect_weights(r.weights, {0.5, 0.5});
}

TEST(MoeRouter, SoftmaxTopKNanRanksLast) {
  RouterParams p;
  p.kind = RouterKind::kSoftmaxTopK;
  Routed r = run(p, {NAN, 1, 2, -INFINITY}, 4, 3);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1, 0}));  // NaN ranks with -inf; lower id first
}

TEST(MoeRouter, TopKSoftmaxWithRouterBias) {
  // gpt-oss: v = logits + bias = [0.5, 1.0, -1.0, 1.5]; top-2 = {3, 1}; softmax over the two.
  RouterParams p;
  p.kind = RouterKind::kTopKSoftmax;
  Routed r = run(p, {0.5f, 2.0f, -1.0f, 1.0f}, 4, 2, {0, -1.0f, 0, 0.5f});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 1}));
  expect_weights(r.weights, {0.6224593312018546, 0.37754066879814546});
}

TEST(MoeRouter, SigmoidGroupedTopKExcludesUnselectedGroups) {
  // sigmoid: ln3 -> 0.75, -ln3 -> 0.25, 0 -> 0.5. Biased choice values
  // c = [0.75, 0.85, 0.5, 0.5, 0.75, 0.75, 0.9, 0.25]; group scores (best two):
  // g0 1.6, g1 1.0, g2 1.5, g3 1.15 -> groups 0 and 2. Expert 6 has the best single value but
  // sits in group 3. Picks: 1 (0.85), then the 0.75 tie among {0, 4, 5} -> 0.
  // Weights from the unbiased scores [0.25, 0.75], normalised, times 2.
  const float l3 = std::log(3.0f);
  const std::vector<float> logits{l3, -l3, 0, 0, l3, l3, l3, -l3};
  const std::vector<float> corr{0, 0.6f, 0, 0, 0, 0, 0.15f, 0};
  RouterParams p;
  p.kind = RouterKind::kSigmoidGroupedTopK;
  p.n_group = 4;
  p.topk_group = 2;
  p.routed_scaling_factor = 2.0f;
  Routed r = run(p, logits, 8, 2, {}, corr);
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 0}));
  expect_weights(r.weights, {0.5, 1.5});
  // Ungrouped, expert 6 wins; no renormalisation keeps the raw scores (times the factor).
  p.n_group = 1;
  p.topk_group = 1;
  p.renormalize = false;
  p.routed_scaling_factor = 1.0f;
  r = run(p, logits, 8, 2, {}, corr);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{6, 1}));
  expect_weights(r.weights, {0.75, 0.25});
}

TEST(MoeRouter, SqrtSoftplusTopK) {
  // softplus: 0 -> ln 2; 25 -> 25 (torch's threshold 20); -30 -> ~1e-13; ln(e - 1) -> 1.
  // scores sqrt: [0.8326, 5, ~3e-7, 1]; bias lifts expert 3 above expert 1.
  // Weights [1, 5] / 6 * 1.5.
  RouterParams p;
  p.kind = RouterKind::kSqrtSoftplusTopK;
  p.routed_scaling_factor = 1.5f;
  Routed r = run(p, {0.0f, 25.0f, -30.0f, 0.541324854612918f}, 4, 2, {}, {0, 0, 0, 4.5f});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 1}));
  expect_weights(r.weights, {0.25, 1.25});
}

TEST(MoeRouter, HashTakesTableIdsAndLearnedScores) {
  // tid2eid [[0, 1], [2, 3], [3, 0]]; tokens [2, 0]. Row 0 scores sqrt(softplus([0,0,0,25])):
  // token 2 -> experts [3, 0] weighted [5, 0.8326] / 5.8326 * 1.5. Row 1: equal scores.
  RouterParams p;
  p.kind = RouterKind::kHash;
  p.routed_scaling_factor = 1.5f;
  Routed r = run(p, {0, 0, 0, 25, 1, 1, 1, 1}, 4, 2, {}, {}, {2, 0}, {0, 1, 2, 3, 3, 0});
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 0, 0, 1}));
  expect_weights(r.weights, {1.2858859453544547, 0.21411405464554528, 0.75, 0.75});
}

TEST(MoeRouter, HashRejectsBadTokenOrTableEntryAndWritesNothing) {
  RouterParams p;
  p.kind = RouterKind::kHash;
  Routed r = run(p, {0, 0, 0, 0, 0, 0, 0, 0}, 4, 2, {}, {}, {1, 3}, {0, 1, 2, 3, 3, 0});
  EXPECT_EQ(r.status.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(r.status.field(), "token_ids");
  EXPECT_EQ(r.ids, (std::vector<int32_t>{-7, -7, -7, -7}));
  r = run(p, {0, 0, 0, 0}, 4, 2, {}, {}, {1}, {0, 1, 2, 4, 3, 0});
  EXPECT_EQ(r.status.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(r.status.field(), "tid2eid");
  EXPECT_EQ(r.weights[0], -7.0f);
}

TEST(MoeRouter, RejectsBadArguments) {
  RouterParams p;
  p.kind = RouterKind::kSoftmaxTopK;
  EXPECT_EQ(run(p, {1, 2, 3}, 3, 4).status.field(), "ids");  // K > E
  Routed r = run(p, {1, 2, 3, 4}, 4, 2, {}, {0, 0, 0, 0});
  EXPECT_EQ(r.status.field(), "correction_bias");  // softmax routers take no correction bias
  p.kind = RouterKind::kSigmoidGroupedTopK;
  p.n_group = 3;
  EXPECT_EQ(run(p, {1, 2, 3, 4}, 4, 2).status.field(), "params.n_group");
  p.n_group = 2;
  p.topk_group = 3;
  EXPECT_EQ(run(p, {1, 2, 3, 4}, 4, 2).status.field(), "params.topk_group");
  p.topk_group = 1;
  EXPECT_EQ(run(p, {1, 2, 3, 4}, 4, 3).status.field(), "ids");  // 3 > 1 group of 2
  p.kind = RouterKind::kHash;
  MOE_EXPECT_STATUS(run(p, {1, 2, 3, 4}, 4, 2).status, ErrorCode::kInvalidArgument, "tid2eid");

  // A bf16 logits view is refused by name.
  std::vector<uint16_t> logits(4);
  std::vector<int32_t> ids(2);
  std::vector<float> w(2);
  RouterArgs a;
  a.logits = TensorView::contiguous(logits.data(), DType::kBF16, Shape{1, 4});
  a.ids = TensorView::contiguous(ids.data(), DType::kI32, Shape{1, 2});
  a.weights = TensorView::contiguous(w.data(), DType::kF32, Shape{1, 2});
  RouterParams q;
  MOE_EXPECT_STATUS(route(kCpu, q, a), ErrorCode::kInvalidArgument, "logits");
}

TEST(MoeRouter, EmptyBatchIsFine) {
  RouterParams p;
  Routed r = run(p, {}, 4, 2);
  EXPECT_TRUE(r.status.ok()) << r.status.to_string();
}

TEST(MoeMath, SharedScalarFunctions) {
  // The deterministic exp/log against libm (double) over a wide range: within 2 ulp.
  for (float x = -100.0f; x < 88.0f; x += 0.37f) {
    const double want = std::exp(static_cast<double>(x));
    const float got = math::exp(x);
    // Subnormal results (below 2^-126) keep fewer bits: two steps of 2^-149 there.
    EXPECT_NEAR(got, want, std::max(2.5e-7 * want, 2.9e-45)) << x;
  }
  EXPECT_EQ(math::exp(-200.0f), 0.0f);
  EXPECT_TRUE(std::isinf(math::exp(100.0f)));
  EXPECT_TRUE(std::isnan(math::exp(NAN)));
  for (float x = -40.0f; x < 40.0f; x += 0.13f) {
    const double want = std::sqrt(x > 20 ? x : std::log1p(std::exp(static_cast<double>(x))));
    EXPECT_NEAR(math::sqrt_softplus(x), want, 3e-7 * want + 1e-30) << x;
    const double sg = 1.0 / (1.0 + std::exp(-static_cast<double>(x)));
    EXPECT_NEAR(math::sigmoid(x), sg, 3e-7 * sg) << x;
  }
}

}  // namespace
}  // namespace rolloutd::moe
