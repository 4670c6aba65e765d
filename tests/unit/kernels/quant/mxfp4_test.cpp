// MXFP4 on the CPU reference: hand-checked blocks for every edge case of kernels/quant/mxfp4.hpp,
// FP32-vs-BF16 byte identity, round trips, the kernel layout (against the layout written out
// as loops over tiles) and its in-place inverse, and every argument check.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/quant/quant_ops.hpp"
#include "tests/unit/kernels/quant/quant_test_util.hpp"

namespace rolloutd::quant {
namespace {

using test::bf16;
using test::bits;
using test::kCpu;
using test::view;

struct Mx4 {
  std::vector<uint8_t> blocks, scales;
  uint32_t code(int64_t r, int64_t k) const {  // element k of row r
    const int64_t row_bytes = static_cast<int64_t>(blocks.size()) / rows;
    const uint8_t b = blocks[static_cast<size_t>(r * row_bytes + k / 2)];
    return k % 2 == 0 ? (b & 0xfu) : (b >> 4);
  }
  int64_t rows = 1;
};

template <class T>
Mx4 quantize(std::vector<T>& x, int64_t rows, int64_t k) {
  const DType dt = sizeof(T) == 2 ? DType::kBF16 : DType::kF32;
  const int64_t nkb = test::ceil_div(k, 32);
  Mx4 m;
  m.rows = rows;
  m.blocks.assign(static_cast<size_t>(rows * nkb * 16), 0xCD);
  m.scales.assign(static_cast<size_t>(rows * nkb), 0xCD);
  const Status st = quantize_mxfp4(kCpu, view(x, dt, {rows, k}), view(m.blocks, DType::kU8, {rows, nkb, 16}),
                                   view(m.scales, DType::kE8M0, {rows, nkb}));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return m;
}

std::vector<uint32_t> dequant_f32(Mx4& m, int64_t rows, int64_t k) {
  std::vector<uint32_t> out(static_cast<size_t>(rows * k), 0xdeadbeef);
  const int64_t nkb = test::ceil_div(k, 32);
  const Status st = dequantize_mxfp4(kCpu, view(m.blocks, DType::kFP4x2, {rows, nkb, 16}),
                                     view(m.scales, DType::kU8, {rows, nkb}),
                                     view(out, DType::kF32, {rows, k}));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return out;
}

std::vector<uint16_t> block_of(std::initializer_list<float> values) {
  std::vector<uint16_t> x(32, 0);
  size_t i = 0;
  for (float v : values) x[i++] = bf16(v);
  return x;
}

// ---- one block, by hand -------------------------------------------------------------------

TEST(Mxfp4, HandCheckedBlockWithTiesAndSigns) {
  // amax 6: scale 2^0 (code 127). Ties go to the even code; -0 and tiny negatives keep the sign.
  auto x = block_of({6, -6, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, -5, 0, -0.0f, 0.5f, 3, 4,
                     1.5f, -0.25f, -0.1f});
  const Mx4 m = quantize(x, 1, 32);
  EXPECT_EQ(m.scales[0], 127);
  const std::vector<uint8_t> expect = {0xF7, 0x20, 0x42, 0x64, 0xE6, 0x80, 0x51, 0x36, 0x88,
                                       0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(m.blocks, expect);
}

struct ScaleCase {
  const char* what;
  std::vector<uint16_t> x;  // one block
  uint8_t scale;
  std::vector<uint32_t> codes;  // of the first elements; the rest must be +0
};

TEST(Mxfp4, ScaleRuleEdgeCases) {
  const uint16_t sub_1p5_m127 = 0x0060, min_sub = 0x0001, min_normal = 0x0080;
  const std::vector<ScaleCase> cases = {
      {"amax 4, a power of two", block_of({4, 1, -2}), 127, {6, 2, 12}},
      {"amax 8: scale 2^1, 5/2 = 2.5 ties to 2", block_of({8, 5, 1, -3}), 128, {6, 4, 1, 11}},
      {"amax 7.5 clips to 6 (OCP rule)", block_of({7.5f, 6.5f, -7}), 127, {7, 7, 15}},
      {"amax 0.75: scale 2^-3", block_of({0.75f, 0.1875f}), 124, {7, 3}},
      {"bf16 subnormals: scale 2^-127", {sub_1p5_m127, min_sub, static_cast<uint16_t>(0x8000 | min_sub)}, 0, {3, 0, 8}},
      {"amax 2^-126: exponent -128 clamps to -127", {min_normal, 0x0040, 0x0020}, 0, {4, 2, 1}},
      {"zeros of both signs", block_of({0, -0.0f, 0, -0.0f}), 0, {0, 8, 0, 8}},
      {"near FLT_MAX: scale 2^125, 1 underflows to 0", block_of({3e38f, 1, -1}), 252, {7, 0, 8}},
  };
  for (const ScaleCase& c : cases) {
    std::vector<uint16_t> x = c.x;
    x.resize(32, 0);
    const Mx4 m = quantize(x, 1, 32);
    EXPECT_EQ(m.scales[0], c.scale) << c.what;
    for (int64_t k = 0; k < 32; ++k) {
      const uint32_t want = k < static_cast<int64_t>(c.codes.size()) ? c.codes[static_cast<size_t>(k)] : 0;
      EXPECT_EQ(m.code(0, k), want) << c.what << ", element " << k;
    }
  }
}

TEST(Mxfp4, NanOrInfPoisonsOnlyItsBlock) {
  // Row of 4 blocks: ordinary, NaN, +Inf, -Inf.
  std::vector<uint16_t> x(128, bf16(1.0f));
  x[40] = 0x7fc0;  // NaN
  x[70] = bf16(INFINITY);
  x[127] = bf16(-INFINITY);
  Mx4 m = quantize(x, 1, 128);
  EXPECT_EQ(m.scales, (std::vector<uint8_t>{125, 255, 255, 255}));  // 1.0: 2^(0-2)
  for (int64_t k = 0; k < 32; ++k) EXPECT_EQ(m.code(0, k), 6u);    // 1 / 2^-2 = 4
  for (int64_t k = 32; k < 128; ++k) EXPECT_EQ(m.code(0, k), 0u) << k;
  const auto out = dequant_f32(m, 1, 128);
  for (int64_t k = 0; k < 32; ++k) EXPECT_EQ(out[static_cast<size_t>(k)], bits(1.0f));
  for (int64_t k = 32; k < 128; ++k) EXPECT_EQ(out[static_cast<size_t>(k)], kF32CanonicalNan) << k;
}

TEST(Mxfp4, PartialLastBlockIsPaddedWithZero) {
  // Values from the E2M1 grid: any block of them round-trips exactly, whatever its amax.
  const float grid[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  std::vector<uint16_t> x(80);
  for (int i = 0; i < 80; ++i) x[static_cast<size_t>(i)] = bf16((i % 3 ? 1.0f : -1.0f) * grid[(i * 5) % 8]);
  const Mx4 m = quantize(x, 2, 40);  // [2, 40]: two blocks per row, the second 8 wide
  ASSERT_EQ(m.blocks.size(), 2u * 2 * 16);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t k = 40; k < 64; ++k) EXPECT_EQ(m.code(r, k), 0u);
  Mx4 copy = m;
  const auto out = dequant_f32(copy, 2, 40);
  // Every value is on the grid of its block (multiples of 0.5 up to 6): exact round trip.
  for (size_t i = 0; i < 80; ++i) EXPECT_EQ(out[i], bits(test::from_bf16(x[i]))) << i;
}

TEST(Mxfp4, DequantizesToBf16AndFp32) {
  // Scale 2^127: 6 * 2^127 overflows FP32 to +inf (a foreign scale; quantize never writes
  // more than 2^125 for MXFP4).
  std::vector<uint8_t> blocks(16, 0), scales = {254};
  blocks[0] = 0x71;  // element 0 = 0.5, element 1 = 6
  blocks[1] = 0x08;  // element 2 = -0, element 3 = +0
  std::vector<uint32_t> f(32);
  ASSERT_OK(dequantize_mxfp4(kCpu, view(blocks, DType::kU8, {1, 16}), view(scales, DType::kU8, {1}),
                             view(f, DType::kF32, {32})));
  EXPECT_EQ(f[0], bits(std::ldexp(1.0f, 126)));
  EXPECT_EQ(f[1], bits(INFINITY));
  EXPECT_EQ(f[2], bits(-0.0f));
  std::vector<uint16_t> h(32);
  scales[0] = 0;  // 2^-127: 0.5 * 2^-127 = 2^-128, exact in bf16 too
  ASSERT_OK(dequantize_mxfp4(kCpu, view(blocks, DType::kU8, {1, 16}), view(scales, DType::kU8, {1}),
                             view(h, DType::kBF16, {32})));
  EXPECT_EQ(h[0], bf16(std::ldexp(1.0f, -128)));
  EXPECT_EQ(h[1], bf16(6 * std::ldexp(1.0f, -127)));
  EXPECT_EQ(h[2], 0x8000);
}

// ---- FP32 input ----------------------------------------------------------------------------

TEST(Mxfp4, Fp32OfExactBf16IsByteIdenticalToBf16) {
  test::Rng rng(11);
  for (const auto& [rows, k] : {std::pair<int64_t, int64_t>{7, 200}, {33, 64}, {1, 5}}) {
    auto xb = test::random_bf16(rng, rows * k);
    auto xf = test::widen(xb);
    const Mx4 a = quantize(xb, rows, k), b = quantize(xf, rows, k);
    EXPECT_EQ(a.blocks, b.blocks);
    EXPECT_EQ(a.scales, b.scales);
  }
  // The same through the kernel-layout writer.
  auto xb = test::random_bf16(rng, 2 * 64 * 128);
  auto xf = test::widen(xb);
  std::vector<uint8_t> b1(2 * 64 * 64), s1(2 * 64 * 4), k1(s1.size()), b2(b1.size()), s2(s1.size()), k2(s1.size());
  for (auto order : {Mxfp4RowOrder::kPlain, Mxfp4RowOrder::kGateUpInterleaved, Mxfp4RowOrder::kGateUpConcatenated}) {
    ASSERT_OK(quantize_mxfp4_to_kernel_layout(kCpu, view(xb, DType::kBF16, {2, 64, 128}),
                                              view(b1, DType::kU8, {2, 64, 4, 16}), view(s1, DType::kU8, {2, 64, 4}),
                                              view(k1, DType::kU8, {2, 64, 4}), order));
    ASSERT_OK(quantize_mxfp4_to_kernel_layout(kCpu, view(xf, DType::kF32, {2, 64, 128}),
                                              view(b2, DType::kU8, {2, 64, 4, 16}), view(s2, DType::kU8, {2, 64, 4}),
                                              view(k2, DType::kU8, {2, 64, 4}), order));
    EXPECT_EQ(b1, b2);
    EXPECT_EQ(s1, s2);
    EXPECT_EQ(k1, k2);
  }
}

TEST(Mxfp4, Fp32IsQuantizedFromItsOwnValueNotThroughBf16) {
  // 1.2500001 is above the 1 | 1.5 tie; its bf16 rounding (1.25) is on it and goes to 1.
  std::vector<float> xf(32, 0.0f);
  xf[0] = 6.0f;
  xf[1] = 1.2500001f;
  std::vector<uint16_t> xb(32, 0);
  xb[0] = bf16(6.0f);
  xb[1] = bf16(1.2500001f);
  EXPECT_EQ(quantize(xf, 1, 32).code(0, 1), 3u);
  EXPECT_EQ(quantize(xb, 1, 32).code(0, 1), 2u);
}

TEST(Mxfp4, CanonicalBlocksRoundTripThroughDequantize) {
  // Blocks whose largest code is in E2M1's top binade (4 or 6) keep scale and codes exactly.
  test::Rng rng(5);
  const int64_t rows = 9, k = 256, nkb = k / 32;
  Mx4 m;
  m.rows = rows;
  m.blocks.resize(static_cast<size_t>(rows * nkb * 16));
  m.scales.resize(static_cast<size_t>(rows * nkb));
  for (auto& b : m.blocks) b = static_cast<uint8_t>(rng.next());
  for (int64_t blk = 0; blk < rows * nkb; ++blk) {
    m.blocks[static_cast<size_t>(blk * 16)] = static_cast<uint8_t>((m.blocks[static_cast<size_t>(blk * 16)] & 0xf0) | 0x6 | (rng.next() & 9));
    m.scales[static_cast<size_t>(blk)] = static_cast<uint8_t>(2 + rng.below(250));  // 2^-125 .. 2^124
  }
  auto f = dequant_f32(m, rows, k);
  std::vector<float> x(f.size());
  for (size_t i = 0; i < f.size(); ++i) x[i] = f32_from_bits(f[i]);
  const Mx4 again = quantize(x, rows, k);
  EXPECT_EQ(again.scales, m.scales);
  // -0 and +0 both decode to zeros that keep their sign, so the codes come back exactly.
  EXPECT_EQ(again.blocks, m.blocks);
}

TEST(Mxfp4, StridedInputMatchesContiguous) {
  // A [K, N] export read as [N, K] through a transposed view (gpt-oss BF16 is [E, H, 2I]).
  test::Rng rng(9);
  const int64_t n = 5, k = 96;
  auto kn = test::random_bf16(rng, k * n);  // row-major [K, N]
  std::vector<uint16_t> nk(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) nk[static_cast<size_t>(i * k + j)] = kn[static_cast<size_t>(j * n + i)];
  const Mx4 want = quantize(nk, n, k);
  TensorView t = view(kn, DType::kBF16, {n, k});
  t.strides = Shape{1, n};
  Mx4 got;
  got.blocks.assign(want.blocks.size(), 0);
  got.scales.assign(want.scales.size(), 0);
  ASSERT_OK(quantize_mxfp4(kCpu, t, view(got.blocks, DType::kU8, {n, 3, 16}), view(got.scales, DType::kU8, {n, 3})));
  EXPECT_EQ(got.blocks, want.blocks);
  EXPECT_EQ(got.scales, want.scales);
}

// ---- kernel layout --------------------------------------------------------------------------

// Step 4 of mxfp4.hpp's "tiled v2" from its decode formulas, bit by bit: slot q holds the
// pair of elements kSlotLow[q] and kSlotLow[q] + 4 as bf16 bits of E2M1 * 2^-126 (code bits m,
// e0, e1, sign at bf16 bits 6, 7, 8, 15, +16 for the second element), read as
// rotr(word, r) & mask.
constexpr int kSlotLow[4] = {0, 1, 3, 2};

uint32_t arranged_by_bits(uint32_t v1) {
  const int bf16_bit[4] = {6, 7, 8, 15};
  uint32_t out = 0;
  for (int q = 0; q < 4; ++q)
    for (int half = 0; half < 2; ++half) {
      const int elem = half * 4 + kSlotLow[q];
      for (int cb = 0; cb < 4; ++cb) {
        const int rot = q == 0 ? 0 : q == 1 ? 4 : q == 2 ? 10 : (cb == 0 ? 14 : 6);
        const int dst = (bf16_bit[cb] + 16 * half + rot) % 32;
        out |= ((v1 >> (4 * elem + cb)) & 1u) << dst;
      }
    }
  return out;
}

uint32_t rotr(uint32_t x, int r) { return r == 0 ? x : (x >> r) | (x << (32 - r)); }

TEST(Mxfp4Layout, WordArrangementMatchesItsDefinitionAndTheDecodeFormulas) {
  test::Rng rng(11);
  for (int i = 0; i < 20000; ++i) {
    const uint32_t v1 = i < 16 ? 0x11111111u * static_cast<uint32_t>(i) : static_cast<uint32_t>(rng.next());
    const uint32_t a = mxfp4_arrange_word(v1);
    ASSERT_EQ(a, arranged_by_bits(v1)) << std::hex << v1;
    ASSERT_EQ(mxfp4_unarrange_word(a), v1) << std::hex << v1;
    // The header's decode formulas give each element's E2M1 value * 2^-126 as bf16 bits.
    const uint32_t m = 0x81C081C0u;
    const uint32_t pairs[4] = {a & m, rotr(a, 4) & m, rotr(a, 10) & m,
                               (rotr(a, 6) & 0x81808180u) | (rotr(a, 14) & 0x00400040u)};
    for (int q = 0; q < 4; ++q)
      for (int half = 0; half < 2; ++half) {
        const uint32_t code = (v1 >> (4 * (half * 4 + kSlotLow[q]))) & 15u;
        const uint32_t want = f32_to_bf16_bits(f32_from_bits(e2m1_decode_bits(code, -126)));
        ASSERT_EQ((pairs[q] >> (16 * half)) & 0xffffu, want) << std::hex << v1 << " pair " << q;
      }
  }
  uint8_t bytes[4] = {0x10, 0x32, 0x54, 0x76};
  mxfp4_arrange_bytes(bytes, true);
  EXPECT_EQ(uint32_t{bytes[0]} | uint32_t{bytes[1]} << 8 | uint32_t{bytes[2]} << 16 | uint32_t{bytes[3]} << 24,
            arranged_by_bits(0x76543210u));
  mxfp4_arrange_bytes(bytes, false);
  EXPECT_EQ(bytes[0], 0x10);
  EXPECT_EQ(bytes[3], 0x76);
}

// mxfp4.hpp's "tiled v2" written out as loops over tiles, independently of its index helpers.
// Kernel group g holds gate rows 16g..16g+15 then the up rows of the same features.
int64_t checkpoint_row_of(int64_t kr, int64_t n, Mxfp4RowOrder order) {
  if (order == Mxfp4RowOrder::kPlain) return kr;
  const int64_t group = kr / 32, in = kr % 32;
  const bool up = in >= 16;
  const int64_t feature = group * 16 + in % 16;
  if (order == Mxfp4RowOrder::kGateUpInterleaved) return 2 * feature + (up ? 1 : 0);
  return (up ? n / 2 : 0) + feature;  // concatenated [gate; up]
}

std::vector<uint8_t> tiled_blocks(const std::vector<uint8_t>& ckpt, int64_t experts, int64_t n,
                                  int64_t row_bytes, Mxfp4RowOrder order) {
  std::vector<uint8_t> out(ckpt.size());
  const int64_t kt_n = row_bytes / 32;
  size_t o = 0;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t rt = 0; rt < n / 16; ++rt)
      for (int64_t kt = 0; kt < kt_n; ++kt)
        for (int64_t i = 0; i < 16; ++i)
          for (int64_t j = 0; j < 32; ++j)
            out[o++] = ckpt[static_cast<size_t>((e * n + checkpoint_row_of(rt * 16 + i, n, order)) * row_bytes + kt * 32 + j)];
  for (size_t w = 0; w < out.size(); w += 4) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v |= uint32_t{out[w + i]} << (8 * i);
    v = arranged_by_bits(v);
    for (size_t i = 0; i < 4; ++i) out[w + i] = static_cast<uint8_t>(v >> (8 * i));
  }
  return out;
}

std::vector<uint8_t> tiled_scales(const std::vector<uint8_t>& ckpt, int64_t experts, int64_t n,
                                  int64_t nkb, Mxfp4RowOrder order) {
  std::vector<uint8_t> out(ckpt.size());
  size_t o = 0;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t rt = 0; rt < n / 16; ++rt)
      for (int64_t kt = 0; kt < nkb / 2; ++kt)
        for (int64_t i = 0; i < 16; ++i)
          for (int64_t j = 0; j < 2; ++j)
            out[o++] = ckpt[static_cast<size_t>((e * n + checkpoint_row_of(rt * 16 + i, n, order)) * nkb + kt * 2 + j)];
  return out;
}

struct LayoutShape {
  int64_t experts, n, k;
  Mxfp4RowOrder order;
};

const LayoutShape kLayoutShapes[] = {
    {1, 16, 64, Mxfp4RowOrder::kPlain},
    {3, 48, 192, Mxfp4RowOrder::kPlain},
    {1, 32, 64, Mxfp4RowOrder::kGateUpInterleaved},
    {2, 96, 320, Mxfp4RowOrder::kGateUpInterleaved},
    {4, 64, 2880, Mxfp4RowOrder::kGateUpInterleaved},
    {1, 32, 64, Mxfp4RowOrder::kGateUpConcatenated},
    {2, 96, 320, Mxfp4RowOrder::kGateUpConcatenated},   // 6 tiles: cycles (1 2 4 3) and fixed 0, 5
    {3, 224, 128, Mxfp4RowOrder::kGateUpConcatenated},  // 14 tiles
    {2, 64, 2880, Mxfp4RowOrder::kGateUpConcatenated},
};

TEST(Mxfp4Layout, InPlaceForwardMatchesTheTiledLayoutAndInverseRestores) {
  test::Rng rng(3);
  for (const LayoutShape& s : kLayoutShapes) {
    const int64_t row_bytes = s.k / 2, nkb = s.k / 32;
    std::vector<uint8_t> data(static_cast<size_t>(s.experts * s.n * row_bytes));
    for (auto& b : data) b = static_cast<uint8_t>(rng.next());
    const std::vector<uint8_t> original = data;
    const TensorView v = view(data, DType::kFP4x2, {s.experts, s.n, nkb, 16});
    ASSERT_OK(mxfp4_blocks_to_kernel_layout(kCpu, v, s.order));
    EXPECT_EQ(data, tiled_blocks(original, s.experts, s.n, row_bytes, s.order)) << s.n << "x" << s.k;
    // An honest permutation, except where it degenerates: one K tile and no row shuffle.
    if (s.k > 64 || s.order == Mxfp4RowOrder::kGateUpInterleaved) {
      EXPECT_NE(data, original);
    }
    // The header's index helpers agree with the loops: the word holding byte b of row r, back
    // in v1 order, holds the checkpoint byte there.
    for (int64_t r = 0; r < s.n; r += 7)
      for (int64_t b = 0; b < row_bytes; b += 5) {
        uint8_t word[4];
        std::memcpy(word, &data[static_cast<size_t>(mxfp4_kernel_value_offset(r, b & ~3, s.n, row_bytes, s.order))], 4);
        mxfp4_arrange_bytes(word, false);
        EXPECT_EQ(word[b & 3], original[static_cast<size_t>(r * row_bytes + b)]);
      }
    ASSERT_OK(mxfp4_blocks_to_checkpoint_layout(kCpu, v, s.order));
    EXPECT_EQ(data, original) << "restore after postprocess is the identity";
  }
}

TEST(Mxfp4Layout, ForwardTwiceIsNotTheIdentity) {
  // The registry must track which layout is live: postprocess is never idempotent.
  std::vector<uint8_t> data(32 * 32);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + i / 32);
  const auto original = data;
  const TensorView v = view(data, DType::kU8, {32, 2, 16});
  ASSERT_OK(mxfp4_blocks_to_kernel_layout(kCpu, v, Mxfp4RowOrder::kGateUpInterleaved));
  const auto once = data;
  ASSERT_OK(mxfp4_blocks_to_kernel_layout(kCpu, v, Mxfp4RowOrder::kGateUpInterleaved));
  EXPECT_NE(data, once);
  EXPECT_NE(data, original);
}

TEST(Mxfp4Layout, KernelScalesAreACopyAndCheckpointScalesStayUntouched) {
  test::Rng rng(4);
  for (const LayoutShape& s : kLayoutShapes) {
    const int64_t nkb = s.k / 32;
    std::vector<uint8_t> scales(static_cast<size_t>(s.experts * s.n * nkb));
    for (auto& b : scales) b = static_cast<uint8_t>(rng.next());
    const auto before = scales;
    std::vector<uint8_t> kernel(scales.size(), 0xCD), back(scales.size(), 0xCD);
    ASSERT_OK(mxfp4_scales_to_kernel_layout(kCpu, view(scales, DType::kE8M0, {s.experts, s.n, nkb}),
                                            view(kernel, DType::kE8M0, {s.experts, s.n, nkb}), s.order));
    EXPECT_EQ(scales, before);
    EXPECT_EQ(kernel, tiled_scales(scales, s.experts, s.n, nkb, s.order));
    ASSERT_OK(mxfp4_scales_to_checkpoint_layout(kCpu, view(kernel, DType::kU8, {s.experts, s.n, nkb}),
                                                view(back, DType::kU8, {s.experts, s.n, nkb}), s.order));
    EXPECT_EQ(back, scales);
  }
}

TEST(Mxfp4Layout, QuantizeToKernelLayoutEqualsQuantizeThenPermute) {
  test::Rng rng(6);
  for (const LayoutShape& s : kLayoutShapes) {
    if (s.k > 1024) continue;
    const int64_t nkb = s.k / 32, rows = s.experts * s.n;
    auto x = test::random_bf16(rng, rows * s.k);
    Mx4 ref = quantize(x, rows, s.k);
    ASSERT_OK(mxfp4_blocks_to_kernel_layout(kCpu, view(ref.blocks, DType::kU8, {s.experts, s.n, nkb, 16}), s.order));
    std::vector<uint8_t> ref_kscales(ref.scales.size());
    ASSERT_OK(mxfp4_scales_to_kernel_layout(kCpu, view(ref.scales, DType::kU8, {s.experts, s.n, nkb}),
                                            view(ref_kscales, DType::kU8, {s.experts, s.n, nkb}), s.order));
    std::vector<uint8_t> blocks(ref.blocks.size(), 0xCD), scales(ref.scales.size(), 0xCD), kscales(ref.scales.size(), 0xCD);
    ASSERT_OK(quantize_mxfp4_to_kernel_layout(kCpu, view(x, DType::kBF16, {s.experts, s.n, s.k}),
                                              view(blocks, DType::kFP4x2, {s.experts, s.n, nkb, 16}),
                                              view(scales, DType::kE8M0, {s.experts, s.n, nkb}),
                                              view(kscales, DType::kE8M0, {s.experts, s.n, nkb}), s.order));
    EXPECT_EQ(blocks, ref.blocks);
    EXPECT_EQ(scales, ref.scales);
    EXPECT_EQ(kscales, ref_kscales);
  }
}

// ---- argument checks --------------------------------------------------------------------------

TEST(Mxfp4Errors, BadViewsAreRejectedBeforeAnyWrite) {
  std::vector<uint16_t> x(2 * 64, bf16(1.0f));
  std::vector<uint8_t> blocks(2 * 2 * 16, 0xCD), scales(4, 0xCD);
  const auto xv = view(x, DType::kBF16, {2, 64});
  const auto bv = view(blocks, DType::kU8, {2, 2, 16});
  const auto sv = view(scales, DType::kU8, {2, 2});
  EXPECT_STATUS(quantize_mxfp4(kCpu, view(x, DType::kF16, {2, 64}), bv, sv), ErrorCode::kInvalidArgument, "x");
  EXPECT_STATUS(quantize_mxfp4(kCpu, xv, view(blocks, DType::kI8, {2, 2, 16}), sv), ErrorCode::kInvalidArgument, "blocks");
  EXPECT_STATUS(quantize_mxfp4(kCpu, xv, view(blocks, DType::kF8E4M3, {2, 2, 16}), sv), ErrorCode::kInvalidArgument, "blocks");
  EXPECT_STATUS(quantize_mxfp4(kCpu, xv, view(blocks, DType::kU8, {2, 32}), sv), ErrorCode::kInvalidArgument, "blocks");
  EXPECT_STATUS(quantize_mxfp4(kCpu, xv, bv, view(scales, DType::kU8, {4})), ErrorCode::kInvalidArgument, "scales");
  EXPECT_STATUS(quantize_mxfp4(kCpu, xv, bv, view(scales, DType::kI8, {2, 2})), ErrorCode::kInvalidArgument, "scales");
  TensorView strided = bv;
  strided.strides = Shape{16, 32, 1};
  EXPECT_STATUS(quantize_mxfp4(kCpu, xv, strided, sv), ErrorCode::kInvalidArgument, "blocks");
  EXPECT_STATUS(quantize_mxfp4(kCpu, view(x, DType::kBF16, {2, 64}, Device::cuda(0)), bv, sv),
                ErrorCode::kInvalidArgument, "x");
  TensorView null_x = xv;
  null_x.data = nullptr;
  EXPECT_STATUS(quantize_mxfp4(kCpu, null_x, bv, sv), ErrorCode::kInvalidArgument, "x");
  EXPECT_STATUS(quantize_mxfp4(kCpu, xv, bv, TensorView{}), ErrorCode::kInvalidArgument, "scales");
  const Status st = quantize_mxfp4(kCpu, xv, view(blocks, DType::kI8, {2, 2, 16}), sv);
  EXPECT_NE(st.message().find("signed"), std::string::npos) << st.message();
  EXPECT_EQ(blocks, std::vector<uint8_t>(blocks.size(), 0xCD));
  EXPECT_EQ(scales, std::vector<uint8_t>(scales.size(), 0xCD));
  // Dequantize: the output's K decides the block count.
  std::vector<float> out(2 * 64);
  EXPECT_STATUS(dequantize_mxfp4(kCpu, bv, sv, view(out, DType::kF32, {2, 65})), ErrorCode::kInvalidArgument, "blocks");
  EXPECT_STATUS(dequantize_mxfp4(kCpu, bv, sv, view(out, DType::kI32, {2, 64})), ErrorCode::kInvalidArgument, "out");
}

TEST(Mxfp4Errors, LayoutShapeRules) {
  std::vector<uint8_t> b(2 * 32 * 4 * 16, 0xCD);
  const auto untouched = b;
  EXPECT_STATUS(mxfp4_blocks_to_kernel_layout(kCpu, view(b, DType::kU8, {64, 3, 16}), Mxfp4RowOrder::kPlain),
                ErrorCode::kInvalidArgument, "blocks");  // K = 96: not a multiple of 64
  EXPECT_STATUS(mxfp4_blocks_to_kernel_layout(kCpu, view(b, DType::kU8, {48, 4, 16}), Mxfp4RowOrder::kGateUpInterleaved),
                ErrorCode::kInvalidArgument, "blocks");  // N = 48: not a multiple of 32
  EXPECT_STATUS(mxfp4_blocks_to_kernel_layout(kCpu, view(b, DType::kU8, {48, 4, 16}), Mxfp4RowOrder::kGateUpConcatenated),
                ErrorCode::kInvalidArgument, "blocks");
  EXPECT_STATUS(mxfp4_blocks_to_kernel_layout(kCpu, view(b, DType::kU8, {8, 16, 16}), Mxfp4RowOrder::kPlain),
                ErrorCode::kInvalidArgument, "blocks");  // N = 8
  EXPECT_STATUS(mxfp4_blocks_to_kernel_layout(kCpu, view(b, DType::kU8, {64, 64}), Mxfp4RowOrder::kPlain),
                ErrorCode::kInvalidArgument, "blocks");  // rank 2
  EXPECT_STATUS(mxfp4_blocks_to_kernel_layout(kCpu, view(b, DType::kI8, {64, 2, 16}), Mxfp4RowOrder::kPlain),
                ErrorCode::kInvalidArgument, "blocks");
  EXPECT_STATUS(mxfp4_blocks_to_kernel_layout(kCpu, view(b, DType::kU8, {64, 2, 16}), static_cast<Mxfp4RowOrder>(7)),
                ErrorCode::kInvalidArgument, "order");
  EXPECT_EQ(b, untouched);
  // Scale copies: same shape, no overlap.
  std::vector<uint8_t> s(64 * 4), k(64 * 4);
  EXPECT_STATUS(mxfp4_scales_to_kernel_layout(kCpu, view(s, DType::kU8, {64, 4}), view(s, DType::kU8, {64, 4}),
                                              Mxfp4RowOrder::kPlain),
                ErrorCode::kInvalidArgument, "kernel_scales");
  EXPECT_STATUS(mxfp4_scales_to_kernel_layout(kCpu, view(s, DType::kU8, {64, 4}), view(k, DType::kU8, {32, 8}),
                                              Mxfp4RowOrder::kPlain),
                ErrorCode::kInvalidArgument, "kernel_scales");
  EXPECT_STATUS(mxfp4_scales_to_checkpoint_layout(kCpu, view(s, DType::kU8, {64, 3}), view(k, DType::kU8, {64, 3}),
                                                  Mxfp4RowOrder::kPlain),
                ErrorCode::kInvalidArgument, "kernel_scales");
  // The one-pass writer refuses kernel scales aliasing the checkpoint scales.
  std::vector<uint16_t> x(64 * 128, 0);
  EXPECT_STATUS(quantize_mxfp4_to_kernel_layout(kCpu, view(x, DType::kBF16, {64, 128}), view(b, DType::kU8, {64, 4, 16}),
                                                view(s, DType::kU8, {64, 4}), view(s, DType::kU8, {64, 4}),
                                                Mxfp4RowOrder::kPlain),
                ErrorCode::kInvalidArgument, "kernel_scales");
  EXPECT_STATUS(quantize_mxfp4_to_kernel_layout(kCpu, view(x, DType::kBF16, {8192}), view(b, DType::kU8, {256, 16}),
                                                view(s, DType::kU8, {256}), view(k, DType::kU8, {256}),
                                                Mxfp4RowOrder::kPlain),
                ErrorCode::kInvalidArgument, "x");  // needs [.., N, K]
}

TEST(Mxfp4Errors, CudaContextWithoutCudaBuild) {
  if (cuda_backend() != nullptr) GTEST_SKIP() << "CUDA backend built: covered by quant_parity_test";
  std::vector<uint16_t> x(32);
  std::vector<uint8_t> b(16), s(1);
  const ExecContext gpu{Device::cuda(0), nullptr};
  EXPECT_STATUS(quantize_mxfp4(gpu, view(x, DType::kBF16, {32}, Device::cuda(0)),
                               view(b, DType::kU8, {1, 16}, Device::cuda(0)), view(s, DType::kU8, {1}, Device::cuda(0))),
                ErrorCode::kUnimplemented, "ctx.device");
}

TEST(Mxfp4, EmptyTensorsAreFine) {
  std::vector<uint16_t> x;
  std::vector<uint8_t> b, s;
  ASSERT_OK(quantize_mxfp4(kCpu, view(x, DType::kBF16, {0, 64}), view(b, DType::kU8, {0, 2, 16}), view(s, DType::kU8, {0, 2})));
  ASSERT_OK(quantize_mxfp4(kCpu, view(x, DType::kBF16, {3, 0}), view(b, DType::kU8, {3, 0, 16}), view(s, DType::kU8, {3, 0})));
  ASSERT_OK(mxfp4_blocks_to_kernel_layout(kCpu, view(b, DType::kU8, {0, 16, 2, 16}), Mxfp4RowOrder::kPlain));
}

}  // namespace
}  // namespace rolloutd::quant
