// CUDA twin of cpu_moe_experts.cpp: the routed experts as
//   permute (one CTA) -> activations to bf16 / MXFP8 -> grouped gate_up GEMM with bias and
//   SwiGLU in the epilogue -> [h to MXFP8] -> grouped down GEMM with bias -> combine in k order.
// MXFP4 weights with few tokens per expert (pairs / active experts < 48) take the decode kernels
// further down (decode_gemm_kernel: mma.sync with the weights as A, see its NOTES); with more,
// the prefill kernel (prefill_gemm_kernel: weight tiles dequantized once per CTA into shared
// memory, ldmatrix + mma.sync over 64 or 128 tokens; MXFP8 activations reach it as bf16); the
// tiled WMMA GEMM below serves bf16 weights at prefill sizes (and MXFP4 past the prefill grid's
// 65,535 M tiles).
//
// Permutation: every valid (token, k) pair gets its physical expert e = l2p[id] (a bad id or
// map entry: the pair is dropped); a counting sort groups pairs by expert (order inside one
// expert is whatever the atomics give: each GEMM row depends only on its own pair, and the
// combine reads rows back by pair in k order, so results do not depend on it). The M tiles
// of every expert (ceil(count / BM) each) are listed in a tile table; the GEMM grid is
// (max_m_tiles(P, E, BM), N / 64) for P pairs (the prefill kernel's: (N / 128, max_m_tiles)),
// a bound known on the host without a sync (the
// grid does not depend on the routing, which keeps the launch capturable in a CUDA graph), and
// CTAs past the real tile count exit at once. Experts with no tokens cost nothing.
//
// GEMM (simple, no wgmma, no TMA): a CTA computes BM pair rows x 64 kernel rows of one expert,
// K in steps of 256 (BM 16) or 128 (BM 64) through shared memory as bf16, WMMA m16n16k16 (bf16
// in, fp32 accumulate), 4 warps. Global loads are 16-byte vectors, prefetched into registers one step ahead. Weights
// and MXFP8 activations are dequantized on the way into shared memory (E2M1 from the arranged
// words by bit moves, E4M3 with a lookup table; exact: E2M1 and E4M3 values times a power of
// two are bf16 numbers), so the tensor cores see exactly the dequantized operands the CPU
// reference multiplies in FP32.
// - MXFP4 weights: the tiled kernel layout (kernels/quant/mxfp4.hpp): one 16-byte vector is one
//   32-element block of one row (4 arranged words), a 16 x 64 tile is 512 contiguous bytes; gate/up rows come in
//   groups of 32 (16 gate then the 16 up rows of the same features), so a 64-row CTA holds 32
//   complete (gate, up) pairs and applies SwiGLU in its epilogue.
// - bf16 weights: checkpoint rows, read in that same kernel-row order
//   (mxfp4_checkpoint_row), so the epilogue is shared.
// H % 64 == 0 and I % 64 == 0 (host-checked); the last K step may be partly empty (zero-filled).
#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/moe/moe_math.hpp"
#include "kernels/moe/moe_plan.hpp"
#include "kernels/quant/e4m3_cuda.cuh"
#include "kernels/quant/mxfp4.hpp"
#include "kernels/quant/quant_ops.hpp"

namespace rolloutd::moe::detail {
namespace {

using cuda::DeviceGuard;
using cuda::stream_of;
namespace wmma = nvcuda::wmma;

constexpr int kThreads = 128;
constexpr int kBN = 64;        // kernel rows (output columns) per CTA
constexpr int kLdC = kBN + 4;  // shared row stride of the fp32 tile
constexpr int kPermuteThreads = 1024;

struct GemmArgs {
  const int32_t* expert_offsets;  // [E + 1]
  const int32_t* tile_expert;     // [tiles]
  const int32_t* tile_row0;       // [tiles]
  const int32_t* meta;            // meta[0]: number of tiles
  const int32_t* sorted_pair;     // [P]
  int top_k;
  // A operand: rows of K elements (gate_up: one row per token; down: one row per sorted pair).
  const uint16_t* a_bf16;
  const uint8_t* a_q;       // e4m3 [rows, K]
  const uint8_t* a_scales;  // e8m0 [rows, K / 32]
  // B operand: every expert's [N, K] matrix.
  const uint16_t* w_bf16;   // [E, N, K] checkpoint rows
  const uint8_t* w_blocks;  // MXFP4 kernel layout
  const uint8_t* w_scales;  // kernel-layout scales
  int row_order;            // quant::Mxfp4RowOrder of the checkpoint rows
  int64_t n, k;
  const float* bias;  // [E, N] checkpoint rows, nullable
  // Epilogue.
  int act_kind;
  float limit, alpha;
  int64_t inter;      // gate_up: I (h row length)
  uint16_t* h_bf16;   // gate_up out, bf16 [P, I]
  float* h_f32;       // gate_up out, fp32 [P, I] (quantized to MXFP8 afterwards)
  float* y;           // down out, fp32 [P, N]
  int h_mx8;          // prefill gate_up: h_bf16 gets h through MXFP8 and back (prefill_h_mx8)
};

// BM pair rows x 64 kernel rows per CTA, K in steps of kBK. The decode tile (BM 16) takes
// 256-wide K steps: twice the bytes in flight per CTA, which is what a bandwidth-bound
// few-tokens-per-expert GEMM needs; the prefill tile (BM 64) keeps 128 to stay within 48 KiB of
// static shared memory.
template <int BM>
struct TileShape {
  static constexpr int kBK = BM == 16 ? 256 : 128;
  static constexpr int kLdAB = kBK + 8;  // shared row stride in bf16 (16-aligned, skewed banks)
  static constexpr int kWarpsM = BM >= 32 ? 2 : 1;
  static constexpr int kWarpsN = 4 / kWarpsM;
  static constexpr int kFragM = BM / 16 / kWarpsM;
  static constexpr int kFragN = kBN / 16 / kWarpsN;
  static constexpr int kABytes = BM * kLdAB * 2;  // a multiple of 32 bytes (WMMA alignment)
  static constexpr int kBBytes = kBN * kLdAB * 2;
  static constexpr int kCBytes = BM * kLdC * 4;
  static constexpr int kSmem = (kABytes + kBBytes) > kCBytes ? (kABytes + kBBytes) : kCBytes;
  static_assert(kFragM * kWarpsM * 16 == BM && kFragN * kWarpsN * 16 == kBN, "tile split");
  static_assert(kSmem + BM * 8 + 256 * 2 <= 48 * 1024, "static shared memory");
  static_assert(kABytes % 32 == 0 && (16 * kLdAB * 2) % 32 == 0, "WMMA pointer alignment");
};

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 x, y;
  memcpy(&x, &a, 4);
  memcpy(&y, &b, 4);
  const __nv_bfloat162 r = __hmul2(x, y);
  uint32_t o;
  memcpy(&o, &r, 4);
  return o;
}

// 2^(s - 127) as a bf16 pair (s = 255: NaN). Every E8M0 value is a bf16 number.
__device__ __forceinline__ uint32_t scale_bf16x2(uint8_t s) {
  const uint32_t f = quant::e8m0_decode_bits(quant::E8M0{s});
  const uint32_t b = f32_to_bf16_bits(quant::f32_from_bits(f));
  return b | (b << 16);
}

__device__ __forceinline__ uint32_t bf16x2_mul_rn(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The four bf16 pairs of an arranged MXFP4 word (kernels/quant/mxfp4.hpp, layout step 4):
// slots p[0..3] hold elements (0,4), (1,5), (3,7), (2,6) of the word's 8, each as the bf16 bits
// of E2M1 * 2^-126 (sign at bit 15 / 31, e1 e0 m at bits 8..6 / 24..22): 9 integer
// instructions per word.
__device__ __forceinline__ void e2m1_pairs_raw(uint32_t a, uint32_t (&p)[4]) {
  constexpr uint32_t kM = 0x81C081C0u;
  p[0] = a & kM;
  p[1] = __funnelshift_r(a, a, 4) & kM;
  p[2] = __funnelshift_r(a, a, 10) & kM;
  p[3] = (__funnelshift_r(a, a, 6) & 0x81808180u) | (__funnelshift_r(a, a, 14) & 0x00400040u);
}

// The bf16x2 factor that turns e2m1_pairs_raw() into E2M1 * 2^(s - 127): 2^(s - 1) for scale
// codes s <= 128; for 128 < s < 255 that overflows bf16, so such codes take 2^126 here and
// dec_big_factor() afterwards (a warp takes that slower path only when one of its lanes needs
// it: real expert weights never do); s = 255 (NaN) gives NaN.
__device__ __forceinline__ uint32_t dec_factor(uint32_t s) {
  const uint32_t b = s == 255u ? 0x7FC0u : (s <= 128u ? (s + 126u) << 7 : 0x7E80u);
  return b | (b << 16);
}
__device__ __forceinline__ uint32_t dec_big_factor(uint32_t s) {
  const uint32_t b = (s > 128u && s < 255u) ? s << 7 : 0x3F80u;  // 2^(s - 127), else 1
  return b | (b << 16);
}
// dec_factor() for s <= 128 in one integer multiply-add: (s + 126) << 7 in both halves. The
// chunk loop takes it when no lane of the warp has a larger code (one vote on the maximum), and
// dec_factor() / dec_big_factor() otherwise: the scale costs two instructions per 32 weights.
__device__ __forceinline__ uint32_t dec_factor_small(uint32_t s) { return s * 0x00800080u + 0x3F003F00u; }


// The 8 elements of an arranged word in K order as bf16 pairs (0,1), (2,3), (4,5), (6,7), times
// 2^(s - 127) for block scale code s: the bits of the E2M1 value times scale_bf16x2(s), as the
// byte lookup table of the layout's v1 gave them (both products are exact; a scale code above
// 128 goes through the E2M1 value first, since 2^(s - 1) is not a bf16 number).
__device__ __forceinline__ void e2m1_word_bf16(uint32_t a, uint32_t s, uint32_t* o) {
  uint32_t p[4];
  e2m1_pairs_raw(a, p);
  if (s <= 128u) {
    const uint32_t f = dec_factor_small(s);
#pragma unroll
    for (int q = 0; q < 4; ++q) p[q] = bf16x2_mul_rn(p[q], f);
  } else {
    const uint32_t f = scale_bf16x2(static_cast<uint8_t>(s));
#pragma unroll
    for (int q = 0; q < 4; ++q) p[q] = bf16x2_mul_rn(bf16x2_mul_rn(p[q], 0x7E807E80u), f);  // x 2^126: the E2M1 value
  }
  o[0] = __byte_perm(p[0], p[1], 0x5410);  // low halves of (0,4) and (1,5)
  o[1] = __byte_perm(p[3], p[2], 0x5410);  // low halves of (2,6) and (3,7)
  o[2] = __byte_perm(p[0], p[1], 0x7632);  // high halves
  o[3] = __byte_perm(p[3], p[2], 0x7632);
}

// Occupancy: the MXFP4 kernels are held to 128 (decode) / 168 (prefill) registers so that 4 / 3
// CTAs share an SM (a few bytes spill in the prefill tile); the bf16-weight kernels keep their
// registers (their 16-vector prefetch would spill kilobytes).
template <int BM, bool kBf16W, bool kMx8A, bool kGateUp>
__global__ void __launch_bounds__(kThreads, kBf16W ? 1 : (BM == 16 ? 4 : 3)) gemm_kernel(const GemmArgs g) {
  using S = TileShape<BM>;
  constexpr int kBK = S::kBK, kLdAB = S::kLdAB;
  __shared__ __align__(128) uint8_t smem[S::kSmem];
  __shared__ int64_t row_src[BM];
  __shared__ uint16_t lut_e4m3[256];   // E4M3 code -> bf16 (scale 2^0)

  const int tile = blockIdx.x;
  if (tile >= g.meta[0]) return;  // whole CTA
  const int tid = threadIdx.x;
  const int e = g.tile_expert[tile];
  const int row0 = g.tile_row0[tile];
  const int base = g.expert_offsets[e];
  const int count = g.expert_offsets[e + 1] - base;
  const int rows = count - row0 < BM ? count - row0 : BM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const int64_t kdim = g.k, ndim = g.n;

  if (tid < BM) {
    int64_t src = -1;
    if (tid < rows) {
      const int s = base + row0 + tid;
      src = kGateUp ? g.sorted_pair[s] / g.top_k : s;
    }
    row_src[tid] = src;
  }
  for (int i = tid; i < 256; i += kThreads) {
    if constexpr (kMx8A)
      lut_e4m3[i] = f32_to_bf16_bits(quant::f32_from_bits(
          quant::e4m3_decode_bits(quant::E4M3{static_cast<uint8_t>(i)}, 0)));
  }
  __syncthreads();

  __nv_bfloat16* as = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* bs = reinterpret_cast<__nv_bfloat16*>(smem + S::kABytes);
  uint16_t* as_u = reinterpret_cast<uint16_t*>(as);
  uint16_t* bs_u = reinterpret_cast<uint16_t*>(bs);

  // ---- register prefetch of one K step ----
  constexpr int kAChunks = kMx8A ? BM * (kBK / 16) / kThreads : BM * (kBK / 8) / kThreads;
  constexpr int kBChunks = kBf16W ? kBN * (kBK / 8) / kThreads : kBN * (kBK / 32) / kThreads;
  static_assert(kAChunks >= 1 && kBChunks >= 1, "chunks per thread");
  uint4 a_reg[kAChunks];
  uint8_t a_sc[kMx8A ? kAChunks : 1];
  uint4 b_reg[kBChunks];
  uint8_t b_sc[kBf16W ? 1 : kBChunks];
  const uint4 zero4 = make_uint4(0, 0, 0, 0);

  const int64_t k_tiles = kdim / 64;  // MXFP4 64-wide K tiles per row tile
  const uint8_t* wblk = g.w_blocks + static_cast<int64_t>(e) * ndim * kdim / 2;
  const uint8_t* wsc = g.w_scales + static_cast<int64_t>(e) * ndim * kdim / 32;

  auto load = [&](int64_t k0) {
#pragma unroll
    for (int j = 0; j < kAChunks; ++j) {
      const int c = tid + j * kThreads;
      if constexpr (kMx8A) {
        const int m = c / (kBK / 16), kc = (c % (kBK / 16)) * 16;
        const int64_t src = row_src[m];
        const bool ok = src >= 0 && k0 + kc < kdim;
        a_reg[j] = ok ? __ldg(reinterpret_cast<const uint4*>(g.a_q + src * kdim + k0 + kc)) : zero4;
        a_sc[j] = ok ? g.a_scales[src * (kdim / 32) + (k0 + kc) / 32] : 0;
      } else {
        const int m = c / (kBK / 8), kc = (c % (kBK / 8)) * 8;
        const int64_t src = row_src[m];
        const bool ok = src >= 0 && k0 + kc < kdim;
        a_reg[j] = ok ? __ldg(reinterpret_cast<const uint4*>(g.a_bf16 + src * kdim + k0 + kc)) : zero4;
      }
    }
#pragma unroll
    for (int j = 0; j < kBChunks; ++j) {
      const int c = tid + j * kThreads;
      if constexpr (kBf16W) {
        const int r = c / (kBK / 8), kc = (c % (kBK / 8)) * 8;
        const int64_t kr = n0 + r;
        const int64_t cr =
            quant::mxfp4_checkpoint_row(kr, ndim, static_cast<quant::Mxfp4RowOrder>(g.row_order));
        const bool ok = k0 + kc < kdim;
        b_reg[j] = ok ? __ldg(reinterpret_cast<const uint4*>(
                            g.w_bf16 + (static_cast<int64_t>(e) * ndim + cr) * kdim + k0 + kc))
                      : zero4;
      } else {
        const int ti = c >> 5, within = c & 31;  // 32 vectors per 16 x 64 tile
        const int rt = ti / (kBK / 64), kt = ti % (kBK / 64);
        const int row = within >> 1, half = within & 1;
        const int64_t ktile = k0 / 64 + kt;
        const int64_t tile_idx = (n0 / 16 + rt) * k_tiles + ktile;
        const bool ok = ktile < k_tiles;
        b_reg[j] = ok ? __ldg(reinterpret_cast<const uint4*>(wblk + tile_idx * 512 + row * 32 + half * 16))
                      : zero4;
        b_sc[j] = ok ? wsc[tile_idx * 32 + row * 2 + half] : 0;
      }
    }
  };

  auto store = [&]() {
#pragma unroll
    for (int j = 0; j < kAChunks; ++j) {
      const int c = tid + j * kThreads;
      if constexpr (kMx8A) {
        const int m = c / (kBK / 16), kc = (c % (kBK / 16)) * 16;
        const uint32_t sc = scale_bf16x2(a_sc[j]);
        const uint32_t words[4] = {a_reg[j].x, a_reg[j].y, a_reg[j].z, a_reg[j].w};
        uint32_t o[8];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint32_t wv = words[q];
          const uint32_t p0 = static_cast<uint32_t>(lut_e4m3[wv & 0xffu]) |
                              (static_cast<uint32_t>(lut_e4m3[(wv >> 8) & 0xffu]) << 16);
          const uint32_t p1 = static_cast<uint32_t>(lut_e4m3[(wv >> 16) & 0xffu]) |
                              (static_cast<uint32_t>(lut_e4m3[wv >> 24]) << 16);
          o[2 * q] = bf16x2_mul(p0, sc);
          o[2 * q + 1] = bf16x2_mul(p1, sc);
        }
        uint4* dst = reinterpret_cast<uint4*>(as_u + m * kLdAB + kc);
        dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
        dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
      } else {
        const int m = c / (kBK / 8), kc = (c % (kBK / 8)) * 8;
        *reinterpret_cast<uint4*>(as_u + m * kLdAB + kc) = a_reg[j];
      }
    }
#pragma unroll
    for (int j = 0; j < kBChunks; ++j) {
      const int c = tid + j * kThreads;
      if constexpr (kBf16W) {
        const int r = c / (kBK / 8), kc = (c % (kBK / 8)) * 8;
        *reinterpret_cast<uint4*>(bs_u + r * kLdAB + kc) = b_reg[j];
      } else {
        const int ti = c >> 5, within = c & 31;
        const int rt = ti / (kBK / 64), kt = ti % (kBK / 64);
        const int row = within >> 1, half = within & 1;
        const uint32_t words[4] = {b_reg[j].x, b_reg[j].y, b_reg[j].z, b_reg[j].w};
        uint32_t o[16];
#pragma unroll
        for (int q = 0; q < 4; ++q) e2m1_word_bf16(words[q], b_sc[j], o + 4 * q);
        uint4* dst = reinterpret_cast<uint4*>(bs_u + (rt * 16 + row) * kLdAB + kt * 64 + half * 32);
        dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
        dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
        dst[2] = make_uint4(o[8], o[9], o[10], o[11]);
        dst[3] = make_uint4(o[12], o[13], o[14], o[15]);
      }
    }
  };

  const int warp = tid >> 5;
  const int wm = warp / S::kWarpsN, wn = warp % S::kWarpsN;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[S::kFragM][S::kFragN];
#pragma unroll
  for (int i = 0; i < S::kFragM; ++i)
#pragma unroll
    for (int j = 0; j < S::kFragN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const int64_t steps = (kdim + kBK - 1) / kBK;
  load(0);
  for (int64_t st = 0; st < steps; ++st) {
    store();
    __syncthreads();
    if (st + 1 < steps) load((st + 1) * kBK);
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> af[S::kFragM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> bf[S::kFragN];
#pragma unroll
      for (int i = 0; i < S::kFragM; ++i)
        wmma::load_matrix_sync(af[i], as + ((wm * S::kFragM + i) * 16) * kLdAB + kk, kLdAB);
#pragma unroll
      for (int j = 0; j < S::kFragN; ++j)
        wmma::load_matrix_sync(bf[j], bs + ((wn * S::kFragN + j) * 16) * kLdAB + kk, kLdAB);
#pragma unroll
      for (int i = 0; i < S::kFragM; ++i)
#pragma unroll
        for (int j = 0; j < S::kFragN; ++j) wmma::mma_sync(acc[i][j], af[i], bf[j], acc[i][j]);
    }
    __syncthreads();
  }

  // ---- epilogue through shared memory (the operand tiles are dead now) ----
  float* cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < S::kFragM; ++i)
#pragma unroll
    for (int j = 0; j < S::kFragN; ++j)
      wmma::store_matrix_sync(cs + ((wm * S::kFragM + i) * 16) * kLdC + (wn * S::kFragN + j) * 16,
                              acc[i][j], kLdC, wmma::mem_row_major);
  __syncthreads();

  const float* bias = g.bias ? g.bias + static_cast<int64_t>(e) * ndim : nullptr;
  if constexpr (kGateUp) {
    // Columns [32 gg, 32 gg + 16) are the gate rows of features (n0/32 + gg)*16 + i, the next
    // 16 columns their up rows.
    const auto order = static_cast<quant::Mxfp4RowOrder>(g.row_order);
    for (int idx = tid; idx < BM * 32; idx += kThreads) {
      const int m = idx >> 5, gg = (idx >> 4) & 1, i = idx & 15;
      if (m >= rows) continue;
      const int cg = gg * 32 + i, cu = cg + 16;
      float gv = cs[m * kLdC + cg], uv = cs[m * kLdC + cu];
      if (bias) {
        gv = math::add(gv, bias[quant::mxfp4_checkpoint_row(n0 + cg, ndim, order)]);
        uv = math::add(uv, bias[quant::mxfp4_checkpoint_row(n0 + cu, ndim, order)]);
      }
      const float hv = math::activate(g.act_kind, g.limit, g.alpha, gv, uv);
      const int64_t j = (n0 / 32 + gg) * 16 + i;
      const int64_t s = base + row0 + m;
      if (g.h_bf16)
        g.h_bf16[s * g.inter + j] = f32_to_bf16_bits(hv);
      else
        g.h_f32[s * g.inter + j] = hv;
    }
  } else {
    for (int idx = tid; idx < BM * (kBN / 4); idx += kThreads) {
      const int m = idx / (kBN / 4), c4 = (idx % (kBN / 4)) * 4;
      if (m >= rows) continue;
      float4 v = *reinterpret_cast<const float4*>(cs + m * kLdC + c4);
      if (bias) {
        v.x = math::add(v.x, bias[n0 + c4]);
        v.y = math::add(v.y, bias[n0 + c4 + 1]);
        v.z = math::add(v.z, bias[n0 + c4 + 2]);
        v.w = math::add(v.w, bias[n0 + c4 + 3]);
      }
      const int64_t s = base + row0 + m;
      *reinterpret_cast<float4*>(g.y + s * ndim + n0 + c4) = v;
    }
  }
}

struct PermuteArgs {
  const int32_t* ids;
  const int32_t* l2p;
  int64_t pairs;  // num_valid * top_k
  const int32_t* num_valid_device;  // nullable: pairs past *it * top_k are padding
  int top_k;
  int num_logical, num_physical, bm;
  // Decode (bm = 2^30: one tile per busy expert): experts with more than `heavy` pairs (several
  // passes of the decode kernel) are listed first; 0: every expert in index order. Only with
  // bm = 2^30: the placement counts one tile per heavy expert (the host sets it so).
  int heavy;
  bool stage_l2p;  // the map fits in shared memory beside the counts: read from there
  int32_t* pair_expert;
  int32_t* pair_pos;
  int32_t* sorted_pair;
  int32_t* expert_offsets;
  int32_t* tile_expert;
  int32_t* tile_row0;
  int32_t* meta;
};

// One CTA: count pairs per expert, scan, scatter, list the M tiles.
// NOTES: at one decode token the kernel is a chain of dependent steps (ids, the map, five
// barriers, global writes read back), not work: with 1,024 threads it took 6.2 us of Nsight
// Compute time in a 49 us gpt-oss-120b layer. Launched with as many threads as pairs or experts
// (4 warps at one token), the scatter taking a thread's own pair from a register, the MoE layer at
// one token was 3.5 % (gpt-oss) and 6-8 % (Qwen3) faster and an h2880 step 2 % (same-run A/B on
// an H100, 2026-12-06, tests/bench/NOTES.md); the lists written are the same.
__global__ void __launch_bounds__(kPermuteThreads) permute_kernel(const PermuteArgs a) {
  extern __shared__ int32_t sh[];
  cuda::pdl_begin();
  int32_t* cnt = sh;                      // [E]: counts, then scatter cursors
  int32_t* toff = sh + a.num_physical;    // [E + 1]: first tile of each expert
  const int tid = threadIdx.x;
  // The loads that do not depend on each other go out together: this thread's first id (before
  // the count of real rows is known), the map (staged), the count. One round trip to memory
  // instead of three in a row (count, id, map), each ~0.5 us at one decode token.
  const int32_t first_id = tid < a.pairs ? a.ids[tid] : -1;
  const int32_t* l2p = a.l2p;
  if (a.stage_l2p) {
    int32_t* staged = toff + a.num_physical + 1;  // [L]
    for (int e = tid; e < a.num_logical; e += blockDim.x) staged[e] = a.l2p[e];
    l2p = staged;
  }
  // Pairs of padding rows (a graph replayed with fewer real rows than its bucket) get no expert.
  int64_t live = a.pairs;
  if (a.num_valid_device) {
    const int64_t d = *a.num_valid_device;
    const int64_t rows = d < 0 ? 0 : d;
    if (rows * a.top_k < live) live = rows * a.top_k;
  }
  for (int e = tid; e < a.num_physical; e += blockDim.x) cnt[e] = 0;
  __syncthreads();  // the counts zeroed, the map staged
  int32_t my_e = -1;  // pair tid's expert, kept for the scatter (a decode step's pairs: one a thread)
  for (int64_t i = tid; i < a.pairs; i += blockDim.x) {
    const int32_t id = i < live ? (i == tid ? first_id : a.ids[i]) : -1;
    int32_t e = -1;
    if (id >= 0 && id < a.num_logical) {
      const int32_t pe = l2p[id];
      if (pe >= 0 && pe < a.num_physical) e = pe;
    }
    a.pair_expert[i] = e;
    if (i == tid) my_e = e;
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  {
    // Exclusive scan of (pairs, tiles, heavy experts) over the experts: thread tid owns the
    // experts [e0, e1) (a few consecutive ones), the threads' sums are scanned by warp shuffles
    // and then across warps (thread 0 walking 128 experts alone took ~2.5 us of a decode step's
    // layer).
    __shared__ int32_t warp_pairs[kPermuteThreads / 32], warp_tiles[kPermuteThreads / 32],
        warp_heavy[kPermuteThreads / 32];
    const int nthreads = static_cast<int>(blockDim.x), nwarps = nthreads / 32;
    const int ne = a.num_physical, per = (ne + nthreads - 1) / nthreads;
    const int e0 = tid * per < ne ? tid * per : ne, e1 = e0 + per < ne ? e0 + per : ne;
    auto is_heavy = [&](int32_t c) { return a.heavy > 0 && c > a.heavy; };
    int32_t my_pairs = 0, my_tiles = 0, my_heavy = 0;
    for (int e = e0; e < e1; ++e) {
      my_pairs += cnt[e];
      my_tiles += (cnt[e] + a.bm - 1) / a.bm;
      my_heavy += is_heavy(cnt[e]);
    }
    const int lane = tid & 31, warp = tid >> 5;
    int32_t inc_pairs = my_pairs, inc_tiles = my_tiles, inc_heavy = my_heavy;  // inclusive within the warp
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t p = __shfl_up_sync(0xffffffffu, inc_pairs, d), t = __shfl_up_sync(0xffffffffu, inc_tiles, d),
                    hv = __shfl_up_sync(0xffffffffu, inc_heavy, d);
      if (lane >= d) {
        inc_pairs += p;
        inc_tiles += t;
        inc_heavy += hv;
      }
    }
    if (lane == 31) {
      warp_pairs[warp] = inc_pairs;
      warp_tiles[warp] = inc_tiles;
      warp_heavy[warp] = inc_heavy;
    }
    __syncthreads();
    int32_t off = inc_pairs - my_pairs, tiles = inc_tiles - my_tiles, heavy = inc_heavy - my_heavy, num_heavy = 0;
    for (int w = 0; w < nwarps; ++w) {
      if (w < warp) {
        off += warp_pairs[w];
        tiles += warp_tiles[w];
        heavy += warp_heavy[w];
      }
      num_heavy += warp_heavy[w];
    }
    // NOTES: the decode kernel's grid runs the listed experts in order, a row of CTAs each, in
    // about two waves at batch 32; an expert past the pass size takes twice as long a CTA, and
    // listed late it runs alone after the others have finished (longest first: the tail is the
    // light experts' short CTAs). Which CTA runs an expert does not change its sums.
    for (int e = e0; e < e1; ++e) {
      const int32_t c = cnt[e];
      const int32_t nt = (c + a.bm - 1) / a.bm;
      a.expert_offsets[e] = off;
      // Heavy experts take the first tiles in index order, the rest follow in index order (a
      // light expert's tiles: the tiles before it less the heavy experts' ones, one each).
      toff[e] = is_heavy(c) ? heavy : num_heavy + tiles - heavy;
      cnt[e] = off;  // cursor
      off += c;
      tiles += nt;
      heavy += is_heavy(c);
    }
    if (tid == nthreads - 1) {  // its running sums end at the totals
      a.expert_offsets[ne] = off;
      a.meta[0] = tiles;
      a.meta[1] = off;
    }
  }
  __syncthreads();
  for (int64_t i = tid; i < a.pairs; i += blockDim.x) {
    const int32_t e = i == tid ? my_e : a.pair_expert[i];
    if (e >= 0) {
      const int32_t pos = atomicAdd(&cnt[e], 1);
      a.sorted_pair[pos] = static_cast<int32_t>(i);
      a.pair_pos[i] = pos;
    } else {
      a.pair_pos[i] = -1;
    }
  }
  __syncthreads();  // cnt[e] is now the end of e's pairs (the cursors ran through them)
  for (int e = tid; e < a.num_physical; e += blockDim.x) {
    const int32_t c = cnt[e] - a.expert_offsets[e];
    const int32_t nt = (c + a.bm - 1) / a.bm;
    for (int32_t j = 0; j < nt; ++j) {
      a.tile_expert[toff[e] + j] = e;
      a.tile_row0[toff[e] + j] = j * a.bm;
    }
  }
}

__global__ void to_bf16_kernel(uint16_t* __restrict__ out, const float* __restrict__ in, int64_t n) {
  cuda::pdl_begin();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = f32_to_bf16_bits(in[i]);
}

// x [rows, cols] (FP32 or BF16, cols % 32 == 0) through MXFP8 and back, as BF16 rows: each
// 32-element block's scale and E4M3 codes by the rule quantize_mxfp8 follows (minifloat.hpp:
// mx_scale_from_amax, e4m3_encode; a block with a NaN or an Inf is poisoned), each code decoded
// as the staged MXFP8 passes decode it (dec_store_item: e4m3_decode_bits, a poisoned block's
// values NaN) and rounded to BF16 by the same function: exact (E4M3 has 3 mantissa bits) except
// for codes below BF16's smallest subnormal at the smallest scales, which both paths round the
// same way. The decode passes then read these rows as BF16: the same B values as staging the
// codes. One warp a block, a lane an element.
constexpr int kMx8RoundThreads = 256;
__global__ void __launch_bounds__(kMx8RoundThreads)
    mx8_round_bf16_kernel(uint16_t* __restrict__ out, const void* x, bool x_bf16, int64_t blocks) {
  cuda::pdl_begin();
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kMx8RoundThreads / 32);
  // Whole warps step together (blocks is the same for all), so the reduction sees 32 lanes.
  for (int64_t b = (static_cast<int64_t>(blockIdx.x) * kMx8RoundThreads + threadIdx.x) / 32; b < blocks;
       b += warps) {
    const int64_t i = b * quant::kMxBlockSize + lane;
    // x is the previous kernel's output: L2 loads after the wait, not __ldg.
    const uint32_t bits = x_bf16 ? static_cast<uint32_t>(__ldcg(static_cast<const unsigned short*>(x) + i)) << 16
                                 : __float_as_uint(__ldcg(static_cast<const float*>(x) + i));
    // The block's largest magnitude as FP32 bits: NaN and Inf sort above every finite value.
    const uint32_t amax = __reduce_max_sync(0xffffffffu, bits & quant::kF32AbsMask);
    const quant::E8M0 sc = quant::mx_scale_from_amax(amax, quant::kE4M3EmaxElem);
    // The round trip on the hardware's conversions (e4m3_cuda.cuh): the same bits as
    // e4m3_decode_bits(e4m3_encode(bits, se), se).
    const float f = quant::e8m0_is_nan(sc) ? quant::f32_from_bits(quant::kF32CanonicalNan)
                                           : quant::mx8_round2(__uint_as_float(bits), 0.0f, quant::e8m0_exponent(sc)).x;
    out[i] = f32_to_bf16_bits(f);
  }
}

// out[t] = (accumulate ? out[t] : 0) + sum_k w[t,k] y[pos(t,k)], k in order; padding rows 0.
// Grid (token, block of kCombineThreads float4 columns): one token spreads over H / 512 CTAs
// (one CTA walking all H columns took ~12 us per layer at one token).
constexpr int kCombineThreads = 128;
constexpr int kCombineMaxK = 8;  // picks a token held in registers (more: the loop)
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(float* __restrict__ out, const float* __restrict__ y, const int32_t* __restrict__ pair_pos,
                   const float* __restrict__ w, int64_t num_valid, const int32_t* __restrict__ num_valid_device,
                   int64_t hidden, int top_k, bool accumulate) {
  cuda::pdl_begin();
  const int64_t t = blockIdx.x;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kCombineThreads + threadIdx.x) * 4;
  if (c >= hidden) return;
  if (num_valid_device) {  // the count of this replay (graphs padded to a bucket)
    const int64_t d = *num_valid_device;
    if (d < num_valid) num_valid = d < 0 ? 0 : d;
  }
  float* row = out + t * hidden;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (t < num_valid && top_k <= kCombineMaxK) {
    // The same sums as the loop below, with every load in flight at once: the positions and
    // weights, then the rows they name (a loop of dependent loads, two round trips a pick, took
    // 4.0 us at one token, top-4, and 5.0 us at 8 tokens, top-8, on an H100).
    if (accumulate) acc = *reinterpret_cast<const float4*>(row + c);
    int32_t pos[kCombineMaxK];
    float wk[kCombineMaxK];
    float4 v[kCombineMaxK];
#pragma unroll
    for (int j = 0; j < kCombineMaxK; ++j) {
      pos[j] = j < top_k ? pair_pos[t * top_k + j] : -1;
      wk[j] = j < top_k ? w[t * top_k + j] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kCombineMaxK; ++j)
      if (pos[j] >= 0) v[j] = *reinterpret_cast<const float4*>(y + static_cast<int64_t>(pos[j]) * hidden + c);
#pragma unroll
    for (int j = 0; j < kCombineMaxK; ++j) {
      if (pos[j] < 0) continue;
      acc.x = math::add(acc.x, math::mul(wk[j], v[j].x));
      acc.y = math::add(acc.y, math::mul(wk[j], v[j].y));
      acc.z = math::add(acc.z, math::mul(wk[j], v[j].z));
      acc.w = math::add(acc.w, math::mul(wk[j], v[j].w));
    }
  } else if (t < num_valid) {
    if (accumulate) acc = *reinterpret_cast<const float4*>(row + c);
    for (int j = 0; j < top_k; ++j) {
      const int32_t pos = pair_pos[t * top_k + j];
      if (pos < 0) continue;
      const float wk = w[t * top_k + j];
      const float4 v = *reinterpret_cast<const float4*>(y + static_cast<int64_t>(pos) * hidden + c);
      acc.x = math::add(acc.x, math::mul(wk, v.x));
      acc.y = math::add(acc.y, math::mul(wk, v.y));
      acc.z = math::add(acc.z, math::mul(wk, v.z));
      acc.w = math::add(acc.w, math::mul(wk, v.w));
    }
  }
  *reinterpret_cast<float4*>(row + c) = acc;
}

// ---- decode path: MXFP4 weights x few tokens per expert ----------------------------------------
//
// NOTES (why this kernel exists): with a few tokens per expert the layer is a stream of MXFP4
// weights (0.53 bytes per weight) past a handful of activation rows, so the whole game is to keep
// enough bytes in flight on every SM (Little's law: ~16 B/cycle/SM at the HBM rate times ~1 us of
// latency, ~20-30 KB per SM) and to spend few instructions per weight. The tiled WMMA kernel above
// stages dequantized bf16 weights through shared memory and keeps ~8.5 KB per CTA in flight; here:
// - "Swap AB": weights are the MMA's A operand (16 kernel rows = M), tokens its B operand (N = 8
//   per n-tile), mma.sync m16n8k16 bf16 with FP32 accumulation, so a single token wastes nothing
//   on the weight side.
// - Each lane fetches its own A fragments as 16-byte vectors of the tiled layout (row r and
//   r + 8 of a 16-row tile, one 32-element block each, lanes 4r..4r+3 covering a 128-wide K
//   chunk: two 256-byte runs per copy instruction, whole sectors) through a per-warp cp.async
//   ring in shared memory (3 stages: chunks i + 1 and i + 2 in flight while chunk i is used, no
//   register cost; every lane reads back only its own bytes), and dequantizes in registers: E2M1 codes are moved into bf16 bit positions (value * 2^-126, subnormal for
//   +-0.5) and multiplied by the block scale 2^(s-127) * 2^126 (exact: every E2M1 value times a
//   power of two is a bf16 number; scales above 2^1 take a second multiply). The layout stores
//   each word's bits arranged for this (mxfp4.hpp, step 4): 9 integer instructions for its 4
//   pairs (an AND; a rotate and an AND twice; two of each and an OR).
// - The K order inside a chunk is permuted (a 32-bit word's pairs are its elements (0,4), (1,5),
//   (3,7), (2,6)), so the activations are staged in shared memory once per CTA in the same
//   permuted order, as bf16 (rounded exactly as the other path rounds them).
// - A warp owns 32 kernel rows (for gate_up: 16 gate and the 16 up rows of the same features, so
//   SwiGLU runs in registers); the CTA's 8 warps split K (1-8 ways, reduced through shared
//   memory in a fixed order: deterministic) or take more rows, whichever gives enough CTAs.
// - A pass takes up to 4 n-tiles (32 tokens; 5 where experts average more than 24): every dequantized A fragment feeds one mma per
//   n-tile, so the weight bytes and the dequantization per token drop with the tokens per pass;
//   an expert with more tokens takes several passes, each streaming all its weights again. Each
//   n-tile's accumulator sees the same mma sequence whatever the n-tiles per pass, so results
//   do not depend on them. 8 tokens per pass only (the launch's tok_cap) while experts average
//   at most 4 tokens (decode: nothing to gain, and staged rows cost shared memory).
// - Staged rows take (K * 2 + 64) bytes each (5.9 KB at K = 2880): 32 of them do not fit beside
//   the rings with two CTAs per SM, so passes of more than 8 tokens stage K in segments (the
//   chunks every K slice works through next), synchronising the CTA between segments while the
//   weight rings stay in flight: as many CTA-wide stagings as the 8-token passes they replace.
// - 8 warps x 2 CTAs per SM (registers, shared memory): ncu showed the first version (4 warps,
//   16 staged tokens, one CTA per SM) issue-starved at 6 % occupancy.
constexpr int kDecWarps = 8;
constexpr int kDecThreads = kDecWarps * 32;
constexpr int kDecMaxTok = 8;  // tokens per pass while experts see few tokens (one n-tile)
constexpr int kDecMaxNt = 5;   // n-tiles per pass at most (five_n_tiles(): 4 where it is off)
constexpr int kDecStages = 3;

enum DecSrc : int { kSrcF32 = 0, kSrcBf16 = 1, kSrcMx8 = 2 };

struct DecodeArgs {
  const int32_t* expert_offsets;  // [E + 1]
  const int32_t* active;          // [>= bound]: physical ids of the experts with pairs (heavy first)
  const int32_t* meta;            // meta[0]: number of active experts
  const int32_t* sorted_pair;     // [P]
  int top_k;
  int src;                        // DecSrc of the B operand
  const void* b;                  // gate_up: x [T, K] (f32 / bf16); down: h [P, K] bf16
  const uint8_t* b_q;             // MXFP8 codes [rows, K]
  const uint8_t* b_scales;        // MXFP8 scales [rows, K / 32]
  const uint8_t* w_blocks;        // MXFP4 kernel layout, every expert
  const uint8_t* w_scales;
  int row_order;                  // quant::Mxfp4RowOrder of the checkpoint rows (bias lookup)
  int n, k;                       // kernel rows, K
  int ksplit;                     // 1, 2, 4 or 8 warps along K
  int tok_cap;                    // staged rows per pass (<= 8 kDecMaxNt; the smem size)
  int seg_chunks, num_segs;       // K staged in num_segs segments of seg_chunks chunks per slice
  int ks_log2, seg_recip;         // log2(ksplit); ceil(2^16 / seg_chunks), exact for every slot (num_segs > 1; else 0)
  uint32_t pair_recip;            // ceil(2^32 / top_k), or 0 (divide): not exact for every pair, or top_k 1
  int row_blocks;                 // blocks of kDecWarps / ksplit 32-row groups per expert (>= the CTAs an expert)
  int expert_major;               // grid (experts, CTAs an expert) instead of (CTAs an expert, experts)
  const float* bias;              // [E, N] checkpoint rows, nullable
  int act_kind;
  float limit, alpha;
  int inter;
  uint16_t* h_bf16;  // gate_up out [P, I] (sorted rows)
  float* h_f32;      // gate_up out for MXFP8 (quantized afterwards)
  float* y;          // down out [P, N] fp32 (sorted rows)
};

using cuda::mma_bf16_16816;

// Stage B rows base + g0 + n (n < nrows) into shared memory as bf16, permuted: the 16 bytes at
// n*stride + slot*256 + wi*64 + c*16 hold the pairs (0,4), (1,5), (3,7), (2,6) of elements
// kc*128 + 32c + 8wi + 0..7 of the K chunk kc in that slot; zeros past K. One segment: slot kc
// holds chunk kc (all of K). Several: slot q*W + l holds chunk kc_begin(q) + seg*W + l, the W
// chunks that the warps of K slice q work through in segment seg (W = g.seg_chunks).
//
// An item is one 8-element group (row n, group gi = slot * 16 + g8). Two ways to walk them, each
// where it measured faster (same-run A/B, tests/bench/NOTES.md "Staging"): passes of one n-tile
// (decode: a few rows, K whole, once per CTA while its first weight chunks are in flight) take
// one item per loop step (dec_stage_each); wider passes (16-48 tokens per expert, 2-6 K
// segments per pass, each a CTA-wide stall) issue the loads of several items before converting
// any (dec_stage_batched): one L2 round trip per batch rather than per item.

// The chunk of staged slot `slot` in segment `seg`; false where no warp reads it (past its K
// slice's end).
// Called for every staged item, so without a division (each was ~20 instructions, three an item
// with dec_source_row's: ~9 % of gate_up's instructions at 32 tokens an expert, ncu on an H100,
// 2026-12-07): q = slot / seg_chunks by the reciprocal launch_decode checked exact for every slot,
// and chunks * q / ksplit as a shift (ksplit is a power of two). The same kc as the divisions.
__device__ __forceinline__ bool dec_slot_chunk(const DecodeArgs& g, int chunks, int slot, int seg, int& kc) {
  kc = slot;
  if (g.num_segs == 1) return true;
  const int q = (slot * g.seg_recip) >> 16, l = slot - q * g.seg_chunks;
  kc = ((chunks * q) >> g.ks_log2) + seg * g.seg_chunks + l;
  return kc < ((chunks * (q + 1)) >> g.ks_log2);
}

// The 8-element group (of the chunk's 16) that item gi stages: items are numbered in the order
// of their shared-memory slots (item gi at byte gi * 16 of its row), so consecutive lanes store
// to consecutive 16-byte slots (conflict-free); numbered by K group instead, a quarter warp's 8
// stores fell on 4 slots mod 128 bytes, 2 wavefronts where 1 does (ncu, H100, 2026-12-07). Slot
// j = wi * 4 + c holds group 4c + wi (the layout above). The global loads of a warp cover the
// same 16-byte pieces of the same rows either way.
__device__ __forceinline__ int dec_item_group(int gi) { return (gi & 3) << 2 | (gi >> 2 & 3); }

// One item's source: 8 elements of B row `row` from k8 (< K), as loaded (kSrc's raw words).
// Ordinary loads, not __ldg: B is x or h, the output of the kernel ahead in the stream, and down
// computes these addresses (the permutation) before its griddepcontrol.wait; a non-coherent
// load the compiler may hoist above that wait could read h before gate_up wrote it
// (cuda_common.cuh's rule for programmatic dependent launches).
template <int kSrc>
struct DecRaw {
  uint32_t w[kSrc == kSrcF32 ? 8 : kSrc == kSrcBf16 ? 4 : 2];
  uint32_t scale;  // MXFP8: the block's UE8M0 scale
};
template <int kSrc>
__device__ __forceinline__ void dec_load_item(const DecodeArgs& g, int64_t row, int k8, DecRaw<kSrc>& r) {
  if constexpr (kSrc == kSrcF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(g.b) + row * g.k + k8);
    const float4 a = p[0], b = p[1];
    const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) r.w[i] = __float_as_uint(f[i]);
  } else if constexpr (kSrc == kSrcBf16) {
    const uint4 a = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(g.b) + row * g.k + k8);
    r.w[0] = a.x, r.w[1] = a.y, r.w[2] = a.z, r.w[3] = a.w;
  } else {
    const uint2 q = *reinterpret_cast<const uint2*>(g.b_q + row * g.k + k8);
    r.w[0] = q.x, r.w[1] = q.y;
    r.scale = g.b_scales[row * (g.k / 32) + k8 / 32];
  }
}
// The item as bf16 (rounded as the other path rounds), its pairs permuted, into shared memory.
template <int kSrc>
__device__ __forceinline__ void dec_store_item(const DecRaw<kSrc>& r, uint8_t* dst) {
  uint32_t v[8];
  if constexpr (kSrc == kSrcF32) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = f32_to_bf16_bits(__uint_as_float(r.w[i]));
  } else if constexpr (kSrc == kSrcBf16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = r.w[i] & 0xffffu;
      v[2 * i + 1] = r.w[i] >> 16;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint8_t code = static_cast<uint8_t>(r.w[i / 4] >> (8 * (i % 4)));
      const uint32_t f = r.scale == 255u ? quant::kF32CanonicalNan
                                         : quant::e4m3_decode_bits(quant::E4M3{code}, static_cast<int>(r.scale) - 127);
      v[i] = f32_to_bf16_bits(quant::f32_from_bits(f));
    }
  }
  *reinterpret_cast<uint4*>(dst) =
      make_uint4(v[0] | (v[4] << 16), v[1] | (v[5] << 16), v[3] | (v[7] << 16), v[2] | (v[6] << 16));
}

// The token of sorted row s (gate_up: its pair / top_k; pair_recip: the division as a multiply,
// exact for every pair of the launch).
__device__ __forceinline__ int64_t dec_source_row(const DecodeArgs& g, int s) {
  if (g.sorted_pair == nullptr) return s;
  const int pair = g.sorted_pair[s];
  return g.pair_recip != 0 ? static_cast<int64_t>(__umulhi(static_cast<uint32_t>(pair), g.pair_recip))
                           : static_cast<int64_t>(pair / g.top_k);
}

// One item per loop step (passes of one n-tile).
__device__ __forceinline__ void dec_stage_each(const DecodeArgs& g, uint8_t* smem, int stride, int slots, int chunks,
                                               int base, int g0, int nrows, int seg) {
  // (n, gi) walked by adding, as dec_stage_batched walks them: no division per item (step_g <
  // groups, so one wrap a step).
  const int groups = slots * 16, total = nrows * groups;
  const int step_n = kDecThreads / groups, step_g = kDecThreads - step_n * groups;
  int n = static_cast<int>(threadIdx.x) / groups, gi = static_cast<int>(threadIdx.x) - n * groups;
  const auto advance = [&] {
    gi += step_g;
    n += step_n;
    if (gi >= groups) gi -= groups, ++n;
  };
  for (int idx = threadIdx.x; idx < total; idx += kDecThreads, advance()) {
    const int slot = gi >> 4, g8 = dec_item_group(gi);
    int kc;
    if (!dec_slot_chunk(g, chunks, slot, seg, kc)) continue;
    uint8_t* dst = smem + n * stride + gi * 16;  // = slot * 256 + (g8 & 3) * 64 + (g8 >> 2) * 16
    const int k8 = kc * 128 + g8 * 8;
    if (k8 >= g.k) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      continue;
    }
    const int64_t row = dec_source_row(g, base + g0 + n);
    if (g.src == kSrcF32) {
      DecRaw<kSrcF32> r;
      dec_load_item(g, row, k8, r);
      dec_store_item(r, dst);
    } else if (g.src == kSrcBf16) {
      DecRaw<kSrcBf16> r;
      dec_load_item(g, row, k8, r);
      dec_store_item(r, dst);
    } else {
      DecRaw<kSrcMx8> r;
      dec_load_item(g, row, k8, r);
      dec_store_item(r, dst);
    }
  }
}

// kU items' loads before their conversions (passes of several n-tiles); (n, gi) walked by adding.
template <int kSrc>
__device__ __forceinline__ void dec_stage_batched(const DecodeArgs& g, uint8_t* smem, int stride, int slots,
                                                  int chunks, int base, int g0, int nrows, int seg) {
  constexpr int kU = kSrc == kSrcF32 ? 2 : 4;
  const int groups = slots * 16, total = nrows * groups;
  const int step_n = kDecThreads / groups, step_g = kDecThreads - step_n * groups;
  int n = static_cast<int>(threadIdx.x) / groups, gi = static_cast<int>(threadIdx.x) - n * groups;
  for (int i0 = threadIdx.x; i0 < total; i0 += kU * kDecThreads) {
    int dst[kU];  // byte offset in smem; -1: nothing to store
    DecRaw<kSrc> r[kU];  // zeros past K (+0.0 in every source format)
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      dst[u] = -1;
      r[u] = DecRaw<kSrc>{};
      int kc;
      if (i0 + u * kDecThreads < total && dec_slot_chunk(g, chunks, gi >> 4, seg, kc)) {
        const int g8 = dec_item_group(gi), k8 = kc * 128 + g8 * 8;
        dst[u] = n * stride + gi * 16;  // = (gi >> 4) * 256 + (g8 & 3) * 64 + (g8 >> 2) * 16
        if (k8 < g.k) dec_load_item(g, dec_source_row(g, base + g0 + n), k8, r[u]);
      }
      gi += step_g;
      n += step_n;
      if (gi >= groups) gi -= groups, ++n;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (dst[u] >= 0) dec_store_item(r[u], smem + dst[u]);
    }
  }
}

template <int NT>
__device__ __forceinline__ void dec_stage(const DecodeArgs& g, uint8_t* smem, int stride, int slots, int chunks,
                                          int base, int g0, int nrows, int seg) {
  if constexpr (NT == 1) {
    dec_stage_each(g, smem, stride, slots, chunks, base, g0, nrows, seg);
  } else if (g.src == kSrcF32) {
    dec_stage_batched<kSrcF32>(g, smem, stride, slots, chunks, base, g0, nrows, seg);
  } else if (g.src == kSrcBf16) {
    dec_stage_batched<kSrcBf16>(g, smem, stride, slots, chunks, base, g0, nrows, seg);
  } else {
    dec_stage_batched<kSrcMx8>(g, smem, stride, slots, chunks, base, g0, nrows, seg);
  }
}

struct DecChunk {
  uint4 v[2][2];     // [tile][half]
  uint32_t f[2][2];  // dec_factor of the block's scale
  uint32_t g[2][2];  // dec_big_factor (kBig only)
};

// acc[tile][n-tile][4] += one K chunk (128 wide) of 2 row tiles times NT staged n-tiles of 8
// tokens; the chunk's staged rows start at byte koff. The dequantized A fragments serve all NT
// n-tiles; each n-tile's accumulator sees the same mma sequence whatever NT is.
// load_b(wi, nt): the lane's B fragment of n-tile nt for the chunk's 16-wide K step wi, its pairs
// in the permuted order.
template <bool kBig, int NT, typename LoadB>
__device__ __forceinline__ void dec_compute(float (&acc)[2][NT][4], const DecChunk& ch, LoadB&& load_b) {
#pragma unroll
  for (int wi = 0; wi < 4; ++wi) {
    uint4 bq[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) bq[nt] = load_b(wi, nt);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      uint32_t p[2][4];  // [half][slot: pairs (0,4) (1,5) (3,7) (2,6)]
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const uint32_t w = wi == 0 ? ch.v[t][hh].x : wi == 1 ? ch.v[t][hh].y : wi == 2 ? ch.v[t][hh].z : ch.v[t][hh].w;
        e2m1_pairs_raw(w, p[hh]);
#pragma unroll
        for (int q = 0; q < 4; ++q) p[hh][q] = bf16x2_mul_rn(p[hh][q], ch.f[t][hh]);
        if constexpr (kBig) {
#pragma unroll
          for (int q = 0; q < 4; ++q) p[hh][q] = bf16x2_mul_rn(p[hh][q], ch.g[t][hh]);
        }
      }
      const uint32_t a0[4] = {p[0][0], p[1][0], p[0][1], p[1][1]};
      const uint32_t a1[4] = {p[0][2], p[1][2], p[0][3], p[1][3]};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        mma_bf16_16816(acc[t][nt], a0, bq[nt].x, bq[nt].y);
        mma_bf16_16816(acc[t][nt], a1, bq[nt].z, bq[nt].w);
      }
    }
  }
}

using cuda::cp_async16;
using cuda::cp_async16_ca_zfill;
using cuda::cp_async4;
using cuda::cp_async_commit;
using cuda::cp_async_wait;
using cuda::cp_async_wait_all;

// Bulk copies (the TMA's one-dimensional form) completing on an mbarrier: one lane asks for a
// chunk's weights in a few instructions instead of every lane computing its own copies.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_inval(uint32_t bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// One warp's ring of K chunks in shared memory, per stage the chunk's codes and scales in the bulk
// layout below (kBulk*: global order, K tiles padded). The staged passes' lanes copy their own
// 16-byte vectors and a scale word each for the warp, so a __syncwarp after each cp.async.wait_group makes
// the chunk visible to the warp (direct passes: bulk copies on a stage mbarrier, below). Stage
// bytes past the bulk layout: the direct passes' B fragments. (The staged passes use 2,368 of the
// stage's 2,560 bytes, the split-K partials more.)
constexpr int kDecStageBytes = 4 * 16 * 32 + 4 * 4 * 32;  // 2.5 KiB
constexpr int kDecWarpRing = kDecStages * kDecStageBytes;
static_assert(2 * kDecMaxNt * 4 * 32 * 4 <= kDecWarpRing, "split-K partials fit in a warp's ring");
// Direct B (one-n-tile passes over bf16 rows, no staged rows): a stage also holds the lane's B
// fragments of the chunk, 4 vectors of 16 B ([wi][lane]: conflict-free reads); two stages, so
// that three CTAs fit an SM (3 x 72 KiB).
constexpr int kDirStages = 2;
constexpr int kDirCtas = 3;  // CTAs per SM (launch bounds, the block loop's residency)
constexpr int kDirStageBytes = kDecStageBytes + 4 * 16 * 32;  // 4.5 KiB
constexpr int kDirWarpRing = kDirStages * kDirStageBytes;
static_assert(2 * 1 * 4 * 32 * 4 <= kDirWarpRing, "split-K partials fit in a direct warp's ring");
// A direct stage as the bulk copies fill it: the chunk's codes as 4 pieces of 512 B (row tile t,
// K tile kt: 16 rows x 64 values) at t * 1152 + kt * 576 (the 64 B between K tiles keep a
// quarter warp's 16-byte reads on distinct banks), the scales of tile t (64 B) at 2240 + 64 t, the
// stage's mbarrier at 2368; B at kDecStageBytes as before.
constexpr int kBulkTile = 1152, kBulkKt = 576, kBulkScales = 2240, kBulkBar = 2368;
static_assert(kBulkBar + 8 <= kDecStageBytes, "the bulk layout fits the weight part of a stage");

// The weights of one warp (2 row tiles from rt0, K chunks [kc_begin, kc_end) of K slice wk)
// against the staged B rows; acc[tile][n-tile][4]. K goes in num_segs segments of seg_chunks
// chunks per slice: stage(seg) stages segment seg (and synchronises the CTA) before the warp
// works through it. The ring runs on across segment boundaries, so the next chunks' loads are in
// flight while the CTA stages; stage(0) runs between issuing the first chunks and waiting for
// them (the first staging overlaps the first weight loads).
//
// kDirect (one n-tile, K whole, bf16 B rows in global memory in their natural order): no staged
// rows; lane 0 asks for the chunk's weights and scales as 6 bulk copies completing on the stage's
// mbarrier (instead of 8 address sums and copies in every lane: the same bytes, the same bits;
// H100, 2026-12-05: 8 tokens 2-4 %, 64 tokens 6-7 %, an h2880 step at batch 32 3-5 % faster, one
// token unchanged, NOTES); each lane copies its own B bytes with the chunk's weights (bg: its token's row at byte
// c * 64; !bvalid: zeros, a lane past the pass's rows) and swaps their pairs into the permuted
// order in registers; stage(0) only waits for the producer of B (down), between the first chunk's
// weight copies and its B copies.
template <int NT, bool kDirect, typename Stage>
__device__ __forceinline__ void dec_pass(float (&acc)[2][NT][4], const uint8_t* wblk, const uint8_t* wsc,
                                         int rt0, int k_tiles, int kc_begin, int kc_end, int wk, int seg_chunks,
                                         int num_segs, const uint8_t* bsm, int stride, int staged, uint8_t* ring, int lane,
                                         const uint8_t* bg, bool bvalid, Stage&& stage) {
  static_assert(!kDirect || NT == 1, "direct B: one n-tile per pass");
  constexpr int kStages = kDirect ? kDirStages : kDecStages;
  constexpr int kStageBytes = kDirect ? kDirStageBytes : kDecStageBytes;
  const int r = lane >> 2, c = lane & 3;
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][nt][i] = 0.0f;
  // The lane's B row (token r of each n-tile). A one-n-tile launch may stage fewer than 8 rows
  // (tok_cap = the pairs, below 8 at batch 1): lanes of the absent rows read row 0 instead, whose
  // products land in columns the epilogue drops; reading row r there left the staged area (and,
  // at one staged row and K = 8512, the CTA's shared memory).
  const uint8_t* blane = bsm + (r < staged ? r : 0) * stride + c * 16;
  // The lane's vector of (tile t, half hh) at chunk 0; chunk kc is 2 K tiles on (1024 value
  // bytes, 64 scale bytes). A lane reads its scale as the aligned 4-byte word that holds it.
  const int64_t t0 = static_cast<int64_t>(rt0) * k_tiles + (c >> 1);
  const uint8_t* pv = wblk + t0 * 512 + r * 32 + (c & 1) * 16;
  const int tstride_v = k_tiles * 512, tstride_s = k_tiles * 32;  // one 16-row tile (8 K < 2^31)
  const uint32_t ssel = 0x4440u | static_cast<uint32_t>((r & 1) * 2 + (c & 1));  // __byte_perm: the lane's scale byte
  // Ring slots rotate with the chunks (chunk kc sits in slot (kc - kc_begin) % kStages): counters
  // instead of a modulo per issue and per use.
  int issue_slot = 0, use_slot = 0;
  // The lane's B bytes of chunk kc (direct): elements kc*128 + 32c + 8wi .. + 7 of its row, zeros
  // past K (the zero weights there would turn garbage into NaN) and for lanes without a row.
  auto issue_b = [&](int kc, uint8_t* st) {
    const bool valid = bvalid && kc * 2 + (c >> 1) < k_tiles;
#pragma unroll
    for (int wi = 0; wi < 4; ++wi)
      cp_async16_ca_zfill(st + kDecStageBytes + (wi * 32 + lane) * 16, valid ? bg + kc * 256 + wi * 16 : bg, valid);
  };
  // Direct: lane 0 asks for the chunk's weights as bulk copies on the stage's mbarrier (a last
  // half chunk: K tile 0 of each row tile, 32 scale bytes); the lanes of the absent K tile read
  // zero weights instead (consumer side).
  const uint8_t* wtile = wblk + static_cast<int64_t>(rt0) * k_tiles * 512;
  const uint8_t* stile = wsc + static_cast<int64_t>(rt0) * k_tiles * 32;
  // Staged passes: lane l copies scale word l & 15 of row tile l >> 4 into the bulk layout's
  // 128 scale bytes (4-byte copies: moe_checks promises the scales 4-byte alignment only).
  const uint8_t* sc_src = stile + (lane >> 4) * tstride_s + (lane & 15) * 4;
  uint32_t phases = 0;  // the parity each stage's mbarrier completes next, a bit per stage
  if constexpr (kDirect) {
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) mbar_init(smem_u32(ring + s * kStageBytes + kBulkBar));
      // The inits visible to the copies' completions; the ring's earlier generic writes (split-K
      // partials) ordered before the async proxy's.
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncwarp();
  }
  auto issue = [&](int kc, bool with_b) {
    if (kc >= kc_end) return;
    uint8_t* st = ring + issue_slot * kStageBytes;
    issue_slot = issue_slot == kStages - 1 ? 0 : issue_slot + 1;
    if constexpr (kDirect) {
      if (with_b) issue_b(kc, st);
      if (lane == 0) {
        // The lanes' generic reads of this slot's previous chunk (ordered by the __syncwarp before
        // the issue) before the async proxy's writes into it: the PTX memory model's cross-proxy
        // fence (the loads have returned by now anyway: their values fed the previous chunk's mma).
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        const bool full = kc * 2 + 1 < k_tiles;
        const uint32_t bar = smem_u32(st + kBulkBar);
        mbar_expect(bar, full ? 2 * (1024 + 64) : 2 * (512 + 32));
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const uint8_t* v = wtile + t * tstride_v + kc * 1024;
          bulk_copy(smem_u32(st + t * kBulkTile), v, 512, bar);
          if (full) bulk_copy(smem_u32(st + t * kBulkTile + kBulkKt), v + 512, 512, bar);
          bulk_copy(smem_u32(st + kBulkScales + t * 64), stile + t * tstride_s + kc * 64, full ? 64 : 32, bar);
        }
      }
      return;
    }
    // The bulk layout, filled by the lanes: each lane's 16 bytes land where they sit in the
    // chunk's global order (K tile c >> 1 of the row tile, padded as kBulkKt says), so that every
    // 256-byte run of the copies is one run in shared memory: one wavefront per 128 bytes. The
    // lane-ordered ring before (vector v of lane l at (v * 32 + l) * 16) wrote each 32-byte sector
    // in a wavefront of its own, 4x the ideal (ncu, H100, 2026-12-07: 40 % of the decode GEMMs'
    // shared wavefronts excessive at 32 tokens an expert). The scales: the chunk's 64 bytes a row
    // tile, one 4-byte word a lane in order (before: the word holding the lane's own scale byte,
    // at the lane's slot, also 4x its ideal wavefronts). An absent upper K tile (a last 64-wide
    // chunk) is not copied: the consumer reads zeros and scale 127 for it.
    if (kc * 2 + (c >> 1) < k_tiles) {
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          cp_async16(st + t * kBulkTile + (c >> 1) * kBulkKt + hh * 256 + r * 32 + (c & 1) * 16,
                     pv + t * tstride_v + hh * 256 + kc * 1024);
    }
    if (kc * 2 + ((lane & 15) >> 3) < k_tiles)  // lane: row tile lane >> 4, K tile (lane & 15) >> 3
      cp_async4(st + kBulkScales + lane * 4, sc_src + kc * 64);
  };
  if constexpr (kDirect) {
    // The first chunk's weights, the wait for B's producer (stage(0)), then its B.
    issue(kc_begin, false);
    stage(0);
    if (kc_begin < kc_end) issue_b(kc_begin, ring);
    cp_async_commit();
#pragma unroll
    for (int d = 1; d < kStages - 1; ++d) {  // the rest of the prologue (kDirStages > 2)
      issue(kc_begin + d, true);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int d = 0; d < kDecStages - 1; ++d) {
      issue(kc_begin + d, true);
      cp_async_commit();
    }
  }
  for (int seg = 0; seg < num_segs; ++seg) {
    if constexpr (!kDirect) stage(seg);
    const int s_begin = kc_begin + seg * seg_chunks;
    const int s_end = kc_end < s_begin + seg_chunks ? kc_end : s_begin + seg_chunks;
    const int slot0 = num_segs == 1 ? 0 : wk * seg_chunks - s_begin;  // chunk kc is in slot kc + slot0
    for (int kc = s_begin; kc < s_end; ++kc) {
      __syncwarp();  // every lane is done with the slot that lane 0 (direct) or the warp's scale copies refill
      issue(kc + kStages - 1, true);
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      // The chunk's scale words were copied by other lanes: their completed copies visible to the warp.
      if constexpr (!kDirect) __syncwarp();
      const uint8_t* st = ring + use_slot * kStageBytes;
      if constexpr (kDirect) {
        mbar_wait(smem_u32(st + kBulkBar), (phases >> use_slot) & 1u);
        phases ^= 1u << use_slot;
      }
      use_slot = use_slot == kStages - 1 ? 0 : use_slot + 1;
      DecChunk ch;
      uint32_t sc[2][2];
      uint32_t smax = 0;
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          // Both rings in the bulk layout (the direct passes' bulk copies, the others' lanes).
          const bool lv = kc * 2 + (c >> 1) < k_tiles;
          ch.v[t][hh] = lv ? *reinterpret_cast<const uint4*>(st + t * kBulkTile + (c >> 1) * kBulkKt + hh * 256 +
                                                             r * 32 + (c & 1) * 16)
                           : make_uint4(0, 0, 0, 0);
          const uint32_t raw =
              lv ? *reinterpret_cast<const uint32_t*>(st + kBulkScales + t * 64 + (c >> 1) * 32 + hh * 16 + ((r * 2) & ~3))
                 : 0x7f7f7f7fu;
          sc[t][hh] = __byte_perm(raw, 0u, ssel);
          ch.f[t][hh] = dec_factor_small(sc[t][hh]);
          smax = max(smax, sc[t][hh]);
        }
      const uint8_t* brow = blane + (kc + slot0) * 256;
      const uint8_t* bst = st + kDecStageBytes + lane * 16;
      auto load_b = [&](int wi, int nt) -> uint4 {
        if constexpr (kDirect) {
          // Natural order e0e1 e2e3 e4e5 e6e7 -> pairs (0,4), (1,5), (3,7), (2,6).
          const uint4 v = *reinterpret_cast<const uint4*>(bst + wi * 512);
          return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                            __byte_perm(v.y, v.w, 0x7632), __byte_perm(v.y, v.w, 0x5410));
        } else {
          return *reinterpret_cast<const uint4*>(brow + nt * 8 * stride + wi * 64);
        }
      };
      if (__any_sync(0xffffffffu, smax > 128u)) {  // some lane's block scale is large or NaN
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            ch.f[t][hh] = dec_factor(sc[t][hh]);
            ch.g[t][hh] = dec_big_factor(sc[t][hh]);
          }
        dec_compute<true, NT>(acc, ch, load_b);
      } else {
        dec_compute<false, NT>(acc, ch, load_b);
      }
    }
  }
  cp_async_wait_all();
  __syncwarp();  // every lane's copies complete before the ring holds other data (split-K partials)
  if constexpr (kDirect) {
    // Every chunk issued was waited for: the barriers go before the ring holds other data.
    if (lane == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) mbar_inval(smem_u32(ring + s * kStageBytes + kBulkBar));
    }
    __syncwarp();
  }
}

// What one CTA of the decode kernel works on (the same for all its passes).
struct DecCta {
  int base, count;      // the expert's sorted rows
  int warp, lane, ks, wk;
  int grp;              // 32-row group of this warp
  bool has_rows;
  int k_tiles, chunks, kc_begin, kc_end;
  int slots, stride;    // staged chunks per row, bytes per staged row
  const uint8_t* wblk;
  const uint8_t* wsc;
  uint8_t* rings;       // [kDecWarps][kDecWarpRing] after the staged rows ([kDirWarpRing], direct)
  const float* bias;
};

// One pass: rows base + g0 .. + nrows (nrows <= 8 NT) of the expert through NT n-tiles. Without
// stage_rows the rows staged by the CTA's previous block (the same rows, all of K) are used.
// kDirect: B straight from g.b (bf16 rows), nothing staged (dec_pass); first: the CTA's first pass,
// where down waits for gate_up.
template <int NT, bool kGateUp, bool kDirect = false>
__device__ __forceinline__ void dec_rows(const DecodeArgs& g, const DecCta& a, uint8_t* dsm, int g0, int nrows,
                                         bool stage_rows, bool first = false) {
  constexpr int kRing = kDirect ? kDirWarpRing : kDecWarpRing;
  float acc[2][NT][4];
  uint8_t* ring = a.rings + a.warp * kRing;
  const uint8_t* bg = nullptr;
  bool bvalid = false;
  if constexpr (kDirect) {
    // The lane's token (row r of the pass); lanes past the pass's rows copy zeros.
    const int r = a.lane >> 2;
    bvalid = r < nrows;
    const int s = a.base + g0 + (bvalid ? r : 0);
    const int64_t row = kGateUp ? dec_source_row(g, s) : s;
    bg = static_cast<const uint8_t*>(g.b) + (row * g.k + (a.lane & 3) * 32) * 2;
  }
  dec_pass<NT, kDirect>(acc, a.wblk, a.wsc, a.grp * 2, a.k_tiles, a.kc_begin, a.kc_end, a.wk, g.seg_chunks,
                        g.num_segs, dsm, a.stride, g.tok_cap, ring, a.lane, bg, bvalid, [&](int seg) {
                 if constexpr (kDirect) {
                   if constexpr (!kGateUp) {
                     if (first) asm volatile("griddepcontrol.wait;" ::: "memory");  // h is written
                   }
                   return;
                 }
                 if (seg > 0) {
                   __syncthreads();  // every warp is done with the previous segment's rows
                 } else if constexpr (!kGateUp) {
                   if (g0 == 0) asm volatile("griddepcontrol.wait;" ::: "memory");  // h is written
                 }
                 if (seg > 0 || stage_rows) {
                   dec_stage<NT>(g, dsm, a.stride, a.slots, a.chunks, a.base, g0, nrows, seg);
                   __syncthreads();
                 }
               });
  const int ks = a.ks, lane = a.lane;
  if (ks > 1) {
    // Fixed-order reduction over the K slices: slice 0 adds slices 1.. in order.
    if (a.wk > 0) {
      float* dst = reinterpret_cast<float*>(ring) + lane;
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) dst[((t * NT + nt) * 4 + i) * 32] = acc[t][nt][i];
    }
    __syncthreads();
    if (a.wk == 0) {
      for (int q = 1; q < ks; ++q) {
        const float* src = reinterpret_cast<const float*>(a.rings + (a.warp + q) * kRing) + lane;
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[t][nt][i] += src[((t * NT + nt) * 4 + i) * 32];
      }
    }
  }
  if (a.wk != 0 || !a.has_rows) return;
  // acc[t][nt][i]: row r + 8 (i >> 1) of tile t, token column 8 nt + 2c + (i & 1).
  const int r = lane >> 2, c = lane & 3, grp = a.grp;
  // The biases of this lane's rows (r and r + 8 of each 16-row half), loaded once before the
  // stores: loaded per output, each load followed the previous output's store, which may alias it
  // (see GateUpBias).
  if constexpr (kGateUp) {
    const auto order = static_cast<quant::Mxfp4RowOrder>(g.row_order);
    float bg0 = 0.0f, bu0 = 0.0f, bg1 = 0.0f, bu1 = 0.0f;
    if (a.bias) {
      bg0 = a.bias[quant::mxfp4_checkpoint_row(grp * 32 + r, g.n, order)];
      bu0 = a.bias[quant::mxfp4_checkpoint_row(grp * 32 + r + 16, g.n, order)];
      bg1 = a.bias[quant::mxfp4_checkpoint_row(grp * 32 + r + 8, g.n, order)];
      bu1 = a.bias[quant::mxfp4_checkpoint_row(grp * 32 + r + 24, g.n, order)];
    }
    auto emit = [&](int nt, int i, float gv, float uv) {
      const int col = nt * 8 + 2 * c + (i & 1);
      if (col >= nrows) return;
      const int64_t s = a.base + g0 + col;
      const int row = r + 8 * (i >> 1);
      if (a.bias) {
        gv = math::add(gv, (i >> 1) ? bg1 : bg0);  // selects: i runs in a loop, not unrolled
        uv = math::add(uv, (i >> 1) ? bu1 : bu0);
      }
      const float hv = math::activate(g.act_kind, g.limit, g.alpha, gv, uv);
      const int64_t jf = static_cast<int64_t>(grp) * 16 + row;
      if (g.h_bf16)
        g.h_bf16[s * g.inter + jf] = f32_to_bf16_bits(hv);
      else
        g.h_f32[s * g.inter + jf] = hv;
    };
    if constexpr (NT == 1 && kDirect) {
      // At 80 registers (three CTAs per SM) the unrolled activation spilled 76 bytes (ptxas);
      // one emit at a time keeps the accumulators in 32 bytes of local memory here instead.
#pragma unroll 1
      for (int i = 0; i < 4; ++i) emit(0, i, acc[0][0][i], acc[1][0][i]);
    } else if constexpr (NT == 1) {
#pragma unroll
      for (int i = 0; i < 4; ++i) emit(0, i, acc[0][0][i], acc[1][0][i]);
    } else {
      // Through the warp's own ring (each lane reads back what it wrote): the activation
      // unrolled over NT n-tiles with every accumulator live would spill.
      float* own = reinterpret_cast<float*>(ring) + lane;
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) own[((t * NT + nt) * 4 + i) * 32] = acc[t][nt][i];
#pragma unroll 1
      for (int j = 0; j < NT * 4; ++j) emit(j >> 2, j & 3, own[j * 32], own[(NT * 4 + j) * 32]);
    }
  } else {
    float bd[2][2] = {};  // [t][i >> 1]: rows grp * 32 + 16 t + r (+ 8)
    if (a.bias) {
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) bd[t][h] = a.bias[grp * 32 + t * 16 + r + 8 * h];
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = nt * 8 + 2 * c + (i & 1);
        if (col >= nrows) continue;
        const int64_t s = a.base + g0 + col;
        const int row = r + 8 * (i >> 1);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int kr = grp * 32 + t * 16 + row;
          float v = acc[t][nt][i];
          if (a.bias) v = math::add(v, bd[t][i >> 1]);
          g.y[s * g.n + kr] = v;
        }
      }
  }
}

// kMaxNt: n-tiles per pass at most (g.tok_cap <= 8 kMaxNt); a pass takes the fewest of 1, 2, 4
// (5 in a 5-n-tile kernel) that cover its rows, or 3 for 17-24 rows in a wider kernel (same-run A/B on an H100,
// 2026-12-07, NOTES: h2880 step at batch 128 -2.7 %, 256 -0.9 %; each n-tile's mma sequence is
// the same whatever NT, so the bits are too). kDirect (kMaxNt 1, bf16 B): nothing staged, only
// the warps' rings in shared memory, three CTAs per SM.
template <bool kGateUp, int kMaxNt, bool kDirect = false>
__global__ void __launch_bounds__(kDecThreads, kDirect ? kDirCtas : 2) decode_gemm_kernel(const DecodeArgs g) {
  static_assert(!kDirect || kMaxNt == 1, "direct B: one n-tile per pass");
  extern __shared__ __align__(16) uint8_t dsm[];
  // gate_up as a programmatic dependent: the permutation (and x's rounding) complete before any
  // read. down's reads before its griddepcontrol.wait (the permutation, weights) are complete by
  // the time it launches: every gate_up CTA has passed this wait when it triggers below.
  // down reads the permutation before its wait through L2 (ld.global.cg): the PTX ISA promises
  // visibility of a prerequisite grid's writes only after griddepcontrol.wait, and the
  // permutation's own grid is two launches back; L2 is where its completed writes are.
  if constexpr (kGateUp) cuda::pdl_wait();
  // Expert-major grids (launch_decode) list every expert's first row block before any expert's
  // second; the other order runs each expert's blocks together, heavy experts first.
  const int j = g.expert_major ? blockIdx.x : blockIdx.y;
  const int blk0 = g.expert_major ? blockIdx.y : blockIdx.x;
  const int blk_step = g.expert_major ? gridDim.y : gridDim.x;
  if (j >= __ldcg(g.meta)) {  // whole CTA: fewer active experts than the bound
    if constexpr (!kGateUp) cuda::pdl_wait();  // every CTA of a dependent grid waits (cuda_common.cuh)
    return;
  }
  const int e = __ldcg(g.active + j);
  DecCta a;
  a.base = __ldcg(g.expert_offsets + e);
  a.count = __ldcg(g.expert_offsets + e + 1) - a.base;
  a.warp = threadIdx.x >> 5;
  a.lane = threadIdx.x & 31;
  a.ks = g.ksplit;
  a.wk = a.warp % a.ks;
  const int wr = a.warp / a.ks, groups_per_cta = kDecWarps / a.ks;
  a.k_tiles = g.k / 64;
  a.chunks = (g.k + 127) / 128;
  a.kc_begin = a.chunks * a.wk / a.ks;
  a.slots = g.num_segs == 1 ? a.chunks : a.ks * g.seg_chunks;
  a.stride = a.slots * 256 + 64;
  a.wblk = g.w_blocks + static_cast<int64_t>(e) * g.n * g.k / 2;
  a.wsc = g.w_scales + static_cast<int64_t>(e) * g.n * g.k / 32;
  // A warp's split-K partials go into its own ring once its pass is done.
  a.rings = kDirect ? dsm : dsm + g.tok_cap * a.stride;
  a.bias = g.bias ? g.bias + static_cast<int64_t>(e) * g.n : nullptr;

  // Programmatic dependent launch: the down kernel may start while gate_up's last CTAs run;
  // everything it does before griddepcontrol.wait reads only the permutation (complete before
  // gate_up passed its wait) and the weights, so its first weight loads overlap gate_up's tail.
  // down triggers too: combine (which waits at its top) is launched while down's last CTAs run.
  cuda::pdl_trigger();

  // One row block (groups_per_cta 32-row groups) of the expert.
  auto run_block = [&](int blk) {
    a.grp = blk * groups_per_cta + wr;
    a.has_rows = a.grp * 32 < g.n;
    a.kc_end = a.has_rows ? a.chunks * (a.wk + 1) / a.ks : a.kc_begin;
    // A later block of a one-pass expert with K staged whole finds its rows staged already.
    const bool stage_rows = blk == blk0 || a.count > g.tok_cap || g.num_segs > 1;
    for (int g0 = 0; g0 < a.count; g0 += g.tok_cap) {
      const int nrows = a.count - g0 < g.tok_cap ? a.count - g0 : g.tok_cap;
      // The previous pass (or block) is done with the staged rows and (split K) with every
      // warp's ring.
      if (g0 > 0 || blk != blk0) __syncthreads();
      if constexpr (kDirect) {
        dec_rows<1, kGateUp, true>(g, a, dsm, g0, nrows, false, g0 == 0 && blk == blk0);
        continue;
      }
      if constexpr (kMaxNt >= 5) {
        if (nrows > 32) {
          dec_rows<5, kGateUp>(g, a, dsm, g0, nrows, stage_rows);
          continue;
        }
      }
      if constexpr (kMaxNt >= 4) {
        if (nrows > 24) {
          dec_rows<4, kGateUp>(g, a, dsm, g0, nrows, stage_rows);
          continue;
        }
        if (nrows > 16) {  // three n-tiles: a quarter fewer mma and B loads than four
          dec_rows<3, kGateUp>(g, a, dsm, g0, nrows, stage_rows);
          continue;
        }
      }
      if constexpr (kMaxNt >= 2) {
        if (nrows > 8) {
          dec_rows<2, kGateUp>(g, a, dsm, g0, nrows, stage_rows);
          continue;
        }
      }
      dec_rows<1, kGateUp>(g, a, dsm, g0, nrows, stage_rows);
    }
  };
  // One-n-tile launches may give an expert fewer CTAs than row blocks (launch_decode: where each
  // block is a few chunks per warp): blocks blk0, blk0 + blk_step, ..., so that a CTA's start
  // (the launch, the routing loads, the staging of its rows) is paid once for several short
  // blocks. Wider launches have a CTA per block (and keep the registers the loop would take).
  if constexpr (kMaxNt == 1) {
    for (int blk = blk0; blk < g.row_blocks; blk += blk_step) run_block(blk);
  } else {
    run_block(blk0);
  }
}

// Tokens per pass and how K is staged (see the NOTES): tok_cap rows, num_segs segments of
// seg_chunks 128-wide chunks per K slice (one segment: all of K).
struct DecodeShape {
  int tok_cap, seg_chunks, num_segs;
  size_t smem;
};

// Shared memory per CTA with which two CTAs share an SM (228 KiB, 1 KiB reserved per CTA).
constexpr size_t kDecSmemTwoCtas = 113 * 1024;
constexpr size_t kDecSmemMax = 200 * 1024;  // the opt-in of the decode kernels

// More than 8 tokens per pass (max_nt n-tiles, 2, 4 or 5) only where they fit with two CTAs per SM,
// staging K in segments if all of it does not fit; else fewer n-tiles, down to the one-n-tile
// pass over all of K (up to kDecSmemMax, one CTA per SM for long K) that decode sizes take.
DecodeShape decode_shape(int64_t k, int ks, int max_nt, int64_t pairs) {
  const int64_t chunks = (k + 127) / 128;
  const int64_t rings = static_cast<int64_t>(kDecWarps) * kDecWarpRing;
  const int64_t budget = static_cast<int64_t>(kDecSmemTwoCtas);
  for (int nt = max_nt; nt > 1; nt = nt > 4 ? 4 : nt / 2) {
    const int64_t tok = nt * 8;
    const int64_t whole = tok * (chunks * 256 + 64) + rings;
    if (whole <= budget)
      return {static_cast<int>(tok), static_cast<int>(chunks), 1, static_cast<size_t>(whole)};
    const int64_t w = ((budget - rings) / tok - 64) / 256 / ks;  // chunks per slice and segment
    if (w < 1) continue;
    const int64_t per_slice = (chunks + ks - 1) / ks;
    const int64_t segs = (per_slice + w - 1) / w;
    const int64_t seg_chunks = (per_slice + segs - 1) / segs;  // the same segments, evened out
    const int64_t smem = tok * (ks * seg_chunks * 256 + 64) + rings;
    return {static_cast<int>(tok), static_cast<int>(seg_chunks), static_cast<int>(segs), static_cast<size_t>(smem)};
  }
  const int64_t tok = pairs < kDecMaxTok ? pairs : kDecMaxTok;
  return {static_cast<int>(tok), static_cast<int>(chunks), 1, static_cast<size_t>(tok * (chunks * 256 + 64) + rings)};
}

// K slices per CTA (1, 2, 4 or 8 warps along K; the rest of the CTA's warps take more rows): the
// fewest that give about four CTAs per SM. Where that takes all 8 (few busy experts: ~3 chunks a
// warp, and CTAs looping over more row blocks than a wave holds, e.g. gpt-oss's gate_up at one
// token), the most whose (32-row group, K slice) tasks still fit one wave of warps at kDirCtas
// CTAs per SM instead: fewer, longer warps, one wave. Measured on an H200 (2026-12-02, NOTES):
// that rule alone was 4-6 % faster at one token (gpt-oss gate_up 8 -> 4 slices, Qwen3 down
// 8 -> 4) but 5 % slower a step at h2880 batch 32, where it took down from 2 slices to 1 (4 tokens
// per expert). Independent of the tokens once pairs >= E (the bound is then E), so the sums (hence
// the bits) of a token do not depend on how many share its pass. ctas_per_sm is the residency the
// one-wave count assumes: kDirCtas for bf16 rows, 2 for staged rows (MXFP8, f32), whose CTAs hold
// 2 an SM; counting 3 for them gave gate_up 4 slices at one MXFP8 token where 2 are 4-6 % faster
// (H100, 2026-12-05, NOTES).
int decode_ksplit(int64_t bound_experts, int64_t n, int num_sms, int ctas_per_sm) {
  const int64_t groups = n / 32;
  for (int ks = 1; ks < kDecWarps; ks *= 2) {
    const int64_t per_cta = kDecWarps / ks;
    if (bound_experts * ((groups + per_cta - 1) / per_cta) >= 4 * num_sms) return ks;
  }
  const int64_t tasks = bound_experts * groups, wave = static_cast<int64_t>(ctas_per_sm) * kDecWarps * num_sms;
  int ks = 1;
  while (ks < kDecWarps && tasks * ks * 2 <= wave) ks *= 2;
  return ks;
}

using cuda::opt_in_smem;

// More than 48 KiB: the most the decode path asks for.
template <bool kGateUp, int kMaxNt, bool kDirect = false>
Status decode_opt_in(int device) {
  static std::atomic<uint64_t> opted{0};
  return opt_in_smem(opted, decode_gemm_kernel<kGateUp, kMaxNt, kDirect>, static_cast<int>(kDecSmemMax), device);
}

// Shared memory of a direct-B CTA: the warps' rings only.
constexpr size_t kDirSmem = static_cast<size_t>(kDecWarps) * kDirWarpRing;
static_assert(kDirCtas * (kDirSmem + 1024) <= 228 * 1024, "kDirCtas direct-B CTAs fit an SM");

// ROLLOUTD_MOE_KSPLIT_GATE_UP / ROLLOUTD_MOE_KSPLIT_DOWN = 1, 2, 4 or 8 (environment, read once):
// that GEMM's decode launches take that many K slices instead of decode_ksplit()'s choice. For
// same-binary A/B runs of the rule; other values are ignored. Other slices, other sums: the bits
// change as with any K split.
int ksplit_override(bool gate_up) {
  static const int v[2] = {[] {
                             const char* s = std::getenv("ROLLOUTD_MOE_KSPLIT_DOWN");
                             const int k = s != nullptr ? std::atoi(s) : 0;
                             return k == 1 || k == 2 || k == 4 || k == 8 ? k : 0;
                           }(),
                           [] {
                             const char* s = std::getenv("ROLLOUTD_MOE_KSPLIT_GATE_UP");
                             const int k = s != nullptr ? std::atoi(s) : 0;
                             return k == 1 || k == 2 || k == 4 || k == 8 ? k : 0;
                           }()};
  return v[gate_up ? 1 : 0];
}

// ROLLOUTD_MOE_HEAVY_FIRST=0 (environment, read once): the decode launches' experts in index
// order instead of those with more than a pass of tokens first. For same-binary A/B runs; the
// results are the same bits either way (the order only says which CTA runs which expert).
bool heavy_first() {
  static const bool on = [] {
    const char* s = std::getenv("ROLLOUTD_MOE_HEAVY_FIRST");
    return s == nullptr || std::string_view(s) != "0";
  }();
  return on;
}

// ROLLOUTD_MOE_MXFP8_BF16_ROWS (environment, read once; on unless "0"): MXFP8 decode launches
// take x, and then h, through MXFP8 and back as BF16 rows (mx8_round_bf16_kernel, in place of
// quantize_mxfp8: the same launches), so that gate_up's and down's passes read B as BF16,
// straight from memory where they take one n-tile, instead of staging and converting the codes
// in every CTA. The same B values; the K splits are the BF16 ones, so the sums (the bits) differ
// from the staged path's, which "0" keeps (an A/B switch; ctest moe_parity_test_mxfp8_staged).
// NOTES: x's rows alone (gate_up) made the MoE layer from a graph 5.5-6 % faster at one MXFP8
// token (gpt-oss-120b 0.0582 -> 0.0550 ms, Qwen3-30B 0.0384 -> 0.0362), 2-6 % at 64 tokens, and
// 0.6 % slower at 8 gpt-oss tokens (same-run A/B on an H100, 2026-12-06, tests/bench/NOTES.md).
// Prefill launches under it round x in one launch and h in gate_up's epilogue (prefill_h_mx8)
// instead of quantize_mxfp8 + dequantize_mxfp8 launches for each: the same values.
bool mxfp8_bf16_rows() {
  static const bool on = [] {
    const char* v = std::getenv("ROLLOUTD_MOE_MXFP8_BF16_ROWS");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return on;
}

// ROLLOUTD_MOE_FIVE_NT (environment, read once): which decode GEMMs may take passes of 40 tokens
// (five n-tiles) where experts average more than 24: unset (or any other value) both, "gate_up"
// gate_up only (down's 5-n-tile kernel spills 28 bytes at its 128 registers, ptxas sm_90a;
// gate_up's does not), "0" neither (passes of 32 at most). Same bits either way (a column's mma
// sequence does not depend on the n-tiles of its pass). Why 40: at h2880 batch 256 (32 experts,
// 32 rows each on average) about half the experts took a second pass over their weights for 1-12
// rows. Same-run A/B on an H100 (2026-12-07, tests/bench/NOTES.md): h2880 batch 256 step -6.7 %,
// gpt-oss-120b layer at 1,024 tokens -7.3 % (bf16) and -8.8 % (MXFP8); "gate_up" the same step
// and a smaller layer gain (-6 % bf16), so both is the default despite down's spill. Returns the most n-tiles a
// pass of gate_up (true) or down (false) may take.
int five_n_tiles(bool gate_up) {
  static const int v = [] {
    const char* s = std::getenv("ROLLOUTD_MOE_FIVE_NT");
    if (s == nullptr) return 2;
    const std::string_view sv(s);
    return sv == "0" ? 0 : sv == "gate_up" ? 1 : 2;
  }();
  return v == 2 || (v == 1 && gate_up) ? 5 : 4;
}

// ROLLOUTD_MOE_EXPERT_MAJOR (environment, read once): "0" or "1" forces DecodeArgs::expert_major
// for every decode launch (a same-binary A/B of launch_decode's rule); -1 where unset.
int expert_major_override() {
  static const int v = [] {
    const char* s = std::getenv("ROLLOUTD_MOE_EXPERT_MAJOR");
    if (s == nullptr) return -1;
    const std::string_view sv(s);
    return sv == "1" ? 1 : sv == "0" ? 0 : -1;
  }();
  return v;
}

// max_tokens_per_expert: a bound the host knows (the valid tokens: a token picks an expert once
// through an injective map; a map that is not makes the rule a guess, never a wrong result).
template <bool kGateUp>
Status launch_decode(const ExecContext& ctx, const DecodeArgs& g, int64_t bound, int num_sms, int max_nt,
                     int64_t pairs, int64_t max_tokens_per_expert) {
  DecodeArgs a = g;
  const int forced = ksplit_override(kGateUp);
  // By the source format only, not the tokens: the bits of a token still do not depend on its
  // pass's other tokens.
  a.ksplit = forced != 0 ? forced : decode_ksplit(bound, a.n, num_sms, a.src == kSrcBf16 ? kDirCtas : 2);
  DecodeShape shape = decode_shape(a.k, a.ksplit, max_nt, pairs);
  // One-n-tile passes over bf16 rows take B straight from global memory (16-byte copies: rows
  // of K % 8 == 0 bf16 from a 16-byte aligned base); f32 and MXFP8 rows are staged (converted).
  // The zeros past K are decided per 64-wide tile as for the weights: K % 64 == 0 (moe_checks'
  // kKAlign, which every decode launch has passed).
  // Their weights come as bulk copies (16-byte aligned sources: each piece starts a multiple of
  // 32 bytes into its expert, whose blocks and scales start at multiples of 64 bytes from the bases).
  const bool direct = shape.tok_cap <= 8 && a.src == kSrcBf16 && a.k % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(a.b) % 16 == 0 && reinterpret_cast<uintptr_t>(a.w_blocks) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(a.w_scales) % 16 == 0;
  if (direct) shape.smem = kDirSmem;
  a.tok_cap = shape.tok_cap;
  a.seg_chunks = shape.seg_chunks;
  a.num_segs = shape.num_segs;
  // The staging's divisions as a shift and two reciprocals, each checked here for every value it
  // will see (a few hundred slots, the launch's pairs by a bound), so the kernel's results are
  // the divisions' by construction.
  a.ks_log2 = 0;
  while ((1 << a.ks_log2) < a.ksplit) ++a.ks_log2;
  if ((1 << a.ks_log2) != a.ksplit) return Status(ErrorCode::kInternal, "decode K split not a power of two", "x");
  // Only K in segments reads it (dec_slot_chunk), where seg_chunks is small (decode_shape: at most
  // ~28 at 16+ tokens a pass); with one segment seg_chunks is all of K's chunks, for which the
  // 16-bit reciprocal need not be exact (review: K = 14,336 at a split of 8 would have failed).
  a.seg_recip = 0;
  if (a.num_segs > 1) {
    a.seg_recip = (65536 + a.seg_chunks - 1) / a.seg_chunks;
    for (int slot = 0; slot < a.ksplit * a.seg_chunks; ++slot)
      if ((slot * a.seg_recip) >> 16 != slot / a.seg_chunks)
        return Status(ErrorCode::kInternal, "decode staging: segment reciprocal not exact", "x");
  }
  a.pair_recip = 0;
  if (a.top_k >= 1 && pairs >= 0 && static_cast<uint64_t>(pairs) * static_cast<uint64_t>(a.top_k) < (1ull << 32))
    // Exact for n < pairs: n * (ceil(2^32 / k) - 2^32 / k) < n < 2^32 / k. top_k 1 overflows to 0:
    // the division, which is then free anyway.
    a.pair_recip = static_cast<uint32_t>(((1ull << 32) + a.top_k - 1) / a.top_k);
  // A direct pass issues and waits for its bulk copies over K in one segment (decode_shape gives
  // one at up to 8 tokens a pass); more would leave copies unwaited at the barriers' inval.
  if (direct && a.num_segs != 1) return Status(ErrorCode::kInternal, "direct decode pass over K in segments", "x");
  const int64_t groups = a.n / 32, per_cta = kDecWarps / a.ksplit;
  const int64_t blocks = (groups + per_cta - 1) / per_cta;
  a.row_blocks = static_cast<int>(blocks);
  // K split 8 ways (few experts: a block is one 32-row group, ~K / 1024 chunks per warp), one
  // n-tile, and more blocks than the SMs hold at once (two CTAs each, one past kDecSmemTwoCtas):
  // one wave of CTAs, each looping over blocks of its expert. The routing loads, the CTA launch
  // and the first staging were most of such a CTA's time (gpt-oss gate_up at one token had 720
  // CTAs of one block, ~2.7 waves, before decode_ksplit's one-wave rule gave it 4 slices). Since
  // that rule, split 8 means at most one wave of direct-B warps, so only staged launches (MXFP8
  // rows, or more than kDecSmemTwoCtas) still loop.
  int64_t ctas = blocks;
  const int64_t resident = (direct ? kDirCtas : shape.smem <= kDecSmemTwoCtas ? 2 : 1) * static_cast<int64_t>(num_sms);
  if (a.ksplit == kDecWarps && a.tok_cap <= 8 && blocks * bound > resident) {
    const int64_t per_expert = resident / bound;
    ctas = per_expert < 1 ? 1 : per_expert;
  }
  // Expert-major where every expert takes one pass (at most tok_cap tokens: no expert's CTAs run
  // longer than another's), so that a wave holds blocks of every busy expert; with heavier
  // experts the default order starts their longer CTAs first. The same bits either way (the order
  // says only which CTA runs when). Same-run A/B (H100, 2026-12-06, NOTES): 3 % faster at 8 Qwen3
  // tokens, 6 % slower at 64 when applied there too. ROLLOUTD_MOE_EXPERT_MAJOR=0 / 1 forces it.
  const int forced_major = expert_major_override();
  a.expert_major = forced_major >= 0 ? forced_major : (max_tokens_per_expert <= a.tok_cap ? 1 : 0);
  if (ctas > 65535) a.expert_major = 0;  // gridDim.y's limit (never reached by real row counts)
  const dim3 grid = a.expert_major ? dim3(static_cast<unsigned int>(bound), static_cast<unsigned int>(ctas))
                                   : dim3(static_cast<unsigned int>(ctas), static_cast<unsigned int>(bound));
  if (shape.smem > kDecSmemMax) return Status(ErrorCode::kUnimplemented, "hidden size too large for the decode kernel", "x");
  // The down kernel is launched as a programmatic dependent of whatever precedes it (gate_up,
  // which triggers early; the MXFP8 quantization of h, which does not, so down then waits for it).
  // gate_up is one too (of the permutation or x's rounding): it waits at its top
  // (cuda_common.cuh), down only before it first reads h. ROLLOUTD_PDL=0: neither.
  const auto launch = [&](auto kernel) {
    return cuda::launch_dependent(kernel, grid, kDecThreads, shape.smem, stream_of(ctx), a);
  };
  if (a.tok_cap > 32) {
    RD_RETURN_IF_ERROR((decode_opt_in<kGateUp, 5>(ctx.device.index)));
    RD_CUDA_CHECK(launch(decode_gemm_kernel<kGateUp, 5>));
  } else if (a.tok_cap > 16) {
    RD_RETURN_IF_ERROR((decode_opt_in<kGateUp, 4>(ctx.device.index)));
    RD_CUDA_CHECK(launch(decode_gemm_kernel<kGateUp, 4>));
  } else if (a.tok_cap > 8) {
    RD_RETURN_IF_ERROR((decode_opt_in<kGateUp, 2>(ctx.device.index)));
    RD_CUDA_CHECK(launch(decode_gemm_kernel<kGateUp, 2>));
  } else if (direct) {
    RD_RETURN_IF_ERROR((decode_opt_in<kGateUp, 1, true>(ctx.device.index)));
    RD_CUDA_CHECK(launch(decode_gemm_kernel<kGateUp, 1, true>));
  } else {
    RD_RETURN_IF_ERROR((decode_opt_in<kGateUp, 1>(ctx.device.index)));
    RD_CUDA_CHECK(launch(decode_gemm_kernel<kGateUp, 1>));
  }
  RD_CUDA_CHECK_LAUNCH("moe decode_gemm_kernel");
  return Status::Ok();
}

// ---- prefill: MXFP4 weights, many tokens per expert ---------------------------------------
// A CTA computes BM pair rows (64 or 128) x 128 kernel rows of one expert, K in steps of 64
// (one MXFP4 tile column). Per step, cp.async brings the token rows (bf16) and the raw MXFP4
// tile (4 KiB of codes; per thread the aligned scale word holding its block's scale) into a
// 3-stage ring; each thread dequantizes the 32 codes it copied itself (e2m1_word_bf16: bit moves
// and one bf16x2 multiply by the block scale, the same exact arithmetic as gemm_kernel) into a double-buffered
// bf16 weight tile, so the only CTA barrier per step is the one that publishes that tile and the
// next token rows. 8 warps (2 along M x 4 along N, 32 kernel rows each) multiply with ldmatrix +
// mma.sync m16n8k16, FP32 accumulators in registers, while the same warps dequantize the next
// step's tile. A weight tile is dequantized once for all BM tokens (the decode kernel: per 8-32
// tokens), so at many tokens per expert the tensor cores, not the dequantization, set the pace.
// A warp's 32 kernel rows are one (16 gate, 16 up) group, so gate_up's SwiGLU epilogue runs from
// registers. The grid is (N tiles, M tiles): consecutive CTAs share the token rows of one M tile
// and the weights of one expert (both stay in L2). N % 64 == 0: the last N tile may hold 64 rows
// (gpt-oss's H = 2880); K % 64 == 0 (host-checked). MXFP8 activations reach it dequantized to
// bf16 (exact: E4M3 times a power of two is a bf16 number).
constexpr int kPfThreads = 256;
constexpr int64_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y: the prefill kernel's M tiles
constexpr int kPfBN = 128;
constexpr int kPfBK = 64;
constexpr int kPfStages = 3;
constexpr int kPfLd = kPfBK + 8;                  // bf16 row stride in shared memory (144 B: ldmatrix conflict-free)
constexpr int kPfRawBytes = 4096 + kPfThreads * 4;  // 8 row tiles of 512 B codes + one scale word per thread

template <int BM>
struct PfShape {
  static constexpr int kMt = BM / 32;  // m16 tiles per warp (2 warps along M)
  static constexpr int kABytes = BM * kPfLd * 2;
  static constexpr int kBBytes = kPfBN * kPfLd * 2;
  static constexpr int kSmem = kPfStages * (kABytes + kPfRawBytes) + 2 * kBBytes;
  static_assert(BM == 64 || BM == 128, "tile height");
};

using cuda::cp_async16_zfill;
__device__ __forceinline__ void cp_async4_zfill(void* smem, const void* gmem, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(gmem), "r"(n) : "memory");
}
using cuda::ldmatrix_x4;

// The gate and up biases of one of a thread's features, and of all four (columns j * 8 + q2 + c
// of its warp's 32-row group): loaded once before an epilogue's loops. Loaded per output, each
// load followed the previous output's store (or the amax exchange's), which the compiler must
// assume may alias it: 64 dependent global loads a thread and tile in the PTX, against 8.
struct GateUpBias {
  bool on;
  float g, u;
};
__device__ __forceinline__ GateUpBias gate_up_bias(const float* bias, int64_t gcol, int64_t ndim,
                                                   quant::Mxfp4RowOrder order) {
  if (!bias) return GateUpBias{false, 0.0f, 0.0f};
  return GateUpBias{true, bias[quant::mxfp4_checkpoint_row(gcol, ndim, order)],
                    bias[quant::mxfp4_checkpoint_row(gcol + 16, ndim, order)]};
}
struct GateUpBiases {
  GateUpBias f[2][2];  // [j][c]
};
__device__ __forceinline__ GateUpBiases gate_up_biases(const float* bias, int64_t wcol0, int64_t ndim, int q2,
                                                       quant::Mxfp4RowOrder order) {
  GateUpBiases b;
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) b.f[j][c] = gate_up_bias(bias, wcol0 + j * 8 + q2 + c, ndim, order);
  return b;
}

// gate_up's activation of one output of a warp's 32 kernel rows: gate column col (0..15) and its
// up column col + 16, the expert's biases added first. Both prefill epilogues take h from here.
template <int kMt>
__device__ __forceinline__ float gate_up_activation(const GemmArgs& g, const float (&acc)[kMt][4][4], int i, int j,
                                                    int hr, int c, const GateUpBiases& b) {
  float gv = acc[i][j][hr * 2 + c], uv = acc[i][j + 2][hr * 2 + c];
  if (b.f[j][c].on) {
    gv = math::add(gv, b.f[j][c].g);
    uv = math::add(uv, b.f[j][c].u);
  }
  return math::activate(g.act_kind, g.limit, g.alpha, gv, uv);
}

// gate_up's epilogue for MXFP8 activations: h through MXFP8 and back as bf16 rows, by the rule
// mx8_round_bf16_kernel follows (the block's scale from its largest magnitude, E4M3 codes, decoded
// and rounded to bf16), written straight into h_bf16 where gate_up wrote FP32 rows that two more
// launches quantized and dequantized (the same values: the down pass reads h as bf16 either way).
// A 32-feature MX block is this warp's 16 features (gate/up group wcol0 / 32, an even group for
// wn even: n0 is a multiple of 128) and its partner's (wn ^ 1), for the same token rows: each
// warp reduces its rows' magnitudes over the 4 lanes of a row, the pair exchanges them in shared
// memory (the staging ring, which every warp finished reading at the main loop's last barrier)
// behind a named barrier of its 64 threads, and each rounds its own values. A pair returns
// before the barrier together (an empty N half), never one warp of it.
template <int BM, int kMt>
__device__ __forceinline__ void prefill_h_mx8(const GemmArgs& g, float (&acc)[kMt][4][4], const float* bias,
                                              uint8_t* smem, int e, int row_base, int rows, int64_t wcol0,
                                              int64_t ndim, int wm, int wn, int lane) {
  (void)e;
  const auto order = static_cast<quant::Mxfp4RowOrder>(g.row_order);
  const int q2 = 2 * (lane & 3);
  uint32_t* amax_sm = reinterpret_cast<uint32_t*>(smem);  // [4 wn][BM rows]
  // Pass 1: the activations into the gate slots (j = 0, 1) of acc, each row's magnitude.
  const GateUpBiases gb = gate_up_biases(bias, wcol0, ndim, q2, order);
#pragma unroll
  for (int i = 0; i < kMt; ++i)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      uint32_t am = 0;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float hv = gate_up_activation(g, acc, i, j, hr, c, gb);
          acc[i][j][hr * 2 + c] = hv;
          am = max(am, __float_as_uint(hv) & quant::kF32AbsMask);  // NaN and Inf above every finite
        }
      am = max(am, __shfl_xor_sync(0xffffffffu, am, 1));
      am = max(am, __shfl_xor_sync(0xffffffffu, am, 2));
      const int m = wm * (BM / 2) + i * 16 + (lane >> 2) + hr * 8;
      if ((lane & 3) == 0) amax_sm[wn * BM + m] = am;
    }
  asm volatile("bar.sync %0, 64;" ::"r"(1 + wm * 2 + (wn >> 1)) : "memory");
  // Pass 2: the block's scale, the codes, back to bf16.
#pragma unroll
  for (int i = 0; i < kMt; ++i)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int m = wm * (BM / 2) + i * 16 + (lane >> 2) + hr * 8;
      if (m >= rows) continue;
      const uint32_t am = max(amax_sm[wn * BM + m], amax_sm[(wn ^ 1) * BM + m]);
      const quant::E8M0 sc = quant::mx_scale_from_amax(am, quant::kE4M3EmaxElem);
      const bool poisoned = quant::e8m0_is_nan(sc);
      const int se = poisoned ? 0 : quant::e8m0_exponent(sc);
      const int64_t s = row_base + m;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // A pair of features on the hardware's conversions (e4m3_cuda.cuh: the same bits as
        // e4m3_decode_bits(e4m3_encode(.)) in about a tenth of the instructions).
        float2 f = quant::mx8_round2(acc[i][j][hr * 2], acc[i][j][hr * 2 + 1], se);
        if (poisoned) f.x = f.y = quant::f32_from_bits(quant::kF32CanonicalNan);
        const int64_t jf = (wcol0 / 32) * 16 + j * 8 + q2;
        *reinterpret_cast<uint32_t*>(g.h_bf16 + s * g.inter + jf) = f32_to_bf16_bits(f.x) | (f32_to_bf16_bits(f.y) << 16);
      }
    }
}

// kHMx8 (gate_up only): the epilogue is prefill_h_mx8. An instantiation of its own, so that the
// BF16 kernels' code stays what it was without it: with the MXFP8 epilogue behind a runtime flag
// in the same kernel, Qwen3's BF16 gate_up at 8,192 tokens was 2.6 % slower (same-run A/B on an
// H100, 2026-12-06, tests/bench/NOTES.md).
template <int BM, bool kGateUp, bool kHMx8 = false>
__global__ void __launch_bounds__(kPfThreads, 2) prefill_gemm_kernel(const GemmArgs g) {
  static_assert(kGateUp || !kHMx8, "h through MXFP8 is gate_up's epilogue");
  using S = PfShape<BM>;
  extern __shared__ __align__(128) uint8_t pf_smem[];
  __shared__ int64_t row_src[BM];

  const int tile = blockIdx.y;
  if (tile >= g.meta[0]) return;  // whole CTA
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int e = g.tile_expert[tile];
  const int row0 = g.tile_row0[tile];
  const int base = g.expert_offsets[e];
  const int count = g.expert_offsets[e + 1] - base;
  const int rows = count - row0 < BM ? count - row0 : BM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kPfBN;
  const int64_t kdim = g.k, ndim = g.n;

  uint8_t* a_ring = pf_smem;
  uint8_t* raw_ring = a_ring + kPfStages * S::kABytes;
  uint8_t* b_tiles = raw_ring + kPfStages * kPfRawBytes;

  if (tid < BM) {
    int64_t src = -1;
    if (tid < rows) {
      const int s = base + row0 + tid;
      src = kGateUp ? g.sorted_pair[s] / g.top_k : s;
    }
    row_src[tid] = src;
  }
  __syncthreads();

  const int64_t steps = kdim / kPfBK;  // = MXFP4 K tiles per row tile
  const uint8_t* wblk = g.w_blocks + static_cast<int64_t>(e) * ndim * kdim / 2;
  const uint8_t* wsc = g.w_scales + static_cast<int64_t>(e) * ndim * kdim / 32;
  // Thread tid's weight block: row tile rt, row, K half of the step (16 B of codes, one scale).
  const int rt = tid >> 5, within = tid & 31, wrow = within >> 1, whalf = within & 1;
  const int sc_idx = wrow * 2 + whalf;  // the block's scale byte within the tile's 32
  const bool w_ok = n0 / 16 + rt < ndim / 16;
  const int64_t w_tile0 = w_ok ? (n0 / 16 + rt) * steps : 0;

  auto issue = [&](int64_t st) {
    const int slot = static_cast<int>(st % kPfStages);
    uint8_t* as = a_ring + slot * S::kABytes;
    const int64_t k0 = st * kPfBK;
#pragma unroll
    for (int j = 0; j < BM * 8 / kPfThreads; ++j) {
      const int c = tid + j * kPfThreads;
      const int m = c >> 3, kc = c & 7;
      const int64_t src = row_src[m];
      const uint16_t* p = g.a_bf16 + (src >= 0 ? src * kdim + k0 + kc * 8 : 0);
      cp_async16_zfill(as + m * kPfLd * 2 + kc * 16, p, src >= 0);
    }
    uint8_t* raw = raw_ring + slot * kPfRawBytes;
    const int64_t ti = w_ok ? w_tile0 + st : 0;
    cp_async16_zfill(raw + tid * 16, wblk + ti * 512 + within * 16, w_ok);
    cp_async4_zfill(raw + 4096 + tid * 4, wsc + ti * 32 + (sc_idx & ~3), w_ok);
  };

  // Dequantize this thread's block of step st (copied by this thread: its own wait_group is the
  // only synchronisation needed) into weight tile buffer st % 2.
  auto dequant = [&](int64_t st) {
    const uint8_t* raw = raw_ring + static_cast<int>(st % kPfStages) * kPfRawBytes;
    uint16_t* bt = reinterpret_cast<uint16_t*>(b_tiles + static_cast<int>(st % 2) * S::kBBytes);
    const uint4 v = *reinterpret_cast<const uint4*>(raw + tid * 16);
    const uint32_t sc = raw[4096 + tid * 4 + (sc_idx & 3)];
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    uint32_t o[16];
#pragma unroll
    for (int q = 0; q < 4; ++q) e2m1_word_bf16(words[q], sc, o + 4 * q);
    uint4* dst = reinterpret_cast<uint4*>(bt + (rt * 16 + wrow) * kPfLd + whalf * 32);
    dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
    dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
    dst[2] = make_uint4(o[8], o[9], o[10], o[11]);
    dst[3] = make_uint4(o[12], o[13], o[14], o[15]);
  };

  const int wm = warp >> 2, wn = warp & 3;
  float acc[S::kMt][4][4];
#pragma unroll
  for (int i = 0; i < S::kMt; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;

  // Prologue: steps 0 and 1 in flight, step 0 dequantized and published.
  issue(0);
  cp_async_commit();
  if (steps > 1) issue(1);
  cp_async_commit();
  cp_async_wait<1>();
  dequant(0);
  __syncthreads();

  const int a_row = wm * (BM / 2) + (lane & 15), a_col = (lane >> 4) * 8;
  const int b_row = wn * 32 + (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;
  for (int64_t st = 0; st < steps; ++st) {
    // Slot (st + 2) % 3 last held step st - 1: its token rows were read by the previous step's
    // mma (every warp passed the barrier since), its raw tile by this thread's dequant before.
    if (st + 2 < steps) issue(st + 2);
    cp_async_commit();
    const uint16_t* as = reinterpret_cast<const uint16_t*>(a_ring + static_cast<int>(st % kPfStages) * S::kABytes);
    const uint16_t* bt = reinterpret_cast<const uint16_t*>(b_tiles + static_cast<int>(st % 2) * S::kBBytes);
#pragma unroll
    for (int kk = 0; kk < kPfBK; kk += 16) {
      uint32_t af[S::kMt][4];
      uint32_t bf[2][4];
#pragma unroll
      for (int i = 0; i < S::kMt; ++i) ldmatrix_x4(af[i], as + (a_row + i * 16) * kPfLd + kk + a_col);
#pragma unroll
      for (int p = 0; p < 2; ++p) ldmatrix_x4(bf[p], bt + (b_row + p * 16) * kPfLd + kk + b_col);
#pragma unroll
      for (int i = 0; i < S::kMt; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_bf16_16816(acc[i][j], af[i], bf[j >> 1][(j & 1) * 2], bf[j >> 1][(j & 1) * 2 + 1]);
    }
    if (st + 1 < steps) {
      cp_async_wait<1>();  // step st + 1's copies (this thread's) landed; st + 2 may be in flight
      dequant(st + 1);     // into the other buffer: every warp finished reading it last step
    }
    __syncthreads();  // publishes weight tile st + 1 and everyone's token rows of step st + 1
  }
  cp_async_wait_all();

  // Epilogue from registers: acc[i][j][c] is row wm * BM/2 + 16 i + lane/4 (+8 for c >= 2),
  // column wn * 32 + 8 j + 2 (lane % 4) (+1 for odd c).
  const int64_t wcol0 = n0 + wn * 32;
  if (wcol0 >= ndim) return;  // the empty half of a 64-row last N tile
  const float* bias = g.bias ? g.bias + static_cast<int64_t>(e) * ndim : nullptr;
  const int q2 = 2 * (lane & 3);
  if constexpr (kHMx8) {
    prefill_h_mx8<BM>(g, acc, bias, pf_smem, e, base + row0, rows, wcol0, ndim, wm, wn, lane);
  } else {
    // The biases, loaded once (see GateUpBias): gate_up's 4 features, or down's 8 columns.
    GateUpBiases gb{};
    float2 db[4] = {};
    if constexpr (kGateUp) {
      gb = gate_up_biases(bias, wcol0, ndim, q2, static_cast<quant::Mxfp4RowOrder>(g.row_order));
    } else if (bias) {
#pragma unroll
      for (int j = 0; j < 4; ++j) db[j] = make_float2(bias[wcol0 + j * 8 + q2], bias[wcol0 + j * 8 + q2 + 1]);
    }
#pragma unroll
    for (int i = 0; i < S::kMt; ++i) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int m = wm * (BM / 2) + i * 16 + (lane >> 2) + hr * 8;
        if (m >= rows) continue;
        const int64_t s = base + row0 + m;
        if constexpr (kGateUp) {
          // Columns 0..15 of the warp are the gate rows of features (wcol0 / 32) * 16 + 0..15,
          // columns 16..31 their up rows.
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float hv[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) hv[c] = gate_up_activation(g, acc, i, j, hr, c, gb);
            const int64_t jf = (wcol0 / 32) * 16 + j * 8 + q2;
            if (g.h_bf16)
              *reinterpret_cast<uint32_t*>(g.h_bf16 + s * g.inter + jf) =
                  f32_to_bf16_bits(hv[0]) | (f32_to_bf16_bits(hv[1]) << 16);
            else
              *reinterpret_cast<float2*>(g.h_f32 + s * g.inter + jf) = make_float2(hv[0], hv[1]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int64_t col = wcol0 + j * 8 + q2;
            float2 v = make_float2(acc[i][j][hr * 2], acc[i][j][hr * 2 + 1]);
            if (bias) {
              v.x = math::add(v.x, db[j].x);
              v.y = math::add(v.y, db[j].y);
            }
            *reinterpret_cast<float2*>(g.y + s * ndim + col) = v;
          }
        }
      }
    }
  }
}

template <int BM, bool kGateUp, bool kHMx8>
Status prefill_opt_in(int device) {
  static std::atomic<uint64_t> opted{0};
  return opt_in_smem(opted, prefill_gemm_kernel<BM, kGateUp, kHMx8>, PfShape<BM>::kSmem, device);
}

template <int BM, bool kGateUp, bool kHMx8 = false>
Status launch_prefill_bm(const ExecContext& ctx, const GemmArgs& g, const dim3 grid) {
  RD_RETURN_IF_ERROR((prefill_opt_in<BM, kGateUp, kHMx8>(ctx.device.index)));
  prefill_gemm_kernel<BM, kGateUp, kHMx8><<<grid, kPfThreads, PfShape<BM>::kSmem, stream_of(ctx)>>>(g);
  RD_CUDA_CHECK_LAUNCH("moe prefill_gemm_kernel");
  return Status::Ok();
}

template <bool kGateUp>
Status launch_prefill(const ExecContext& ctx, const GemmArgs& g, int bm, int64_t max_tiles) {
  if (max_tiles == 0) return Status::Ok();
  if (max_tiles > kMaxGridY) return Status(ErrorCode::kInternal, "too many row tiles for the prefill grid", "x");
  const dim3 grid(static_cast<unsigned int>((g.n + kPfBN - 1) / kPfBN), static_cast<unsigned int>(max_tiles));
  if constexpr (kGateUp) {
    if (g.h_mx8) {
      if (bm == 128) return launch_prefill_bm<128, true, true>(ctx, g, grid);
      return launch_prefill_bm<64, true, true>(ctx, g, grid);
    }
  }
  if (bm == 128) return launch_prefill_bm<128, kGateUp>(ctx, g, grid);
  return launch_prefill_bm<64, kGateUp>(ctx, g, grid);
}

template <bool kGateUp>
Status launch_gemm(const ExecContext& ctx, const GemmArgs& g, int bm, bool bf16_weights, bool mx8,
                   int64_t max_tiles) {
  if (max_tiles == 0) return Status::Ok();
  const dim3 grid(static_cast<unsigned int>(max_tiles), static_cast<unsigned int>(g.n / kBN));
  cudaStream_t s = stream_of(ctx);
#define RD_MOE_GEMM(BM, W, A) gemm_kernel<BM, W, A, kGateUp><<<grid, kThreads, 0, s>>>(g)
  if (bm == 16 && bf16_weights && mx8) RD_MOE_GEMM(16, true, true);
  else if (bm == 16 && bf16_weights) RD_MOE_GEMM(16, true, false);
  else if (bm == 16 && mx8) RD_MOE_GEMM(16, false, true);
  else if (bm == 16) RD_MOE_GEMM(16, false, false);
  else if (bf16_weights && mx8) RD_MOE_GEMM(64, true, true);
  else if (bf16_weights) RD_MOE_GEMM(64, true, false);
  else if (mx8) RD_MOE_GEMM(64, false, true);
  else RD_MOE_GEMM(64, false, false);
#undef RD_MOE_GEMM
  RD_CUDA_CHECK_LAUNCH("moe gemm_kernel");
  return Status::Ok();
}

TensorView dev_view(const ExecContext& ctx, void* data, DType dtype, Shape shape) {
  return TensorView::contiguous(data, dtype, shape, ctx.device);
}

}  // namespace

Status cuda_experts(const ExecContext& ctx, const ExpertsPlan& p) {
  if (p.num_tokens == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  cudaStream_t stream = stream_of(ctx);
  const int64_t t = p.num_tokens, nv = p.num_valid, h = p.hidden, inter = p.inter, k = p.top_k;
  const int64_t ep = p.num_physical, pairs = nv * k;
  const ExpertsWorkspace ws = experts_workspace(t, k, h, inter, ep, p.precision);
  uint8_t* w8 = p.workspace;
  auto at = [&](size_t off) { return static_cast<void*>(w8 + off); };
  int32_t* pair_pos = static_cast<int32_t*>(at(ws.pair_pos));
  float* y = static_cast<float*>(at(ws.y));

  if (pairs > 0) {
    // Tile height: 16 rows when experts see few tokens each (decode), 64 otherwise.
    const int64_t busy = pairs < ep ? pairs : ep;
    int bm = pairs / busy >= kDecodeMaxPairsPerExpert ? 64 : 16;
    // MXFP4 weights with few tokens per expert take the decode kernel (one "tile" per active
    // expert: the permutation lists the active experts, those past a pass first); with many,
    // the prefill kernel (tiles of 64 or 128 rows).
    const bool mx8 = p.precision == ActPrecision::kMXFP8;
    const bool decode = p.format == WeightFormat::kMXFP4 && bm == 16;
    // (The prefill grid puts the tiles on y: past 65,535 of them, gemm_kernel takes over.)
    const int pf_bm = pairs / busy >= 128 ? 128 : 64;
    const bool prefill =
        p.format == WeightFormat::kMXFP4 && bm == 64 && max_m_tiles(pairs, ep, pf_bm) <= kMaxGridY;
    if (prefill) bm = pf_bm;
    const int64_t max_tiles = max_m_tiles(pairs, ep, bm);
    if (max_tiles > INT_MAX)
      return Status(ErrorCode::kUnimplemented, "too many rows for one MoE launch", "x");

    PermuteArgs pa;
    pa.ids = p.ids;
    pa.l2p = p.l2p;
    pa.pairs = pairs;
    pa.num_valid_device = p.num_valid_device;
    pa.top_k = static_cast<int>(k);
    pa.num_logical = static_cast<int>(p.num_logical);
    pa.num_physical = static_cast<int>(ep);
    pa.bm = decode ? (1 << 30) : bm;
    // N-tiles per decode pass from the tokens per expert that the host knows without a sync (a
    // lower bound of the mean: fewer experts may be active); an expert past tok_cap takes more
    // passes, and the permutation lists such experts first (heavy_first()).
    const int64_t per_expert = pairs / busy;
    const int max_nt = per_expert > 24 ? 5 : per_expert > 8 ? 4 : per_expert > 4 ? 2 : 1;
    // Down's pass (<= gate_up's): an expert past it is listed first in both GEMMs.
    pa.heavy = decode && heavy_first() ? 8 * std::min(max_nt, five_n_tiles(false)) : 0;
    pa.pair_expert = static_cast<int32_t*>(at(ws.pair_expert));
    pa.pair_pos = pair_pos;
    pa.sorted_pair = static_cast<int32_t*>(at(ws.sorted_pair));
    pa.expert_offsets = static_cast<int32_t*>(at(ws.expert_offsets));
    pa.tile_expert = static_cast<int32_t*>(at(ws.tile_expert));
    pa.tile_row0 = static_cast<int32_t*>(at(ws.tile_row0));
    pa.meta = static_cast<int32_t*>(at(ws.meta));
    // The counts and tile offsets, and the map when all fit the default 48 KiB beside the
    // kernel's static arrays (its scan's three per-warp sums).
    size_t psmem = static_cast<size_t>(2 * ep + 1) * sizeof(int32_t);
    const size_t map_bytes = static_cast<size_t>(p.num_logical) * sizeof(int32_t);
    constexpr size_t kPermuteStaticBytes = 3 * (kPermuteThreads / 32) * sizeof(int32_t);
    pa.stage_l2p = psmem + map_bytes + kPermuteStaticBytes <= 48 * 1024;
    if (pa.stage_l2p) psmem += map_bytes;
    // As many threads as pairs or experts (whole warps, 128 to kPermuteThreads): a decode step's
    // few pairs take 4 warps, not 32, through the kernel's five barriers.
    const int64_t pwork = pairs > ep ? pairs : ep;
    const int pthreads = pwork >= kPermuteThreads ? kPermuteThreads
                                                  : static_cast<int>(pwork < 128 ? 128 : (pwork + 31) / 32 * 32);
    (void)cuda::launch_dependent(permute_kernel, 1, pthreads, psmem, stream, pa);
    RD_CUDA_CHECK_LAUNCH("moe permute_kernel");

    const bool bf16w = p.format == WeightFormat::kBF16;
    if (decode) {
      int num_sms = 0;
      RD_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, ctx.device.index));
      const int64_t bound = busy;  // active experts <= min(pairs, E): a grid bound without a sync
      DecodeArgs dg{};
      dg.expert_offsets = pa.expert_offsets;
      dg.active = pa.tile_expert;
      dg.meta = pa.meta;
      dg.top_k = static_cast<int>(k);
      dg.act_kind = static_cast<int>(p.act.kind);
      dg.limit = p.act.limit;
      dg.alpha = p.act.alpha;
      dg.inter = static_cast<int>(inter);
      // gate_up: B = x rows (f32 rounded to bf16 while staging, bf16, or MXFP8).
      dg.sorted_pair = pa.sorted_pair;
      if (mx8 && mxfp8_bf16_rows()) {
        // x's BF16 rows in y's space (y is written by down, after gate_up has read them).
        const int64_t blocks = nv * h / quant::kMxBlockSize;
        (void)cuda::launch_dependent(mx8_round_bf16_kernel,
                                     cuda::blocks_for(blocks, kMx8RoundThreads / 32, 4096), kMx8RoundThreads, 0,
                                     stream, static_cast<uint16_t*>(at(ws.y)), p.x, p.x_bf16, blocks);
        RD_CUDA_CHECK_LAUNCH("moe mx8_round_bf16_kernel");
        dg.src = kSrcBf16;
        dg.b = at(ws.y);
        dg.h_f32 = static_cast<float*>(at(ws.h));
      } else if (mx8) {
        const TensorView x_rows = dev_view(ctx, const_cast<void*>(p.x),
                                           p.x_bf16 ? DType::kBF16 : DType::kF32, Shape{nv, h});
        RD_RETURN_IF_ERROR(quant::quantize_mxfp8(ctx, x_rows, dev_view(ctx, at(ws.xa), DType::kU8, Shape{nv, h}),
                                                 dev_view(ctx, at(ws.xa_scales), DType::kU8, Shape{nv, h / 32})));
        dg.src = kSrcMx8;
        dg.b_q = static_cast<const uint8_t*>(at(ws.xa));
        dg.b_scales = static_cast<const uint8_t*>(at(ws.xa_scales));
        dg.h_f32 = static_cast<float*>(at(ws.h));
      } else if (!p.x_bf16 && max_nt == 1) {
        // One-n-tile passes read bf16 rows straight from memory (direct B): FP32 x rounded to
        // bf16 once here, by the function the staging rounds with (same products, same results).
        (void)cuda::launch_dependent(to_bf16_kernel, cuda::blocks_for(nv * h, 256, 4096), 256, 0, stream,
                                     static_cast<uint16_t*>(at(ws.xa)), static_cast<const float*>(p.x), nv * h);
        RD_CUDA_CHECK_LAUNCH("moe to_bf16_kernel");
        dg.src = kSrcBf16;
        dg.b = at(ws.xa);
        dg.h_bf16 = static_cast<uint16_t*>(at(ws.h));
      } else {
        dg.src = p.x_bf16 ? kSrcBf16 : kSrcF32;
        dg.b = p.x;
        dg.h_bf16 = static_cast<uint16_t*>(at(ws.h));
      }
      dg.w_blocks = p.gate_up_blocks;
      dg.w_scales = p.gate_up_scales;
      dg.row_order = static_cast<int>(p.order == GateUpOrder::kInterleaved
                                          ? quant::Mxfp4RowOrder::kGateUpInterleaved
                                          : quant::Mxfp4RowOrder::kGateUpConcatenated);
      dg.n = static_cast<int>(2 * inter);
      dg.k = static_cast<int>(h);
      dg.bias = p.gate_up_bias;
      RD_RETURN_IF_ERROR(launch_decode<true>(ctx, dg, bound, num_sms, std::min(max_nt, five_n_tiles(true)), pairs, nv));
      // down: B = h rows in sorted order.
      DecodeArgs dd = dg;
      dd.sorted_pair = nullptr;
      dd.b = nullptr;
      dd.b_q = nullptr;
      dd.b_scales = nullptr;
      if (mx8 && mxfp8_bf16_rows()) {
        // h's rows through MXFP8 and back as BF16, as x's were (h_q's space holds 2 bytes a value
        // for a decode launch's pairs: experts_workspace).
        const int64_t blocks = pairs * inter / quant::kMxBlockSize;
        (void)cuda::launch_dependent(mx8_round_bf16_kernel,
                                     cuda::blocks_for(blocks, kMx8RoundThreads / 32, 4096), kMx8RoundThreads, 0,
                                     stream, static_cast<uint16_t*>(at(ws.h_q)), at(ws.h), false, blocks);
        RD_CUDA_CHECK_LAUNCH("moe mx8_round_bf16_kernel (h)");
        dd.src = kSrcBf16;
        dd.b = at(ws.h_q);
      } else if (mx8) {
        RD_RETURN_IF_ERROR(quant::quantize_mxfp8(
            ctx, dev_view(ctx, at(ws.h), DType::kF32, Shape{pairs, inter}),
            dev_view(ctx, at(ws.h_q), DType::kU8, Shape{pairs, inter}),
            dev_view(ctx, at(ws.h_scales), DType::kU8, Shape{pairs, inter / 32})));
        dd.src = kSrcMx8;
        dd.b_q = static_cast<const uint8_t*>(at(ws.h_q));
        dd.b_scales = static_cast<const uint8_t*>(at(ws.h_scales));
      } else {
        dd.src = kSrcBf16;
        dd.b = at(ws.h);
      }
      dd.h_bf16 = nullptr;
      dd.h_f32 = nullptr;
      dd.y = y;
      dd.w_blocks = p.down_blocks;
      dd.w_scales = p.down_scales;
      dd.row_order = static_cast<int>(quant::Mxfp4RowOrder::kPlain);
      dd.n = static_cast<int>(h);
      dd.k = static_cast<int>(inter);
      dd.bias = p.down_bias;
      RD_RETURN_IF_ERROR(launch_decode<false>(ctx, dd, bound, num_sms, std::min(max_nt, five_n_tiles(false)), pairs, nv));
    } else {
    GemmArgs g{};
    g.expert_offsets = pa.expert_offsets;
    g.tile_expert = pa.tile_expert;
    g.tile_row0 = pa.tile_row0;
    g.meta = pa.meta;
    g.sorted_pair = pa.sorted_pair;
    g.top_k = static_cast<int>(k);
    g.act_kind = static_cast<int>(p.act.kind);
    g.limit = p.act.limit;
    g.alpha = p.act.alpha;
    g.inter = inter;

    // GEMM-1 operand: x as bf16 or MXFP8, one row per real token.
    const TensorView x_rows = dev_view(ctx, const_cast<void*>(p.x),
                                       p.x_bf16 ? DType::kBF16 : DType::kF32, Shape{nv, h});
    // Prefill with MXFP8 activations, fused (mxfp8_bf16_rows(), the default): x through MXFP8 as
    // bf16 rows in one launch, and h written by gate_up's epilogue as bf16 rows through MXFP8
    // (prefill_h_mx8), where quantize + dequantize launches ran for each: the same values.
    const bool pf_fused = mx8 && prefill && mxfp8_bf16_rows();
    if (pf_fused) {
      const int64_t blocks = nv * h / quant::kMxBlockSize;
      (void)cuda::launch_dependent(mx8_round_bf16_kernel, cuda::blocks_for(blocks, kMx8RoundThreads / 32, 4096),
                                   kMx8RoundThreads, 0, stream, static_cast<uint16_t*>(at(ws.y)), p.x, p.x_bf16,
                                   blocks);
      RD_CUDA_CHECK_LAUNCH("moe mx8_round_bf16_kernel (prefill x)");
      g.a_bf16 = static_cast<const uint16_t*>(at(ws.y));
    } else if (mx8) {
      RD_RETURN_IF_ERROR(quant::quantize_mxfp8(ctx, x_rows, dev_view(ctx, at(ws.xa), DType::kU8, Shape{nv, h}),
                                               dev_view(ctx, at(ws.xa_scales), DType::kU8, Shape{nv, h / 32})));
      if (prefill) {  // the prefill kernel takes the MXFP8 values as bf16, in y's space (unused until down)
        RD_RETURN_IF_ERROR(quant::dequantize_mxfp8(ctx, dev_view(ctx, at(ws.xa), DType::kU8, Shape{nv, h}),
                                                   dev_view(ctx, at(ws.xa_scales), DType::kU8, Shape{nv, h / 32}),
                                                   dev_view(ctx, at(ws.y), DType::kBF16, Shape{nv, h})));
        g.a_bf16 = static_cast<const uint16_t*>(at(ws.y));
      } else {
        g.a_q = static_cast<const uint8_t*>(at(ws.xa));
        g.a_scales = static_cast<const uint8_t*>(at(ws.xa_scales));
      }
    } else if (p.x_bf16) {
      g.a_bf16 = static_cast<const uint16_t*>(p.x);
    } else {
      (void)cuda::launch_dependent(to_bf16_kernel, cuda::blocks_for(nv * h, 256, 4096), 256, 0, stream,
                                   static_cast<uint16_t*>(at(ws.xa)), static_cast<const float*>(p.x), nv * h);
      RD_CUDA_CHECK_LAUNCH("moe to_bf16_kernel");
      g.a_bf16 = static_cast<const uint16_t*>(at(ws.xa));
    }
    g.n = 2 * inter;
    g.k = h;
    g.w_bf16 = p.gate_up_bf16;
    g.w_blocks = p.gate_up_blocks;
    g.w_scales = p.gate_up_scales;
    g.row_order = static_cast<int>(p.order == GateUpOrder::kInterleaved
                                       ? quant::Mxfp4RowOrder::kGateUpInterleaved
                                       : quant::Mxfp4RowOrder::kGateUpConcatenated);
    g.bias = p.gate_up_bias;
    if (mx8 && !pf_fused)
      g.h_f32 = static_cast<float*>(at(ws.h));
    else
      g.h_bf16 = static_cast<uint16_t*>(at(ws.h));
    g.h_mx8 = pf_fused ? 1 : 0;
    if (prefill)
      RD_RETURN_IF_ERROR(launch_prefill<true>(ctx, g, bm, max_tiles));
    else
      RD_RETURN_IF_ERROR(launch_gemm<true>(ctx, g, bm, bf16w, mx8, max_tiles));

    // GEMM-2 operand: h (sorted rows), bf16 or MXFP8.
    GemmArgs d = g;
    d.a_bf16 = nullptr;
    d.a_q = nullptr;
    d.a_scales = nullptr;
    d.h_mx8 = 0;
    if (pf_fused) {
      d.a_bf16 = static_cast<const uint16_t*>(at(ws.h));
    } else if (mx8) {
      RD_RETURN_IF_ERROR(quant::quantize_mxfp8(
          ctx, dev_view(ctx, at(ws.h), DType::kF32, Shape{pairs, inter}),
          dev_view(ctx, at(ws.h_q), DType::kU8, Shape{pairs, inter}),
          dev_view(ctx, at(ws.h_scales), DType::kU8, Shape{pairs, inter / 32})));
      if (prefill) {  // as bf16 again, over h's float32 rows (read by the quantization before)
        RD_RETURN_IF_ERROR(quant::dequantize_mxfp8(ctx, dev_view(ctx, at(ws.h_q), DType::kU8, Shape{pairs, inter}),
                                                   dev_view(ctx, at(ws.h_scales), DType::kU8, Shape{pairs, inter / 32}),
                                                   dev_view(ctx, at(ws.h), DType::kBF16, Shape{pairs, inter})));
        d.a_bf16 = static_cast<const uint16_t*>(at(ws.h));
      } else {
        d.a_q = static_cast<const uint8_t*>(at(ws.h_q));
        d.a_scales = static_cast<const uint8_t*>(at(ws.h_scales));
      }
    } else {
      d.a_bf16 = static_cast<const uint16_t*>(at(ws.h));
    }
    d.n = h;
    d.k = inter;
    d.w_bf16 = p.down_bf16;
    d.w_blocks = p.down_blocks;
    d.w_scales = p.down_scales;
    d.row_order = static_cast<int>(quant::Mxfp4RowOrder::kPlain);
    d.bias = p.down_bias;
    d.h_bf16 = nullptr;
    d.h_f32 = nullptr;
    d.y = y;
    if (prefill)
      RD_RETURN_IF_ERROR(launch_prefill<false>(ctx, d, bm, max_tiles));
    else
      RD_RETURN_IF_ERROR(launch_gemm<false>(ctx, d, bm, bf16w, mx8, max_tiles));
    }
  }

  if (t > INT_MAX) return Status(ErrorCode::kUnimplemented, "too many tokens", "x");
  const dim3 combine_grid(static_cast<unsigned int>(t),
                          static_cast<unsigned int>((h / 4 + kCombineThreads - 1) / kCombineThreads));
  (void)cuda::launch_dependent(combine_kernel, combine_grid, kCombineThreads, 0, stream, p.out, y, pair_pos,
                               p.topk_weights, nv, p.num_valid_device, h, static_cast<int>(k), p.accumulate);
  RD_CUDA_CHECK_LAUNCH("moe combine_kernel");
  return Status::Ok();
}

}  // namespace rolloutd::moe::detail
