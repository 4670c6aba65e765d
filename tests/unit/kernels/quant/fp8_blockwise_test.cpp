// UE8M0 blockwise FP8 on the CPU reference: hand-checked 1 x 128 and 128 x 128 blocks (scale
// rule, partial edge blocks, poisoning, subnormals, packing), FP32-vs-BF16 byte identity,
// stacked weights, dequantization through both scale forms, argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/quant/quant_ops.hpp"
#include "tests/unit/kernels/quant/quant_test_util.hpp"

namespace rolloutd::quant {
namespace {

using test::bf16;
using test::bits;
using test::kCpu;
using test::view;

struct Fp8 {
  std::vector<uint8_t> q;
  std::vector<float> scales;
  std::vector<int32_t> packed;
  int64_t num_kb = 0;
  uint32_t scale_bits(int64_t sr, int64_t kb) const { return bits(scales[static_cast<size_t>(sr * num_kb + kb)]); }
};

// x: [lead..., (N,) K] as given by `shape`.
template <class T>
Fp8 quantize(std::vector<T>& x, Shape shape, Fp8ScaleBlock block) {
  const DType dt = sizeof(T) == 2 ? DType::kBF16 : DType::kF32;
  const int r = shape.rank();
  const int64_t k = shape[r - 1], nkb = test::ceil_div(k, 128), words = test::ceil_div(nkb, 4);
  Shape ss = shape, ps = shape;
  if (block == Fp8ScaleBlock::k128x128) {
    ss[r - 2] = ps[r - 2] = test::ceil_div(shape[r - 2], 128);
  }
  ss[r - 1] = nkb;
  ps[r - 1] = words;
  Fp8 f;
  f.num_kb = nkb;
  f.q.assign(static_cast<size_t>(shape.numel()), 0xCD);
  f.scales.assign(static_cast<size_t>(ss.numel()), -1.0f);
  f.packed.assign(static_cast<size_t>(ps.numel()), 0x5a5a5a5a);
  const Status st = quantize_fp8_blockwise(kCpu, view(x, dt, shape), block, view(f.q, DType::kF8E4M3, shape),
                                           view(f.scales, DType::kF32, ss), view(f.packed, DType::kI32, ps));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return f;
}

TEST(Fp8Blockwise, PerTokenHandChecked) {
  // [2, 300]: three blocks per row, the last 44 wide.
  std::vector<uint16_t> x(600, 0);
  auto at = [&](int64_t r, int64_t k) -> uint16_t& { return x[static_cast<size_t>(r * 300 + k)]; };
  at(0, 0) = bf16(448), at(0, 1) = bf16(1), at(0, 2) = bf16(-224), at(0, 3) = bf16(std::ldexp(1.0f, -9));
  at(0, 128) = bf16(450), at(0, 129) = bf16(225);  // both exact in bf16 (449 is not)
  at(1, 5) = 0x7fc0, at(1, 6) = bf16(3);  // NaN
  at(1, 130) = bf16(1), at(1, 131) = bf16(0.5f);
  at(1, 299) = 0x8000;  // -0 alone in a block
  const Fp8 f = quantize(x, {2, 300}, Fp8ScaleBlock::k1x128);
  // Row 0: amax 448 -> scale 1; 450 -> 2 (450 / 2 = 225 -> 224, 225 / 2 = 112.5 -> 112);
  // zeros -> 2^-127.
  EXPECT_EQ(f.scale_bits(0, 0), bits(1.0f));
  EXPECT_EQ(f.scale_bits(0, 1), bits(2.0f));
  EXPECT_EQ(f.scale_bits(0, 2), 0x00400000u);
  EXPECT_EQ(f.q[0], 0x7E);
  EXPECT_EQ(f.q[1], 0x38);
  EXPECT_EQ(f.q[2], 0xF6);
  EXPECT_EQ(f.q[3], 0x01);
  EXPECT_EQ(f.q[128], 0x76);
  EXPECT_EQ(f.q[129], 0x6E);
  // Row 1: NaN -> NaN scale, codes 0; amax 1 -> 2^-8; -0 -> 0x80 under 2^-127.
  EXPECT_EQ(f.scale_bits(1, 0), kF32CanonicalNan);
  for (int k = 0; k < 128; ++k) EXPECT_EQ(f.q[static_cast<size_t>(300 + k)], 0) << k;
  EXPECT_EQ(f.scale_bits(1, 1), bits(std::ldexp(1.0f, -8)));
  EXPECT_EQ(f.q[300 + 130], 0x78);
  EXPECT_EQ(f.q[300 + 131], 0x70);
  EXPECT_EQ(f.q[300 + 299], 0x80);
  // Packed: one int32 per row, codes of blocks 0..2 then a zero byte, little-endian.
  ASSERT_EQ(f.packed.size(), 2u);
  EXPECT_EQ(f.packed[0], 127 | (128 << 8) | (0 << 16));
  EXPECT_EQ(f.packed[1], 255 | (119 << 8) | (0 << 16));
}

TEST(Fp8Blockwise, WeightBlocksHandCheckedWithPartialEdges) {
  // [130, 260]: block rows {0..127, 128..129} x block columns {0..127, 128..255, 256..259}.
  std::vector<uint16_t> x(130 * 260, 0);
  auto at = [&](int64_t r, int64_t k) -> uint16_t& { return x[static_cast<size_t>(r * 260 + k)]; };
  at(100, 5) = bf16(896), at(0, 0) = bf16(1);          // (0,0): 896/448 = 2 exactly -> 2
  at(10, 258) = bf16(-3);                               // (0,2): 3/448 -> 2^-7
  at(129, 127) = bf16(std::ldexp(1.0f, -130));          // (1,0): subnormal quotient -> 2^-127
  at(128, 200) = bf16(INFINITY);                        // (1,1): poisoned
  at(129, 259) = bf16(0.25f);                           // (1,2): 0.25/448 -> 2^-10
  const Fp8 f = quantize(x, {130, 260}, Fp8ScaleBlock::k128x128);
  ASSERT_EQ(f.scales.size(), 6u);
  EXPECT_EQ(f.scale_bits(0, 0), bits(2.0f));
  EXPECT_EQ(f.scale_bits(0, 1), 0x00400000u);
  EXPECT_EQ(f.scale_bits(0, 2), bits(std::ldexp(1.0f, -7)));
  EXPECT_EQ(f.scale_bits(1, 0), 0x00400000u);
  EXPECT_EQ(f.scale_bits(1, 1), kF32CanonicalNan);
  EXPECT_EQ(f.scale_bits(1, 2), bits(std::ldexp(1.0f, -10)));
  EXPECT_EQ(f.q[100 * 260 + 5], 0x7E);
  EXPECT_EQ(f.q[0], 0x30);
  EXPECT_EQ(f.q[10 * 260 + 258], 0xFC);
  EXPECT_EQ(f.q[129 * 260 + 127], 0x20);
  EXPECT_EQ(f.q[128 * 260 + 200], 0x00);
  EXPECT_EQ(f.q[129 * 260 + 259], 0x78);
  EXPECT_EQ(f.packed[0], 128 | (0 << 8) | (120 << 16));
  EXPECT_EQ(f.packed[1], 0 | (255 << 8) | (117 << 16));
}

TEST(Fp8Blockwise, StackedWeightsAreIndependentMatrices) {
  test::Rng rng(31);
  const int64_t e = 3, n = 150, k = 200;
  auto x = test::random_bf16(rng, e * n * k);
  const Fp8 all = quantize(x, {e, n, k}, Fp8ScaleBlock::k128x128);
  for (int64_t i = 0; i < e; ++i) {
    std::vector<uint16_t> one(x.begin() + i * n * k, x.begin() + (i + 1) * n * k);
    const Fp8 f = quantize(one, {n, k}, Fp8ScaleBlock::k128x128);
    EXPECT_TRUE(std::equal(f.q.begin(), f.q.end(), all.q.begin() + i * n * k));
    for (size_t j = 0; j < f.scales.size(); ++j)
      EXPECT_EQ(bits(f.scales[j]), bits(all.scales[static_cast<size_t>(i) * f.scales.size() + j]));
    EXPECT_TRUE(std::equal(f.packed.begin(), f.packed.end(), all.packed.begin() + i * static_cast<int64_t>(f.packed.size())));
  }
}

TEST(Fp8Blockwise, Fp32OfExactBf16IsByteIdentical) {
  test::Rng rng(32);
  for (auto block : {Fp8ScaleBlock::k1x128, Fp8ScaleBlock::k128x128}) {
    for (const Shape& s : {Shape{3, 300}, Shape{129, 130}, Shape{2, 5, 7}}) {
      auto xb = test::random_bf16(rng, s.numel());
      auto xf = test::widen(xb);
      const Fp8 a = quantize(xb, s, block), b = quantize(xf, s, block);
      EXPECT_EQ(a.q, b.q);
      EXPECT_EQ(std::memcmp(a.scales.data(), b.scales.data(), a.scales.size() * 4), 0);
      EXPECT_EQ(a.packed, b.packed);
    }
  }
}

TEST(Fp8Blockwise, BothScaleFormsDequantizeAlike) {
  test::Rng rng(33);
  for (auto block : {Fp8ScaleBlock::k1x128, Fp8ScaleBlock::k128x128}) {
    const Shape s{140, 390};
    auto x = test::random_bf16(rng, s.numel());
    x[17] = 0x7fc0;  // one poisoned block
    Fp8 f = quantize(x, s, block);
    const int64_t sr = block == Fp8ScaleBlock::k128x128 ? 2 : 140;
    std::vector<uint32_t> a(static_cast<size_t>(s.numel())), b(a.size());
    ASSERT_OK(dequantize_fp8_blockwise(kCpu, view(f.q, DType::kF8E4M3, s), view(f.scales, DType::kF32, {sr, 4}),
                                       block, view(a, DType::kF32, s)));
    ASSERT_OK(dequantize_fp8_blockwise(kCpu, view(f.q, DType::kU8, s), view(f.packed, DType::kI32, {sr, 1}), block,
                                       view(b, DType::kF32, s)));
    EXPECT_EQ(a, b);
    for (int64_t k = 0; k < 128; ++k) EXPECT_EQ(a[static_cast<size_t>(k)], kF32CanonicalNan) << k;
  }
}

TEST(Fp8Blockwise, OneScaleFormIsEnough) {
  std::vector<uint16_t> x(256, bf16(1.0f));
  std::vector<uint8_t> q(256);
  std::vector<float> s(2);
  std::vector<int32_t> p(1);
  ASSERT_OK(quantize_fp8_blockwise(kCpu, view(x, DType::kBF16, {256}), Fp8ScaleBlock::k1x128,
                                   view(q, DType::kU8, {256}), view(s, DType::kF32, {2}), TensorView{}));
  ASSERT_OK(quantize_fp8_blockwise(kCpu, view(x, DType::kBF16, {256}), Fp8ScaleBlock::k1x128,
                                   view(q, DType::kU8, {256}), TensorView{}, view(p, DType::kI32, {1})));
  EXPECT_EQ(p[0], 119 | (119 << 8));
}

TEST(Fp8BlockwiseErrors, BadViews) {
  std::vector<uint16_t> x(2 * 256);
  std::vector<uint8_t> q(512, 0xCD);
  std::vector<float> s(4, -1.0f);
  std::vector<int32_t> p(2, 7);
  const auto xv = view(x, DType::kBF16, {2, 256});
  const auto qv = view(q, DType::kF8E4M3, {2, 256});
  const auto sv = view(s, DType::kF32, {2, 2});
  const auto pv = view(p, DType::kI32, {2, 1});
  const auto tok = Fp8ScaleBlock::k1x128, w = Fp8ScaleBlock::k128x128;
  EXPECT_STATUS(quantize_fp8_blockwise(kCpu, xv, tok, qv, TensorView{}, TensorView{}), ErrorCode::kInvalidArgument, "scales");
  EXPECT_STATUS(quantize_fp8_blockwise(kCpu, xv, tok, qv, view(s, DType::kF32, {4}), pv), ErrorCode::kInvalidArgument, "scales");
  EXPECT_STATUS(quantize_fp8_blockwise(kCpu, xv, tok, qv, sv, view(p, DType::kU8, {2, 1})), ErrorCode::kInvalidArgument, "scales_ue8m0");
  EXPECT_STATUS(quantize_fp8_blockwise(kCpu, xv, tok, qv, sv, view(p, DType::kI32, {1, 2})),
                ErrorCode::kInvalidArgument, "scales_ue8m0");
  EXPECT_STATUS(quantize_fp8_blockwise(kCpu, xv, tok, view(q, DType::kI8, {2, 256}), sv, pv), ErrorCode::kInvalidArgument, "q");
  EXPECT_STATUS(quantize_fp8_blockwise(kCpu, view(x, DType::kBF16, {512}), w, view(q, DType::kU8, {512}), sv, pv),
                ErrorCode::kInvalidArgument, "x");  // weights need [.., N, K]
  EXPECT_STATUS(quantize_fp8_blockwise(kCpu, xv, w, qv, sv, pv), ErrorCode::kInvalidArgument, "scales");  // wants [1, 2]
  EXPECT_STATUS(quantize_fp8_blockwise(kCpu, xv, static_cast<Fp8ScaleBlock>(9), qv, sv, pv), ErrorCode::kInvalidArgument, "block");
  EXPECT_EQ(q, std::vector<uint8_t>(512, 0xCD));
  EXPECT_EQ(s, std::vector<float>(4, -1.0f));
  EXPECT_EQ(p, std::vector<int32_t>(2, 7));
  std::vector<float> out(512);
  EXPECT_STATUS(dequantize_fp8_blockwise(kCpu, qv, view(x, DType::kBF16, {2, 2}), tok, view(out, DType::kF32, {2, 256})),
                ErrorCode::kInvalidArgument, "scales");
  EXPECT_STATUS(dequantize_fp8_blockwise(kCpu, qv, view(p, DType::kI32, {2, 2}), tok, view(out, DType::kF32, {2, 256})),
                ErrorCode::kInvalidArgument, "scales");
  EXPECT_STATUS(dequantize_fp8_blockwise(kCpu, qv, sv, tok, view(out, DType::kF32, {2, 255})), ErrorCode::kInvalidArgument, "q");
}

}  // namespace
}  // namespace rolloutd::quant
