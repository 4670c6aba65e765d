// The CPU reference against small cases computed by hand, and every argument check with
// its typed code and field. The CUDA twin is held to this reference by
// backend_parity_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/bf16.hpp"
#include "kernels/quant/quant_ops.hpp"

namespace rolloutd {
namespace {

const Backend& cpu() { return cpu_backend(); }
const ExecContext kCtx{Device::cpu(), nullptr};

TensorView f32(std::vector<float>& v, Shape s) {
  return TensorView::contiguous(v.data(), DType::kF32, s);
}
TensorView i32(std::vector<int32_t>& v, Shape s) {
  return TensorView::contiguous(v.data(), DType::kI32, s);
}

float silu(float x) { return x / (1.0f + std::exp(-x)); }

#define EXPECT_STATUS(expr, code_, field_)        \
  do {                                            \
    const ::rolloutd::Status st_ = (expr);        \
    EXPECT_EQ(st_.code(), code_) << st_.to_string(); \
    EXPECT_EQ(st_.field(), field_) << st_.to_string(); \
  } while (0)

// ---- hand-computed results -------------------------------------------------------------

TEST(CpuBackend, LinearTwoByThree) {
  std::vector<float> x{1, 2, 3, 4, 5, 6};             // [2, 3]
  std::vector<float> w{1, 0, -1, 0.5f, 2, 0};          // [2, 3], Hugging Face [N, K]
  std::vector<float> y(4, NAN);
  ASSERT_TRUE(cpu().linear(kCtx, f32(y, {2, 2}), f32(x, {2, 3}), f32(w, {2, 3})).ok());
  EXPECT_EQ(y, (std::vector<float>{-2, 4.5f, -2, 12}));
}

TEST(CpuBackend, LinearFlattensLeadingDimensions) {
  std::vector<float> x{1, 2, 3, 4, 5, 6};
  std::vector<float> w{1, 1};  // [1, 2]
  std::vector<float> y(3, NAN);
  ASSERT_TRUE(cpu().linear(kCtx, f32(y, {3, 1}), f32(x, {3, 2}), f32(w, {1, 2})).ok());
  EXPECT_EQ(y, (std::vector<float>{3, 7, 11}));
  std::vector<float> y3(3, NAN);
  ASSERT_TRUE(cpu().linear(kCtx, f32(y3, {1, 3, 1}), f32(x, {1, 3, 2}), f32(w, {1, 2})).ok());
  EXPECT_EQ(y3, (std::vector<float>{3, 7, 11}));
}

TEST(CpuBackend, LinearLongRowsUseEveryElement) {
  // K = 19 crosses the eight-wide partial sums and their tail.
  std::vector<float> x(19), w(19);
  float expect = 0;
  for (int i = 0; i < 19; ++i) {
    x[i] = static_cast<float>(i + 1);
    w[i] = (i % 2) ? -1.0f : 2.0f;
    expect += x[i] * w[i];
  }
  std::vector<float> y(1, NAN);
  ASSERT_TRUE(cpu().linear(kCtx, f32(y, {1, 1}), f32(x, {1, 19}), f32(w, {1, 19})).ok());
  EXPECT_FLOAT_EQ(y[0], expect);
}

TEST(CpuBackend, RmsNormOfKnownVector) {
  std::vector<float> x{1, 2, 3, 4};
  std::vector<float> w{1, 1, 2, 0.5f};
  std::vector<float> out(4, NAN);
  ASSERT_TRUE(cpu().rmsnorm(kCtx, f32(out, {1, 4}), f32(x, {1, 4}), f32(w, {4}), 0.0f).ok());
  const float inv = 1.0f / std::sqrt(7.5f);  // mean of squares = 30 / 4
  EXPECT_FLOAT_EQ(out[0], 1 * inv);
  EXPECT_FLOAT_EQ(out[1], 2 * inv);
  EXPECT_FLOAT_EQ(out[2], 6 * inv);
  EXPECT_FLOAT_EQ(out[3], 2 * inv);
  // eps enters under the root; in place is allowed.
  ASSERT_TRUE(cpu().rmsnorm(kCtx, f32(x, {4}), f32(x, {4}), f32(w, {4}), 2.5f).ok());
  EXPECT_FLOAT_EQ(x[2], 3 * 2 / std::sqrt(10.0f));
}

TEST(CpuBackend, RopeAtPositionOneMatchesCosSinByHand) {
  // D = 4, theta = 10000: inv_freq = {1, 10000^-0.5 = 0.01}; element i pairs with i + 2.
  std::vector<float> x{1, 2, 3, 4, 1, 2, 3, 4};  // [T=2, heads=1, D=4]
  std::vector<int32_t> pos{1, 0};
  ASSERT_TRUE(cpu().rope(kCtx, f32(x, {2, 1, 4}), i32(pos, {2}), 10000.0f).ok());
  const double c1 = std::cos(1.0), s1 = std::sin(1.0);
  const double c2 = std::cos(0.01), s2 = std::sin(0.01);
  EXPECT_NEAR(x[0], 1 * c1 - 3 * s1, 1e-6);
  EXPECT_NEAR(x[2], 3 * c1 + 1 * s1, 1e-6);
  EXPECT_NEAR(x[1], 2 * c2 - 4 * s2, 1e-6);
  EXPECT_NEAR(x[3], 4 * c2 + 2 * s2, 1e-6);
  // Position 0 is the identity.
  EXPECT_EQ(std::vector<float>(x.begin() + 4, x.end()), (std::vector<float>{1, 2, 3, 4}));
}

TEST(CpuBackend, RopeRotatesEveryHeadOfAToken) {
  std::vector<float> x{1, 0, 1, 0};  // [T=1, heads=2, D=2]
  std::vector<int32_t> pos{2};
  ASSERT_TRUE(cpu().rope(kCtx, f32(x, {1, 2, 2}), i32(pos, {1}), 10000.0f).ok());
  for (int h = 0; h < 2; ++h) {
    EXPECT_NEAR(x[2 * h], std::cos(2.0), 1e-6);
    EXPECT_NEAR(x[2 * h + 1], std::sin(2.0), 1e-6);
  }
}

TEST(CpuBackend, EmbeddingCopiesRows) {
  std::vector<float> table{0, 1, 10, 11, 20, 21};  // [3, 2]
  std::vector<int32_t> ids{2, 0, 2};
  std::vector<float> out(6, NAN);
  ASSERT_TRUE(cpu().embedding(kCtx, f32(out, {3, 2}), f32(table, {3, 2}), i32(ids, {3})).ok());
  EXPECT_EQ(out, (std::vector<float>{20, 21, 0, 1, 20, 21}));
}

TEST(CpuBackend, AddElementwise) {
  std::vector<float> a{1, 2, 3}, b{10, 20, 30}, out(3, NAN);
  ASSERT_TRUE(cpu().add(kCtx, f32(out, {3}), f32(a, {3}), f32(b, {3})).ok());
  EXPECT_EQ(out, (std::vector<float>{11, 22, 33}));
  ASSERT_TRUE(cpu().add(kCtx, f32(a, {1, 3}), f32(a, {1, 3}), f32(b, {1, 3})).ok());  // in place
  EXPECT_EQ(a, (std::vector<float>{11, 22, 33}));
}

TEST(CpuBackend, SoftmaxTopKBreaksTiesByLowerId) {
  std::vector<float> logits{1, 3, 3, 0};
  std::vector<int32_t> ids(3, -7);
  std::vector<float> w(3, NAN);
  ASSERT_TRUE(
      cpu().router_softmax_topk(kCtx, i32(ids, {1, 3}), f32(w, {1, 3}), f32(logits, {1, 4}), false)
          .ok());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2, 0}));
  const double z = std::exp(1.0) + 2 * std::exp(3.0) + 1.0;
  EXPECT_NEAR(w[0], std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(w[1], std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(w[2], std::exp(1.0) / z, 1e-6);

  std::vector<int32_t> ids2(2, -7);
  std::vector<float> w2(2, NAN);
  ASSERT_TRUE(cpu().router_softmax_topk(kCtx, i32(ids2, {1, 2}), f32(w2, {1, 2}),
                                        f32(logits, {1, 4}), true)
                  .ok());
  EXPECT_EQ(ids2, (std::vector<int32_t>{1, 2}));
  EXPECT_FLOAT_EQ(w2[0], 0.5f);
  EXPECT_FLOAT_EQ(w2[1], 0.5f);
}

// Backend::router is linear, add_bias and router_softmax_topk in one call: bit for bit on the
// CPU (the decoder's CPU results do not move), with and without a bias, plain and renormalised;
// refusals name the argument and write nothing.
TEST(CpuBackend, RouterIsLinearBiasThenSoftmaxTopK) {
  const int64_t T = 5, H = 12, E = 9, K = 3;
  std::vector<float> x(T * H), w(E * H), bias(E);
  // The router's views over the test's buffers (no bias).
  const auto args = [&](std::vector<int32_t>& ids, std::vector<float>& wt, std::vector<float>& logits) {
    RouterArgs a;
    a.ids = i32(ids, {T, K});
    a.weights = f32(wt, {T, K});
    a.logits = f32(logits, {T, E});
    a.x = f32(x, {T, H});
    a.w = f32(w, {E, H});
    return a;
  };
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i)) * 1.5f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::cos(0.11f * static_cast<float>(i * i % 97));
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = 0.25f * static_cast<float>(i % 4) - 0.4f;
  for (const bool with_bias : {false, true})
    for (const bool renorm : {false, true}) {
      SCOPED_TRACE(std::to_string(with_bias) + std::to_string(renorm));
      std::vector<float> logits(T * E, NAN), ref_logits(T * E, NAN), wt(T * K, NAN), ref_wt(T * K, NAN);
      std::vector<int32_t> ids(T * K, -7), ref_ids(T * K, -7);
      ASSERT_TRUE(cpu().linear(kCtx, f32(ref_logits, {T, E}), f32(x, {T, H}), f32(w, {E, H})).ok());
      if (with_bias) {
        ASSERT_TRUE(cpu().add_bias(kCtx, f32(ref_logits, {T, E}), f32(bias, {E})).ok());
      }
      ASSERT_TRUE(cpu().router_softmax_topk(kCtx, i32(ref_ids, {T, K}), f32(ref_wt, {T, K}), f32(ref_logits, {T, E}),
                                            renorm).ok());
      RouterArgs a = args(ids, wt, logits);
      if (with_bias) a.bias = f32(bias, {E});
      a.renormalize = renorm;
      ASSERT_TRUE(cpu().router(kCtx, a).ok());
      EXPECT_EQ(ids, ref_ids);
      EXPECT_EQ(std::memcmp(wt.data(), ref_wt.data(), wt.size() * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(logits.data(), ref_logits.data(), logits.size() * sizeof(float)), 0);
    }

  std::vector<float> logits(T * E, NAN), wt(T * K, NAN), short_bias(E - 1);
  std::vector<int32_t> ids(T * K, -7);
  const RouterArgs good = args(ids, wt, logits);
  RouterArgs bad = good;
  bad.w = f32(w, {E, H - 1});
  EXPECT_STATUS(cpu().router(kCtx, bad), ErrorCode::kInvalidArgument, "x");
  bad = good;
  bad.bias = f32(short_bias, {E - 1});
  EXPECT_STATUS(cpu().router(kCtx, bad), ErrorCode::kInvalidArgument, "bias");
  bad = good;
  bad.logits = TensorView::contiguous(x.data(), DType::kF32, Shape{T, E});  // inside x
  EXPECT_STATUS(cpu().router(kCtx, bad), ErrorCode::kInvalidArgument, "logits");
  bad = good;
  bad.weights = TensorView::contiguous(logits.data(), DType::kF32, Shape{T, K});
  EXPECT_STATUS(cpu().router(kCtx, bad), ErrorCode::kInvalidArgument, "ids");
  bad = good;
  bad.logits = f32(logits, {T, E - 1});
  EXPECT_STATUS(cpu().router(kCtx, bad), ErrorCode::kInvalidArgument, "logits");
  EXPECT_TRUE(std::all_of(ids.begin(), ids.end(), [](int32_t v) { return v == -7; }));
  EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isnan(v); }));
}

TEST(CpuBackend, SoftmaxTopKRenormalisesByTheSumOfTheK) {
  std::vector<float> logits{0, std::log(2.0f), std::log(6.0f), -1, 5, -3};
  // Row 0: probabilities proportional to {1, 2, 6}; top-2 = {2, 1}, renormalised 6/8, 2/8.
  // Row 1 is routed on its own: top-2 = {1, 0}, renormalised e^5 / (e^5 + e^-1).
  std::vector<int32_t> ids(4, -7);
  std::vector<float> w(4, NAN);
  ASSERT_TRUE(cpu().router_softmax_topk(kCtx, i32(ids, {2, 2}), f32(w, {2, 2}),
                                        f32(logits, {2, 3}), true)
                  .ok());
  EXPECT_EQ(ids, (std::vector<int32_t>{2, 1, 1, 0}));
  EXPECT_NEAR(w[0], 0.75, 1e-6);
  EXPECT_NEAR(w[1], 0.25, 1e-6);
  EXPECT_NEAR(w[2], 1 / (1 + std::exp(-6.0)), 1e-6);
  EXPECT_NEAR(w[2] + w[3], 1.0, 1e-6);
}

// A cache of 2 blocks x 2 slots, one kv head of D = 2; helper fills slot s with k = kv[s].
struct TinyCache {
  std::vector<float> k = std::vector<float>(8, 0.0f), v = std::vector<float>(8, 0.0f);
  TensorView kv(std::vector<float>& c, int64_t kv_heads, int64_t d) {
    return f32(c, {2, 2, kv_heads, d});
  }
};

TEST(CpuBackend, AttentionOverOneKeyReturnsItsValue) {
  TinyCache c;
  c.k = {5, -3, 0, 0, 0, 0, 0, 0};
  c.v = {0.25f, 7, 0, 0, 0, 0, 0, 0};
  std::vector<float> q{1, 2}, out(2, NAN);
  std::vector<int32_t> table{0, 1}, seq{0}, len{1};
  ASSERT_TRUE(cpu().paged_attention(kCtx, f32(out, {1, 1, 2}), f32(q, {1, 1, 2}), c.kv(c.k, 1, 2),
                                    c.kv(c.v, 1, 2), i32(table, {1, 2}), i32(seq, {1}),
                                    i32(len, {1}), 0.7f)
                  .ok());
  EXPECT_FLOAT_EQ(out[0], 0.25f);
  EXPECT_FLOAT_EQ(out[1], 7.0f);
}

TEST(CpuBackend, AttentionWeighsKeysBySoftmaxAcrossBlocks) {
  // Three positions over two blocks; table maps position 0-1 -> block 1, 2 -> block 0.
  TinyCache c;
  const float l3 = std::log(3.0f);
  // block 1 slot 0: score 0; block 1 slot 1: score ln 3; block 0 slot 0: score 0.
  c.k = {0, 0, 9, 9, 0, 0, l3, 0};
  c.v = {4, 0, 9, 9, 1, 0, 0, 1};
  std::vector<float> q{1, 0, 1, 0}, out(4, NAN);
  std::vector<int32_t> table{1, 0}, seq{0, 0}, len{2, 3};  // causal: token 0 sees 2, token 1 sees 3
  ASSERT_TRUE(cpu().paged_attention(kCtx, f32(out, {2, 1, 2}), f32(q, {2, 1, 2}), c.kv(c.k, 1, 2),
                                    c.kv(c.v, 1, 2), i32(table, {1, 2}), i32(seq, {2}),
                                    i32(len, {2}), 1.0f)
                  .ok());
  // token 0: weights 1/4, 3/4 over v = (1,0), (0,1)
  EXPECT_NEAR(out[0], 0.25, 1e-6);
  EXPECT_NEAR(out[1], 0.75, 1e-6);
  // token 1: weights 1/5, 3/5, 1/5 over (1,0), (0,1), (4,0)
  EXPECT_NEAR(out[2], 0.2 + 0.8, 1e-6);
  EXPECT_NEAR(out[3], 0.6, 1e-6);
}

TEST(CpuBackend, AttentionGqaMapsQueryHeadToKvHeadByDivision) {
  // QH = 4, KVH = 2: heads 0,1 read kv head 0; heads 2,3 read kv head 1. One key each.
  std::vector<float> k(2 * 2 * 2 * 1, 0.0f), v(2 * 2 * 2 * 1, 0.0f);
  v[0] = 10;  // block 0, slot 0, kv head 0
  v[1] = 20;  // block 0, slot 0, kv head 1
  std::vector<float> q{1, 1, 1, 1}, out(4, NAN);
  std::vector<int32_t> table{0}, seq{0}, len{1};
  ASSERT_TRUE(cpu().paged_attention(kCtx, f32(out, {1, 4, 1}), f32(q, {1, 4, 1}),
                                    f32(k, {2, 2, 2, 1}), f32(v, {2, 2, 2, 1}),
                                    i32(table, {1, 1}), i32(seq, {1}), i32(len, {1}), 1.0f)
                  .ok());
  EXPECT_EQ(out, (std::vector<float>{10, 10, 20, 20}));
}

TEST(CpuBackend, AttentionWithEmptyContextWritesZeros) {
  TinyCache c;
  std::vector<float> q{1, 2}, out(2, NAN);
  std::vector<int32_t> table{0, 1}, seq{0}, len{0};
  ASSERT_TRUE(cpu().paged_attention(kCtx, f32(out, {1, 1, 2}), f32(q, {1, 1, 2}), c.kv(c.k, 1, 2),
                                    c.kv(c.v, 1, 2), i32(table, {1, 2}), i32(seq, {1}),
                                    i32(len, {1}), 1.0f)
                  .ok());
  EXPECT_EQ(out, (std::vector<float>{0, 0}));
}

// A BF16 out (o_proj's input on CUDA) holds the FP32 result rounded once, padding rows zero; an
// out of any other dtype is refused, naming it.
TEST(CpuBackend, AttentionBf16OutIsTheFp32ResultRounded) {
  TinyCache c;
  c.k = {0.3f, -1.1f, 0.7f, 0.2f, 0, 0, 0, 0};
  c.v = {1.0f / 3, -2.71828f, 0.1f, 1e-3f, 0, 0, 0, 0};
  std::vector<float> q{0.9f, -0.4f, 1.3f, 0.25f, 5, 5}, out(6, NAN);
  std::vector<int32_t> table{0, 1}, seq{0, 0, 0}, len{1, 2, 0};
  ASSERT_TRUE(cpu().paged_attention(kCtx, f32(out, {3, 1, 2}), f32(q, {3, 1, 2}), c.kv(c.k, 1, 2), c.kv(c.v, 1, 2),
                                    i32(table, {1, 2}), i32(seq, {3}), i32(len, {3}), 0.8f)
                  .ok());
  std::vector<uint16_t> got(6, 0xffff);
  ASSERT_TRUE(cpu().paged_attention(kCtx, TensorView::contiguous(got.data(), DType::kBF16, Shape{3, 1, 2}),
                                    f32(q, {3, 1, 2}), c.kv(c.k, 1, 2), c.kv(c.v, 1, 2), i32(table, {1, 2}),
                                    i32(seq, {3}), i32(len, {3}), 0.8f)
                  .ok());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], f32_to_bf16_bits(out[i])) << i;
  EXPECT_EQ(got[4], 0u);  // the padding row
  EXPECT_EQ(got[5], 0u);
  EXPECT_NE(got[0], f32_to_bf16_bits(0.0f));  // real rows are not zero
  std::vector<int32_t> bad(6, 0);
  EXPECT_STATUS(cpu().paged_attention(kCtx, i32(bad, {3, 1, 2}), f32(q, {3, 1, 2}), c.kv(c.k, 1, 2), c.kv(c.v, 1, 2),
                                      i32(table, {1, 2}), i32(seq, {3}), i32(len, {3}), 0.8f),
                ErrorCode::kInvalidArgument, "out");
  EXPECT_EQ(bad, std::vector<int32_t>(6, 0));  // refused before anything was written
}

AttentionOptions attn_options(TensorView sinks, int64_t window) {
  AttentionOptions o;
  o.sinks = sinks;
  o.window = window;
  return o;
}

TEST(CpuBackend, AttentionSinkJoinsTheDenominatorOnly) {
  // The three-position case above with a sink of ln 5: token 1's weights 1/10, 3/10, 1/10 (the
  // sink takes the other 5/10 and brings no value).
  TinyCache c;
  const float l3 = std::log(3.0f);
  c.k = {0, 0, 9, 9, 0, 0, l3, 0};
  c.v = {4, 0, 9, 9, 1, 0, 0, 1};
  std::vector<float> q{1, 0}, out(2, NAN), sinks{std::log(5.0f)};
  std::vector<int32_t> table{1, 0}, seq{0}, len{3};
  ASSERT_TRUE(cpu().paged_attention_ex(kCtx, f32(out, {1, 1, 2}), f32(q, {1, 1, 2}), c.kv(c.k, 1, 2),
                                       c.kv(c.v, 1, 2), i32(table, {1, 2}), i32(seq, {1}), i32(len, {1}), 1.0f,
                                       attn_options(f32(sinks, {1}), 0))
                  .ok());
  EXPECT_NEAR(out[0], 0.1 + 0.4, 1e-6);
  EXPECT_NEAR(out[1], 0.3, 1e-6);
}

TEST(CpuBackend, AttentionWindowSeesOnlyTheLastPositions) {
  // Window 2 at context 3: positions 1 and 2 only (scores ln 3, 0), weights 3/4, 1/4.
  TinyCache c;
  const float l3 = std::log(3.0f);
  c.k = {0, 0, 9, 9, 0, 0, l3, 0};
  c.v = {4, 0, 9, 9, 1, 0, 0, 1};
  std::vector<float> q{1, 0}, out(2, NAN);
  std::vector<int32_t> table{1, 0}, seq{0}, len{3};
  const auto run = [&](int64_t window) {
    return cpu().paged_attention_ex(kCtx, f32(out, {1, 1, 2}), f32(q, {1, 1, 2}), c.kv(c.k, 1, 2), c.kv(c.v, 1, 2),
                                    i32(table, {1, 2}), i32(seq, {1}), i32(len, {1}), 1.0f,
                                    attn_options(TensorView{}, window));
  };
  ASSERT_TRUE(run(2).ok());
  EXPECT_NEAR(out[0], 0.25 * 4, 1e-6);  // position 2 (block 0 slot 0) has v = (4, 0)
  EXPECT_NEAR(out[1], 0.75, 1e-6);
  // A window at least the context is plain causal attention (1/5, 3/5, 1/5).
  ASSERT_TRUE(run(3).ok());
  EXPECT_NEAR(out[0], 1.0, 1e-6);
  EXPECT_NEAR(out[1], 0.6, 1e-6);
  EXPECT_STATUS(run(-1), ErrorCode::kInvalidArgument, "window");
  // Blocks wholly before the window are never followed: window 1 with the first block -1.
  table = {-1, 0};
  ASSERT_TRUE(run(1).ok());
  EXPECT_EQ(out, (std::vector<float>{4, 0}));
  table = {1, 0};
  std::vector<float> bad_sinks{0, 0};
  EXPECT_STATUS(cpu().paged_attention_ex(kCtx, f32(out, {1, 1, 2}), f32(q, {1, 1, 2}), c.kv(c.k, 1, 2),
                                         c.kv(c.v, 1, 2), i32(table, {1, 2}), i32(seq, {1}), i32(len, {1}), 1.0f,
                                         attn_options(f32(bad_sinks, {2}), 0)),
                ErrorCode::kInvalidArgument, "sinks");
}

TEST(AttentionWorkspace, CapacityIsTheMostTokensTheBytesHold) {
  // The split workspace's layout follows its capacity (a workspace reused by launches of other
  // token counts): every size from one token's bytes to 40 tokens', at gpt-oss's 64 heads of 64
  // and at 3 heads of 5 (counters not a multiple of 16 bytes), against a linear search.
  for (const auto& [qh, d] : {std::pair<int64_t, int64_t>{64, 64}, {3, 5}, {1, 2}}) {
    EXPECT_EQ(paged_attention_workspace_tokens(0, qh, d), 0);
    EXPECT_EQ(paged_attention_workspace_tokens(paged_attention_workspace_bytes(1, qh, d) - 1, qh, d), 0);
    for (int64_t t = 1; t <= 40; ++t) {
      const int64_t b = paged_attention_workspace_bytes(t, qh, d);
      for (const int64_t bytes : {b, b + 1, b + 15, paged_attention_workspace_bytes(t + 1, qh, d) - 1})
        EXPECT_EQ(paged_attention_workspace_tokens(bytes, qh, d), t)
            << qh << " heads of " << d << ", " << bytes << " bytes";
    }
  }
  EXPECT_EQ(paged_attention_workspace_tokens(1 << 20, 0, 64), 0);
  EXPECT_EQ(paged_attention_workspace_tokens(-5, 64, 64), 0);
}

TEST(CpuBackend, AttentionWorkspaceIsCheckedThenIgnored) {
  // The split-row workspace is CUDA's scratch: the CPU reference checks it like any view and
  // computes the same values with or without it; a refused call writes nothing.
  TinyCache c;
  const float l3 = std::log(3.0f);
  c.k = {0, 0, 9, 9, 0, 0, l3, 0};
  c.v = {4, 0, 9, 9, 1, 0, 0, 1};
  std::vector<float> q{1, 0}, out(2, NAN);
  std::vector<int32_t> table{1, 0}, seq{0}, len{3};
  const int64_t need = paged_attention_workspace_bytes(1, 1, 2);
  ASSERT_EQ(need, 16 + 16 * 4 * 4);  // counters rounded to 16 bytes, then 16 parts of (2 + 2) floats
  alignas(16) std::array<uint8_t, 256> bytes{};
  const auto run = [&](TensorView ws, int32_t ctas) {
    AttentionOptions o;
    o.workspace = ws;
    o.split_ctas = ctas;
    return cpu().paged_attention_ex(kCtx, f32(out, {1, 1, 2}), f32(q, {1, 1, 2}), c.kv(c.k, 1, 2), c.kv(c.v, 1, 2),
                                    i32(table, {1, 2}), i32(seq, {1}), i32(len, {1}), 1.0f, o);
  };
  auto u8 = [&](size_t offset, int64_t n, DType t = DType::kU8) {
    return TensorView::contiguous(bytes.data() + offset, t, Shape{n}, kCtx.device);
  };
  ASSERT_TRUE(run(TensorView{}, 0).ok());
  const std::vector<float> plain = out;
  out.assign(2, NAN);
  ASSERT_TRUE(run(u8(0, need), 3).ok());
  EXPECT_EQ(out, plain);
  out.assign(2, NAN);
  EXPECT_STATUS(run(u8(0, need - 1), 0), ErrorCode::kInvalidArgument, "workspace");
  EXPECT_STATUS(run(u8(4, need), 0), ErrorCode::kInvalidArgument, "workspace");  // not 16-byte aligned
  EXPECT_STATUS(run(u8(0, need / 4, DType::kI32), 0), ErrorCode::kInvalidArgument, "workspace");
  EXPECT_STATUS(run(u8(0, need), -1), ErrorCode::kInvalidArgument, "split_ctas");
  EXPECT_TRUE(std::isnan(out[0]) && std::isnan(out[1])) << "out written by a refused call";
  // A workspace over the output.
  std::vector<uint8_t> shared(static_cast<size_t>(need) + 64);
  auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared.data()) + 15) / 16 * 16);
  AttentionOptions o;
  o.workspace = TensorView::contiguous(base, DType::kU8, Shape{need}, kCtx.device);
  EXPECT_STATUS(cpu().paged_attention_ex(kCtx, TensorView::contiguous(base, DType::kF32, Shape{1, 1, 2}, kCtx.device),
                                         f32(q, {1, 1, 2}), c.kv(c.k, 1, 2), c.kv(c.v, 1, 2), i32(table, {1, 2}),
                                         i32(seq, {1}), i32(len, {1}), 1.0f, o),
                ErrorCode::kInvalidArgument, "workspace");
}

TEST(CpuBackend, RopeTableRotatesByTheGivenFrequencyAndScales) {
  // Position 3, frequency 0.5: angle 1.5; cos/sin times 2.
  std::vector<float> x{1, 0.5f}, inv{0.5f};
  std::vector<int32_t> pos{3};
  ASSERT_TRUE(cpu().rope_table(kCtx, f32(x, {1, 1, 2}), i32(pos, {1}), f32(inv, {1}), 2.0f).ok());
  EXPECT_NEAR(x[0], 2 * (std::cos(1.5) - 0.5 * std::sin(1.5)), 1e-6);
  EXPECT_NEAR(x[1], 2 * (0.5 * std::cos(1.5) + std::sin(1.5)), 1e-6);
  std::vector<float> inv2{0.5f, 0.25f};
  EXPECT_STATUS(cpu().rope_table(kCtx, f32(x, {1, 1, 2}), i32(pos, {1}), f32(inv2, {2}), 1.0f),
                ErrorCode::kInvalidArgument, "inv_freq");
  EXPECT_STATUS(cpu().rope_table(kCtx, f32(x, {1, 1, 2}), i32(pos, {1}), f32(inv, {1}), 0.0f),
                ErrorCode::kInvalidArgument, "scale");
}

TEST(CpuBackend, AddBiasAndTranspose) {
  std::vector<float> y{1, 2, 3, 4, 5, 6}, b{10, 20, 30};
  ASSERT_TRUE(cpu().add_bias(kCtx, f32(y, {2, 3}), f32(b, {3})).ok());
  EXPECT_EQ(y, (std::vector<float>{11, 22, 33, 14, 25, 36}));
  EXPECT_STATUS(cpu().add_bias(kCtx, f32(y, {2, 3}), f32(b, {2})), ErrorCode::kInvalidArgument, "bias");
  // [2, 2, 3] -> [2, 3, 2]
  std::vector<float> src{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, dst(12, NAN);
  ASSERT_TRUE(cpu().transpose(kCtx, f32(dst, {2, 3, 2}), f32(src, {2, 2, 3})).ok());
  EXPECT_EQ(dst, (std::vector<float>{1, 4, 2, 5, 3, 6, 7, 10, 8, 11, 9, 12}));
  EXPECT_STATUS(cpu().transpose(kCtx, f32(dst, {2, 2, 3}), f32(src, {2, 2, 3})), ErrorCode::kInvalidArgument, "dst");
  EXPECT_STATUS(cpu().transpose(kCtx, f32(src, {2, 3, 2}), f32(src, {2, 2, 3})), ErrorCode::kInvalidArgument, "dst");
}

TEST(CpuBackend, MoeMxfp4ExpertsEqualFp32OnTheDequantizedWeights) {
  // The MXFP4 path reads each weight as quant::dequantize_mxfp4 would write it: with the same
  // bytes dequantized into FP32 tensors, the FP32 path gives the same output bit for bit.
  const int64_t T = 3, H = 64, I = 32, E = 3, K = 2;
  uint64_t st = 12345;
  auto next = [&] { st = st * 6364136223846793005ull + 1442695040888963407ull; return static_cast<uint32_t>(st >> 33); };
  std::vector<uint8_t> gb(E * 2 * I * (H / 32) * 16), gs(E * 2 * I * (H / 32)), db(E * H * (I / 32) * 16),
      ds(E * H * (I / 32));
  for (auto& b : gb) b = static_cast<uint8_t>(next());
  for (auto& b : db) b = static_cast<uint8_t>(next());
  for (auto& b : gs) b = static_cast<uint8_t>(120 + next() % 8);
  for (auto& b : ds) b = static_cast<uint8_t>(120 + next() % 8);
  std::vector<float> gu(E * 2 * I * H), dn(E * H * I);
  auto u8 = [](std::vector<uint8_t>& v, Shape s) { return TensorView::contiguous(v.data(), DType::kU8, s); };
  ASSERT_TRUE(quant::dequantize_mxfp4(kCtx, u8(gb, {E, 2 * I, H / 32, 16}), u8(gs, {E, 2 * I, H / 32}),
                                      f32(gu, {E, 2 * I, H})).ok());
  ASSERT_TRUE(quant::dequantize_mxfp4(kCtx, u8(db, {E, H, I / 32, 16}), u8(ds, {E, H, I / 32}), f32(dn, {E, H, I})).ok());
  std::vector<float> x(T * H), w{0.7f, 0.3f, 0.5f, 0.5f, 1.0f, 0.25f}, b_gu(E * 2 * I), b_dn(E * H);
  for (auto& v : x) v = static_cast<float>(next() % 2001) / 1000.0f - 1.0f;
  for (auto& v : b_gu) v = static_cast<float>(next() % 201) / 100.0f - 1.0f;
  for (auto& v : b_dn) v = static_cast<float>(next() % 201) / 100.0f - 1.0f;
  std::vector<int32_t> ids{0, 2, 1, 0, 2, 1}, map{2, 0, 1};
  std::vector<float> out_fp32(T * H, NAN), out_mx(T * H, NAN);
  MoeExpertsArgs a;
  a.x = f32(x, {T, H});
  a.topk_ids = i32(ids, {T, K});
  a.topk_weights = f32(w, {T, K});
  a.logical_to_physical = i32(map, {E});
  a.gate_up_interleaved = true;
  a.activation = MoeExpertsArgs::Activation::kGptOss;
  a.b_gate_up = f32(b_gu, {E, 2 * I});
  a.b_down = f32(b_dn, {E, H});
  a.out = f32(out_fp32, {T, H});
  a.w_gate_up = f32(gu, {E, 2 * I, H});
  a.w_down = f32(dn, {E, H, I});
  ASSERT_TRUE(cpu().moe_experts(kCtx, a).ok());
  a.out = f32(out_mx, {T, H});
  a.w_gate_up = TensorView{};
  a.w_down = TensorView{};
  a.w_gate_up_blocks = u8(gb, {E, 2 * I, H / 32, 16});
  a.w_gate_up_scales = u8(gs, {E, 2 * I, H / 32});
  a.w_down_blocks = u8(db, {E, H, I / 32, 16});
  a.w_down_scales = u8(ds, {E, H, I / 32});
  ASSERT_TRUE(cpu().moe_experts(kCtx, a).ok());
  EXPECT_EQ(out_mx, out_fp32);
  EXPECT_NE(out_mx[0], 0.0f);
  // A scale tensor of the wrong shape is refused, naming it.
  a.w_down_scales = u8(ds, {E, H / 2, 2 * (I / 32)});
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kInvalidArgument, "w_down_scales");
}

TEST(CpuBackend, KvStoreWritesSlotsAndSkipsNegative) {
  std::vector<float> kc(8, 0.0f), vc(8, 0.0f);  // [2 blocks, 2 slots, 1 head, D = 2]
  std::vector<float> k{1, 2, 3, 4, 5, 6}, v{-1, -2, -3, -4, -5, -6};
  std::vector<int32_t> slots{3, -1, 0};
  ASSERT_TRUE(cpu().kv_store(kCtx, f32(kc, {2, 2, 1, 2}), f32(vc, {2, 2, 1, 2}),
                             f32(k, {3, 1, 2}), f32(v, {3, 1, 2}), i32(slots, {3}))
                  .ok());
  EXPECT_EQ(kc, (std::vector<float>{5, 6, 0, 0, 0, 0, 1, 2}));
  EXPECT_EQ(vc, (std::vector<float>{-5, -6, 0, 0, 0, 0, -1, -2}));
}

// BF16 caches: each value rounded to nearest even as it is stored. Expected bits by hand from
// the format (sign, 8 exponent bits, 7 mantissa bits; 1.0 = 0x3f80, a step at 1 is 2^-7):
// 1 + 2^-8 is a tie and goes to the even 1.0; 1 + 3 * 2^-8 is a tie and goes up to the even
// 1 + 2^-6; 1 + 2^-8 + 2^-20 is past the tie and goes up; -2.5 and 0 are exact.
TEST(CpuBackend, KvStoreIntoBf16RoundsToNearestEven) {
  std::vector<uint16_t> kc(8, 0xffff), vc(8, 0xffff);  // [2 blocks, 2 slots, 1 head, D = 2]
  const float tie_down = 1.0f + std::ldexp(1.0f, -8), tie_up = 1.0f + 3 * std::ldexp(1.0f, -8);
  const float past = 1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20);
  std::vector<float> k{tie_down, tie_up, 9, 9}, v{past, -2.5f, 9, 9};
  std::vector<int32_t> slots{2, -1};
  const auto bf = [](std::vector<uint16_t>& b) {
    return TensorView::contiguous(b.data(), DType::kBF16, Shape{2, 2, 1, 2});
  };
  ASSERT_TRUE(cpu().kv_store(kCtx, bf(kc), bf(vc), f32(k, {2, 1, 2}), f32(v, {2, 1, 2}), i32(slots, {2})).ok());
  EXPECT_EQ(kc, (std::vector<uint16_t>{0xffff, 0xffff, 0xffff, 0xffff, 0x3f80, 0x3f82, 0xffff, 0xffff}));
  EXPECT_EQ(vc, (std::vector<uint16_t>{0xffff, 0xffff, 0xffff, 0xffff, 0x3f81, 0xc020, 0xffff, 0xffff}));
  // The caches must share one dtype: a BF16 k_cache with an FP32 v_cache is refused, nothing written.
  std::vector<float> vf(8, 0.0f);
  EXPECT_EQ(cpu().kv_store(kCtx, bf(kc), f32(vf, {2, 2, 1, 2}), f32(k, {2, 1, 2}), f32(v, {2, 1, 2}), i32(slots, {2}))
                .field(),
            "v_cache");
  EXPECT_EQ(vf, std::vector<float>(8, 0.0f));
}

// Attention over BF16 caches is attention over the FP32 values those bits stand for.
TEST(CpuBackend, AttentionOverBf16CachesEqualsFp32OfTheSameValues) {
  // [3 blocks, 2 slots, 1 head, D = 2]; a context of 5 over blocks 2, 0, 1 (a window of 3).
  std::vector<float> kf{0.5f, -1.25f, 2, 0.75f, 1, 1, -3, 0.25f, 1.5f, 0.125f, -0.5f, 2.5f};
  std::vector<float> vf{1, 2, 3, 4, 5, 6, 7, 8, -1, -2, -3, -4};
  std::vector<uint16_t> kb(kf.size()), vb(vf.size());
  for (size_t i = 0; i < kf.size(); ++i) {  // all exact in BF16
    kb[i] = f32_to_bf16_bits(kf[i]);
    vb[i] = f32_to_bf16_bits(vf[i]);
    ASSERT_EQ(bf16_bits_to_f32(kb[i]), kf[i]);
  }
  std::vector<float> q{0.3f, -0.7f, 1.1f, 0.2f, -0.4f, 0.9f, 0.6f, -1.3f}, sinks{0.4f, -1.0f}, a(8, NAN), b(8, NAN);
  std::vector<int32_t> table{2, 0, 1}, seq{0, 0}, len{4, 5};
  const Shape cs{3, 2, 1, 2};
  AttentionOptions o;
  o.sinks = f32(sinks, {2});
  o.window = 3;
  ASSERT_TRUE(cpu().paged_attention_ex(kCtx, f32(a, {2, 2, 2}), f32(q, {2, 2, 2}), f32(kf, cs), f32(vf, cs),
                                       i32(table, {1, 3}), i32(seq, {2}), i32(len, {2}), 0.9f, o)
                  .ok());
  ASSERT_TRUE(cpu().paged_attention_ex(kCtx, f32(b, {2, 2, 2}), f32(q, {2, 2, 2}),
                                       TensorView::contiguous(kb.data(), DType::kBF16, cs),
                                       TensorView::contiguous(vb.data(), DType::kBF16, cs), i32(table, {1, 3}),
                                       i32(seq, {2}), i32(len, {2}), 0.9f, o)
                  .ok());
  EXPECT_EQ(a, b);
  for (float x : a) EXPECT_TRUE(std::isfinite(x));
}

// One token, H = 2, I = 1. Physical expert 1 is the interesting one.
struct TinyMoe {
  std::vector<float> x{2, 3};
  // [E_phys = 2, 2 * I = 2, H = 2]: expert 0 all zero; expert 1 gate row {1, 0}, up row {0, 1}
  std::vector<float> w_gate_up{0, 0, 0, 0, 1, 0, 0, 1};
  // [E_phys = 2, H = 2, I = 1]: expert 1 down = {1, -2}
  std::vector<float> w_down{0, 0, 1, -2};
  std::vector<int32_t> ids{0};
  std::vector<float> w{1.0f};
  std::vector<int32_t> map{1, 0};  // logical 0 -> physical 1
  std::vector<float> out = std::vector<float>(2, NAN);
  MoeExpertsArgs args(int64_t t = 1) {
    MoeExpertsArgs a;
    a.out = f32(out, {t, 2});
    a.x = f32(x, {t, 2});
    a.w_gate_up = f32(w_gate_up, {2, 2, 2});
    a.w_down = f32(w_down, {2, 2, 1});
    a.topk_ids = i32(ids, {t, 1});
    a.topk_weights = f32(w, {t, 1});
    a.logical_to_physical = i32(map, {2});
    return a;
  }
};

TEST(CpuBackend, MoeOneExpertWeightOneMatchesManualSwiGlu) {
  TinyMoe m;
  ASSERT_TRUE(cpu().moe_experts(kCtx, m.args()).ok());
  const float h = silu(2.0f) * 3.0f;  // gate = x . {1, 0}, up = x . {0, 1}
  EXPECT_FLOAT_EQ(m.out[0], h);
  EXPECT_FLOAT_EQ(m.out[1], -2 * h);
}

TEST(CpuBackend, MoeWeighsAndSumsTheKExperts) {
  TinyMoe m;
  m.ids = {0, 1};        // logical 0 -> physical 1; logical 1 -> physical 0 (all zero)
  m.w = {0.25f, 0.75f};
  MoeExpertsArgs a = m.args();
  a.topk_ids = i32(m.ids, {1, 2});
  a.topk_weights = f32(m.w, {1, 2});
  ASSERT_TRUE(cpu().moe_experts(kCtx, a).ok());
  const float h = silu(2.0f) * 3.0f;
  EXPECT_FLOAT_EQ(m.out[0], 0.25f * h);
  EXPECT_FLOAT_EQ(m.out[1], 0.25f * -2 * h);
}

TEST(CpuBackend, MoePaddingRowsAreZeroAndTheirIdsNeverRead) {
  TinyMoe m;
  m.x = {2, 3, 100, 100};
  m.ids = {0, 987654};  // row 1 is padding: a garbage id must not be an error
  m.w = {1, 1};
  m.out.assign(4, NAN);
  MoeExpertsArgs a = m.args(2);
  a.num_valid_tokens = 1;
  ASSERT_TRUE(cpu().moe_experts(kCtx, a).ok());
  const float h = silu(2.0f) * 3.0f;
  EXPECT_FLOAT_EQ(m.out[0], h);
  EXPECT_EQ(m.out[2], 0.0f);
  EXPECT_EQ(m.out[3], 0.0f);
}

TEST(CpuBackend, MoeGptOssActivationClampsAndAddsBiases) {
  // gpt-oss: g' = min(g, limit), u' = clamp(u, -limit, limit), h = g' sigmoid(alpha g') (u' + 1);
  // gate/up biases before it, the down bias after the down projection, before the routing weight.
  TinyMoe m;
  m.w = {0.5f};
  std::vector<float> b_gate_up{0, 0, 0.5f, -7.0f}, b_down{0, 0, 0.25f, 0};  // expert 1: gate +0.5, up -7
  MoeExpertsArgs a = m.args();
  a.activation = MoeExpertsArgs::Activation::kGptOss;
  a.swiglu_limit = 2.0f;
  a.swiglu_alpha = 1.702f;
  a.b_gate_up = f32(b_gate_up, {2, 2});
  a.b_down = f32(b_down, {2, 2});
  a.topk_weights = f32(m.w, {1, 1});
  ASSERT_TRUE(cpu().moe_experts(kCtx, a).ok());
  const float g = 2.0f;                    // min(2 + 0.5, 2)
  const float u = -2.0f;                   // clamp(3 - 7, -2, 2)
  const float h = g / (1 + std::exp(-1.702f * g)) * (u + 1);
  EXPECT_FLOAT_EQ(m.out[0], 0.5f * (h + 0.25f));
  EXPECT_FLOAT_EQ(m.out[1], 0.5f * (-2 * h));
  a.swiglu_limit = 0.0f;
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kInvalidArgument, "swiglu_limit");
  a.swiglu_limit = 2.0f;
  a.b_down = f32(b_down, {1, 4});
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kInvalidArgument, "b_down");
}

// ---- memory ops -----------------------------------------------------------------------

// ---- fused decoder ops: bit for bit the unfused sequence -----------------------------------

// Deterministic values in [lo, hi) (a linear congruential generator: the test needs variety,
// not statistics).
std::vector<float> pseudo_random(size_t n, float lo, float hi, uint32_t seed) {
  std::vector<float> v(n);
  for (float& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = lo + (hi - lo) * static_cast<float>(seed >> 8) * (1.0f / 16777216.0f);
  }
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(CpuBackend, AddRmsnormEqualsAddThenRmsnormThenConvertBitForBit) {
  struct Case {
    int64_t rows, hidden;
  };
  for (const Case c : {Case{1, 2880}, Case{3, 33}, Case{5, 64}, Case{2, 9000}}) {
    const size_t n = static_cast<size_t>(c.rows * c.hidden);
    const std::vector<float> h0 = pseudo_random(n, -3, 3, 1), r = pseudo_random(n, -1, 1, 2);
    std::vector<float> w = pseudo_random(static_cast<size_t>(c.hidden), 0.5f, 1.5f, 3), rv = r;
    const Shape shape{c.rows, c.hidden};
    // Unfused: add, rmsnorm, convert.
    std::vector<float> h_ref = h0, x_ref(n);
    std::vector<uint16_t> b_ref(n);
    ASSERT_TRUE(cpu().add(kCtx, f32(h_ref, shape), f32(h_ref, shape), f32(rv, shape)).ok());
    ASSERT_TRUE(cpu().rmsnorm(kCtx, f32(x_ref, shape), f32(h_ref, shape), f32(w, {c.hidden}), 1e-6f).ok());
    ASSERT_TRUE(cpu().convert(kCtx, b_ref.data(), DType::kBF16, x_ref.data(), DType::kF32, n).ok());
    // Fused, both outputs; then the BF16 output alone (the decoder's dense-input form).
    std::vector<float> h = h0, x(n, NAN);
    std::vector<uint16_t> b(n, 0xffff);
    ASSERT_TRUE(cpu().add_rmsnorm(kCtx, f32(x, shape), TensorView::contiguous(b.data(), DType::kBF16, shape),
                                  f32(h, shape), f32(rv, shape), {}, f32(w, {c.hidden}), 1e-6f)
                    .ok());
    EXPECT_TRUE(same_bits(h, h_ref)) << c.rows << "x" << c.hidden;
    EXPECT_TRUE(same_bits(x, x_ref)) << c.rows << "x" << c.hidden;
    EXPECT_EQ(b, b_ref) << c.rows << "x" << c.hidden;
    h = h0;
    std::fill(b.begin(), b.end(), uint16_t{0xffff});
    ASSERT_TRUE(cpu().add_rmsnorm(kCtx, {}, TensorView::contiguous(b.data(), DType::kBF16, shape), f32(h, shape),
                                  f32(rv, shape), {}, f32(w, {c.hidden}), 1e-6f)
                    .ok());
    EXPECT_TRUE(same_bits(h, h_ref));
    EXPECT_EQ(b, b_ref);
    // Without r: rmsnorm (+ convert), h untouched; out may alias h.
    std::vector<float> x2(n, NAN), x2_ref(n);
    h = h0;
    ASSERT_TRUE(cpu().rmsnorm(kCtx, f32(x2_ref, shape), f32(h, shape), f32(w, {c.hidden}), 1e-5f).ok());
    ASSERT_TRUE(cpu().add_rmsnorm(kCtx, f32(x2, shape), {}, f32(h, shape), {}, {}, f32(w, {c.hidden}), 1e-5f).ok());
    EXPECT_TRUE(same_bits(x2, x2_ref));
    EXPECT_TRUE(same_bits(h, h0));
    ASSERT_TRUE(cpu().add_rmsnorm(kCtx, f32(h, shape), {}, f32(h, shape), {}, {}, f32(w, {c.hidden}), 1e-5f).ok());
    EXPECT_TRUE(same_bits(h, x2_ref));
    // No output at all: the add alone.
    h = h0;
    ASSERT_TRUE(cpu().add_rmsnorm(kCtx, {}, {}, f32(h, shape), f32(rv, shape), {}, f32(w, {c.hidden}), 1e-6f).ok());
    EXPECT_TRUE(same_bits(h, h_ref));
  }
}

// r_bias (o_proj's bias, gpt-oss) is add_bias on r, then the fused op: bit for bit, and r itself
// is left as it was.
TEST(CpuBackend, AddRmsnormWithResidualBiasEqualsAddBiasFirstBitForBit) {
  for (const int64_t rows : {1, 4}) {
    for (const int64_t hidden : {int64_t{2880}, int64_t{33}}) {
      const size_t n = static_cast<size_t>(rows * hidden);
      const Shape shape{rows, hidden};
      const std::vector<float> h0 = pseudo_random(n, -3, 3, 11), r0 = pseudo_random(n, -1, 1, 12);
      std::vector<float> rb = pseudo_random(static_cast<size_t>(hidden), -0.5f, 0.5f, 13);
      std::vector<float> w = pseudo_random(static_cast<size_t>(hidden), 0.5f, 1.5f, 14);
      // Unfused: add_bias, then add_rmsnorm without a bias.
      std::vector<float> h_ref = h0, r_ref = r0, x_ref(n, NAN);
      ASSERT_TRUE(cpu().add_bias(kCtx, f32(r_ref, shape), f32(rb, {hidden})).ok());
      ASSERT_TRUE(cpu().add_rmsnorm(kCtx, f32(x_ref, shape), {}, f32(h_ref, shape), f32(r_ref, shape), {},
                                    f32(w, {hidden}), 1e-6f)
                      .ok());
      ASSERT_FALSE(same_bits(h_ref, h0));
      std::vector<float> h = h0, r = r0, x(n, NAN);
      ASSERT_TRUE(cpu().add_rmsnorm(kCtx, f32(x, shape), {}, f32(h, shape), f32(r, shape), f32(rb, {hidden}),
                                    f32(w, {hidden}), 1e-6f)
                      .ok());
      EXPECT_TRUE(same_bits(h, h_ref)) << rows << "x" << hidden;
      EXPECT_TRUE(same_bits(x, x_ref)) << rows << "x" << hidden;
      EXPECT_TRUE(same_bits(r, r0)) << "r is read, not written";
      // The add alone (no output) takes the bias too.
      h = h0;
      ASSERT_TRUE(
          cpu().add_rmsnorm(kCtx, {}, {}, f32(h, shape), f32(r, shape), f32(rb, {hidden}), f32(w, {hidden}), 1e-6f)
              .ok());
      EXPECT_TRUE(same_bits(h, h_ref));
    }
  }
}

TEST(CpuBackend, RopeQkEqualsNormsThenRopesBitForBit) {
  struct Case {
    int64_t tokens, q_heads, kv_heads, head_dim;
    bool norm, table;
  };
  for (const Case c : {Case{3, 4, 2, 64, true, false}, Case{2, 8, 1, 128, false, false}, Case{5, 2, 2, 6, true, true},
                       Case{1, 64, 8, 64, false, true}}) {
    const int64_t T = c.tokens, D = c.head_dim;
    const std::vector<float> q0 = pseudo_random(static_cast<size_t>(T * c.q_heads * D), -2, 2, 5);
    const std::vector<float> k0 = pseudo_random(static_cast<size_t>(T * c.kv_heads * D), -2, 2, 6);
    std::vector<float> qw = pseudo_random(static_cast<size_t>(D), 0.5f, 1.5f, 7);
    std::vector<float> kw = pseudo_random(static_cast<size_t>(D), 0.5f, 1.5f, 8);
    std::vector<float> inv = pseudo_random(static_cast<size_t>(D / 2), 1e-4f, 1.0f, 9);
    std::vector<int32_t> pos(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(t * 977 + 3);
    const float theta = 1e6f, scale = c.table ? 1.3465736f : 1.0f;
    const Shape qs{T, c.q_heads, D}, ks{T, c.kv_heads, D};
    std::vector<float> q_ref = q0, k_ref = k0;
    if (c.norm) {
      ASSERT_TRUE(cpu().rmsnorm(kCtx, f32(q_ref, qs), f32(q_ref, qs), f32(qw, {D}), 1e-6f).ok());
      ASSERT_TRUE(cpu().rmsnorm(kCtx, f32(k_ref, ks), f32(k_ref, ks), f32(kw, {D}), 1e-6f).ok());
    }
    for (auto [v, s] : {std::pair{&q_ref, qs}, std::pair{&k_ref, ks}}) {
      if (c.table)
        ASSERT_TRUE(cpu().rope_table(kCtx, f32(*v, s), i32(pos, {T}), f32(inv, {D / 2}), scale).ok());
      else
        ASSERT_TRUE(cpu().rope(kCtx, f32(*v, s), i32(pos, {T}), theta).ok());
    }
    std::vector<float> q = q0, k = k0;
    RopeQkArgs a;
    a.q = f32(q, qs);
    a.k = f32(k, ks);
    a.positions = i32(pos, {T});
    if (c.table) a.inv_freq = f32(inv, {D / 2});
    a.theta = theta;
    a.scale = scale;
    if (c.norm) {
      a.q_norm = f32(qw, {D});
      a.k_norm = f32(kw, {D});
    }
    a.eps = 1e-6f;
    ASSERT_TRUE(cpu().rope_qk(kCtx, a).ok());
    EXPECT_TRUE(same_bits(q, q_ref)) << T << " " << c.q_heads << " " << D;
    EXPECT_TRUE(same_bits(k, k_ref)) << T << " " << c.kv_heads << " " << D;
  }
}

// The fused form with projection biases equals the unfused sequence: split qkv's rows, add_bias
// on q, k and v, then rope_qk on q and k (with and without the QK-norm, which sees the biased
// values), bit for bit.
TEST(CpuBackend, RopeQkBiasesEqualSplitAddBiasThenRopeQk) {
  for (const bool norm : {false, true}) {
    const int64_t T = 3, QH = 4, KVH = 2, D = 8, W = (QH + 2 * KVH) * D;
    std::vector<float> qkv = pseudo_random(static_cast<size_t>(T * W), -2, 2, 11);
    std::vector<float> qb = pseudo_random(static_cast<size_t>(QH * D), -1, 1, 12);
    std::vector<float> kb = pseudo_random(static_cast<size_t>(KVH * D), -1, 1, 13);
    std::vector<float> vb = pseudo_random(static_cast<size_t>(KVH * D), -1, 1, 14);
    std::vector<float> qw = pseudo_random(static_cast<size_t>(D), 0.5f, 1.5f, 15);
    std::vector<float> kw = pseudo_random(static_cast<size_t>(D), 0.5f, 1.5f, 16);
    std::vector<int32_t> pos{0, 7, 300};
    const Shape qs{T, QH, D}, ks{T, KVH, D};
    // Reference: the unfused ops.
    std::vector<float> q_ref, k_ref, v_ref;
    for (int64_t t = 0; t < T; ++t) {
      const float* row = qkv.data() + t * W;
      q_ref.insert(q_ref.end(), row, row + QH * D);
      k_ref.insert(k_ref.end(), row + QH * D, row + (QH + KVH) * D);
      v_ref.insert(v_ref.end(), row + (QH + KVH) * D, row + W);
    }
    ASSERT_TRUE(cpu().add_bias(kCtx, f32(q_ref, {T, QH * D}), f32(qb, {QH * D})).ok());
    ASSERT_TRUE(cpu().add_bias(kCtx, f32(k_ref, {T, KVH * D}), f32(kb, {KVH * D})).ok());
    ASSERT_TRUE(cpu().add_bias(kCtx, f32(v_ref, {T, KVH * D}), f32(vb, {KVH * D})).ok());
    RopeQkArgs r;
    r.q = f32(q_ref, qs);
    r.k = f32(k_ref, ks);
    r.positions = i32(pos, {T});
    r.theta = 150000.0f;
    if (norm) {
      r.q_norm = f32(qw, {D});
      r.k_norm = f32(kw, {D});
    }
    ASSERT_TRUE(cpu().rope_qk(kCtx, r).ok());
    // Fused, biases inside.
    std::vector<float> q(q_ref.size(), NAN), k(k_ref.size(), NAN), v(v_ref.size(), NAN);
    RopeQkArgs a = r;
    a.q = f32(q, qs);
    a.k = f32(k, ks);
    a.qkv = f32(qkv, {T, W});
    a.v = f32(v, ks);
    a.q_bias = f32(qb, {QH * D});
    a.k_bias = f32(kb, {KVH * D});
    a.v_bias = f32(vb, {KVH * D});
    ASSERT_TRUE(cpu().rope_qk(kCtx, a).ok());
    EXPECT_TRUE(same_bits(q, q_ref)) << norm;
    EXPECT_TRUE(same_bits(k, k_ref)) << norm;
    EXPECT_TRUE(same_bits(v, v_ref)) << norm;
    EXPECT_FALSE(same_bits(v, std::vector<float>(qkv.begin() + (QH + KVH) * D, qkv.begin() + W)));  // v_bias applied
  }
}

// With the caches, the fused form also stores every token's rotated k and its v at the token's
// slot: the same bits as rope_qk without them followed by kv_store (a padding row, slot -1, is
// stored nowhere; the rest of the caches keeps its values).
TEST(CpuBackend, RopeQkWithCachesEqualsRopeQkThenKvStore) {
  const int64_t T = 3, QH = 4, KVH = 2, D = 8, W = (QH + 2 * KVH) * D, NB = 2, BS = 4;
  std::vector<float> qkv = pseudo_random(static_cast<size_t>(T * W), -2, 2, 21);
  std::vector<float> qw = pseudo_random(static_cast<size_t>(D), 0.5f, 1.5f, 22);
  std::vector<float> kw = pseudo_random(static_cast<size_t>(D), 0.5f, 1.5f, 23);
  const std::vector<float> cache0 = pseudo_random(static_cast<size_t>(NB * BS * KVH * D), -1, 1, 24);
  std::vector<int32_t> pos{0, 7, 300}, slots{5, -1, 2};
  const Shape qs{T, QH, D}, ks{T, KVH, D}, cs{NB, BS, KVH, D};
  auto base = [&](std::vector<float>& q, std::vector<float>& k, std::vector<float>& v) {
    RopeQkArgs a;
    a.q = f32(q, qs);
    a.k = f32(k, ks);
    a.v = f32(v, ks);
    a.qkv = f32(qkv, {T, W});
    a.positions = i32(pos, {T});
    a.theta = 150000.0f;
    a.q_norm = f32(qw, {D});
    a.k_norm = f32(kw, {D});
    return a;
  };
  std::vector<float> q_ref(static_cast<size_t>(T * QH * D)), k_ref(static_cast<size_t>(T * KVH * D)),
      v_ref(k_ref.size()), kc_ref = cache0, vc_ref = cache0;
  ASSERT_TRUE(cpu().rope_qk(kCtx, base(q_ref, k_ref, v_ref)).ok());
  ASSERT_TRUE(cpu().kv_store(kCtx, f32(kc_ref, cs), f32(vc_ref, cs), f32(k_ref, ks), f32(v_ref, ks), i32(slots, {T})).ok());
  std::vector<float> q(q_ref.size(), NAN), k(k_ref.size(), NAN), v(v_ref.size(), NAN), kc = cache0, vc = cache0;
  RopeQkArgs a = base(q, k, v);
  a.k_cache = f32(kc, cs);
  a.v_cache = f32(vc, cs);
  a.slot_mapping = i32(slots, {T});
  ASSERT_TRUE(cpu().rope_qk(kCtx, a).ok());
  EXPECT_TRUE(same_bits(q, q_ref));
  EXPECT_TRUE(same_bits(k, k_ref));
  EXPECT_TRUE(same_bits(v, v_ref));
  EXPECT_TRUE(same_bits(kc, kc_ref));
  EXPECT_TRUE(same_bits(vc, vc_ref));
  // Slot 5 holds token 0's rotated k and slot 2 token 2's v; untouched slots keep their values.
  const int64_t row = KVH * D;
  EXPECT_TRUE(same_bits(std::vector<float>(kc.begin() + 5 * row, kc.begin() + 6 * row),
                        std::vector<float>(k.begin(), k.begin() + row)));
  EXPECT_TRUE(same_bits(std::vector<float>(vc.begin() + 2 * row, vc.begin() + 3 * row),
                        std::vector<float>(v.begin() + 2 * row, v.begin() + 3 * row)));
  EXPECT_TRUE(same_bits(std::vector<float>(kc.begin(), kc.begin() + row),
                        std::vector<float>(cache0.begin(), cache0.begin() + row)));
}

TEST(CpuBackend, AllocIsAlignedAndCopyRoundTrips) {
  void* p = nullptr;
  ASSERT_TRUE(cpu().alloc(kCtx, 3, &p).ok());
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  const char src[3] = {'a', 'b', 'c'};
  ASSERT_TRUE(cpu().copy(kCtx, p, src, 3, CopyKind::kHostToHost).ok());
  EXPECT_EQ(static_cast<char*>(p)[2], 'c');
  EXPECT_TRUE(cpu().synchronize(kCtx).ok());
  EXPECT_TRUE(cpu().free(kCtx, p).ok());

  void* zero = reinterpret_cast<void*>(1);
  ASSERT_TRUE(cpu().alloc(kCtx, 0, &zero).ok());
  EXPECT_EQ(zero, nullptr);
  EXPECT_TRUE(cpu().free(kCtx, nullptr).ok());
}

TEST(CpuBackend, MemoryOpsRejectBadArguments) {
  char a[4], b[4];
  EXPECT_STATUS(cpu().copy(kCtx, a, b, 4, CopyKind::kHostToDevice), ErrorCode::kInvalidArgument,
                "kind");
  EXPECT_STATUS(cpu().copy(kCtx, nullptr, b, 4, CopyKind::kHostToHost),
                ErrorCode::kInvalidArgument, "dst");
  EXPECT_STATUS(cpu().alloc(kCtx, 4, nullptr), ErrorCode::kInvalidArgument, "out");
  const ExecContext gpu_ctx{Device::cuda(0), nullptr};
  void* p = nullptr;
  EXPECT_STATUS(cpu().alloc(gpu_ctx, 4, &p), ErrorCode::kInvalidArgument, "ctx.device");
}

// ---- argument checks ------------------------------------------------------------------

class CpuBackendChecks : public ::testing::Test {
 protected:
  std::vector<float> f = std::vector<float>(4096, 1.0f);
  std::vector<float> g = std::vector<float>(4096, 1.0f);
  std::vector<float> o = std::vector<float>(4096, NAN);
  std::vector<int32_t> n = std::vector<int32_t>(64, 0);
  std::vector<int32_t> m = std::vector<int32_t>(64, 0);
  std::vector<int32_t> z = std::vector<int32_t>(64, 0);
};

TEST_F(CpuBackendChecks, LinearRejectsRankDtypeShapeLayoutAndDevice) {
  EXPECT_STATUS(cpu().linear(kCtx, f32(o, {2, 2}), f32(f, {2, 3}), f32(g, {6})),
                ErrorCode::kInvalidArgument, "w");
  EXPECT_STATUS(cpu().linear(kCtx, f32(o, {2, 2}), i32(n, {2, 3}), f32(g, {2, 3})),
                ErrorCode::kInvalidArgument, "x");
  EXPECT_STATUS(cpu().linear(kCtx, f32(o, {2, 2}), f32(f, {2, 4}), f32(g, {2, 3})),
                ErrorCode::kInvalidArgument, "x");
  EXPECT_STATUS(cpu().linear(kCtx, f32(o, {2, 5}), f32(f, {2, 3}), f32(g, {2, 3})),
                ErrorCode::kInvalidArgument, "y");
  EXPECT_STATUS(cpu().linear(kCtx, f32(o, {3, 2}), f32(f, {2, 3}), f32(g, {2, 3})),
                ErrorCode::kInvalidArgument, "y");
  EXPECT_STATUS(cpu().linear(kCtx, f32(o, {2, 2}), f32(f, {2, 3}), f32(g, {0, 3})),
                ErrorCode::kInvalidArgument, "w");

  TensorView strided = f32(f, {2, 3});
  strided.strides = Shape{4, 1};
  EXPECT_STATUS(cpu().linear(kCtx, f32(o, {2, 2}), strided, f32(g, {2, 3})),
                ErrorCode::kInvalidArgument, "x");
  TensorView on_gpu = f32(g, {2, 3});
  on_gpu.device = Device::cuda(0);
  EXPECT_STATUS(cpu().linear(kCtx, f32(o, {2, 2}), f32(f, {2, 3}), on_gpu),
                ErrorCode::kInvalidArgument, "w");
  TensorView null_x = f32(f, {2, 3});
  null_x.data = nullptr;
  EXPECT_STATUS(cpu().linear(kCtx, f32(o, {2, 2}), null_x, f32(g, {2, 3})),
                ErrorCode::kInvalidArgument, "x");
  TensorView negative = f32(f, {2, 3});
  negative.shape[0] = -2;
  EXPECT_STATUS(cpu().linear(kCtx, f32(o, {2, 2}), negative, f32(g, {2, 3})),
                ErrorCode::kInvalidArgument, "x");
  EXPECT_STATUS(cpu().linear(ExecContext{Device::cuda(0), nullptr}, f32(o, {2, 2}),
                             f32(f, {2, 3}), f32(g, {2, 3})),
                ErrorCode::kInvalidArgument, "ctx.device");
  // Nothing was written by any rejected call.
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(std::isnan(o[i]));
}

TEST_F(CpuBackendChecks, EmbeddingRejectsIdsOutsideTheVocabularyWithoutWriting) {
  n[0] = 1;
  n[1] = 3;  // V = 3
  EXPECT_STATUS(cpu().embedding(kCtx, f32(o, {2, 4}), f32(f, {3, 4}), i32(n, {2})),
                ErrorCode::kOutOfRange, "ids");
  n[1] = -1;
  EXPECT_STATUS(cpu().embedding(kCtx, f32(o, {2, 4}), f32(f, {3, 4}), i32(n, {2})),
                ErrorCode::kOutOfRange, "ids");
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(std::isnan(o[i]));
  EXPECT_STATUS(cpu().embedding(kCtx, f32(o, {2, 4}), f32(f, {3, 4}), f32(g, {2})),
                ErrorCode::kInvalidArgument, "ids");
  EXPECT_STATUS(cpu().embedding(kCtx, f32(o, {2, 5}), f32(f, {3, 4}), i32(z, {2})),
                ErrorCode::kInvalidArgument, "out");
  EXPECT_STATUS(cpu().embedding(kCtx, f32(o, {3, 4}), f32(f, {3, 4}), i32(z, {2})),
                ErrorCode::kInvalidArgument, "out");
}

TEST_F(CpuBackendChecks, RmsNormAddAndRopeChecks) {
  EXPECT_STATUS(cpu().rmsnorm(kCtx, f32(o, {2, 4}), f32(f, {2, 4}), f32(g, {3}), 1e-6f),
                ErrorCode::kInvalidArgument, "w");
  EXPECT_STATUS(cpu().rmsnorm(kCtx, f32(o, {4, 2}), f32(f, {2, 4}), f32(g, {4}), 1e-6f),
                ErrorCode::kInvalidArgument, "out");
  EXPECT_STATUS(cpu().rmsnorm(kCtx, f32(o, {2, 4}), f32(f, {2, 4}), f32(g, {4}), -1.0f),
                ErrorCode::kInvalidArgument, "eps");
  EXPECT_STATUS(cpu().rmsnorm(kCtx, f32(o, {2, 4}), f32(f, {2, 4}), f32(g, {4}), NAN),
                ErrorCode::kInvalidArgument, "eps");
  EXPECT_STATUS(cpu().add(kCtx, f32(o, {2, 4}), f32(f, {2, 4}), f32(g, {4, 2})),
                ErrorCode::kInvalidArgument, "b");
  EXPECT_STATUS(cpu().add(kCtx, f32(o, {8}), f32(f, {2, 4}), f32(g, {2, 4})),
                ErrorCode::kInvalidArgument, "out");
  EXPECT_STATUS(cpu().rope(kCtx, f32(f, {2, 1, 3}), i32(n, {2}), 10000.0f),
                ErrorCode::kInvalidArgument, "x");
  EXPECT_STATUS(cpu().rope(kCtx, f32(f, {2, 4}), i32(n, {2}), 10000.0f),
                ErrorCode::kInvalidArgument, "x");
  EXPECT_STATUS(cpu().rope(kCtx, f32(f, {2, 1, 4}), i32(n, {3}), 10000.0f),
                ErrorCode::kInvalidArgument, "positions");
  EXPECT_STATUS(cpu().rope(kCtx, f32(f, {2, 1, 4}), i32(n, {2}), 0.0f),
                ErrorCode::kInvalidArgument, "theta");
}

TEST_F(CpuBackendChecks, AddRmsnormRejectsBadViewsWithoutWriting) {
  auto bf16 = [](std::vector<float>& v, Shape s) { return TensorView::contiguous(v.data(), DType::kBF16, s); };
  std::vector<float> h(8, 2.0f), r(8, 1.0f);
  auto call = [&](TensorView out, TensorView out_b, TensorView hv, TensorView rv, TensorView w, float eps) {
    return cpu().add_rmsnorm(kCtx, out, out_b, hv, rv, {}, w, eps);
  };
  std::vector<float> rb(4, 0.5f);
  auto call_b = [&](TensorView rv, TensorView rbv) {
    return cpu().add_rmsnorm(kCtx, f32(o, {2, 4}), {}, f32(h, {2, 4}), rv, rbv, f32(g, {4}), 1e-6f);
  };
  EXPECT_STATUS(call(f32(o, {2, 4}), {}, f32(h, {2, 4}), f32(r, {4, 2}), f32(g, {4}), 1e-6f),
                ErrorCode::kInvalidArgument, "r");
  EXPECT_STATUS(call(f32(o, {2, 4}), {}, f32(h, {2, 4}), f32(r, {2, 4}), f32(g, {3}), 1e-6f),
                ErrorCode::kInvalidArgument, "w");
  EXPECT_STATUS(call(f32(o, {8}), {}, f32(h, {2, 4}), f32(r, {2, 4}), f32(g, {4}), 1e-6f),
                ErrorCode::kInvalidArgument, "out");
  EXPECT_STATUS(call({}, f32(o, {2, 4}), f32(h, {2, 4}), f32(r, {2, 4}), f32(g, {4}), 1e-6f),
                ErrorCode::kInvalidArgument, "out_bf16");
  EXPECT_STATUS(call({}, bf16(o, {2, 2}), f32(h, {2, 4}), f32(r, {2, 4}), f32(g, {4}), 1e-6f),
                ErrorCode::kInvalidArgument, "out_bf16");
  EXPECT_STATUS(call(f32(o, {2, 4}), {}, i32(n, {2, 4}), f32(r, {2, 4}), f32(g, {4}), 1e-6f),
                ErrorCode::kInvalidArgument, "h");
  EXPECT_STATUS(call(f32(o, {2, 4}), {}, f32(h, {2, 4}), f32(r, {2, 4}), f32(g, {4}), -1.0f),
                ErrorCode::kInvalidArgument, "eps");
  // Overlaps: out partly over h, out_bf16 over out, r over h.
  EXPECT_STATUS(call(TensorView::contiguous(h.data() + 1, DType::kF32, {1, 4}), {}, f32(h, {1, 4}), {}, f32(g, {4}),
                     1e-6f),
                ErrorCode::kInvalidArgument, "out");
  EXPECT_STATUS(call(f32(o, {2, 4}), bf16(o, {2, 4}), f32(h, {2, 4}), {}, f32(g, {4}), 1e-6f),
                ErrorCode::kInvalidArgument, "out_bf16");
  EXPECT_STATUS(call(f32(o, {1, 4}), {}, f32(h, {1, 4}), f32(h, {1, 4}), f32(g, {4}), 1e-6f),
                ErrorCode::kInvalidArgument, "r");
  // r_bias: only with r, f32 [H], not over h.
  EXPECT_STATUS(call_b({}, f32(rb, {4})), ErrorCode::kInvalidArgument, "r_bias");
  EXPECT_STATUS(call_b(f32(r, {2, 4}), f32(rb, {3})), ErrorCode::kInvalidArgument, "r_bias");
  EXPECT_STATUS(call_b(f32(r, {2, 4}), f32(rb, {1, 4})), ErrorCode::kInvalidArgument, "r_bias");
  EXPECT_STATUS(call_b(f32(r, {2, 4}), i32(n, {4})), ErrorCode::kInvalidArgument, "r_bias");
  EXPECT_STATUS(call_b(f32(r, {2, 4}), TensorView::contiguous(h.data() + 4, DType::kF32, {4})),
                ErrorCode::kInvalidArgument, "r_bias");
  // Nothing was written: h keeps its values (the add never ran), out its poison.
  EXPECT_EQ(h, std::vector<float>(8, 2.0f));
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(std::isnan(o[i]));
}

TEST_F(CpuBackendChecks, RopeQkRejectsBadViewsWithoutWriting) {
  std::vector<float> q(64, 1.0f), k(64, 1.0f);
  auto args = [&] {
    RopeQkArgs a;
    a.q = f32(q, {2, 2, 8});
    a.k = f32(k, {2, 1, 8});
    a.positions = i32(n, {2});
    return a;
  };
  RopeQkArgs a = args();
  a.k = f32(k, {2, 1, 6});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "k");
  a = args();
  a.k = f32(k, {3, 1, 8});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "k");
  a = args();
  a.q = f32(q, {2, 2, 7});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "q");
  a = args();
  a.positions = i32(n, {3});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "positions");
  a = args();
  a.theta = 0.0f;
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "theta");
  a.inv_freq = f32(g, {4});  // the table form never reads theta
  EXPECT_TRUE(cpu().rope_qk(kCtx, a).ok());
  std::fill(q.begin(), q.end(), 1.0f);
  std::fill(k.begin(), k.end(), 1.0f);
  a.inv_freq = f32(g, {8});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "inv_freq");
  a = args();
  a.scale = 0.0f;
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "scale");
  a = args();
  a.q_norm = f32(g, {8});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "k_norm");
  a.k_norm = f32(g, {4});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "k_norm");
  a.k_norm = f32(g, {8});
  a.eps = NAN;
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "eps");
  a = args();
  a.k = f32(q, {2, 1, 8});  // k inside q
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "k");
  EXPECT_EQ(q, std::vector<float>(64, 1.0f));
  EXPECT_EQ(k, std::vector<float>(64, 1.0f));
}

TEST_F(CpuBackendChecks, KvStoreRejectsSlotsBeyondTheCache) {
  n[0] = 0;
  n[1] = 8;  // 2 blocks x 4 slots
  const TensorView kc = f32(o, {2, 4, 1, 2});
  EXPECT_STATUS(cpu().kv_store(kCtx, kc, kc, f32(f, {2, 1, 2}), f32(g, {2, 1, 2}), i32(n, {2})),
                ErrorCode::kOutOfRange, "slot_mapping");
  for (int i = 0; i < 16; ++i) EXPECT_TRUE(std::isnan(o[i]));  // slot 0 was not written either
  EXPECT_STATUS(cpu().kv_store(kCtx, kc, f32(o, {2, 4, 1, 1}), f32(f, {2, 1, 2}),
                               f32(g, {2, 1, 2}), i32(z, {2})),
                ErrorCode::kInvalidArgument, "v_cache");
  EXPECT_STATUS(cpu().kv_store(kCtx, kc, kc, f32(f, {2, 2, 2}), f32(g, {2, 2, 2}), i32(z, {2})),
                ErrorCode::kInvalidArgument, "k");
  EXPECT_STATUS(cpu().kv_store(kCtx, kc, kc, f32(f, {2, 1, 2}), f32(g, {3, 1, 2}), i32(z, {2})),
                ErrorCode::kInvalidArgument, "v");
  EXPECT_STATUS(cpu().kv_store(kCtx, kc, kc, f32(f, {2, 1, 2}), f32(g, {2, 1, 2}), i32(z, {1})),
                ErrorCode::kInvalidArgument, "slot_mapping");
}

// The fused store's arguments: all three caches-and-slots or none, only with qkv, shapes as
// kv_store's, no overlap with the other arguments; a slot past the cache is refused before
// anything (q, k, v or the caches) is written.
TEST_F(CpuBackendChecks, RopeQkRefusesBadCachesWithoutWriting) {
  // q [1, 2, 4], k and v [1, 1, 4], qkv [1, 16]; caches [2, 2, 1, 4] (4 slots).
  std::vector<float> q(8, 1.0f), k(4, 1.0f), v(4, 1.0f), qkv(16, 0.5f), kc(16, 3.0f), vc(16, 3.0f);
  std::vector<int32_t> pos{1}, slot{1}, far{4};
  auto args = [&] {
    RopeQkArgs a;
    a.q = f32(q, {1, 2, 4});
    a.k = f32(k, {1, 1, 4});
    a.v = f32(v, {1, 1, 4});
    a.qkv = f32(qkv, {1, 16});
    a.positions = i32(pos, {1});
    a.k_cache = f32(kc, {2, 2, 1, 4});
    a.v_cache = f32(vc, {2, 2, 1, 4});
    a.slot_mapping = i32(slot, {1});
    return a;
  };
  RopeQkArgs a = args();
  a.slot_mapping = {};
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "slot_mapping");
  a = args();
  a.v_cache = {};
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "v_cache");
  a = args();
  a.qkv = {};
  a.v = {};
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "k_cache");
  a = args();
  a.k_cache = f32(kc, {2, 2, 2, 2});  // KVH 2, D 2: not k's heads
  a.v_cache = f32(vc, {2, 2, 2, 2});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "k");
  a = args();
  a.v_cache = f32(kc, {2, 2, 1, 4});  // the same memory as k_cache
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "v_cache");
  a = args();
  a.k_cache = f32(qkv, {2, 2, 1, 4});  // the projection rows, read while the cache is written
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "k_cache");
  a = args();
  a.slot_mapping = i32(far, {1});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kOutOfRange, "slot_mapping");
  EXPECT_EQ(q, std::vector<float>(8, 1.0f));
  EXPECT_EQ(k, std::vector<float>(4, 1.0f));
  EXPECT_EQ(v, std::vector<float>(4, 1.0f));
  EXPECT_EQ(kc, std::vector<float>(16, 3.0f));
  EXPECT_EQ(vc, std::vector<float>(16, 3.0f));
  EXPECT_TRUE(cpu().rope_qk(kCtx, args()).ok());  // and the good call stores at slot 1
  EXPECT_EQ(std::vector<float>(vc.begin() + 4, vc.begin() + 8), std::vector<float>(4, 0.5f));
}

// Misplaced projection biases are refused naming the bias; nothing is written.
TEST_F(CpuBackendChecks, RopeQkRefusesMisplacedBiases) {
  // q [1, 2, 4], k and v [1, 1, 4], qkv [1, 16]; biases 8 / 4 / 4 floats, all in separate vectors.
  std::vector<float> q(8, 0), k(4, 0), v(4, 0), qkv(16, 1), qb(8, 1), kb(4, 1), vb(4, 1), wide(8, 1);
  std::vector<int32_t> pos{0};
  auto args = [&] {
    RopeQkArgs a;
    a.q = f32(q, {1, 2, 4});
    a.k = f32(k, {1, 1, 4});
    a.positions = i32(pos, {1});
    a.qkv = f32(qkv, {1, 16});
    a.v = f32(v, {1, 1, 4});
    a.q_bias = f32(qb, {8});
    a.k_bias = f32(kb, {4});
    a.v_bias = f32(vb, {4});
    return a;
  };
  ASSERT_TRUE(cpu().rope_qk(kCtx, args()).ok());
  std::fill(q.begin(), q.end(), 0.0f);
  RopeQkArgs a = args();
  a.qkv = {};
  a.v = {};
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "q_bias");  // biases without qkv
  a = args();
  a.v_bias = {};
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "v_bias");  // two of three
  a = args();
  a.k_bias = f32(wide, {8});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "k_bias");  // length
  a = args();
  a.q_bias = i32(m, {8});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "q_bias");  // dtype
  a = args();
  a.v_bias = f32(q, {4});
  EXPECT_STATUS(cpu().rope_qk(kCtx, a), ErrorCode::kInvalidArgument, "v_bias");  // overlaps q
  EXPECT_EQ(q, std::vector<float>(8, 0.0f));  // no refused call wrote q
}

TEST_F(CpuBackendChecks, AttentionRejectsBadIndicesAndShapes) {
  // 2 blocks of 2 slots, KVH = 1, D = 2; one sequence with 2 table entries.
  const TensorView cache = f32(f, {2, 2, 1, 2});
  const TensorView q = f32(g, {1, 2, 2});
  const TensorView out = f32(o, {1, 2, 2});
  auto run = [&](std::vector<int32_t> table, int32_t seq, int32_t len) {
    std::vector<int32_t> t = table, s{seq}, l{len};
    return cpu().paged_attention(kCtx, out, q, cache, cache, i32(t, {1, 2}), i32(s, {1}),
                                 i32(l, {1}), 1.0f);
  };
  EXPECT_TRUE(run({1, 0}, 0, 4).ok());
  EXPECT_STATUS(run({1, 2}, 0, 3), ErrorCode::kOutOfRange, "block_tables");
  EXPECT_STATUS(run({-1, 0}, 0, 1), ErrorCode::kOutOfRange, "block_tables");
  EXPECT_TRUE(run({1, 99}, 0, 2).ok());  // the unused table entry is not followed
  EXPECT_STATUS(run({1, 0}, 1, 2), ErrorCode::kOutOfRange, "seq_of");
  EXPECT_STATUS(run({1, 0}, 0, 5), ErrorCode::kOutOfRange, "ctx_len");
  EXPECT_STATUS(run({1, 0}, 0, -1), ErrorCode::kOutOfRange, "ctx_len");

  std::vector<int32_t> t{0, 1}, s{0}, l{1};
  EXPECT_STATUS(cpu().paged_attention(kCtx, f32(o, {1, 3, 2}), f32(g, {1, 3, 2}),
                                      f32(f, {2, 2, 2, 2}), f32(f, {2, 2, 2, 2}), i32(t, {1, 2}),
                                      i32(s, {1}), i32(l, {1}), 1.0f),
                ErrorCode::kInvalidArgument, "q");  // 3 query heads over 2 kv heads
  EXPECT_STATUS(cpu().paged_attention(kCtx, out, f32(g, {1, 2, 4}), cache, cache, i32(t, {1, 2}),
                                      i32(s, {1}), i32(l, {1}), 1.0f),
                ErrorCode::kInvalidArgument, "k_cache");
  EXPECT_STATUS(cpu().paged_attention(kCtx, f32(g, {1, 2, 2}), q, cache, cache, i32(t, {1, 2}), i32(s, {1}),
                                      i32(l, {1}), 1.0f),
                ErrorCode::kInvalidArgument, "out");  // out over q: read while written
  EXPECT_STATUS(cpu().paged_attention(kCtx, out, q, cache, f32(f, {2, 1, 1, 2}), i32(t, {1, 2}),
                                      i32(s, {1}), i32(l, {1}), 1.0f),
                ErrorCode::kInvalidArgument, "v_cache");
  EXPECT_STATUS(cpu().paged_attention(kCtx, out, q, cache, cache, i32(t, {2}), i32(s, {1}),
                                      i32(l, {1}), 1.0f),
                ErrorCode::kInvalidArgument, "block_tables");
  EXPECT_STATUS(cpu().paged_attention(kCtx, out, q, cache, cache, i32(t, {1, 2}), i32(s, {1}),
                                      i32(l, {2}), 1.0f),
                ErrorCode::kInvalidArgument, "ctx_len");
}

TEST_F(CpuBackendChecks, RouterRejectsTopKAboveExpertsAndMismatchedOutputs) {
  EXPECT_STATUS(cpu().router_softmax_topk(kCtx, i32(n, {2, 5}), f32(o, {2, 5}), f32(f, {2, 4}),
                                          false),
                ErrorCode::kInvalidArgument, "ids");
  EXPECT_STATUS(cpu().router_softmax_topk(kCtx, i32(n, {3, 2}), f32(o, {3, 2}), f32(f, {2, 4}),
                                          false),
                ErrorCode::kInvalidArgument, "ids");
  EXPECT_STATUS(cpu().router_softmax_topk(kCtx, i32(n, {2, 2}), f32(o, {2, 3}), f32(f, {2, 4}),
                                          false),
                ErrorCode::kInvalidArgument, "weights");
  EXPECT_STATUS(cpu().router_softmax_topk(kCtx, f32(o, {2, 2}), f32(o, {2, 2}), f32(f, {2, 4}),
                                          false),
                ErrorCode::kInvalidArgument, "ids");
}

TEST_F(CpuBackendChecks, MoeRejectsBadIdsMapsAndShapes) {
  TinyMoe m;
  m.ids = {2};  // E_logical = 2
  EXPECT_STATUS(cpu().moe_experts(kCtx, m.args()), ErrorCode::kOutOfRange, "topk_ids");
  m.ids = {-1};
  EXPECT_STATUS(cpu().moe_experts(kCtx, m.args()), ErrorCode::kOutOfRange, "topk_ids");
  EXPECT_TRUE(std::isnan(m.out[0]));
  m.ids = {0};
  m.map = {1, 2};  // E_phys = 2
  EXPECT_STATUS(cpu().moe_experts(kCtx, m.args()), ErrorCode::kOutOfRange,
                "logical_to_physical");
  m.map = {1, 0};

  MoeExpertsArgs a = m.args();
  a.num_valid_tokens = 2;
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kOutOfRange, "num_valid_tokens");
  a.num_valid_tokens = -2;
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kOutOfRange, "num_valid_tokens");

  a = m.args();
  a.w_down = f32(m.w_down, {2, 1, 2});
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kInvalidArgument, "w_down");
  a = m.args();
  a.w_gate_up = f32(m.w_gate_up, {1, 4, 2});
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kInvalidArgument, "w_down");
  a = m.args();
  a.w_gate_up = f32(m.w_gate_up, {2, 1, 2});  // 2*I must be even
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kInvalidArgument, "w_gate_up");
  a = m.args();
  a.topk_weights = f32(m.w, {1});
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kInvalidArgument, "topk_weights");
  a = m.args();
  a.logical_to_physical = f32(m.x, {2});
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kInvalidArgument, "logical_to_physical");
  a = m.args();
  a.out = f32(m.out, {2, 1});
  EXPECT_STATUS(cpu().moe_experts(kCtx, a), ErrorCode::kInvalidArgument, "out");
}

TEST(CpuBackend, EmptyBatchesAreNoOps) {
  std::vector<float> f(8, 1.0f), o(8, NAN);
  std::vector<int32_t> ids(1, 0);
  EXPECT_TRUE(cpu().linear(kCtx, f32(o, {0, 2}), f32(f, {0, 4}), f32(f, {2, 4})).ok());
  EXPECT_TRUE(cpu().embedding(kCtx, f32(o, {0, 4}), f32(f, {2, 4}), i32(ids, {0})).ok());
  EXPECT_TRUE(cpu().rmsnorm(kCtx, f32(o, {0, 4}), f32(f, {0, 4}), f32(f, {4}), 1e-6f).ok());
}

}  // namespace
}  // namespace rolloutd
