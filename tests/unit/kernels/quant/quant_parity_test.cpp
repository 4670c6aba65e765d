// CUDA against the CPU reference, bit for bit, for every quantization op: random heavy-tailed
// inputs of shapes that are and are not multiples of the blocks, BF16 and FP32, contiguous,
// transposed and misaligned inputs (the vector and the per-element paths of each kernel), the
// in-place layout permutation and its inverse on device memory. Outputs start poisoned on
// both sides, so a byte one backend forgets to write differs from the other's.
//
// Skips itself without a CUDA build or a visible GPU (label `gpu`).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/quant/quant_ops.hpp"
#include "tests/unit/kernels/quant/quant_test_util.hpp"

namespace rolloutd::quant {
namespace {

using test::Arena;
using Outputs = std::vector<std::vector<uint8_t>>;

uint64_t seed_of(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

struct ParityCase {
  std::string name;
  std::function<Outputs(Arena&, test::Rng&)> run;
};
void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.name; }

std::vector<ParityCase>& registry() {
  static std::vector<ParityCase> r;
  return r;
}
void reg(std::string name, std::function<Outputs(Arena&, test::Rng&)> run) {
  registry().push_back({std::move(name), std::move(run)});
}

std::string shape_name(const Shape& s) {
  std::string n;
  for (int i = 0; i < s.rank(); ++i) n += (i ? "x" : "") + std::to_string(s[i]);
  return n;
}

#define RUN_OK(expr)                                    \
  do {                                                  \
    const ::rolloutd::Status st_ = (expr);              \
    EXPECT_TRUE(st_.ok()) << st_.to_string();           \
  } while (0)

enum class Input { kContiguous, kTransposed, kMisaligned };
const char* input_name(Input i) {
  return i == Input::kContiguous ? "" : (i == Input::kTransposed ? "_transposed" : "_misaligned");
}

// A random input of `shape` (bf16 or f32) laid out as asked.
TensorView make_input(Arena& a, test::Rng& rng, DType dt, Shape shape, Input how) {
  const int64_t n = shape.numel();
  std::vector<uint8_t> bytes(static_cast<size_t>(n) * dtype_size(dt));
  for (int64_t i = 0; i < n; ++i) {
    const float v = rng.heavy();
    if (dt == DType::kBF16) {
      const uint16_t b = test::bf16(v);
      std::memcpy(bytes.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    }
  }
  if (how == Input::kMisaligned) return a.make(dt, shape, bytes.data(), dtype_size(dt));
  TensorView v = a.make(dt, shape, bytes.data());
  if (how == Input::kTransposed) {  // storage [.., K, N] read as [.., N, K]
    const int r = shape.rank();
    const int64_t rows = shape[r - 2];
    v.strides[r - 2] = 1;
    v.strides[r - 1] = rows;
  }
  return v;
}

Shape with_last(Shape s, std::initializer_list<int64_t> tail, int drop = 1) {
  int64_t d[kMaxDims];
  int n = 0;
  for (int i = 0; i < s.rank() - drop; ++i) d[n++] = s[i];
  for (int64_t t : tail) d[n++] = t;
  return Shape::of(d, n);
}

void mx_cases() {
  const Shape shapes[] = {{1, 32}, {3, 40}, {7, 200}, {2, 3, 96}, {5, 7}, {64, 2880}, {1, 1}, {33, 1000}};
  for (const bool fp4 : {true, false}) {
    for (const DType dt : {DType::kBF16, DType::kF32}) {
      for (const Shape& s : shapes) {
        for (const Input how : {Input::kContiguous, Input::kTransposed, Input::kMisaligned}) {
          if (how == Input::kTransposed && s.rank() < 2) continue;
          const std::string name = std::string(fp4 ? "mxfp4" : "mxfp8") + "_" + (dt == DType::kBF16 ? "bf16" : "f32") +
                                   "_" + shape_name(s) + input_name(how);
          reg(name, [=](Arena& a, test::Rng& rng) {
            const TensorView x = make_input(a, rng, dt, s, how);
            const int64_t k = s[s.rank() - 1], nkb = test::ceil_div(k, 32);
            const TensorView q = fp4 ? a.make(DType::kU8, with_last(s, {nkb, 16})) : a.make(DType::kF8E4M3, s);
            const TensorView sc = a.make(DType::kE8M0, with_last(s, {nkb}));
            RUN_OK(fp4 ? quantize_mxfp4(a.ctx(), x, q, sc) : quantize_mxfp8(a.ctx(), x, q, sc));
            const TensorView d16 = a.make(DType::kBF16, s), d32 = a.make(DType::kF32, s);
            RUN_OK(fp4 ? dequantize_mxfp4(a.ctx(), q, sc, d16) : dequantize_mxfp8(a.ctx(), q, sc, d16));
            RUN_OK(fp4 ? dequantize_mxfp4(a.ctx(), q, sc, d32) : dequantize_mxfp8(a.ctx(), q, sc, d32));
            return Outputs{a.read(q), a.read(sc), a.read(d16), a.read(d32)};
          });
        }
      }
    }
  }
  // MXFP8 over every bf16 bit pattern (as bf16, and as f32 with random low bits below them), at
  // several places under its block's scale: blocks of 31 consecutive patterns led by an element
  // 2^k times their largest magnitude, so that the patterns of that magnitude's binade land in
  // [2^(8-k), 2^(9-k)) on the E4M3 grid: k = 0 saturates at 448, 1, 4 and 8 are normals, 15, 16
  // and 17 the three subnormal binades, 18 the ties between 0, 2^-10 and 2^-9, 19 rounds to zero.
  // The grid's points and midpoints are bf16 values, so every tie is here. A leader that
  // overflows (Inf: a poisoned block) and the NaN patterns are cases too.
  // The hardware conversions of e4m3_cuda.cuh against minifloat.hpp's integer codecs, bit for bit.
  for (const DType dt : {DType::kBF16, DType::kF32}) {
    reg(std::string("mxfp8_every_bf16_") + (dt == DType::kBF16 ? "bf16" : "f32"), [=](Arena& a, test::Rng& rng) {
      const int ks[] = {0, 1, 4, 8, 15, 16, 17, 18, 19};
      const int64_t per = 31, chunks = (65536 + per - 1) / per, nk = sizeof(ks) / sizeof(ks[0]);
      const int64_t rows = chunks * nk;
      std::vector<float> vals(static_cast<size_t>(rows * 32), 0.0f);
      for (int64_t kc = 0; kc < nk; ++kc)
        for (int64_t c = 0; c < chunks; ++c) {
          float* blk = vals.data() + (kc * chunks + c) * 32;
          float amax = 0.0f;
          for (int64_t j = 0; j < per; ++j) {
            const int64_t pat = c * per + j;
            if (pat >= 65536) break;
            uint32_t bits = static_cast<uint32_t>(pat) << 16;
            if (dt == DType::kF32 && (bits & 0x7f800000u) != 0x7f800000u) bits |= rng.next() & 0xffffu;
            float v;
            std::memcpy(&v, &bits, 4);
            blk[1 + j] = v;
            if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
          }
          blk[0] = std::ldexp(amax, ks[kc]);
        }
      const Shape s{rows, 32};
      TensorView x;
      if (dt == DType::kBF16) {
        std::vector<uint16_t> b(vals.size());
        for (size_t i = 0; i < vals.size(); ++i) {
          uint32_t u;
          std::memcpy(&u, &vals[i], 4);
          b[i] = static_cast<uint16_t>(u >> 16);  // the patterns themselves (no rounding: exact)
        }
        x = a.make(dt, s, b);
      } else {
        x = a.make(dt, s, vals);
      }
      const TensorView q = a.make(DType::kF8E4M3, s), sc = a.make(DType::kE8M0, {rows, 1});
      RUN_OK(quantize_mxfp8(a.ctx(), x, q, sc));
      const TensorView d16 = a.make(DType::kBF16, s), d32 = a.make(DType::kF32, s);
      RUN_OK(dequantize_mxfp8(a.ctx(), q, sc, d16));
      RUN_OK(dequantize_mxfp8(a.ctx(), q, sc, d32));
      return Outputs{a.read(q), a.read(sc), a.read(d16), a.read(d32)};
    });
  }
  // Dequantization of arbitrary bytes: NaN scales, NaN E4M3 codes, the extreme scales.
  for (const bool fp4 : {true, false}) {
    reg(std::string("dequant_random_bytes_") + (fp4 ? "mxfp4" : "mxfp8"), [=](Arena& a, test::Rng& rng) {
      const int64_t rows = 37, k = 300, nkb = 10;
      std::vector<uint8_t> q(static_cast<size_t>(fp4 ? rows * nkb * 16 : rows * k)), sc(static_cast<size_t>(rows * nkb));
      for (auto& b : q) b = static_cast<uint8_t>(rng.next());
      for (auto& b : sc) b = static_cast<uint8_t>(rng.next());
      sc[0] = 255, sc[1] = 254, sc[2] = 0;
      const TensorView qv = fp4 ? a.make(DType::kFP4x2, {rows, nkb, 16}, q) : a.make(DType::kF8E4M3, {rows, k}, q);
      const TensorView sv = a.make(DType::kE8M0, {rows, nkb}, sc);
      const TensorView d16 = a.make(DType::kBF16, {rows, k}), d32 = a.make(DType::kF32, {rows, k});
      RUN_OK(fp4 ? dequantize_mxfp4(a.ctx(), qv, sv, d16) : dequantize_mxfp8(a.ctx(), qv, sv, d16));
      RUN_OK(fp4 ? dequantize_mxfp4(a.ctx(), qv, sv, d32) : dequantize_mxfp8(a.ctx(), qv, sv, d32));
      return Outputs{a.read(d16), a.read(d32)};
    });
  }
}

struct LayoutShape {
  int64_t e, n, k;
  Mxfp4RowOrder order;
};
const LayoutShape kLayoutShapes[] = {
    {1, 16, 64, Mxfp4RowOrder::kPlain},
    {3, 48, 192, Mxfp4RowOrder::kPlain},
    {1, 32, 64, Mxfp4RowOrder::kGateUpInterleaved},
    {2, 64, 2880, Mxfp4RowOrder::kGateUpInterleaved},
    {2, 96, 7168, Mxfp4RowOrder::kGateUpInterleaved},  // DeepSeek-V3 hidden size: 112 KiB groups
    {1, 32, 64, Mxfp4RowOrder::kGateUpConcatenated},
    {3, 224, 128, Mxfp4RowOrder::kGateUpConcatenated},
    {2, 320, 2880, Mxfp4RowOrder::kGateUpConcatenated},
    {1, 64, 7168, Mxfp4RowOrder::kGateUpConcatenated},
};

std::string layout_name(const LayoutShape& s) {
  return std::to_string(s.e) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k) +
         (s.order == Mxfp4RowOrder::kPlain
              ? "_plain"
              : (s.order == Mxfp4RowOrder::kGateUpInterleaved ? "_gate_up_interleaved" : "_gate_up_concat"));
}

void layout_cases() {
  for (const LayoutShape& s : kLayoutShapes) {
    const int64_t nkb = s.k / 32;
    for (const DType dt : {DType::kBF16, DType::kF32}) {
      reg(std::string("mxfp4_kernel_layout_quantize_") + (dt == DType::kBF16 ? "bf16_" : "f32_") + layout_name(s),
          [=](Arena& a, test::Rng& rng) {
            const TensorView x = make_input(a, rng, dt, {s.e, s.n, s.k}, Input::kContiguous);
            const TensorView b = a.make(DType::kU8, {s.e, s.n, nkb, 16});
            const TensorView sc = a.make(DType::kU8, {s.e, s.n, nkb}), ks = a.make(DType::kU8, {s.e, s.n, nkb});
            RUN_OK(quantize_mxfp4_to_kernel_layout(a.ctx(), x, b, sc, ks, s.order));
            return Outputs{a.read(b), a.read(sc), a.read(ks)};
          });
    }
    for (const size_t offset : {size_t{0}, size_t{1}}) {  // 1: a misaligned base, byte chunks
      reg("mxfp4_layout_in_place_" + layout_name(s) + (offset ? "_misaligned" : ""), [=](Arena& a, test::Rng& rng) {
        std::vector<uint8_t> data(static_cast<size_t>(s.e * s.n * s.k / 2));
        for (auto& b : data) b = static_cast<uint8_t>(rng.next());
        const TensorView v = a.make(DType::kFP4x2, {s.e, s.n, nkb, 16}, data.data(), offset);
        RUN_OK(mxfp4_blocks_to_kernel_layout(a.ctx(), v, s.order));
        const auto kernel = a.read(v);
        RUN_OK(mxfp4_blocks_to_checkpoint_layout(a.ctx(), v, s.order));
        const auto back = a.read(v);
        EXPECT_EQ(back, data) << "inverse after forward must restore the checkpoint layout";
        std::vector<uint8_t> sc(static_cast<size_t>(s.e * s.n * nkb));
        for (auto& b : sc) b = static_cast<uint8_t>(rng.next());
        const TensorView sv = a.make(DType::kE8M0, {s.e, s.n, nkb}, sc), kv = a.make(DType::kE8M0, {s.e, s.n, nkb});
        const TensorView bv = a.make(DType::kE8M0, {s.e, s.n, nkb});
        RUN_OK(mxfp4_scales_to_kernel_layout(a.ctx(), sv, kv, s.order));
        RUN_OK(mxfp4_scales_to_checkpoint_layout(a.ctx(), kv, bv, s.order));
        EXPECT_EQ(a.read(bv), sc);
        return Outputs{kernel, back, a.read(kv), a.read(sv)};
      });
    }
  }
}

void fp8_cases() {
  struct P {
    Fp8ScaleBlock block;
    Shape shape;
  };
  const P ps[] = {
      {Fp8ScaleBlock::k1x128, {1, 1}},        {Fp8ScaleBlock::k1x128, {5, 130}},
      {Fp8ScaleBlock::k1x128, {3, 300}},      {Fp8ScaleBlock::k1x128, {2, 3, 256}},
      {Fp8ScaleBlock::k1x128, {17, 1000}},    {Fp8ScaleBlock::k1x128, {4, 7}},
      {Fp8ScaleBlock::k1x128, {64, 7168}},    {Fp8ScaleBlock::k128x128, {130, 260}},
      {Fp8ScaleBlock::k128x128, {2, 129, 7}}, {Fp8ScaleBlock::k128x128, {257, 1000}},
      {Fp8ScaleBlock::k128x128, {128, 128}},  {Fp8ScaleBlock::k128x128, {1, 5}},
      {Fp8ScaleBlock::k128x128, {3, 256, 384}},
  };
  for (const P& p : ps) {
    for (const DType dt : {DType::kBF16, DType::kF32}) {
      for (const Input how : {Input::kContiguous, Input::kTransposed, Input::kMisaligned}) {
        const std::string name = std::string(p.block == Fp8ScaleBlock::k1x128 ? "fp8_1x128_" : "fp8_128x128_") +
                                 (dt == DType::kBF16 ? "bf16_" : "f32_") + shape_name(p.shape) + input_name(how);
        reg(name, [=](Arena& a, test::Rng& rng) {
          const Shape s = p.shape;
          const int r = s.rank();
          const int64_t nkb = test::ceil_div(s[r - 1], 128), words = test::ceil_div(nkb, 4);
          const bool w = p.block == Fp8ScaleBlock::k128x128;
          const Shape ss = w ? with_last(s, {test::ceil_div(s[r - 2], 128), nkb}, 2) : with_last(s, {nkb});
          const Shape ps_ = w ? with_last(s, {test::ceil_div(s[r - 2], 128), words}, 2) : with_last(s, {words});
          const TensorView x = make_input(a, rng, dt, s, how);
          const TensorView q = a.make(DType::kF8E4M3, s), sc = a.make(DType::kF32, ss), pk = a.make(DType::kI32, ps_);
          RUN_OK(quantize_fp8_blockwise(a.ctx(), x, p.block, q, sc, pk));
          const TensorView d1 = a.make(DType::kBF16, s), d2 = a.make(DType::kF32, s);
          RUN_OK(dequantize_fp8_blockwise(a.ctx(), q, sc, p.block, d1));
          RUN_OK(dequantize_fp8_blockwise(a.ctx(), q, pk, p.block, d2));
          return Outputs{a.read(q), a.read(sc), a.read(pk), a.read(d1), a.read(d2)};
        });
      }
    }
  }
  // FP32 scales that are not powers of two (a caller's own), NaN and Inf included: one
  // correctly rounded multiply on both sides.
  reg("fp8_dequant_foreign_f32_scales", [](Arena& a, test::Rng& rng) {
    const int64_t rows = 140, k = 300;
    std::vector<uint8_t> q(static_cast<size_t>(rows * k));
    for (auto& b : q) b = static_cast<uint8_t>(rng.next());
    std::vector<float> sc(2 * 3);
    for (auto& f : sc) f = rng.heavy();
    sc[0] = NAN, sc[1] = INFINITY, sc[2] = std::ldexp(1.0f, -140);
    const TensorView qv = a.make(DType::kF8E4M3, {rows, k}, q), sv = a.make(DType::kF32, {2, 3}, sc);
    const TensorView d1 = a.make(DType::kF32, {rows, k}), d2 = a.make(DType::kBF16, {rows, k});
    RUN_OK(dequantize_fp8_blockwise(a.ctx(), qv, sv, Fp8ScaleBlock::k128x128, d1));
    RUN_OK(dequantize_fp8_blockwise(a.ctx(), qv, sv, Fp8ScaleBlock::k128x128, d2));
    return Outputs{a.read(d1), a.read(d2)};
  });
}

const std::vector<ParityCase>& all_cases() {
  static const bool once = [] {
    mx_cases();
    layout_cases();
    fp8_cases();
    return true;
  }();
  (void)once;
  return registry();
}

class QuantParity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(QuantParity, CpuReferenceIsDeterministic) {
  const ParityCase& c = GetParam();
  Arena a1(false), a2(false);
  test::Rng r1(seed_of(c.name)), r2(seed_of(c.name));
  EXPECT_EQ(c.run(a1, r1), c.run(a2, r2));
}

TEST_P(QuantParity, CudaMatchesCpuBitForBit) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const ParityCase& c = GetParam();
  Arena cpu(false), gpu(true);
  test::Rng r1(seed_of(c.name)), r2(seed_of(c.name));
  const Outputs want = c.run(cpu, r1), got = c.run(gpu, r2);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const std::string d = test::diff(got[i], want[i]);
    EXPECT_TRUE(d.empty()) << "output " << i << ": " << d;
  }
}

INSTANTIATE_TEST_SUITE_P(AllOps, QuantParity, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<ParityCase>& info) { return info.param.name; });

TEST(QuantCuda, HostViewOnCudaContextIsRefused) {
  if (cuda_backend() == nullptr) GTEST_SKIP() << "CUDA backend not built";
  // Validation happens before any CUDA call: no GPU needed.
  std::vector<uint16_t> x(64);
  std::vector<uint8_t> b(32), s(2);
  const ExecContext gpu{Device::cuda(0), nullptr};
  const Status st = quantize_mxfp4(gpu, test::view(x, DType::kBF16, {64}), test::view(b, DType::kU8, {2, 16}),
                                   test::view(s, DType::kU8, {2}));
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument) << st.to_string();
  EXPECT_EQ(st.field(), "x");
  const Status st2 = mxfp4_blocks_to_kernel_layout(gpu, test::view(b, DType::kU8, {16, 2, 16}), Mxfp4RowOrder::kPlain);
  EXPECT_EQ(st2.field(), "blocks") << st2.to_string();
}

}  // namespace
}  // namespace rolloutd::quant
