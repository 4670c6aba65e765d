// CUDA twins of cpu_quant.cpp, bit-exact with it (quant_parity_test.cpp). What differs from the
// reference is how the work is spread and how an element is encoded:
// - Elements travel in chunks of 8 consecutive ones of a row (one 16-byte load of bf16, two of
//   f32). A "lane" (one thread's share of one block) owns two chunks of its block, chosen so
//   that each load instruction of a warp reads whole 32-byte sectors; every load of a thread
//   is issued before the first is used.
// - MX quantize: two lanes per 32-element block (chunks h and h + 2), amax combined with one
//   shuffle; after encoding the two lanes swap one chunk so each stores 8 contiguous bytes
//   (MXFP4, straight into the kernel layout when asked: 8 bytes never straddle a 32-byte tile
//   row) or 16 (MXFP8).
// - UE8M0 FP8, 1 x 128: eight lanes per block (chunks s and s + 8), three shuffles. 128 x 128:
//   one 256-thread CTA per block holding its 16,384 elements in registers (packed as loaded)
//   between the amax and the encode, so the input is read from DRAM once.
// - Element codecs: E4M3 by the hardware conversion of x * 2^-se, E2M1 by rounding through an
//   addition (bf16 pairs, or f32); both proven equal to minifloat.hpp's round_to_code below.
// - The common case (contiguous, 16-byte aligned, whole blocks) indexes without division; any
//   other input (strided, K not a multiple of the block, misaligned) takes the generic path of
//   the same kernels: 64-bit row/block arithmetic and per-element loads where needed.
// - The in-place MXFP4 layout permutation: one CTA per closed group of 16 or 32 rows, staged
//   through shared memory (the group is the only extra storage); for concatenated gate/up,
//   one CTA per cycle of 16-row tiles, two tiles of shared memory.
// - Dequantization and the scale copies: one thread per output element (not on a hot path).
//
// Predict, change, measure (tests/bench/quant/quant_bench.cu on an H200, 4 GiB of bf16 in; the
// same run's device copy moves 4.2 TB/s read + write). Before: 0.21-0.29 x copy, ~400 G
// elements/s, i.e. ~80 lane instructions per element at the chip's ~33 T/s: instruction-bound
// (per-element integer encoders, a 64-bit division per lane). Issue 4 asks >= 0.7 x copy, which
// for MXFP4 is 1.16 T elements/s, a budget of ~29 instructions per element at full issue.
// Counts below are per element, bf16 input, from the PTX of this file:
//  1. E4M3: FMUL by the exact power of two 2^-se, then cvt.rn.satfinite.e4m3x2.f32 per pair:
//     ~30 -> ~3 instructions. Predicted MXFP8 and both UE8M0 FP8 ops memory-bound.
//  2. E2M1 on bf16 pairs: y = min(|x| 2^-se, 6) and one fma em*64 + y (em = max(2^floor(log2 y),
//     1)) rounds y onto the E2M1 grid in one IEEE rounding; code from the bits: ~35 -> ~6.
//  3. Index math: no 64-bit division on the common path (linear offsets; a 32-bit
//     multiply-high division for the kernel layout's row): ~5 -> < 1.
//  4. Loads: whole sectors per instruction and 64 bytes in flight per thread (was 32, in half
//     sectors). The whole bf16 MXFP4 kernel is ~440 PTX instructions per 32 elements (~14 per
//     element with every per-lane cost, SASS fewer after fusion): ~40% of issue at 0.7 x copy,
//     so DRAM, not issue, should bound it.
//  Predicted (x copy): MXFP4 checkpoint 0.26 -> 0.75-0.85, kernel layout 0.23 -> 0.7-0.8,
//  MXFP8 0.29 -> 0.75-0.85, UE8M0 1 x 128 0.26 -> 0.75-0.85, 128 x 128 0.21 -> 0.7-0.8 (one
//  barrier per tile; 4 CTAs per SM now that the tile stays packed in 32 registers).
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/quant/e4m3_cuda.cuh"
#include "kernels/quant/quant_plan.hpp"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "cuda_quant.cu needs sm_90: cvt.rn.satfinite.e4m3x2.f32 (sm_89) and mul.rn.bf16x2 (sm_90)"
#endif

namespace rolloutd::quant::detail {
namespace {

using cuda::blocks_for;
using cuda::DeviceGuard;
using cuda::stream_of;

constexpr int kThreads = 256;
constexpr int kLayoutThreads = 512;
constexpr int kLaneIters = 2;  // lanes per thread in the quantize kernels: 4 chunks in flight

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// ---- index arithmetic ---------------------------------------------------------------------

// n / d for every 32-bit n with one multiply-high (Granlund & Montgomery 1994, the round-up
// multiplier 2^32 + mul with shift = ceil(log2 d); exact for every n < 2^32, d >= 1).
struct FastDiv {
  uint32_t d = 1, mul = 1, shift = 0;
  static FastDiv of(uint32_t d) {
    FastDiv f;
    f.d = d;
    while ((uint64_t{1} << f.shift) < d) ++f.shift;
    f.mul = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d)) / d + 1);
    return f;
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(__umulhi(n, mul)) + n) >> shift);
  }
};

// mxfp4.hpp's kernel-layout positions in 32-bit arithmetic, for one expert matrix of fewer
// than 2^31 bytes (the host checks): kernel row of checkpoint row r, then the byte offset of
// row byte b (b % 8 == 0 here) and of the scale of block kb. Mirrors mxfp4_kernel_row /
// _value_offset / _scale_offset; quant_parity_test holds the two together.
__device__ __forceinline__ uint32_t kernel_row_u32(uint32_t r, uint32_t n, Mxfp4RowOrder order) {
  if (order == Mxfp4RowOrder::kGateUpInterleaved) return (r & ~31u) + (r & 1u) * 16u + ((r & 31u) >> 1);
  if (order == Mxfp4RowOrder::kGateUpConcatenated) {
    const uint32_t half = n >> 1, up = r >= half ? 1u : 0u, j = r - up * half;
    return (j >> 4) * 32u + up * 16u + (j & 15u);
  }
  return r;
}
__device__ __forceinline__ uint32_t kernel_value_offset_u32(uint32_t kr, uint32_t b, uint32_t k_tiles) {
  return ((kr >> 4) * k_tiles + (b >> 5)) * kMxfp4TileBytes + (kr & 15u) * kMxfp4TileRowBytes + (b & 31u);
}
__device__ __forceinline__ uint32_t kernel_scale_offset_u32(uint32_t kr, uint32_t kb, uint32_t k_tiles) {
  return ((kr >> 4) * k_tiles + (kb >> 1)) * kMxfp4TileScales + (kr & 15u) * 2u + (kb & 1u);
}

// ---- chunks: 8 consecutive elements of a row, as loaded -----------------------------------

template <bool kBf16>
struct Chunk {
  static constexpr int kWords = kBf16 ? 4 : 8;  // bf16: element 2j in the low half of word j
  uint32_t w[kWords];
};

// FP32 bits of element j.
template <bool kBf16>
__device__ __forceinline__ uint32_t elem_bits(const Chunk<kBf16>& c, int j) {
  if constexpr (kBf16) return (j & 1) ? c.w[j >> 1] & 0xffff0000u : c.w[j >> 1] << 16;
  else return c.w[j];
}

template <bool kBf16>
__device__ __forceinline__ void zero(Chunk<kBf16>& c) {
#pragma unroll
  for (int i = 0; i < Chunk<kBf16>::kWords; ++i) c.w[i] = 0;
}

// From a 16-byte aligned element offset of the input's storage.
template <bool kBf16>
__device__ __forceinline__ void load_chunk(const void* data, int64_t off, Chunk<kBf16>& c) {
  if constexpr (kBf16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(data) + off));
    c.w[0] = v.x, c.w[1] = v.y, c.w[2] = v.z, c.w[3] = v.w;
  } else {
    const uint4* s = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(data) + off);
    const uint4 a = __ldg(s), b = __ldg(s + 1);
    c.w[0] = a.x, c.w[1] = a.y, c.w[2] = a.z, c.w[3] = a.w;
    c.w[4] = b.x, c.w[5] = b.y, c.w[6] = b.z, c.w[7] = b.w;
  }
}

// Columns k..k+7 of the row at offset ro (from row_offset); columns at or past K read as +0,
// which never raises an amax and encodes to the +0 code. kVec: contiguous, K % 8 == 0, 16-byte
// aligned, so a chunk is entirely inside the row or entirely past its end.
template <bool kBf16, bool kVec>
__device__ __forceinline__ void load_chunk(const StridedRows& x, int64_t ro, int64_t k, Chunk<kBf16>& c) {
  if constexpr (kVec) {
    if (k >= x.cols) zero(c);
    else load_chunk<kBf16>(x.data, ro + k, c);
  } else {
    zero(c);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t b = k + j < x.cols ? x.load_bits(ro, k + j) : 0u;
      if constexpr (kBf16) c.w[j >> 1] |= (j & 1) ? b : b >> 16;
      else c.w[j] = b;
    }
  }
}

// Offset of row r: kVec inputs are contiguous, so no walk through the strides (whose 64-bit
// divisions would also cost register saves around their subroutine calls).
template <bool kVec>
__device__ __forceinline__ int64_t row_start(const StridedRows& x, int64_t r) {
  return kVec ? r * x.cols : x.row_offset(r);
}

// ---- amax: |x| bits compared as integers (NaN and Inf sort above every finite) ------------
// bf16 keeps two maxima per word (one per half) until amax_finish.

template <bool kBf16>
__device__ __forceinline__ uint32_t amax_combine(uint32_t a, uint32_t b) {
  if constexpr (kBf16) return __vmaxu2(a, b);  // one max.u16x2 on sm_90
  else return max(a, b);
}

template <bool kBf16>
__device__ __forceinline__ uint32_t amax_acc(const Chunk<kBf16>& c, uint32_t m) {
#pragma unroll
  for (int i = 0; i < Chunk<kBf16>::kWords; ++i)
    m = amax_combine<kBf16>(m, c.w[i] & (kBf16 ? 0x7fff7fffu : kF32AbsMask));
  return m;
}

// The FP32 magnitude bits of the maximum.
template <bool kBf16>
__device__ __forceinline__ uint32_t amax_finish(uint32_t m) {
  if constexpr (kBf16) return max(m & 0xffffu, m >> 16) << 16;
  else return m;
}

// ---- E4M3: the hardware conversion ---------------------------------------------------------
// exp2_neg, e4m3x2 and why they give minifloat.hpp's codes exactly: e4m3_cuda.cuh.

template <bool kBf16>
__device__ __forceinline__ uint2 e4m3_chunk(const Chunk<kBf16>& c, float inv_scale) {
  uint32_t h[4];
#pragma unroll
  for (int p = 0; p < 4; ++p)
    h[p] = e4m3x2(__fmul_rn(__uint_as_float(elem_bits(c, 2 * p)), inv_scale),
                  __fmul_rn(__uint_as_float(elem_bits(c, 2 * p + 1)), inv_scale));
  return make_uint2(__byte_perm(h[0], h[1], 0x5410), __byte_perm(h[2], h[3], 0x5410));
}

// ---- E2M1: rounding by addition --------------------------------------------------------------
// With y = min(|x| 2^-se, 6) and em = max(2^floor(log2 y), 1), the E2M1 grid near y has step
// em/2, and r = em * 2^(p-1) + y rounded once to a float of p significant bits (p = 8 for bf16,
// 24 for f32) is y rounded to that step, ties to even (em * 2^(p-1) has a zero mantissa, so
// the parity of r's mantissa is the parity of the multiple). The code is then
// (r - em * 2^(p-1)) / step + 2 log2(em), all in the bits. y below 2^-126 may flush or round
// on the way: its code is 0 either way. Checked against e2m1_encode for every bf16 value and
// every scale exponent (with IEEE and with flush-to-zero bf16 arithmetic), and for f32 on
// random values and every grid point and midpoint of every exponent.
//
// The bf16 pair ops could flush subnormal *inputs*: that matters only when |x| < 2^-126 can
// still reach the 0.25 rounding threshold, i.e. se < -124, a block with 0 < amax < 2^-122.
// Those blocks take e2m1_chunk_exact (the reference, per element).

__device__ __forceinline__ uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t bf16x2_min(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("min.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t bf16x2_max(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

constexpr uint32_t kTinyMxfp4Amax = 0x02800000u;  // 2^-122: below it, se < -124

// Eight E2M1 codes of one chunk as the 4 bytes it occupies in a block (element 2j in the low
// nibble of byte j). s2: 2^-se as a bf16 pair.
__device__ __forceinline__ uint32_t e2m1_chunk(const Chunk<true>& c, uint32_t s2) {
  constexpr uint32_t kSix = 0x40c040c0u, kOne = 0x3f803f80u, k64 = 0x42804280u;
  uint32_t q[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint32_t y = bf16x2_min(bf16x2_mul(c.w[p] & 0x7fff7fffu, s2), kSix);
    const uint32_t em = bf16x2_max(y & 0x7f807f80u, kOne);
    const uint32_t r = bf16x2_fma(em, k64, y);
    // Per half: r - em + (em >> 6) = 0x3FE + code (bits of r = bits of em * 64 + multiple,
    // em >> 6 = 254 + 2 log2(em)); no half borrows from the other.
    const uint32_t t = r + (em >> 6) - em;
    // q = (code << 12) | sign << 15 per half: the 0x3FE bias leaves through the constant,
    // 2^32 - (0x03FE03FE << 12), which has no bit where the sign bits go.
    q[p] = (t << 12) + ((c.w[p] & 0x80008000u) | 0x1fc02000u);
  }
  // Byte j = nibble of element 2j (bits 12..15 of q[j]) | nibble of 2j+1 (bits 28..31) << 4.
  const uint32_t a = __byte_perm(q[0], q[1], 0x7351), b = __byte_perm(q[2], q[3], 0x7351);
  return (__byte_perm(a, b, 0x5410) >> 4) | __byte_perm(a, b, 0x7632);
}

__device__ __forceinline__ uint32_t e2m1_chunk(const Chunk<false>& c, float inv_scale) {
  uint32_t out = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float y = fminf(__fmul_rn(__uint_as_float(c.w[j] & kF32AbsMask), inv_scale), 6.0f);
    const uint32_t em = max(__float_as_uint(y) & 0x7f800000u, 0x3f800000u);
    const float r = __fmaf_rn(__uint_as_float(em), 4194304.0f, y);  // em * 2^22 + y
    // bits(r) - bits(em * 2^22) = multiple of the step; (em >> 22) - 254 = 2 log2(em).
    const uint32_t code = __float_as_uint(r) - em + (em >> 22) - ((22u << 23) + 254u);
    out |= (code | ((c.w[j] >> 28) & 8u)) << (4 * j);
  }
  return out;
}

// The reference encoder on four bf16 pairs, out of line: it is rare, and large inlined.
__device__ __noinline__ uint32_t e2m1_chunk_exact(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, int se) {
  const Chunk<true> c{{w0, w1, w2, w3}};
  uint32_t out = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) out |= e2m1_encode(elem_bits(c, j), se) << (4 * j);
  return out;
}

// The E2M1 codes of a chunk of a block with scale exponent se and maximum amax (finite).
template <bool kBf16>
__device__ __forceinline__ uint32_t e2m1_codes(const Chunk<kBf16>& c, int se, uint32_t amax) {
  if constexpr (kBf16) {
    if (amax != 0 && amax < kTinyMxfp4Amax) return e2m1_chunk_exact(c.w[0], c.w[1], c.w[2], c.w[3], se);
    const uint32_t s = static_cast<uint32_t>(127 - se) << 7;
    return e2m1_chunk(c, s | (s << 16));
  } else {
    return e2m1_chunk(c, exp2_neg(se));
  }
}

// ---- stores -------------------------------------------------------------------------------

// Eight bytes (lo = bytes 0..3, hi = bytes 4..7, little-endian) to dst, of which the first n
// are in range; one 8-byte store when the destination allows it.
__device__ __forceinline__ void store8(uint8_t* dst, uint32_t lo, uint32_t hi, bool vec, int64_t n) {
  if (vec && n >= 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
    return;
  }
  for (int j = 0; j < 8 && j < n; ++j) dst[j] = static_cast<uint8_t>((j < 4 ? lo : hi) >> (8 * (j & 3)));
}

// ---- MX quantize --------------------------------------------------------------------------

enum MxMode : int { kMxfp4Checkpoint = 0, kMxfp4Kernel = 1, kMxfp8 = 2 };

struct MxLaunch {
  int64_t lanes = 0;  // 2 per 32-element block
  bool out_vec = false;  // generic path: 8-byte stores allowed
  // kLinear with the kernel layout: row = block / num_kb, expert = row / rows_per_expert.
  FastDiv num_kb, rows_per_expert;
};

// kLinear: contiguous, 16-byte aligned, K % 32 == 0, output aligned for 8 (MXFP4) or 16
// (MXFP8) byte stores: lane l reads elements 16 l - 8 (l & 1) (+16) and writes bytes 8 l
// (MXFP4) or elements 16 l (MXFP8) of the flat tensors; no division unless the kernel layout
// needs the row. Otherwise (kVec as in load_chunk) rows and blocks come from 64-bit division.
template <bool kBf16, bool kLinear, bool kVec, int kMode>
__global__ void __launch_bounds__(kThreads) mx_quantize_kernel(const MxQuantPlan p, const MxLaunch l) {
  constexpr bool kFp4 = kMode != kMxfp8;
  constexpr int kEmax = kFp4 ? kE2M1EmaxElem : kE4M3EmaxElem;
  constexpr int64_t kSpan = int64_t{kThreads} * kLaneIters;
  // Whole CTAs iterate together and lanes past the end carry zeros and store nothing, so the
  // shuffles below always find their partner lane (a block's two lanes are adjacent).
  for (int64_t base = blockIdx.x * kSpan; base < l.lanes; base += gridDim.x * kSpan) {
    Chunk<kBf16> c[kLaneIters][2];
    int64_t row[kLaneIters], kb[kLaneIters];
#pragma unroll
    for (int i = 0; i < kLaneIters; ++i) {
      const int64_t lane = base + i * kThreads + threadIdx.x, blk = lane >> 1;
      const int h = static_cast<int>(lane & 1);
      row[i] = kb[i] = 0;
      if (lane >= l.lanes) {
        zero(c[i][0]);
        zero(c[i][1]);
      } else if constexpr (kLinear) {
        const int64_t off = blk * kMxBlockSize + 8 * h;
        load_chunk<kBf16>(p.x.data, off, c[i][0]);
        load_chunk<kBf16>(p.x.data, off + 16, c[i][1]);
      } else {
        row[i] = blk / p.num_kb;
        kb[i] = blk - row[i] * p.num_kb;
        const int64_t ro = row_start<kVec>(p.x, row[i]), k = kb[i] * kMxBlockSize + 8 * h;
        load_chunk<kBf16, kVec>(p.x, ro, k, c[i][0]);
        load_chunk<kBf16, kVec>(p.x, ro, k + 16, c[i][1]);
      }
    }
#pragma unroll
    for (int i = 0; i < kLaneIters; ++i) {
      const int64_t lane = base + i * kThreads + threadIdx.x, blk = lane >> 1;
      const int h = static_cast<int>(lane & 1);
      uint32_t m = amax_acc<kBf16>(c[i][1], amax_acc<kBf16>(c[i][0], 0));
      m = amax_combine<kBf16>(m, __shfl_xor_sync(0xffffffffu, m, 1));
      const uint32_t amax = amax_finish<kBf16>(m);
      const E8M0 s = mx_scale_from_amax(amax, kEmax);
      const bool poisoned = e8m0_is_nan(s);
      const int se = e8m0_exponent(s);
      uint8_t* dst;
      if constexpr (kFp4) {
        uint32_t q0 = e2m1_codes<kBf16>(c[i][0], se, amax), q1 = e2m1_codes<kBf16>(c[i][1], se, amax);
        if (poisoned) q0 = q1 = 0;
        // Lane h stores bytes [8h, 8h + 8) of the block's 16: chunks 2h and 2h + 1.
        const uint32_t other = __shfl_xor_sync(0xffffffffu, h ? q0 : q1, 1);
        uint32_t lo = h ? other : q0, hi = h ? q1 : other;
        if (lane >= l.lanes) continue;
        uint8_t* blocks = reinterpret_cast<uint8_t*>(p.blocks);
        if constexpr (kMode == kMxfp4Kernel) {
          int64_t expert_base, value_off, scale_off;
          if constexpr (kLinear) {
            const uint32_t r = l.num_kb.div(static_cast<uint32_t>(blk));
            const uint32_t b = static_cast<uint32_t>(blk - int64_t{r} * l.num_kb.d);
            const uint32_t e = l.rows_per_expert.div(r), lr = r - e * l.rows_per_expert.d;
            const uint32_t kr = kernel_row_u32(lr, l.rows_per_expert.d, p.order), k_tiles = l.num_kb.d / 2;
            expert_base = int64_t{e} * l.rows_per_expert.d;
            value_off = kernel_value_offset_u32(kr, b * kMxfp4BytesPerBlock + 8 * h, k_tiles);
            scale_off = kernel_scale_offset_u32(kr, b, k_tiles);
          } else {
            const int64_t e = row[i] / p.rows_per_expert, lr = row[i] - e * p.rows_per_expert;
            const int64_t row_bytes = p.num_kb * kMxfp4BytesPerBlock;
            expert_base = e * p.rows_per_expert;
            value_off = mxfp4_kernel_value_offset(lr, kb[i] * kMxfp4BytesPerBlock + 8 * h, p.rows_per_expert,
                                                  row_bytes, p.order);
            scale_off = mxfp4_kernel_scale_offset(lr, kb[i], p.rows_per_expert, p.num_kb, p.order);
          }
          dst = blocks + expert_base * p.num_kb * kMxfp4BytesPerBlock + value_off;
          if (h == 0) p.kernel_scales[expert_base * p.num_kb + scale_off] = s;
          lo = mxfp4_arrange_word(lo);  // step 4 of the kernel layout: both words stay whole
          hi = mxfp4_arrange_word(hi);
        } else {
          // Checkpoint blocks [rows, num_kb, 16] are flat in the block index either way.
          dst = blocks + blk * kMxfp4BytesPerBlock + 8 * h;
        }
        if constexpr (kLinear) *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
        else store8(dst, lo, hi, l.out_vec, 8);
      } else {
        const float inv = exp2_neg(se);
        uint2 q0 = e4m3_chunk<kBf16>(c[i][0], inv), q1 = e4m3_chunk<kBf16>(c[i][1], inv);
        if (poisoned) q0 = q1 = make_uint2(0, 0);
        // Lane h stores elements [16h, 16h + 16) of the block: chunks 2h and 2h + 1.
        const uint2 send = h ? q0 : q1;
        const uint2 other = make_uint2(__shfl_xor_sync(0xffffffffu, send.x, 1),
                                       __shfl_xor_sync(0xffffffffu, send.y, 1));
        const uint2 lo = h ? other : q0, hi = h ? q1 : other;
        if (lane >= l.lanes) continue;
        if constexpr (kLinear) {
          dst = reinterpret_cast<uint8_t*>(p.q) + blk * kMxBlockSize + 16 * h;
          *reinterpret_cast<uint4*>(dst) = make_uint4(lo.x, lo.y, hi.x, hi.y);
        } else {
          const int64_t k = kb[i] * kMxBlockSize + 16 * h;
          dst = reinterpret_cast<uint8_t*>(p.q) + row[i] * p.x.cols + k;
          store8(dst, lo.x, lo.y, l.out_vec, p.x.cols - k);
          store8(dst + 8, hi.x, hi.y, l.out_vec, p.x.cols - k - 8);
        }
      }
      // Checkpoint scales [rows, num_kb]: flat in the block index.
      if (h == 0) p.scales[blk] = s;
    }
  }
}

enum class InputPath { kLinear, kVec, kGeneric };

template <bool kBf16, int kMode>
void launch_mx(const MxQuantPlan& p, const MxLaunch& l, InputPath path, cudaStream_t st) {
  const unsigned grid = blocks_for(l.lanes, kThreads * kLaneIters);
  if (path == InputPath::kLinear) mx_quantize_kernel<kBf16, true, true, kMode><<<grid, kThreads, 0, st>>>(p, l);
  else if (path == InputPath::kVec) mx_quantize_kernel<kBf16, false, true, kMode><<<grid, kThreads, 0, st>>>(p, l);
  else mx_quantize_kernel<kBf16, false, false, kMode><<<grid, kThreads, 0, st>>>(p, l);
}

template <int kMode>
void launch_mx(const MxQuantPlan& p, const MxLaunch& l, InputPath path, cudaStream_t st) {
  if (p.x.bf16) launch_mx<true, kMode>(p, l, path, st);
  else launch_mx<false, kMode>(p, l, path, st);
}

// ---- UE8M0 FP8, 1 x 128 -------------------------------------------------------------------

// The reference divides amax / 448 correctly rounded; div.rn would cost a subroutine call (and
// its register saves) per block. Instead: q0 = amax * RN(1/448), one exact-residual FMA
// correction. q equals the IEEE quotient for every amax >= 2^-120; below, it may be 1 ulp off
// in the subnormal range, where both clamp to the scale 2^-127. The E8M0 code it gives was
// checked against the reference's for all 2^31 magnitudes (IEEE single precision, no
// flush-to-zero: the __*_rn intrinsics keep the compiler from contracting or flushing).
__device__ __forceinline__ E8M0 ue8m0_scale(uint32_t amax) {
  constexpr float kInv = 1.0f / kE4M3Max;
  const float a = __uint_as_float(amax), q0 = __fmul_rn(a, kInv);
  return ue8m0_scale_from_quotient(amax, __fmaf_rn(__fmaf_rn(-q0, kE4M3Max, a), kInv, q0));
}

// The scale of block (scale row sr, kb) in both forms, and the packed row's zero padding.
__device__ __forceinline__ void write_fp8_scale(const Fp8QuantPlan& p, int64_t sr, int64_t kb,
                                                E8M0 s) {
  if (p.scales) p.scales[sr * p.g.num_kb + kb] = __uint_as_float(e8m0_decode_bits(s));
  if (p.packed) {
    p.packed[sr * p.g.packed_row_bytes + kb] = s;
    if (kb == p.g.num_kb - 1)
      for (int64_t j = kb + 1; j < p.g.packed_row_bytes; ++j) p.packed[sr * p.g.packed_row_bytes + j] = E8M0{0};
  }
}

// Lane l = 8 * block + s owns chunks s and s + 8 of its 128-element block: eight lanes read
// 128 contiguous bytes (bf16) per instruction. kLinear: contiguous, 16-byte aligned, K % 128
// == 0, q 8-byte aligned, packed rows unpadded (num_kb % 4 == 0): every offset is flat in the
// block index (a 1 x 128 scale row is the input row). Otherwise 64-bit division, as kVec says.
template <bool kBf16, bool kLinear, bool kVec>
__global__ void __launch_bounds__(kThreads)
    fp8_token_kernel(const Fp8QuantPlan p, int64_t total_lanes, bool out_vec) {
  constexpr int64_t kSpan = int64_t{kThreads} * kLaneIters;
  for (int64_t base = blockIdx.x * kSpan; base < total_lanes; base += gridDim.x * kSpan) {
    Chunk<kBf16> c[kLaneIters][2];
    int64_t row[kLaneIters], kb[kLaneIters];
#pragma unroll
    for (int i = 0; i < kLaneIters; ++i) {
      const int64_t lane = base + i * kThreads + threadIdx.x, blk = lane >> 3;
      const int sub = static_cast<int>(lane & 7);
      row[i] = kb[i] = 0;
      if (lane >= total_lanes) {
        zero(c[i][0]);
        zero(c[i][1]);
      } else if constexpr (kLinear) {
        const int64_t off = blk * kFp8BlockK + 8 * sub;
        load_chunk<kBf16>(p.x.data, off, c[i][0]);
        load_chunk<kBf16>(p.x.data, off + 64, c[i][1]);
      } else {
        row[i] = blk / p.g.num_kb;
        kb[i] = blk - row[i] * p.g.num_kb;
        const int64_t ro = row_start<kVec>(p.x, row[i]), k = kb[i] * kFp8BlockK + 8 * sub;
        load_chunk<kBf16, kVec>(p.x, ro, k, c[i][0]);
        load_chunk<kBf16, kVec>(p.x, ro, k + 64, c[i][1]);
      }
    }
#pragma unroll
    for (int i = 0; i < kLaneIters; ++i) {
      const int64_t lane = base + i * kThreads + threadIdx.x, blk = lane >> 3;
      const int sub = static_cast<int>(lane & 7);
      uint32_t m = amax_acc<kBf16>(c[i][1], amax_acc<kBf16>(c[i][0], 0));
#pragma unroll
      for (int d = 1; d < 8; d <<= 1) m = amax_combine<kBf16>(m, __shfl_xor_sync(0xffffffffu, m, d));
      const E8M0 s = ue8m0_scale(amax_finish<kBf16>(m));
      const float inv = exp2_neg(e8m0_exponent(s));
      uint2 q0 = e4m3_chunk<kBf16>(c[i][0], inv), q1 = e4m3_chunk<kBf16>(c[i][1], inv);
      if (e8m0_is_nan(s)) q0 = q1 = make_uint2(0, 0);
      if (lane >= total_lanes) continue;
      if constexpr (kLinear) {
        uint8_t* q = reinterpret_cast<uint8_t*>(p.q) + blk * kFp8BlockK + 8 * sub;
        *reinterpret_cast<uint2*>(q) = q0;
        *reinterpret_cast<uint2*>(q + 64) = q1;
        if (sub == 0) {
          if (p.scales) p.scales[blk] = __uint_as_float(e8m0_decode_bits(s));
          if (p.packed) p.packed[blk] = s;
        }
      } else {
        const int64_t k = kb[i] * kFp8BlockK + 8 * sub;
        uint8_t* q = reinterpret_cast<uint8_t*>(p.q) + row[i] * p.g.cols + k;
        store8(q, q0.x, q0.y, out_vec, p.g.cols - k);
        store8(q + 64, q1.x, q1.y, out_vec, p.g.cols - (k + 64));
        if (sub == 0) write_fp8_scale(p, row[i], kb[i], s);  // 1 x 128: scale row = row
      }
    }
  }
}

// ---- UE8M0 FP8, 128 x 128 -----------------------------------------------------------------

constexpr int kTileThreads = 256;
constexpr int kTileChunks = kFp8WeightBlockN * kFp8BlockK / 8 / kTileThreads;  // 8 per thread

// minBlocks 1: without it ptxas caps the strided bf16 variant at 64 registers and spills
// around the subroutine calls of row_offset's 64-bit divisions; the contiguous bf16 variant
// needs 64 either way (4 CTAs per SM, 128 KB of loads in flight).
template <bool kBf16, bool kVec>
__global__ void __launch_bounds__(kTileThreads, 1) fp8_tile_kernel(const Fp8QuantPlan p, bool out_vec) {
  __shared__ uint32_t warp_max[kTileThreads / 32];
  const Fp8Geometry& g = p.g;
  const int64_t tile = blockIdx.x;
  const int64_t sr = tile / g.num_kb, kb = tile - sr * g.num_kb;
  const int64_t batch = sr / g.row_blocks_per_batch, rb = sr - batch * g.row_blocks_per_batch;
  const int64_t r0 = batch * g.rows_per_batch + rb * g.block_rows;
  const int64_t r1 = min(r0 + g.block_rows, (batch + 1) * g.rows_per_batch);
  const int t = threadIdx.x;
  const int64_t k = kb * kFp8BlockK + (t & 15) * 8;  // this thread's 8 columns
  // Chunk i of this thread covers row r0 + 16 i + t / 16: a warp reads two whole 256-byte
  // (bf16) rows per instruction. The chunks stay packed as loaded (32 registers for bf16).
  Chunk<kBf16> v[kTileChunks];
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kTileChunks; ++i) {
    const int64_t r = r0 + 16 * i + (t >> 4);
    if (r < r1) load_chunk<kBf16, kVec>(p.x, row_start<kVec>(p.x, r), k, v[i]);
    else zero(v[i]);
    m = amax_acc<kBf16>(v[i], m);
  }
  uint32_t amax = __reduce_max_sync(0xffffffffu, amax_finish<kBf16>(m));
  if ((t & 31) == 0) warp_max[t >> 5] = amax;
  __syncthreads();
  amax = 0;
#pragma unroll
  for (int w = 0; w < kTileThreads / 32; ++w) amax = max(amax, warp_max[w]);
  const E8M0 s = ue8m0_scale(amax);
  const bool poisoned = e8m0_is_nan(s);
  const float inv = exp2_neg(e8m0_exponent(s));
  if (t == 0) write_fp8_scale(p, sr, kb, s);
#pragma unroll
  for (int i = 0; i < kTileChunks; ++i) {
    const int64_t r = r0 + 16 * i + (t >> 4);
    if (r >= r1 || k >= g.cols) continue;
    uint2 q = poisoned ? make_uint2(0, 0) : e4m3_chunk<kBf16>(v[i], inv);
    store8(reinterpret_cast<uint8_t*>(p.q) + r * g.cols + k, q.x, q.y, out_vec, g.cols - k);
  }
}

// ---- dequantization: one thread per output element ----------------------------------------

__device__ __forceinline__ void store_out(void* out, bool bf16, int64_t i, uint32_t bits) {
  if (bf16) static_cast<uint16_t*>(out)[i] = f32_to_bf16_bits(__uint_as_float(bits));
  else static_cast<uint32_t*>(out)[i] = bits;
}

__global__ void mx_dequantize_kernel(const MxDequantPlan p) {
  const int64_t total = p.rows * p.cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.cols, k = i - r * p.cols;
    const E8M0 s = p.scales[r * p.num_kb + k / kMxBlockSize];
    uint32_t bits = kF32CanonicalNan;
    if (!e8m0_is_nan(s)) {
      if (p.fp4) {
        const Fp4x2 b = p.blocks[r * p.num_kb * kMxfp4BytesPerBlock + k / 2];
        bits = e2m1_decode_bits((k & 1) == 0 ? fp4x2_even(b) : fp4x2_odd(b), e8m0_exponent(s));
      } else {  // the hardware decode (e4m3_cuda.cuh), checked against e4m3_decode_bits here
        bits = __float_as_uint(e4m3x2_decode(p.q[i].bits, exp2_pos(e8m0_exponent(s))).x);
      }
    }
    store_out(p.out, p.out_bf16, i, bits);
  }
}

__global__ void fp8_dequantize_kernel(const Fp8DequantPlan p) {
  const Fp8Geometry& g = p.g;
  const int64_t total = g.rows * g.cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / g.cols, k = i - r * g.cols;
    const int64_t sr = g.scale_row(r), kb = k / kFp8BlockK;
    uint32_t bits;
    if (p.packed) {
      const E8M0 s = p.packed[sr * g.packed_row_bytes + kb];
      bits = e8m0_is_nan(s) ? kF32CanonicalNan : e4m3_decode_bits(p.q[i], e8m0_exponent(s));
    } else {
      // __fmul_rn: never contracted into an FMA, exactly the reference's single multiply.
      const float v = __fmul_rn(__uint_as_float(e4m3_decode_bits(p.q[i], 0)), p.scales[sr * g.num_kb + kb]);
      bits = isnan(v) ? kF32CanonicalNan : __float_as_uint(v);
    }
    store_out(p.out, p.out_bf16, i, bits);
  }
}

// ---- MXFP4 layouts ------------------------------------------------------------------------

// Position (byte offset) in one 16-row tile's other layout of the byte at `off`: to_kernel
// maps a kernel-tile position [K/64][16][32] to its checkpoint position [16][K/2], and the
// reverse. A 16-byte chunk never straddles a 32-byte tile row or a row (K/2 % 32 == 0), so
// mapping a chunk's first byte maps the chunk.
__device__ __forceinline__ int tile_source(int off, int row_bytes, bool to_kernel) {
  if (to_kernel) {
    const int kt = off / kMxfp4TileBytes, in_tile = off % kMxfp4TileBytes;
    return (in_tile / kMxfp4TileRowBytes) * row_bytes + kt * kMxfp4TileRowBytes +
           in_tile % kMxfp4TileRowBytes;
  }
  const int i = off / row_bytes, b = off % row_bytes;
  return (b / kMxfp4TileRowBytes) * kMxfp4TileBytes + i * kMxfp4TileRowBytes + b % kMxfp4TileRowBytes;
}

// Chunk `from` (byte offset) of the staged bytes, with step 4 of the kernel layout applied on
// the way (arrange: words arranged; otherwise undone). A chunk of 16 bytes is 4 whole words;
// a 1-byte chunk (misaligned tensors) maps the word holding it and keeps its byte. Words
// start at multiples of 4 from the staged base in both layouts (rows are multiples of 32 B).
template <typename Chunk>
__device__ __forceinline__ Chunk mapped_chunk(const unsigned char* staged, int from, bool arrange) {
  if constexpr (sizeof(Chunk) == 16) {
    uint4 v = *reinterpret_cast<const uint4*>(staged + from);
    uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = arrange ? mxfp4_arrange_word(w[i]) : mxfp4_unarrange_word(w[i]);
    return v;
  } else {
    uint8_t word[4];
    const int w0 = from & ~3;
#pragma unroll
    for (int i = 0; i < 4; ++i) word[i] = staged[w0 + i];
    mxfp4_arrange_bytes(word, arrange);
    return word[from & 3];
  }
}

// kPlain / kGateUpInterleaved: one closed group of rows per CTA. Read the group's span into
// shared memory, then write each chunk (16 bytes, or 1 on a misaligned tensor) from where
// the other layout keeps it, arranging (to_kernel) or restoring its words on the way.
template <typename Chunk>
__global__ void __launch_bounds__(kLayoutThreads) mxfp4_layout_kernel(const LayoutPlan p) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kW = sizeof(Chunk);
  const int group = mxfp4_row_multiple(p.order);
  const int row_bytes = static_cast<int>(p.row_bytes);
  const int tile_bytes = kMxfp4TileRows * row_bytes;
  const int span = group * row_bytes;
  const int64_t groups_per_expert = p.n / group;
  const int64_t e = blockIdx.x / groups_per_expert, gi = blockIdx.x - e * groups_per_expert;
  Chunk* base = reinterpret_cast<Chunk*>(reinterpret_cast<uint8_t*>(p.blocks) +
                                         (e * p.n + gi * group) * p.row_bytes);
  Chunk* staged = reinterpret_cast<Chunk*>(smem);
  const int chunks = span / kW;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) staged[c] = base[c];
  __syncthreads();
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const int off = c * kW;
    int from;
    if (p.to_kernel) {  // `off` is a kernel-layout position: kernel row -> checkpoint row
      const int tile = off / tile_bytes, in_tile = tile_source(off % tile_bytes, row_bytes, true);
      const int kr = tile * kMxfp4TileRows + in_tile / row_bytes;
      from = static_cast<int>(mxfp4_checkpoint_row(kr, group, p.order)) * row_bytes + in_tile % row_bytes;
    } else {  // `off` is a checkpoint position: find it in the kernel layout
      const int kr = static_cast<int>(mxfp4_kernel_row(off / row_bytes, group, p.order));
      from = (kr / kMxfp4TileRows) * tile_bytes +
             tile_source((kr % kMxfp4TileRows) * row_bytes + off % row_bytes, row_bytes, false);
    }
    base[c] = mapped_chunk<Chunk>(smem, from, p.to_kernel);
  }
}

// kGateUpConcatenated: CTA (t, e) leads the cycle of tile t of expert e when t is the cycle's
// smallest tile, and walks it: save the first tile, then move each tile into its
// predecessor's place (transposing it), and close with the saved one. Tiles of different
// cycles are disjoint, so the cycles run in parallel; fixed points are one-tile cycles.
template <typename Chunk>
__global__ void __launch_bounds__(kLayoutThreads) mxfp4_tile_cycle_kernel(const LayoutPlan p) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kW = sizeof(Chunk);
  const int64_t nt = p.n / kMxfp4TileRows;
  const int64_t start = blockIdx.x;
  auto next = [&](int64_t k) {
    return p.to_kernel ? mxfp4_concat_source_tile(k, nt) : mxfp4_concat_kernel_tile(k, nt);
  };
  for (int64_t k = next(start); k != start; k = next(k))
    if (k < start) return;  // not the leader (uniform across the CTA)
  const int row_bytes = static_cast<int>(p.row_bytes);
  const int chunks = kMxfp4TileRows * row_bytes / kW;
  uint8_t* mat = reinterpret_cast<uint8_t*>(p.blocks) + static_cast<int64_t>(blockIdx.y) * p.n * p.row_bytes;
  auto tile = [&](int64_t t) { return reinterpret_cast<Chunk*>(mat + t * kMxfp4TileRows * p.row_bytes); };
  Chunk* saved = reinterpret_cast<Chunk*>(smem);
  Chunk* work = saved + chunks;
  auto move = [&](const Chunk* from, Chunk* to) {  // shared -> global, transposing, words mapped
    for (int c = threadIdx.x; c < chunks; c += blockDim.x)
      to[c] = mapped_chunk<Chunk>(reinterpret_cast<const unsigned char*>(from),
                                  tile_source(c * kW, row_bytes, p.to_kernel), p.to_kernel);
  };
  const Chunk* first = tile(start);
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) saved[c] = first[c];
  __syncthreads();
  int64_t cur = start;
  for (int64_t k = next(start); k != start; cur = k, k = next(k)) {
    const Chunk* src = tile(k);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) work[c] = src[c];
    __syncthreads();  // tile k fully read before it is overwritten next step
    move(work, tile(cur));
    __syncthreads();  // `work` free again
  }
  move(saved, tile(cur));
}

__global__ void mxfp4_scales_layout_kernel(const ScalesLayoutPlan p) {
  const int64_t per_expert = p.n * p.row_blocks;
  const int64_t total = p.experts * per_expert;
  const int64_t k_tiles = p.row_blocks / 2;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / per_expert, off = i - e * per_expert;
    int64_t from;
    if (p.to_kernel) {  // i is a kernel-layout position
      const int64_t tile = off / kMxfp4TileScales, in_tile = off % kMxfp4TileScales;
      const int64_t kr = (tile / k_tiles) * kMxfp4TileRows + in_tile / 2;
      const int64_t r = mxfp4_checkpoint_row(kr, p.n, p.order);
      from = r * p.row_blocks + (tile % k_tiles) * 2 + in_tile % 2;
    } else {
      from = mxfp4_kernel_scale_offset(off / p.row_blocks, off % p.row_blocks, p.n, p.row_blocks, p.order);
    }
    p.dst[i] = p.src[e * per_expert + from];
  }
}

}  // namespace

// ---- host entry points --------------------------------------------------------------------

Status cuda_quantize_mx(const ExecContext& ctx, const MxQuantPlan& p) {
  MxLaunch l;
  l.lanes = p.x.rows * p.num_kb * 2;
  if (l.lanes == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const bool vec = p.x.contiguous && p.x.cols % 8 == 0 && aligned(p.x.data, 16);
  l.out_vec = p.fp4 ? aligned(p.blocks, 8) : aligned(p.q, 8) && p.x.cols % 8 == 0;
  bool linear = vec && p.x.cols % kMxBlockSize == 0 && (p.fp4 ? aligned(p.blocks, 8) : aligned(p.q, 16));
  if (linear && p.kernel_layout) {
    // 32-bit row arithmetic: every block index and one expert's bytes below 2^31.
    const int64_t expert_bytes = p.rows_per_expert * p.num_kb * kMxfp4BytesPerBlock;
    linear = p.x.rows * p.num_kb < (int64_t{1} << 31) && expert_bytes < (int64_t{1} << 31);
    if (linear) {
      l.num_kb = FastDiv::of(static_cast<uint32_t>(p.num_kb));
      l.rows_per_expert = FastDiv::of(static_cast<uint32_t>(p.rows_per_expert));
    }
  }
  const InputPath path = linear ? InputPath::kLinear : (vec ? InputPath::kVec : InputPath::kGeneric);
  if (!p.fp4) launch_mx<kMxfp8>(p, l, path, stream_of(ctx));
  else if (p.kernel_layout) launch_mx<kMxfp4Kernel>(p, l, path, stream_of(ctx));
  else launch_mx<kMxfp4Checkpoint>(p, l, path, stream_of(ctx));
  RD_CUDA_CHECK_LAUNCH("mx_quantize_kernel");
  return Status::Ok();
}

Status cuda_dequantize_mx(const ExecContext& ctx, const MxDequantPlan& p) {
  const int64_t total = p.rows * p.cols;
  if (total == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  mx_dequantize_kernel<<<blocks_for(total, kThreads), kThreads, 0, stream_of(ctx)>>>(p);
  RD_CUDA_CHECK_LAUNCH("mx_dequantize_kernel");
  return Status::Ok();
}

Status cuda_layout(const ExecContext& ctx, const LayoutPlan& p) {
  if (p.experts == 0 || p.n == 0 || p.row_bytes == 0) return Status::Ok();
  const bool cycles = p.order == Mxfp4RowOrder::kGateUpConcatenated;
  // Shared memory per CTA: one closed group of rows, or two tiles for the cycle walk.
  const int64_t rows_staged = cycles ? 2 * kMxfp4TileRows : mxfp4_row_multiple(p.order);
  const int64_t smem = rows_staged * p.row_bytes;
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  int device = 0, smem_optin = 0;
  RD_CUDA_CHECK(cudaGetDevice(&device));
  RD_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (smem > smem_optin)
    return Status(ErrorCode::kUnimplemented,
                  "blocks: the in-place permutation stages " + std::to_string(rows_staged) +
                      " rows of " + std::to_string(p.row_bytes) + " bytes (" +
                      std::to_string(smem) + " bytes), above the " + std::to_string(smem_optin) +
                      " bytes of shared memory a block may use: K too large for the CUDA path",
                  "blocks");
  const bool vec = aligned(p.blocks, 16);
  void (*kernel)(LayoutPlan);
  dim3 grid;
  if (cycles) {
    kernel = vec ? mxfp4_tile_cycle_kernel<uint4> : mxfp4_tile_cycle_kernel<uint8_t>;
    if (p.experts > 65535 || p.n / kMxfp4TileRows > 0x7fffffff)
      return Status(ErrorCode::kUnimplemented, "blocks: more than 65535 experts", "blocks");
    grid = dim3(static_cast<unsigned>(p.n / kMxfp4TileRows), static_cast<unsigned>(p.experts));
  } else {
    kernel = vec ? mxfp4_layout_kernel<uint4> : mxfp4_layout_kernel<uint8_t>;
    const int64_t num_groups = p.experts * (p.n / mxfp4_row_multiple(p.order));
    if (num_groups > 0x7fffffff)
      return Status(ErrorCode::kUnimplemented, "blocks: more than 2^31 row groups", "blocks");
    grid = dim3(static_cast<unsigned>(num_groups));
  }
  RD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
  kernel<<<grid, kLayoutThreads, static_cast<size_t>(smem), stream_of(ctx)>>>(p);
  RD_CUDA_CHECK_LAUNCH("mxfp4 layout kernel");
  return Status::Ok();
}

Status cuda_scales_layout(const ExecContext& ctx, const ScalesLayoutPlan& p) {
  const int64_t total = p.experts * p.n * p.row_blocks;
  if (total == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  mxfp4_scales_layout_kernel<<<blocks_for(total, kThreads), kThreads, 0, stream_of(ctx)>>>(p);
  RD_CUDA_CHECK_LAUNCH("mxfp4_scales_layout_kernel");
  return Status::Ok();
}

Status cuda_quantize_fp8(const ExecContext& ctx, const Fp8QuantPlan& p) {
  if (p.x.rows == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const bool vec = p.x.contiguous && p.g.cols % 8 == 0 && aligned(p.x.data, 16);
  const bool out_vec = aligned(p.q, 8) && p.g.cols % 8 == 0;
  const cudaStream_t st = stream_of(ctx);
  if (p.g.num_kb == 0) return Status::Ok();  // K == 0: no element, no scale, no padding
  if (p.g.block_rows == 1) {
    const int64_t lanes = p.x.rows * p.g.num_kb * 8;
    const unsigned grid = blocks_for(lanes, kThreads * kLaneIters);
    const bool linear = vec && p.g.cols % kFp8BlockK == 0 && aligned(p.q, 8) &&
                        (p.packed == nullptr || p.g.packed_row_bytes == p.g.num_kb);
    if (p.x.bf16) {
      if (linear) fp8_token_kernel<true, true, true><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
      else if (vec) fp8_token_kernel<true, false, true><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
      else fp8_token_kernel<true, false, false><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
    } else {
      if (linear) fp8_token_kernel<false, true, true><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
      else if (vec) fp8_token_kernel<false, false, true><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
      else fp8_token_kernel<false, false, false><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
    }
    RD_CUDA_CHECK_LAUNCH("fp8_token_kernel");
    return Status::Ok();
  }
  const int64_t tiles = p.g.num_scale_rows() * p.g.num_kb;
  if (tiles > 0x7fffffff)
    return Status(ErrorCode::kUnimplemented, "x: more than 2^31 blocks of 128 x 128", "x");
  const unsigned grid = static_cast<unsigned>(tiles);
  if (p.x.bf16) {
    if (vec) fp8_tile_kernel<true, true><<<grid, kTileThreads, 0, st>>>(p, out_vec);
    else fp8_tile_kernel<true, false><<<grid, kTileThreads, 0, st>>>(p, out_vec);
  } else {
    if (vec) fp8_tile_kernel<false, true><<<grid, kTileThreads, 0, st>>>(p, out_vec);
    else fp8_tile_kernel<false, false><<<grid, kTileThreads, 0, st>>>(p, out_vec);
  }
  RD_CUDA_CHECK_LAUNCH("fp8_tile_kernel");
  return Status::Ok();
}

Status cuda_dequantize_fp8(const ExecContext& ctx, const Fp8DequantPlan& p) {
  const int64_t total = p.g.rows * p.g.cols;
  if (total == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  fp8_dequantize_kernel<<<blocks_for(total, kThreads), kThreads, 0, stream_of(ctx)>>>(p);
  RD_CUDA_CHECK_LAUNCH("fp8_dequantize_kernel");
  return Status::Ok();
}

}  // namespace rolloutd::quant::detail
