// The CPU reference experts against closed forms: one-hot expert weights make every GEMM a
// single product, so out[t, n] = sum_k w[t,k] * 0.5 * act(x[t,n], f_e * x[t,n]) with f_e the
// expert's up factor, computed here in double from the activation definitions. Plus the
// permutation edge cases, both weight formats and row orders, the activation precisions and
// the argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/unit/kernels/moe/moe_test_util.hpp"

namespace rolloutd::moe {
namespace {

using test::kCpu;
using test::Mxfp4Host;

constexpr int64_t kH = 64, kI = 64;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The activations from their definitions (moe_ops.hpp), in double.
double act_ref(const ActivationParams& p, double g, double u) {
  switch (p.kind) {
    case ActivationKind::kSwiGLU:
      return g * sigmoid(g) * u;
    case ActivationKind::kGptOssSwiGLU:
      g = std::min<double>(g, p.limit);
      u = std::max<double>(-p.limit, std::min<double>(u, p.limit));
      return g * sigmoid(p.alpha * g) * (u + 1.0);
    case ActivationKind::kClampedSwiGLU:
      g = std::min<double>(g, p.limit);
      u = std::max<double>(-p.limit, std::min<double>(u, p.limit));
      return g * sigmoid(g) * u;
  }
  return NAN;
}

TEST(MoeActivation, HandValues) {
  ActivationParams p;
  p.kind = ActivationKind::kSwiGLU;
  EXPECT_NEAR(apply_activation(p, 1.0f, 2.0f), 1.4621171572600098, 1e-6);
  EXPECT_NEAR(apply_activation(p, -20.0f, 1.0f), -4.122307236380407e-08, 1e-13);
  p = {ActivationKind::kGptOssSwiGLU, 7.0f, 1.702f};
  EXPECT_NEAR(apply_activation(p, 10.0f, -9.0f), -41.99971876981991, 4e-5);  // both clamped
  EXPECT_NEAR(apply_activation(p, 0.5f, 0.2f), 0.42046612392765614, 1e-6);
  EXPECT_NEAR(apply_activation(p, -3.0f, 8.0f), -0.14457047766228776, 1e-6);  // u clamped to 7
  p = {ActivationKind::kClampedSwiGLU, 10.0f, 0.0f};
  EXPECT_NEAR(apply_activation(p, 12.0f, -11.0f), -99.99546021312977, 1e-4);
  EXPECT_NEAR(apply_activation(p, -2.0f, 3.0f), -0.7152175321327052, 1e-6);
  // NaN goes through the clamps (torch.clamp propagates it; fminf would not).
  EXPECT_TRUE(std::isnan(apply_activation(p, NAN, 1.0f)));
  EXPECT_TRUE(std::isnan(apply_activation({ActivationKind::kGptOssSwiGLU, 7.0f, 1.702f}, 1.0f, NAN)));
}

// Expert slot s: gate row j = e_j, up row j = (s + 1) e_j (slot 3 copies slot 1), down row n =
// 0.5 e_n. MXFP4-exact, so both formats hold the same values.
struct OneHot {
  Mxfp4Host gu, dn;
  static constexpr int64_t kSlots = 4;
  static float factor(int64_t slot) { return slot == 3 ? 2.0f : static_cast<float>(slot + 1); }
};

Mxfp4Host quantize_host(const std::vector<float>& w, int64_t e, int64_t n, int64_t k) {
  Mxfp4Host m{std::vector<uint8_t>(static_cast<size_t>(e * n * k / 2)),
              std::vector<uint8_t>(static_cast<size_t>(e * n * k / 32)), e, n, k};
  std::vector<float> src = w;
  const Status st = quant::quantize_mxfp4(
      kCpu, TensorView::contiguous(src.data(), DType::kF32, Shape{e, n, k}),
      TensorView::contiguous(m.blocks.data(), DType::kU8, Shape{e, n, k / 32, 16}),
      TensorView::contiguous(m.scales.data(), DType::kU8, Shape{e, n, k / 32}));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return m;
}

OneHot one_hot(GateUpOrder order) {
  const int64_t s = OneHot::kSlots;
  std::vector<float> gu(static_cast<size_t>(s * 2 * kI * kH), 0.0f), dn(static_cast<size_t>(s * kH * kI), 0.0f);
  for (int64_t e = 0; e < s; ++e) {
    for (int64_t j = 0; j < kI; ++j) {
      const int64_t gr = order == GateUpOrder::kInterleaved ? 2 * j : j;
      const int64_t ur = order == GateUpOrder::kInterleaved ? 2 * j + 1 : kI + j;
      gu[static_cast<size_t>((e * 2 * kI + gr) * kH + j)] = 1.0f;
      gu[static_cast<size_t>((e * 2 * kI + ur) * kH + j)] = OneHot::factor(e);
    }
    for (int64_t n = 0; n < kH; ++n) dn[static_cast<size_t>((e * kH + n) * kI + n)] = 0.5f;
  }
  return {quantize_host(gu, s, 2 * kI, kH), quantize_host(dn, s, kH, kI)};
}

struct Batch {
  std::vector<float> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
  std::vector<int32_t> l2p;
  int64_t t = 0, k = 0, num_valid = 0;
};

// Three rows, the last one padding (NaN activations, an id far out of range).
Batch batch() {
  Batch b;
  b.t = 3;
  b.k = 2;
  b.num_valid = 2;
  b.x.resize(static_cast<size_t>(b.t * kH));
  for (int64_t i = 0; i < 2 * kH; ++i) b.x[static_cast<size_t>(i)] = -12.0f + 0.375f * static_cast<float>(i % 64) + (i >= kH ? 0.125f : 0.0f);
  for (int64_t i = 2 * kH; i < 3 * kH; ++i) b.x[static_cast<size_t>(i)] = NAN;
  b.ids = {0, 2, 1, 0, 99, -5};
  b.w = {0.25f, 0.75f, 1.0f, 0.5f, 123.0f, 456.0f};
  b.l2p = {0, 3, 2};  // logical 1 computed by slot 3, the replica of slot 1
  return b;
}

struct ExpertRun {
  Status status;
  std::vector<float> out;
};

ExpertRun run_experts(const Batch& b, const ExpertWeights& w, const ActivationParams& act,
                ActPrecision prec, std::vector<float> out_init = {}) {
  Batch c = b;
  ExpertRun r;
  r.out = out_init.empty() ? std::vector<float>(static_cast<size_t>(b.t * kH), -3.0f) : out_init;
  ExpertsArgs a;
  a.out = TensorView::contiguous(r.out.data(), DType::kF32, Shape{b.t, kH});
  a.x = TensorView::contiguous(c.x.data(), DType::kF32, Shape{b.t, kH});
  a.topk_ids = TensorView::contiguous(c.ids.data(), DType::kI32, Shape{b.t, b.k});
  a.topk_weights = TensorView::contiguous(c.w.data(), DType::kF32, Shape{b.t, b.k});
  a.logical_to_physical = TensorView::contiguous(c.l2p.data(), DType::kI32, Shape{static_cast<int64_t>(c.l2p.size())});
  a.num_valid_tokens = b.num_valid;
  a.weights = w;
  a.activation = act;
  a.precision = prec;
  a.accumulate = !out_init.empty();
  r.status = experts(kCpu, a);
  return r;
}

const ActivationParams kActs[] = {{ActivationKind::kSwiGLU, 7.0f, 1.702f},
                                  {ActivationKind::kGptOssSwiGLU, 7.0f, 1.702f},
                                  {ActivationKind::kClampedSwiGLU, 10.0f, 1.702f}};

TEST(MoeExperts, OneHotClosedFormEveryActivationFormatAndOrder) {
  const Batch b = batch();
  for (const GateUpOrder order : {GateUpOrder::kConcatenated, GateUpOrder::kInterleaved}) {
    const OneHot oh = one_hot(order);
    for (const WeightFormat fmt : {WeightFormat::kBF16, WeightFormat::kMXFP4}) {
      test::Arena arena(false);
      const ExpertWeights w = test::upload_experts(arena, fmt, order, oh.gu, oh.dn);
      for (const ActivationParams& act : kActs) {
        SCOPED_TRACE(std::string(activation_kind_name(act.kind)) + " " + weight_format_name(fmt) +
                     (order == GateUpOrder::kInterleaved ? " interleaved" : " concatenated"));
        const ExpertRun r = run_experts(b, w, act, ActPrecision::kF32);
        ASSERT_TRUE(r.status.ok()) << r.status.to_string();
        for (int64_t t = 0; t < b.t; ++t)
          for (int64_t n = 0; n < kH; ++n) {
            double want = 0.0;
            if (t < b.num_valid)
              for (int64_t j = 0; j < b.k; ++j) {
                const double xv = b.x[static_cast<size_t>(t * kH + n)];
                const int32_t slot = b.l2p[static_cast<size_t>(b.ids[static_cast<size_t>(t * b.k + j)])];
                want += b.w[static_cast<size_t>(t * b.k + j)] * 0.5 * act_ref(act, xv, OneHot::factor(slot) * xv);
              }
            const float got = r.out[static_cast<size_t>(t * kH + n)];
            EXPECT_NEAR(got, want, 2e-6 * (1.0 + std::fabs(want))) << "t=" << t << " n=" << n;
          }
      }
    }
  }
}

TEST(MoeExperts, BiasesEnterBeforeTheActivationAndAfterTheDownProjection) {
  const Batch b = batch();
  const OneHot oh = one_hot(GateUpOrder::kInterleaved);
  std::vector<float> gub(static_cast<size_t>(OneHot::kSlots * 2 * kI)), dnb(static_cast<size_t>(OneHot::kSlots * kH));
  for (size_t i = 0; i < gub.size(); ++i) gub[i] = 0.01f * static_cast<float>(i % 37) - 0.2f;
  for (size_t i = 0; i < dnb.size(); ++i) dnb[i] = 0.02f * static_cast<float>(i % 11) - 0.1f;
  const ActivationParams act{ActivationKind::kGptOssSwiGLU, 7.0f, 1.702f};
  for (const WeightFormat fmt : {WeightFormat::kBF16, WeightFormat::kMXFP4}) {
    test::Arena arena(false);
    const ExpertWeights w = test::upload_experts(arena, fmt, GateUpOrder::kInterleaved, oh.gu, oh.dn, &gub, &dnb);
    const ExpertRun r = run_experts(b, w, act, ActPrecision::kF32);
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    for (int64_t t = 0; t < b.num_valid; ++t)
      for (int64_t n = 0; n < kH; ++n) {
        double want = 0.0;
        for (int64_t j = 0; j < b.k; ++j) {
          const double xv = b.x[static_cast<size_t>(t * kH + n)];
          const int32_t s = b.l2p[static_cast<size_t>(b.ids[static_cast<size_t>(t * b.k + j)])];
          const double g = xv + gub[static_cast<size_t>(s * 2 * kI + 2 * n)];
          const double u = OneHot::factor(s) * xv + gub[static_cast<size_t>(s * 2 * kI + 2 * n + 1)];
          want += b.w[static_cast<size_t>(t * b.k + j)] * (0.5 * act_ref(act, g, u) + dnb[static_cast<size_t>(s * kH + n)]);
        }
        EXPECT_NEAR(r.out[static_cast<size_t>(t * kH + n)], want, 2e-6 * (1.0 + std::fabs(want)));
      }
  }
}

// bf16 precision rounds x and h to bfloat16; MXFP8 quantizes them per 32 (checked through the
// quantization library's own quantize/dequantize, an independent path).
TEST(MoeExperts, ActivationPrecisionRoundsXAndH) {
  Batch b = batch();
  for (int64_t i = 0; i < 2 * kH; ++i) b.x[static_cast<size_t>(i)] *= 1.0f + 1.0f / 3000.0f;  // not bf16
  const OneHot oh = one_hot(GateUpOrder::kConcatenated);
  test::Arena arena(false);
  const ExpertWeights w = test::upload_experts(arena, WeightFormat::kMXFP4, GateUpOrder::kConcatenated, oh.gu, oh.dn);
  const ActivationParams act = kActs[0];
  auto mx8 = [](std::vector<float> v) {
    std::vector<uint8_t> q(v.size()), s(v.size() / 32);
    const int64_t n = static_cast<int64_t>(v.size());
    EXPECT_TRUE(quant::quantize_mxfp8(kCpu, TensorView::contiguous(v.data(), DType::kF32, Shape{n}),
                                      TensorView::contiguous(q.data(), DType::kU8, Shape{n}),
                                      TensorView::contiguous(s.data(), DType::kU8, Shape{n / 32})).ok());
    EXPECT_TRUE(quant::dequantize_mxfp8(kCpu, TensorView::contiguous(q.data(), DType::kU8, Shape{n}),
                                        TensorView::contiguous(s.data(), DType::kU8, Shape{n / 32}),
                                        TensorView::contiguous(v.data(), DType::kF32, Shape{n})).ok());
    return v;
  };
  auto bf = [](std::vector<float> v) {
    for (float& f : v) f = bf16_bits_to_f32(f32_to_bf16_bits(f));
    return v;
  };
  for (const ActPrecision prec : {ActPrecision::kBF16, ActPrecision::kMXFP8}) {
    SCOPED_TRACE(act_precision_name(prec));
    const ExpertRun r = run_experts(b, w, act, prec);
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    for (int64_t t = 0; t < b.num_valid; ++t) {
      std::vector<float> xr(b.x.begin() + t * kH, b.x.begin() + (t + 1) * kH);
      xr = prec == ActPrecision::kBF16 ? bf(xr) : mx8(xr);
      std::vector<double> want(static_cast<size_t>(kH), 0.0);
      for (int64_t j = 0; j < b.k; ++j) {
        const int32_t s = b.l2p[static_cast<size_t>(b.ids[static_cast<size_t>(t * b.k + j)])];
        std::vector<float> h(static_cast<size_t>(kI));
        for (int64_t n = 0; n < kI; ++n) h[static_cast<size_t>(n)] = static_cast<float>(act_ref(act, xr[static_cast<size_t>(n)], OneHot::factor(s) * xr[static_cast<size_t>(n)]));
        h = prec == ActPrecision::kBF16 ? bf(h) : mx8(h);
        for (int64_t n = 0; n < kH; ++n) want[static_cast<size_t>(n)] += b.w[static_cast<size_t>(t * b.k + j)] * 0.5 * h[static_cast<size_t>(n)];
      }
      // h computed in double vs float can round to neighbouring codes near a boundary: allow
      // one MXFP8 step (1/8 relative) on a handful of elements, bf16 steps likewise.
      int off = 0;
      for (int64_t n = 0; n < kH; ++n) {
        const double g = r.out[static_cast<size_t>(t * kH + n)], wv = want[static_cast<size_t>(n)];
        if (std::fabs(g - wv) > 1e-5 * (1 + std::fabs(wv))) ++off;
      }
      EXPECT_LE(off, 2) << "row " << t;
    }
  }
}

TEST(MoeExperts, ReplicaMapGivesIdenticalOutput) {
  Batch b = batch();
  const OneHot oh = one_hot(GateUpOrder::kConcatenated);
  test::Arena arena(false);
  const ExpertWeights w = test::upload_experts(arena, WeightFormat::kMXFP4, GateUpOrder::kConcatenated, oh.gu, oh.dn);
  const ExpertRun via_replica = run_experts(b, w, kActs[1], ActPrecision::kBF16);
  b.l2p = {0, 1, 2};
  const ExpertRun direct = run_experts(b, w, kActs[1], ActPrecision::kBF16);
  ASSERT_TRUE(via_replica.status.ok() && direct.status.ok());
  EXPECT_EQ(via_replica.out, direct.out);
}

TEST(MoeExperts, Mxfp4KernelLayoutEqualsBf16Checkpoint) {
  test::Rng rng(7);
  Batch b = batch();
  b.l2p = {0, 1, 2};
  for (float& v : b.x)
    if (!std::isnan(v)) v = test::gauss(rng) * 3.0f;
  for (const GateUpOrder order : {GateUpOrder::kConcatenated, GateUpOrder::kInterleaved}) {
    const Mxfp4Host gu = test::random_mxfp4(rng, 3, 2 * kI, kH), dn = test::random_mxfp4(rng, 3, kH, kI);
    test::Arena arena(false);
    for (const ActivationParams& act : kActs) {
      const ExpertRun a = run_experts(b, test::upload_experts(arena, WeightFormat::kMXFP4, order, gu, dn), act, ActPrecision::kMXFP8);
      const ExpertRun c = run_experts(b, test::upload_experts(arena, WeightFormat::kBF16, order, gu, dn), act, ActPrecision::kMXFP8);
      ASSERT_TRUE(a.status.ok() && c.status.ok()) << a.status.to_string() << c.status.to_string();
      EXPECT_EQ(a.out, c.out);  // same values, same order of operations
    }
  }
}

TEST(MoeExperts, AccumulateAddsToOut) {
  const Batch b = batch();
  const OneHot oh = one_hot(GateUpOrder::kConcatenated);
  test::Arena arena(false);
  const ExpertWeights w = test::upload_experts(arena, WeightFormat::kBF16, GateUpOrder::kConcatenated, oh.gu, oh.dn);
  const ExpertRun plain = run_experts(b, w, kActs[0], ActPrecision::kBF16);
  std::vector<float> init(static_cast<size_t>(b.t * kH));
  for (size_t i = 0; i < init.size(); ++i) init[i] = 0.5f * static_cast<float>(i % 7);
  const ExpertRun acc = run_experts(b, w, kActs[0], ActPrecision::kBF16, init);
  ASSERT_TRUE(plain.status.ok() && acc.status.ok());
  for (int64_t i = 0; i < b.t * kH; ++i) {
    const float want = i < b.num_valid * kH ? init[static_cast<size_t>(i)] + plain.out[static_cast<size_t>(i)] : 0.0f;
    EXPECT_NEAR(acc.out[static_cast<size_t>(i)], want, 1e-5 * (1 + std::fabs(want))) << i;
  }
}

TEST(MoeExperts, EmptyAndAllPaddingBatches) {
  Batch b = batch();
  const OneHot oh = one_hot(GateUpOrder::kConcatenated);
  test::Arena arena(false);
  const ExpertWeights w = test::upload_experts(arena, WeightFormat::kBF16, GateUpOrder::kConcatenated, oh.gu, oh.dn);
  b.num_valid = 0;
  ExpertRun r = run_experts(b, w, kActs[0], ActPrecision::kBF16);
  ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  for (float v : r.out) EXPECT_EQ(v, 0.0f);
  b.t = 0;
  b.x.clear();
  b.ids.clear();
  b.w.clear();
  r = run_experts(b, w, kActs[0], ActPrecision::kBF16);
  EXPECT_TRUE(r.status.ok()) << r.status.to_string();
}

// num_valid_device: the row count read where the op runs (graphs padded to a bucket) masks rows
// as num_valid_tokens does; a count outside [0, T] is refused before anything is written.
TEST(MoeExperts, DeviceRowCountMasksPaddingRows) {
  const Batch b = batch();
  const OneHot oh = one_hot(GateUpOrder::kConcatenated);
  test::Arena arena(false);
  const ExpertWeights w = test::upload_experts(arena, WeightFormat::kBF16, GateUpOrder::kConcatenated, oh.gu, oh.dn);
  const ExpertRun want = run_experts(b, w, kActs[0], ActPrecision::kBF16);
  ASSERT_TRUE(want.status.ok()) << want.status.to_string();
  for (const int32_t count : {2, 3, 4, -1}) {
    Batch c = b;
    std::vector<float> out(static_cast<size_t>(c.t * kH), -3.0f);
    int32_t n = count;
    ExpertsArgs a;
    a.out = TensorView::contiguous(out.data(), DType::kF32, Shape{c.t, kH});
    a.x = TensorView::contiguous(c.x.data(), DType::kF32, Shape{c.t, kH});
    a.topk_ids = TensorView::contiguous(c.ids.data(), DType::kI32, Shape{c.t, c.k});
    a.topk_weights = TensorView::contiguous(c.w.data(), DType::kF32, Shape{c.t, c.k});
    a.logical_to_physical = TensorView::contiguous(c.l2p.data(), DType::kI32, Shape{3});
    a.num_valid_tokens = count == 3 ? 2 : -1;  // 3 rows on the device, 2 on the host: the smaller
    a.num_valid_device = TensorView::contiguous(&n, DType::kI32, Shape{1});
    a.weights = w;
    a.activation = kActs[0];
    const Status st = experts(kCpu, a);
    if (count == 2 || count == 3) {
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_EQ(out, want.out);
    } else {
      MOE_EXPECT_STATUS(st, ErrorCode::kOutOfRange, "num_valid_device");
      for (float v : out) EXPECT_EQ(v, -3.0f);
    }
  }
}

TEST(MoeExperts, RejectsBadIdsAndMapsWritingNothing) {
  const OneHot oh = one_hot(GateUpOrder::kConcatenated);
  test::Arena arena(false);
  const ExpertWeights w = test::upload_experts(arena, WeightFormat::kBF16, GateUpOrder::kConcatenated, oh.gu, oh.dn);
  Batch b = batch();
  b.ids[3] = 3;  // a real row's id past the 3 logical experts
  ExpertRun r = run_experts(b, w, kActs[0], ActPrecision::kBF16);
  EXPECT_EQ(r.status.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(r.status.field(), "topk_ids");
  for (float v : r.out) EXPECT_EQ(v, -3.0f);
  b = batch();
  b.l2p[2] = 4;  // only 4 slots
  r = run_experts(b, w, kActs[0], ActPrecision::kBF16);
  EXPECT_EQ(r.status.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(r.status.field(), "logical_to_physical");
}

TEST(MoeExperts, RejectsBadArguments) {
  const OneHot oh = one_hot(GateUpOrder::kConcatenated);
  test::Arena arena(false);
  ExpertWeights w = test::upload_experts(arena, WeightFormat::kMXFP4, GateUpOrder::kConcatenated, oh.gu, oh.dn);
  const Batch b = batch();
  auto field_of = [&](ExpertWeights ww, ActivationParams act, int64_t num_valid = 2) {
    Batch c = b;
    c.num_valid = num_valid;
    return run_experts(c, ww, act, ActPrecision::kBF16).status;
  };
  ExpertWeights no_scales = w;
  no_scales.gate_up_scales = TensorView{};
  MOE_EXPECT_STATUS(field_of(no_scales, kActs[0]), ErrorCode::kInvalidArgument, "weights.gate_up_scales");
  ExpertWeights bf = test::upload_experts(arena, WeightFormat::kBF16, GateUpOrder::kConcatenated, oh.gu, oh.dn);
  bf.down_scales = w.down_scales;
  EXPECT_EQ(field_of(bf, kActs[0]).code(), ErrorCode::kInvalidArgument);
  MOE_EXPECT_STATUS(field_of(w, {ActivationKind::kClampedSwiGLU, 0.0f, 1.0f}), ErrorCode::kInvalidArgument,
                    "activation.limit");
  MOE_EXPECT_STATUS(field_of(w, kActs[0], 4), ErrorCode::kInvalidArgument, "num_valid_tokens");
  ExpertWeights bias = w;
  std::vector<float> short_bias(5);
  bias.gate_up_bias = TensorView::contiguous(short_bias.data(), DType::kF32, Shape{5});
  MOE_EXPECT_STATUS(field_of(bias, kActs[0]), ErrorCode::kInvalidArgument, "weights.gate_up_bias");

  // Hidden 48 is not a multiple of 64.
  std::vector<float> x(48), out(48), tw(1);
  std::vector<int32_t> ids(1), l2p(1);
  ExpertsArgs a;
  a.x = TensorView::contiguous(x.data(), DType::kF32, Shape{1, 48});
  a.out = TensorView::contiguous(out.data(), DType::kF32, Shape{1, 48});
  a.topk_ids = TensorView::contiguous(ids.data(), DType::kI32, Shape{1, 1});
  a.topk_weights = TensorView::contiguous(tw.data(), DType::kF32, Shape{1, 1});
  a.logical_to_physical = TensorView::contiguous(l2p.data(), DType::kI32, Shape{1});
  a.weights = w;
  MOE_EXPECT_STATUS(experts(kCpu, a), ErrorCode::kInvalidArgument, "x");
  // out aliasing x.
  a.x = TensorView::contiguous(out.data(), DType::kF32, Shape{1, 48});
  EXPECT_EQ(experts(kCpu, a).code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace rolloutd::moe
