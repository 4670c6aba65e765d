// CUDA twins of cpu_quant.cpp, bit-exact with it (quant_parity_test.cpp). The element codecs
// are the shared integer ones of minifloat.hpp; what differs is how the work is spread:
// - MX quantize: two lanes per 32-element block, 16 elements (one or two 16-byte loads) each,
//   amax combined with one shuffle; MXFP4 writes 8 bytes per lane, straight into the kernel
//   layout when asked (8 bytes never straddle a 32-byte tile row).
// - UE8M0 FP8, 1 x 128: eight lanes per block, three shuffles. 128 x 128: one 256-thread CTA
//   per block holding its 16,384 elements in registers between the amax and the encode, so
//   the input is read from DRAM once.
// - The in-place MXFP4 layout permutation: one CTA per closed group of 16 or 32 rows, staged
//   through shared memory (the group is the only extra storage); for concatenated gate/up,
//   one CTA per cycle of 16-row tiles, two tiles of shared memory.
// - Dequantization and the scale copies: one thread per output element (not on a hot path).
// Input loads are 16-byte vectors where the view is contiguous, K % 8 == 0 and the base is
// aligned; every other input (strided, odd K) takes the per-element path of the same kernel.
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/quant/quant_plan.hpp"

namespace rolloutd::quant::detail {
namespace {

using cuda::blocks_for;
using cuda::DeviceGuard;
using cuda::stream_of;

constexpr int kThreads = 256;
constexpr int kLayoutThreads = 512;

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Eight consecutive elements (row offset ro, columns k..k+7) as FP32 bits; columns at or past
// K read as +0, which never raises an amax and encodes to the +0 code.
template <bool kBf16, bool kVec>
__device__ __forceinline__ void load8(const StridedRows& x, int64_t ro, int64_t k, uint32_t v[8]) {
  if constexpr (kVec) {
    // K % 8 == 0 here, so a chunk is entirely inside the row or entirely past its end.
    if (k >= x.cols) {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = 0;
      return;
    }
    if constexpr (kBf16) {
      const uint4 w =
          __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x.data) + ro + k));
      v[0] = w.x << 16, v[1] = w.x & 0xffff0000u, v[2] = w.y << 16, v[3] = w.y & 0xffff0000u;
      v[4] = w.z << 16, v[5] = w.z & 0xffff0000u, v[6] = w.w << 16, v[7] = w.w & 0xffff0000u;
    } else {
      const uint4* s = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(x.data) + ro + k);
      const uint4 a = __ldg(s), b = __ldg(s + 1);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
      v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = k + j < x.cols ? x.load_bits(ro, k + j) : 0u;
  }
}

__device__ __forceinline__ uint32_t abs_max8(const uint32_t v[8], uint32_t m) {
#pragma unroll
  for (int j = 0; j < 8; ++j) m = max(m, v[j] & kF32AbsMask);
  return m;
}

// Eight bytes (lo = bytes 0..3, hi = bytes 4..7, little-endian) to dst, of which the first n
// are in range; one 8-byte store when the destination allows it.
__device__ __forceinline__ void store8(uint8_t* dst, uint32_t lo, uint32_t hi, bool vec, int64_t n) {
  if (vec && n >= 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
    return;
  }
  for (int j = 0; j < 8 && j < n; ++j) dst[j] = static_cast<uint8_t>((j < 4 ? lo : hi) >> (8 * (j & 3)));
}

// Eight E4M3 codes of v / 2^se packed little-endian into lo/hi.
__device__ __forceinline__ void encode8_e4m3(const uint32_t v[8], int se, uint32_t& lo, uint32_t& hi) {
  lo = hi = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    lo |= static_cast<uint32_t>(e4m3_encode(v[j], se).bits) << (8 * j);
    hi |= static_cast<uint32_t>(e4m3_encode(v[j + 4], se).bits) << (8 * j);
  }
}

// ---- MX quantize --------------------------------------------------------------------------

enum MxMode : int { kMxfp4Checkpoint = 0, kMxfp4Kernel = 1, kMxfp8 = 2 };

template <bool kBf16, bool kVec, int kMode>
__global__ void __launch_bounds__(kThreads)
    mx_quantize_kernel(const MxQuantPlan p, int64_t total_lanes, bool out_vec) {
  constexpr bool kFp4 = kMode != kMxfp8;
  constexpr int kEmax = kFp4 ? kE2M1EmaxElem : kE4M3EmaxElem;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // Whole warps iterate together (blockDim and stride are multiples of 32), so the shuffle
  // below always has its partner lane; lanes past the end carry zeros and store nothing.
  const int64_t end = (total_lanes + 31) & ~int64_t{31};
  for (int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; id < end;
       id += stride) {
    const bool valid = id < total_lanes;
    const int64_t blk = id >> 1;
    const int half = static_cast<int>(id & 1);
    int64_t r = 0, kb = 0;
    uint32_t v[16];
    if (valid) {
      r = blk / p.num_kb;
      kb = blk - r * p.num_kb;
      const int64_t ro = p.x.row_offset(r), k = kb * kMxBlockSize + half * 16;
      load8<kBf16, kVec>(p.x, ro, k, v);
      load8<kBf16, kVec>(p.x, ro, k + 8, v + 8);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = 0;
    }
    uint32_t amax = abs_max8(v + 8, abs_max8(v, 0));
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    if (!valid) continue;
    const E8M0 s = mx_scale_from_amax(amax, kEmax);
    const bool poisoned = e8m0_is_nan(s);
    const int se = e8m0_exponent(s);
    uint32_t lo = 0, hi = 0;
    if constexpr (kFp4) {
      if (!poisoned) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          lo |= static_cast<uint32_t>(fp4x2_pack(e2m1_encode(v[2 * j], se),
                                                 e2m1_encode(v[2 * j + 1], se)).bits) << (8 * j);
          hi |= static_cast<uint32_t>(fp4x2_pack(e2m1_encode(v[8 + 2 * j], se),
                                                 e2m1_encode(v[9 + 2 * j], se)).bits) << (8 * j);
        }
      }
      const int64_t row_bytes = p.num_kb * kMxfp4BytesPerBlock;
      const int64_t b = kb * kMxfp4BytesPerBlock + half * 8;
      uint8_t* blocks = reinterpret_cast<uint8_t*>(p.blocks);
      if constexpr (kMode == kMxfp4Kernel) {
        const int64_t e = r / p.rows_per_expert, lr = r - e * p.rows_per_expert;
        store8(blocks + e * p.rows_per_expert * row_bytes +
                   mxfp4_kernel_value_offset(lr, b, p.rows_per_expert, row_bytes, p.order),
               lo, hi, out_vec, 8);
        if (half == 0)
          p.kernel_scales[e * p.rows_per_expert * p.num_kb +
                          mxfp4_kernel_scale_offset(lr, kb, p.rows_per_expert, p.num_kb, p.order)] = s;
      } else {
        store8(blocks + r * row_bytes + b, lo, hi, out_vec, 8);
      }
    } else {
      const int64_t k = kb * kMxBlockSize + half * 16;
      uint8_t* q = reinterpret_cast<uint8_t*>(p.q) + r * p.x.cols + k;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        if (!poisoned) encode8_e4m3(v + 8 * c, se, lo, hi);
        store8(q + 8 * c, lo, hi, out_vec, p.x.cols - (k + 8 * c));
      }
    }
    if (half == 0) p.scales[r * p.num_kb + kb] = s;
  }
}

template <int kMode>
void launch_mx(const MxQuantPlan& p, bool vec, bool out_vec, int64_t lanes, cudaStream_t st) {
  const unsigned grid = blocks_for(lanes, kThreads);
  if (p.x.bf16) {
    if (vec) mx_quantize_kernel<true, true, kMode><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
    else mx_quantize_kernel<true, false, kMode><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
  } else {
    if (vec) mx_quantize_kernel<false, true, kMode><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
    else mx_quantize_kernel<false, false, kMode><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
  }
}

// ---- UE8M0 FP8, 1 x 128 -------------------------------------------------------------------

__device__ __forceinline__ E8M0 ue8m0_scale(uint32_t amax) {
  return ue8m0_scale_from_quotient(amax, __fdiv_rn(__uint_as_float(amax), kE4M3Max));
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

template <bool kBf16, bool kVec>
__global__ void __launch_bounds__(kThreads)
    fp8_token_kernel(const Fp8QuantPlan p, int64_t total_lanes, bool out_vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t end = (total_lanes + 31) & ~int64_t{31};
  for (int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; id < end;
       id += stride) {
    const bool valid = id < total_lanes;
    const int sub = static_cast<int>(id & 7);
    const int64_t blk = id >> 3;
    int64_t r = 0, kb = 0;
    uint32_t v[16];
    if (valid) {
      r = blk / p.g.num_kb;
      kb = blk - r * p.g.num_kb;
      const int64_t ro = p.x.row_offset(r), k = kb * kFp8BlockK + sub * 16;
      load8<kBf16, kVec>(p.x, ro, k, v);
      load8<kBf16, kVec>(p.x, ro, k + 8, v + 8);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = 0;
    }
    uint32_t amax = abs_max8(v + 8, abs_max8(v, 0));
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
    if (!valid) continue;
    const E8M0 s = ue8m0_scale(amax);
    const bool poisoned = e8m0_is_nan(s);
    const int64_t k = kb * kFp8BlockK + sub * 16;
    uint8_t* q = reinterpret_cast<uint8_t*>(p.q) + r * p.g.cols + k;
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (!poisoned) encode8_e4m3(v + 8 * c, e8m0_exponent(s), lo, hi);
      store8(q + 8 * c, lo, hi, out_vec, p.g.cols - (k + 8 * c));
    }
    if (sub == 0) write_fp8_scale(p, p.g.scale_row(r), kb, s);
  }
}

// ---- UE8M0 FP8, 128 x 128 -----------------------------------------------------------------

constexpr int kTileThreads = 256;
constexpr int kTileChunks = kFp8WeightBlockN * kFp8BlockK / 8 / kTileThreads;  // 8 per thread

template <bool kBf16, bool kVec>
__global__ void __launch_bounds__(kTileThreads) fp8_tile_kernel(const Fp8QuantPlan p, bool out_vec) {
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
  // (bf16) rows per instruction.
  uint32_t v[kTileChunks][8];
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < kTileChunks; ++i) {
    const int64_t r = r0 + 16 * i + (t >> 4);
    if (r < r1) {
      load8<kBf16, kVec>(p.x, p.x.row_offset(r), k, v[i]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[i][j] = 0;
    }
    amax = abs_max8(v[i], amax);
  }
  amax = __reduce_max_sync(0xffffffffu, amax);
  if ((t & 31) == 0) warp_max[t >> 5] = amax;
  __syncthreads();
  amax = 0;
#pragma unroll
  for (int w = 0; w < kTileThreads / 32; ++w) amax = max(amax, warp_max[w]);
  const E8M0 s = ue8m0_scale(amax);
  const bool poisoned = e8m0_is_nan(s);
  if (t == 0) write_fp8_scale(p, sr, kb, s);
#pragma unroll
  for (int i = 0; i < kTileChunks; ++i) {
    const int64_t r = r0 + 16 * i + (t >> 4);
    if (r >= r1 || k >= g.cols) continue;
    uint32_t lo = 0, hi = 0;
    if (!poisoned) encode8_e4m3(v[i], e8m0_exponent(s), lo, hi);
    store8(reinterpret_cast<uint8_t*>(p.q) + r * g.cols + k, lo, hi, out_vec, g.cols - k);
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
      } else {
        bits = e4m3_decode_bits(p.q[i], e8m0_exponent(s));
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

// kPlain / kGateUpInterleaved: one closed group of rows per CTA. Read the group's span into
// shared memory, then write each chunk (16 bytes, or 1 on a misaligned tensor) from where
// the other layout keeps it.
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
    base[c] = staged[from / kW];
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
  auto move = [&](const Chunk* from, Chunk* to) {  // shared -> global, transposing
    for (int c = threadIdx.x; c < chunks; c += blockDim.x)
      to[c] = from[tile_source(c * kW, row_bytes, p.to_kernel) / kW];
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
  const int64_t lanes = p.x.rows * p.num_kb * 2;
  if (lanes == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const bool vec = p.x.contiguous && p.x.cols % 8 == 0 && aligned(p.x.data, 16);
  const bool out_vec = p.fp4 ? aligned(p.blocks, 8) : aligned(p.q, 8) && p.x.cols % 8 == 0;
  if (!p.fp4) launch_mx<kMxfp8>(p, vec, out_vec, lanes, stream_of(ctx));
  else if (p.kernel_layout) launch_mx<kMxfp4Kernel>(p, vec, out_vec, lanes, stream_of(ctx));
  else launch_mx<kMxfp4Checkpoint>(p, vec, out_vec, lanes, stream_of(ctx));
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
    const unsigned grid = blocks_for(lanes, kThreads);
    if (p.x.bf16) {
      if (vec) fp8_token_kernel<true, true><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
      else fp8_token_kernel<true, false><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
    } else {
      if (vec) fp8_token_kernel<false, true><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
      else fp8_token_kernel<false, false><<<grid, kThreads, 0, st>>>(p, lanes, out_vec);
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
