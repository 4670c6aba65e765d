// MXFP8 on the CPU reference: hand-checked blocks for the edge cases of kernels/quant/mxfp8.hpp,
// FP32-vs-BF16 byte identity, partial blocks, dequantization of NaN codes, argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/quant/quant_ops.hpp"
#include "tests/unit/kernels/quant/quant_test_util.hpp"

namespace rolloutd::quant {
namespace {

using test::bf16;
using test::bits;
using test::kCpu;
using test::view;

struct Mx8 {
  std::vector<uint8_t> q, scales;
};

template <class T>
Mx8 quantize(std::vector<T>& x, int64_t rows, int64_t k) {
  const DType dt = sizeof(T) == 2 ? DType::kBF16 : DType::kF32;
  const int64_t nkb = test::ceil_div(k, 32);
  Mx8 m;
  m.q.assign(static_cast<size_t>(rows * k), 0xCD);
  m.scales.assign(static_cast<size_t>(rows * nkb), 0xCD);
  const Status st = quantize_mxfp8(kCpu, view(x, dt, {rows, k}), view(m.q, DType::kF8E4M3, {rows, k}),
                                   view(m.scales, DType::kE8M0, {rows, nkb}));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return m;
}

std::vector<uint16_t> block_of(std::initializer_list<float> values) {
  std::vector<uint16_t> x(32, 0);
  size_t i = 0;
  for (float v : values) x[i++] = bf16(v);
  return x;
}

struct Case {
  const char* what;
  std::vector<uint16_t> x;
  uint8_t scale;
  std::vector<uint8_t> codes;  // of the first elements; the rest +0
};

TEST(Mxfp8, HandCheckedBlocks) {
  const float m9 = std::ldexp(1.0f, -9), m10 = std::ldexp(1.0f, -10);
  const std::vector<Case> cases = {
      {"amax 448: scale 1; ties, subnormals, signs",
       block_of({448, -448, 15.5f, m9, m10, 3 * m10, -m9, -0.0f, 0, 1, 240, 248}),
       127,
       {0x7E, 0xFE, 0x58, 0x01, 0x00, 0x02, 0x81, 0x80, 0x00, 0x38, 0x77, 0x78}},
      {"amax 500: same exponent as 448, saturates", block_of({500, 480, 300}), 127, {0x7E, 0x7E, 0x79}},
      {"amax 512: scale 2", block_of({512, 17, 0.5f}), 128, {0x78, 0x50, 0x28}},
      {"amax 1: scale 2^-8", block_of({1, 0.001f}), 119, {0x78, 0x28}},
      {"zeros of both signs", block_of({0, -0.0f}), 0, {0x00, 0x80}},
      {"bf16 subnormals: scale 2^-127", {0x0060, 0x0001, 0x8001}, 0, {0x3C, 0x08, 0x88}},
      {"NaN poisons", {bf16(1), 0x7fc0, bf16(2)}, 255, {}},
      {"-Inf poisons", {bf16(-INFINITY), bf16(2)}, 255, {}},
  };
  for (const Case& c : cases) {
    std::vector<uint16_t> x = c.x;
    x.resize(32, 0);
    const Mx8 m = quantize(x, 1, 32);
    EXPECT_EQ(m.scales[0], c.scale) << c.what;
    std::vector<uint8_t> want = c.codes;
    want.resize(32, 0);
    EXPECT_EQ(m.q, want) << c.what;
  }
}

TEST(Mxfp8, DequantizeNanCodesAndScales) {
  std::vector<uint8_t> q = {0x7E, 0x7F, 0xFF, 0x80, 0x01}, scales = {127 + 3, 255};
  q.resize(64, 0x38);  // second block: 1.0 under a NaN scale
  std::vector<uint32_t> out(64);
  ASSERT_OK(dequantize_mxfp8(kCpu, view(q, DType::kF8E4M3, {64}), view(scales, DType::kU8, {2}),
                             view(out, DType::kF32, {64})));
  EXPECT_EQ(out[0], bits(448.0f * 8));
  EXPECT_EQ(out[1], kF32CanonicalNan);
  EXPECT_EQ(out[2], kF32CanonicalNan);
  EXPECT_EQ(out[3], bits(-0.0f));
  EXPECT_EQ(out[4], bits(std::ldexp(1.0f, -6)));
  for (size_t i = 32; i < 64; ++i) EXPECT_EQ(out[i], kF32CanonicalNan);
  std::vector<uint16_t> h(64);
  ASSERT_OK(dequantize_mxfp8(kCpu, view(q, DType::kU8, {2, 32}), view(scales, DType::kE8M0, {2, 1}),
                             view(h, DType::kBF16, {2, 32})));
  EXPECT_EQ(h[0], bf16(3584.0f));
  EXPECT_EQ(h[1], 0x7fc0);
}

TEST(Mxfp8, Fp32OfExactBf16IsByteIdenticalAndPartialBlocksWork) {
  test::Rng rng(21);
  for (const auto& [rows, k] : {std::pair<int64_t, int64_t>{6, 40}, {3, 256}, {2, 7}}) {
    auto xb = test::random_bf16(rng, rows * k);
    auto xf = test::widen(xb);
    const Mx8 a = quantize(xb, rows, k), b = quantize(xf, rows, k);
    EXPECT_EQ(a.q, b.q);
    EXPECT_EQ(a.scales, b.scales);
    // Round trip: a dequantized block keeps its amax exponent (the largest code is in
    // [256, 448] times the scale), so it re-quantizes to the same scale.
    std::vector<float> y(static_cast<size_t>(rows * k));
    Mx8 a2 = a;
    ASSERT_OK(dequantize_mxfp8(kCpu, view(a2.q, DType::kU8, {rows, k}),
                               view(a2.scales, DType::kU8, {rows, test::ceil_div(k, 32)}),
                               view(y, DType::kF32, {rows, k})));
    const Mx8 again = quantize(y, rows, k);
    for (size_t blk = 0; blk < a.scales.size(); ++blk) {
      if (a.scales[blk] == 255) continue;  // NaN-poisoned: dequantizes to NaN, stays poisoned
      EXPECT_EQ(again.scales[blk], a.scales[blk]) << blk;
    }
  }
}

TEST(Mxfp8Errors, BadViews) {
  std::vector<uint16_t> x(64);
  std::vector<uint8_t> q(64, 0xCD), s(2, 0xCD);
  EXPECT_STATUS(quantize_mxfp8(kCpu, view(x, DType::kBF16, {64}), view(q, DType::kI8, {64}), view(s, DType::kU8, {2})),
                ErrorCode::kInvalidArgument, "q");
  EXPECT_STATUS(quantize_mxfp8(kCpu, view(x, DType::kBF16, {64}), view(q, DType::kU8, {2, 32}), view(s, DType::kU8, {2})),
                ErrorCode::kInvalidArgument, "q");
  EXPECT_STATUS(quantize_mxfp8(kCpu, view(x, DType::kBF16, {64}), view(q, DType::kU8, {64}), view(s, DType::kU8, {3})),
                ErrorCode::kInvalidArgument, "scales");
  EXPECT_STATUS(quantize_mxfp8(kCpu, view(x, DType::kBF16, {64}), view(q, DType::kFP4x2, {64}), view(s, DType::kU8, {2})),
                ErrorCode::kInvalidArgument, "q");
  EXPECT_EQ(q, std::vector<uint8_t>(64, 0xCD));
  std::vector<float> out(64);
  EXPECT_STATUS(dequantize_mxfp8(kCpu, view(q, DType::kU8, {64}), view(s, DType::kU8, {2}), view(out, DType::kF32, {2, 32})),
                ErrorCode::kInvalidArgument, "q");
}

}  // namespace
}  // namespace rolloutd::quant
