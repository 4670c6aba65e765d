// CUDA twins of the MoE ops: softmax top-k routing (one warp per token) and the SwiGLU
// expert combine (one block per token, experts visited one after another). Simple and
// exact; grouped GEMMs over tokens sorted by expert come later and are checked against
// these and the CPU reference.
//
// Expert ids are on the device and not checked on the host: a (token, k) whose logical id
// is outside [0, E_logical), or whose physical slot is outside [0, E_phys), contributes
// nothing. Padding rows (t >= num_valid_tokens) are zeroed and their ids never read.
#include <climits>
#include <cmath>
#include <cstdlib>

#include <cooperative_groups.h>

#include "kernels/cpu/op_checks.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"
#include "kernels/quant/mxfp4.hpp"

namespace rolloutd::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kRouterWarpsPerBlock = 4;
constexpr int kMoeThreads = 256;
constexpr int kMoeWarps = kMoeThreads / 32;

// The CPU reference's ranking (kernels/cpu/cpu_moe.cpp): by logit, NaN last, equal
// logits by lower id. Identical inputs and comparisons make both backends pick the same
// experts bit for bit, whatever their exp() rounding.
__device__ __forceinline__ float rank_value(float logit) {
  return isnan(logit) ? -INFINITY : logit;
}
__device__ __forceinline__ bool ranks_before(float va, int a, float vb, int b) {
  return va > vb || (va == vb && a < b);
}

// One warp routes one token: logits l[0, E) -> ids[0, K), weights[0, K) (router_softmax_topk's
// arithmetic). Round k picks the best expert ranked after round k-1's pick, so no "taken" set
// is needed. Any E and K; select_topk_lanes below is the same arithmetic, faster, for K <= 32.
__device__ __forceinline__ void select_topk_any(const float* l, int num_experts, int top_k, bool renormalize,
                                            int32_t* ids, float* weights, int lane) {
  float max_logit = -INFINITY;
  for (int e = lane; e < num_experts; e += 32) max_logit = fmaxf(max_logit, l[e]);
  max_logit = warp_max(max_logit);
  float sum = 0.0f;
  for (int e = lane; e < num_experts; e += 32) sum += expf(l[e] - max_logit);
  sum = warp_sum(sum);

  float prev_v = 0.0f;
  int prev = -1;
  float picked_sum = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    float best_v = -INFINITY;
    int best = -1;
    for (int e = lane; e < num_experts; e += 32) {
      const float v = rank_value(l[e]);
      if (prev >= 0 && !ranks_before(prev_v, prev, v, e)) continue;
      if (best < 0 || ranks_before(v, e, best_v, best)) {
        best_v = v;
        best = e;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_v = __shfl_xor_sync(0xffffffffu, best_v, offset);
      const int other = __shfl_xor_sync(0xffffffffu, best, offset);
      if (other >= 0 && (best < 0 || ranks_before(other_v, other, best_v, best))) {
        best_v = other_v;
        best = other;
      }
    }
    if (best < 0) break;  // unreachable while top_k <= num_experts (host-checked)
    prev_v = best_v;
    prev = best;
    const float p = expf(l[best] - max_logit) / sum;
    picked_sum += p;
    if (lane == 0) {
      ids[k] = best;
      weights[k] = p;
    }
  }
  if (renormalize && lane == 0)
    for (int k = 0; k < top_k; ++k) weights[k] = weights[k] / picked_sum;
}

// rank_value's order as unsigned integers, for the warp's max by redux.sync: a larger key ranks
// before a smaller one, and equal floats get equal keys (-0 is made +0 first: they compare
// equal), so ties are left to the lower id as ranks_before leaves them. No key is 0 (that would
// be a NaN's bits, and rank_value has none): 0 stands for "no candidate".
__device__ __forceinline__ uint32_t rank_key(float v) {
  const uint32_t b = __float_as_uint(v + 0.0f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float rank_key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// select_topk_any's picks and bits for E <= 32 * kPerLane and K <= 32, with fewer round trips: a
// lane's logits l[lane + 32 j] stay in registers (lv), the rounds' warp max is two redux.sync
// (the best key, then the lowest id holding it) instead of a shuffle tree, and the weights are
// computed after the rounds, pick k's in lane k, all at once: the same expf(l - max) / sum of the
// same values, summed into picked_sum in pick order, then divided by it, as the loop did. lv must
// hold exactly l's values (l is read again for the picks).
// NOTES: one warp's selection was a chain of dependent steps per round (a load from shared or
// global memory for each of the lane's logits, a shuffle tree, expf and a division, the stores,
// then the renormalisation reading the stored weights back): Nsight Compute timed
// router_select_kernel at 6.2 us at one token (top-4) and 10.3 us at 8 tokens (top-8) on an H100
// (2026-12-06), for ~1 us of work.
template <int kPerLane>
__device__ __forceinline__ void select_topk_lanes(const float (&lv)[kPerLane], const float* l, int num_experts,
                                                  int top_k, bool renormalize, int32_t* ids, float* weights, int lane) {
  float max_logit = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    if (lane + 32 * j < num_experts) max_logit = fmaxf(max_logit, lv[j]);
  max_logit = warp_max(max_logit);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    if (lane + 32 * j < num_experts) sum += expf(lv[j] - max_logit);
  sum = warp_sum(sum);

  float prev_v = 0.0f;
  int prev = -1;
  int mine = -1;  // pick number `lane`
  for (int k = 0; k < top_k; ++k) {
    float best_v = -INFINITY;
    int best = -1;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (e >= num_experts) break;
      const float v = rank_value(lv[j]);
      if (prev >= 0 && !ranks_before(prev_v, prev, v, e)) continue;
      if (best < 0 || ranks_before(v, e, best_v, best)) {
        best_v = v;
        best = e;
      }
    }
    const uint32_t key = best < 0 ? 0u : rank_key(best_v);
    const uint32_t top = __reduce_max_sync(0xffffffffu, key);
    if (top == 0u) break;  // unreachable while top_k <= num_experts (host-checked)
    prev = static_cast<int>(__reduce_min_sync(0xffffffffu, key == top ? static_cast<uint32_t>(best) : 0xffffffffu));
    prev_v = rank_key_value(top);  // -0 comes back as +0: they compare equal in ranks_before
    if (lane == k) mine = prev;
  }
  const float p = mine >= 0 ? expf(l[mine] - max_logit) / sum : 0.0f;
  float picked_sum = 0.0f;
  for (int k = 0; k < top_k; ++k) picked_sum += __shfl_sync(0xffffffffu, p, k);
  if (mine >= 0) {
    ids[lane] = mine;
    weights[lane] = renormalize ? p / picked_sum : p;
  }
}

// lv for select_topk_lanes: the lane's logits of l (all its loads in flight at once).
template <int kPerLane>
__device__ __forceinline__ void select_topk_from(const float* l, int num_experts, int top_k, bool renormalize,
                                                 int32_t* ids, float* weights, int lane) {
  float lv[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) lv[j] = lane + 32 * j < num_experts ? l[lane + 32 * j] : 0.0f;
  select_topk_lanes<kPerLane>(lv, l, num_experts, top_k, renormalize, ids, weights, lane);
}

__device__ __forceinline__ void select_topk(const float* l, int num_experts, int top_k, bool renormalize,
                                            int32_t* ids, float* weights, int lane) {
  if (top_k <= 32) {
    if (num_experts <= 32) return select_topk_from<1>(l, num_experts, top_k, renormalize, ids, weights, lane);
    if (num_experts <= 64) return select_topk_from<2>(l, num_experts, top_k, renormalize, ids, weights, lane);
    if (num_experts <= 128) return select_topk_from<4>(l, num_experts, top_k, renormalize, ids, weights, lane);
    if (num_experts <= 256) return select_topk_from<8>(l, num_experts, top_k, renormalize, ids, weights, lane);
  }
  select_topk_any(l, num_experts, top_k, renormalize, ids, weights, lane);
}

__global__ void router_softmax_topk_kernel(int32_t* __restrict__ ids, float* __restrict__ weights,
                                           const float* __restrict__ logits, int64_t num_tokens,
                                           int num_experts, int top_k, bool renormalize) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouterWarpsPerBlock) + threadIdx.x / 32;
  if (t >= num_tokens) return;  // whole warp
  select_topk(logits + t * num_experts, num_experts, top_k, renormalize, ids + t * top_k, weights + t * top_k,
              threadIdx.x & 31);
}

// One lane's step of a router dot product. Both router kernels below use it, so that a row
// summed by either, lane by lane in the same order of i, gives the same bits.
__device__ __forceinline__ float router_dot4(float acc, float4 a, float4 c) {
  return acc + (a.x * c.x + a.y * c.y + a.z * c.z + a.w * c.w);
}

// The router in one launch for a few tokens (Backend::router): a thread block cluster of
// kRouterCluster CTAs per token. Each CTA stages the token's x in shared memory; the cluster's
// kWarps x 8 warps share the work items (expert e, part p): the dot product of expert e's row with
// x over the p-th of P equal K ranges (P = warps / E rounded down to a power of two, at least 1,
// so few experts keep every warp busy), kRouterUnroll float4 loads in flight per lane, a warp sum
// per item. CTA 0 gathers the partial sums through distributed shared memory, adds the parts in
// order and the bias (as linear + add_bias would: one FP32 add), writes the logits, and its
// first warp selects as router_softmax_topk does. Replaces cuBLAS's GEMV (two kernels at one
// token), add_bias and the selection kernel: ~10 us per layer of a decode step at one token.
// NOTES: at one token the gate GEMV is a chain of round trips to memory on the cluster's 8 SMs.
// With more experts than the 64 warps of 8-warp CTAs (gpt-oss-120b's and Qwen3-30B's 128), a warp
// took two rows; 16-warp CTAs (kRouterWideWarps) give each warp one, two CTAs an SM so that 32
// tokens' 256 CTAs stay one wave, and a lane past its range reloads the range's last vector
// instead of branching around the load, so all kRouterUnroll loads stay in flight. Above 64
// experts P is 1 at either width, so the sums and the bits are the same. Same-run A/B on an H100
// (2026-12-06, tests/bench/NOTES.md): MoE layer at one token gpt-oss-120b -4.8 % (bf16) and
// -4.1 % (MXFP8), Qwen3-30B +0.8-1.0 %; at 32 experts (the h2880 step) 16 warps would change P,
// hence the tokens, for a step +1-2 % slower, so up to 64 experts the 8-warp kernel stays.
constexpr int kRouterCluster = 8;
constexpr int kRouterFusedWarps = 8;
constexpr int kRouterWideWarps = 16;
constexpr int kRouterFusedMaxExperts = 1024;
constexpr int kRouterFusedMaxHidden = 8192;  // x staged in shared memory: 32 KiB
constexpr int kRouterUnroll = 8;

template <int kWarps>
__global__ void __cluster_dims__(kRouterCluster, 1, 1) __launch_bounds__(kWarps * 32, kWarps == kRouterWideWarps ? 2 : 0)
    router_fused_kernel(int32_t* __restrict__ ids, float* __restrict__ weights, float* __restrict__ logits,
                        const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
                        int hidden, int num_experts, int parts, int top_k, bool renormalize) {
  constexpr int kStride = kRouterCluster * kWarps;
  constexpr bool kWide = kWarps == kRouterWideWarps;
  __shared__ __align__(16) float4 xs[kRouterFusedMaxHidden / 4];
  __shared__ float part[kRouterFusedMaxExperts];  // this CTA's items' sums, at their item index
  __shared__ float all[kRouterFusedMaxExperts];   // CTA 0: every expert's logit
  pdl_begin();
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t t = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n4 = hidden / 4;
  const float4* x4 = reinterpret_cast<const float4*>(x + t * hidden);
  // x is the previous kernel's output: a coherent load after the wait, not __ldg (an invariant
  // load the compiler may move above the wait's asm).
  for (int i = threadIdx.x; i < n4; i += blockDim.x) xs[i] = __ldcg(x4 + i);
  __syncthreads();
  const int items = num_experts * parts;
  for (int it = rank * kWarps + warp; it < items; it += kStride) {
    const int e = it / parts, p = it - e * parts;
    const int i0 = static_cast<int>(static_cast<int64_t>(n4) * p / parts);
    const int i1 = static_cast<int>(static_cast<int64_t>(n4) * (p + 1) / parts);
    const float4* w4 = reinterpret_cast<const float4*>(w + static_cast<int64_t>(e) * hidden);
    float acc = 0.0f;
    for (int b = i0 + lane; b < i1; b += 32 * kRouterUnroll) {
      float4 a[kRouterUnroll];
#pragma unroll
      for (int u = 0; u < kRouterUnroll; ++u) {
        const int i = b + 32 * u;
        // Wide: past the range, the range's last vector again (cached, unused; see above).
        if constexpr (kWide)
          a[u] = __ldg(w4 + (i < i1 ? i : i1 - 1));
        else
          a[u] = i < i1 ? __ldg(w4 + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < kRouterUnroll; ++u) {
        const int i = b + 32 * u;
        if (i < i1) acc = router_dot4(acc, a[u], xs[i]);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) part[it] = acc;
  }
  cluster.sync();  // every CTA's part[] written and visible to the cluster
  if (rank == 0)
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
      float v = 0.0f;
      for (int p = 0; p < parts; ++p) {
        const int it = e * parts + p;
        v += cluster.map_shared_rank(part, (it % kStride) / kWarps)[it];
      }
      if (bias != nullptr) v += bias[e];
      all[e] = v;
      logits[t * num_experts + e] = v;
    }
  cluster.sync();  // CTA 0's remote reads done before any CTA exits; all[] visible in CTA 0
  if (rank == 0 && warp == 0)
    select_topk(all, num_experts, top_k, renormalize, ids + t * top_k, weights + t * top_k, lane);
}

// The router for a few tokens over many experts, spread over the GPU: router_spread_kernel's
// warps each take one (expert, token) row dot product, kRouterSpreadWarps to a CTA, and write
// the raw sum to logits; router_select_kernel (the next launch) adds the bias, writes the logits
// and selects, one warp a token.
// NOTES: the cluster kernel at one token pulls the whole gate matrix (gpt-oss-120b: 128 x 2880
// FP32, 1.47 MB) through its cluster's 8 SMs, ~184 KB an SM in three dependent rounds of loads
// per lane; Nsight Compute timed it at 12.7 us of a 53 us MoE layer (one H100, 2026-12-06),
// against ~0.5 us for those bytes at the HBM rate. Spread over 64 CTAs, each SM holds one round
// (kRouterSpreadUnroll float4 a lane, x staged beside them by cp.async) in flight at once.
// Above 64 experts the cluster kernel's parts are 1: each row is one warp's sum over the lanes
// in the same order of i (router_dot4, warp_sum), and the bias is added as there (0 + sum, then
// + bias), so both kernels give the same bits (CudaBackend.RouterRowsAreTheSameBitsWhateverTheBatch).
constexpr int kRouterSpreadWarps = 2;
constexpr int kRouterSpreadUnroll = 24;  // 768 float4 a warp in flight: H <= 3072 in one round
constexpr int kRouterSelectWarps = 4;

__global__ void __launch_bounds__(kRouterSpreadWarps * 32)
    router_spread_kernel(float* __restrict__ sums, const float* __restrict__ x, const float* __restrict__ w,
                         int hidden, int num_experts) {
  extern __shared__ float4 xs_row[];  // [hidden / 4]: this CTA's token's x
  pdl_begin();
  const int64_t t = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = static_cast<int>(blockIdx.x) * kRouterSpreadWarps + warp;
  const int n4 = hidden / 4;
  // A warp past the last expert reads the last row (cached, unused) and writes nothing: it must
  // reach the barrier below.
  const float4* w4 =
      reinterpret_cast<const float4*>(w + static_cast<int64_t>(e < num_experts ? e : num_experts - 1) * hidden);
  float4 a[kRouterSpreadUnroll];
#pragma unroll
  for (int u = 0; u < kRouterSpreadUnroll; ++u) {
    const int i = lane + 32 * u;
    a[u] = __ldg(w4 + (i < n4 ? i : n4 - 1));
  }
  // x is the previous kernel's output: through L2 (cp.async.cg), after the wait above.
  const float4* x4 = reinterpret_cast<const float4*>(x + t * hidden);
  for (int i = threadIdx.x; i < n4; i += blockDim.x) cp_async16(xs_row + i, x4 + i);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  float acc = 0.0f;
  for (int b = lane;;) {
#pragma unroll
    for (int u = 0; u < kRouterSpreadUnroll; ++u) {
      const int i = b + 32 * u;
      if (i < n4) acc = router_dot4(acc, a[u], xs_row[i]);
    }
    b += 32 * kRouterSpreadUnroll;
    if (b >= n4) break;
#pragma unroll
    for (int u = 0; u < kRouterSpreadUnroll; ++u) {
      const int i = b + 32 * u;
      a[u] = __ldg(w4 + (i < n4 ? i : n4 - 1));
    }
  }
  acc = warp_sum(acc);
  if (lane == 0 && e < num_experts) sums[t * num_experts + e] = acc;
}

// kPerLane: 32 * kPerLane >= num_experts (the host picks the smallest of 1, 2, 4, 8 and 32), so
// that a lane's loads of the sums and the bias are all in flight at once.
template <int kPerLane>
__global__ void __launch_bounds__(kRouterSelectWarps * 32)
    router_select_kernel(int32_t* __restrict__ ids, float* __restrict__ weights, float* __restrict__ logits,
                         const float* __restrict__ bias, int64_t num_tokens, int num_experts, int top_k,
                         bool renormalize) {
  __shared__ float rows[kRouterSelectWarps][kRouterFusedMaxExperts];
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterSelectWarps + warp;
  if (t >= num_tokens) return;  // whole warp; no block barrier below
  float* row = logits + t * num_experts;
  float* l = rows[warp];
  float lv[kPerLane], bv[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    lv[j] = e < num_experts ? row[e] : 0.0f;
    bv[j] = bias != nullptr && e < num_experts ? bias[e] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    float v = 0.0f;
    v += lv[j];
    if (bias != nullptr) v += bv[j];
    lv[j] = v;
    if (e < num_experts) {
      l[e] = v;
      row[e] = v;
    }
  }
  __syncwarp();
  if (top_k <= 32)
    select_topk_lanes<kPerLane>(lv, l, num_experts, top_k, renormalize, ids + t * top_k, weights + t * top_k, lane);
  else
    select_topk_any(l, num_experts, top_k, renormalize, ids + t * top_k, weights + t * top_k, lane);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// The activation and the optional biases (MoeExpertsArgs), passed by value to every kernel.
struct ExpertExtras {
  const float* b_gate_up;  // [E_phys, 2I] in w_gate_up's row layout, or nullptr
  const float* b_down;     // [E_phys, H], or nullptr
  bool gpt_oss;            // clamped gpt-oss activation instead of silu(g) * u
  float limit, alpha;
  // MXFP4 experts (checkpoint layout), or nullptr: gate/up [E, 2I, H/32, 16] + [E, 2I, H/32],
  // down [E, H, I/32, 16] + [E, H, I/32].
  const uint8_t *gu_blocks, *gu_scales, *dn_blocks, *dn_scales;
};

// E2M1 code -> value (sign in bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6, exact, in registers (a table
// indexed by data would serialise the lanes).
__device__ __forceinline__ float e2m1_value(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  const float mag = e == 0 ? 0.5f * static_cast<float>(m) : static_cast<float>((2u + m) << e) * 0.25f;
  return (c & 8u) ? -mag : mag;
}

// One lane's part of row `row` of an MXFP4 matrix [rows, cols] dotted with v[cols]: the lane takes
// 4 bytes (8 elements) at a time, w = lane, lane + 32, ... Each weight is the E2M1 value times
// the block's power-of-two scale, a product that is exact in FP32 (the reference's value), then
// multiplied by v as the FP32 path does. Rows start on 16-byte boundaries (cols % 32 == 0).
__device__ __forceinline__ float mx_dot_partial(const uint8_t* __restrict__ blocks, const uint8_t* __restrict__ scales,
                                                int64_t row, int64_t cols, const float* v, int lane) {
  const int64_t nkb = cols / quant::kMxBlockSize;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(blocks + row * nkb * quant::kMxfp4BytesPerBlock);
  const uint8_t* srow = scales + row * nkb;
  float acc = 0.0f;
  for (int64_t w = lane; w < cols / 8; w += 32) {
    const float scale = quant::f32_from_bits(quant::e8m0_decode_bits(quant::E8M0{srow[w >> 2]}));
    const uint32_t q = words[w];
    const float* vv = v + 8 * w;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc += e2m1_value((q >> (4 * j)) & 15u) * scale * vv[j];
  }
  return acc;
}


__device__ __forceinline__ float glu(float g, float u, const ExpertExtras& x) {
  if (!x.gpt_oss) return silu(g) * u;
  g = fminf(g, x.limit);
  u = fminf(fmaxf(u, -x.limit), x.limit);
  return g / (1.0f + expf(-x.alpha * g)) * (u + 1.0f);
}

// act(gate_i . x + b) * (up_i . x + b) for row i of expert e's gate/up block [2I, H]
// (interleaved or concatenated rows), the dot products reduced by the calling warp: every lane
// returns it.
__device__ __forceinline__ float swiglu_row(const float* __restrict__ gu, const float* __restrict__ xr, int64_t i,
                                            int64_t hidden, int64_t inter, bool interleaved, int lane, int64_t e,
                                            const ExpertExtras& ex) {
  const int64_t gr = interleaved ? 2 * i : i, ur = interleaved ? 2 * i + 1 : inter + i;
  float g = 0.0f, u = 0.0f;
  if (ex.gu_blocks) {
    g = mx_dot_partial(ex.gu_blocks, ex.gu_scales, e * 2 * inter + gr, hidden, xr, lane);
    u = mx_dot_partial(ex.gu_blocks, ex.gu_scales, e * 2 * inter + ur, hidden, xr, lane);
  } else {
    const float* gate_row = gu + gr * hidden;
    const float* up_row = gu + ur * hidden;
    for (int64_t c = lane; c < hidden; c += 32) {
      g += gate_row[c] * xr[c];
      u += up_row[c] * xr[c];
    }
  }
  g = warp_sum(g);
  u = warp_sum(u);
  if (ex.b_gate_up) {
    g += ex.b_gate_up[e * 2 * inter + gr];
    u += ex.b_gate_up[e * 2 * inter + ur];
  }
  return glu(g, u, ex);
}

// One block per token row. Warp w owns gate/up rows i = w, w + kMoeWarps, ... and output
// columns j = w, w + kMoeWarps, ...; lanes stride along each weight row (coalesced) and a
// warp reduction finishes each dot product. h = silu(gate) * up of the current expert sits
// in shared memory between the two phases.
__global__ void __launch_bounds__(kMoeThreads)
    moe_experts_kernel(float* __restrict__ out, const float* __restrict__ x,
                       const float* __restrict__ w_gate_up, const float* __restrict__ w_down,
                       const int32_t* __restrict__ topk_ids, const float* __restrict__ topk_w,
                       const int32_t* __restrict__ l2p, int64_t num_valid,
                       const int32_t* __restrict__ num_valid_device, int64_t hidden,
                       int64_t inter, int top_k, int num_logical, int num_phys, bool interleaved,
                       ExpertExtras ex) {
  extern __shared__ float h[];
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* orow = out + t * hidden;
  // The lane that zeroes out[t, j] is the one that later accumulates into it: no barrier.
  if (lane == 0)
    for (int64_t j = warp; j < hidden; j += kMoeWarps) orow[j] = 0.0f;
  if (num_valid_device) {  // the count of this replay (graphs padded to a bucket)
    const int64_t d = *num_valid_device;
    num_valid = d < 0 ? 0 : (d < num_valid ? d : num_valid);
  }
  if (t >= num_valid) return;  // padding row: ids are never read

  const float* xr = x + t * hidden;
  for (int k = 0; k < top_k; ++k) {
    const int32_t logical = topk_ids[t * top_k + k];
    if (logical < 0 || logical >= num_logical) continue;  // uniform across the block
    const int64_t e = l2p[logical];
    if (e < 0 || e >= num_phys) continue;
    const float wk = topk_w[t * top_k + k];

    const float* gu = w_gate_up ? w_gate_up + e * 2 * inter * hidden : nullptr;
    for (int64_t i = warp; i < inter; i += kMoeWarps) {
      const float v = swiglu_row(gu, xr, i, hidden, inter, interleaved, lane, e, ex);
      if (lane == 0) h[i] = v;
    }
    __syncthreads();

    for (int64_t j = warp; j < hidden; j += kMoeWarps) {
      float d = 0.0f;
      if (ex.dn_blocks)
        d = mx_dot_partial(ex.dn_blocks, ex.dn_scales, e * hidden + j, inter, h, lane);
      else
        for (int64_t c = lane; c < inter; c += 32) d += w_down[(e * hidden + j) * inter + c] * h[c];
      d = warp_sum(d);
      if (ex.b_down) d += ex.b_down[e * hidden + j];
      if (lane == 0) orow[j] += wk * d;
    }
    __syncthreads();  // h is rewritten by the next expert
  }
}

// ---- the two-kernel path (MoeExpertsArgs::workspace) ----
// Phase 1: h[t, k, i] = silu(gate_e(x_t))_i * up_e(x_t)_i for one (t, k) pair per blockIdx.x
// and kRowsPerBlock rows i per blockIdx.y (one warp per row). Phase 2: out[t, j] =
// sum_k w[t,k] * down_e[j, :] . h[t, k, :] for one token per blockIdx.x and kRowsPerBlock
// output rows per blockIdx.y, h[t] staged in shared memory. Same sums in the same order as the
// one-kernel path, so the two agree to FP32 rounding of the warp reductions.
constexpr int kRowsPerBlock = 16;

__device__ __forceinline__ int64_t valid_rows(int64_t num_valid, const int32_t* num_valid_device) {
  if (!num_valid_device) return num_valid;
  const int64_t d = *num_valid_device;
  return d < 0 ? 0 : (d < num_valid ? d : num_valid);
}

__global__ void __launch_bounds__(kMoeThreads)
    moe_gate_up_kernel(float* __restrict__ h, const float* __restrict__ x, const float* __restrict__ w_gate_up,
                       const int32_t* __restrict__ topk_ids, const int32_t* __restrict__ l2p, int64_t num_valid,
                       const int32_t* __restrict__ num_valid_device, int64_t hidden, int64_t inter, int top_k,
                       int num_logical, int num_phys, bool interleaved, ExpertExtras ex) {
  const int64_t pair = blockIdx.x, t = pair / top_k;
  if (t >= valid_rows(num_valid, num_valid_device)) return;  // phase 2 never reads it
  const int32_t logical = topk_ids[pair];
  if (logical < 0 || logical >= num_logical) return;
  const int64_t e = l2p[logical];
  if (e < 0 || e >= num_phys) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* xr = x + t * hidden;
  const float* gu = w_gate_up ? w_gate_up + e * 2 * inter * hidden : nullptr;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock + warp;
       i < inter && i < (static_cast<int64_t>(blockIdx.y) + 1) * kRowsPerBlock; i += kMoeWarps) {
    const float v = swiglu_row(gu, xr, i, hidden, inter, interleaved, lane, e, ex);
    if (lane == 0) h[pair * inter + i] = v;
  }
}

__global__ void __launch_bounds__(kMoeThreads)
    moe_down_kernel(float* __restrict__ out, const float* __restrict__ h, const float* __restrict__ w_down,
                    const int32_t* __restrict__ topk_ids, const float* __restrict__ topk_w,
                    const int32_t* __restrict__ l2p, int64_t num_valid, const int32_t* __restrict__ num_valid_device,
                    int64_t hidden, int64_t inter, int top_k, int num_logical, int num_phys, ExpertExtras ex) {
  extern __shared__ float hs[];  // [top_k, inter] of this token
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock;
  float* orow = out + t * hidden;
  if (t >= valid_rows(num_valid, num_valid_device)) {  // padding row: zeros, ids never read
    for (int64_t j = j0 + threadIdx.x; j < hidden && j < j0 + kRowsPerBlock; j += blockDim.x) orow[j] = 0.0f;
    return;
  }
  for (int64_t c = threadIdx.x; c < top_k * inter; c += blockDim.x) hs[c] = h[t * top_k * inter + c];
  __syncthreads();
  for (int64_t j = j0 + warp; j < hidden && j < j0 + kRowsPerBlock; j += kMoeWarps) {
    float acc = 0.0f;
    for (int k = 0; k < top_k; ++k) {
      const int32_t logical = topk_ids[t * top_k + k];
      if (logical < 0 || logical >= num_logical) continue;
      const int64_t e = l2p[logical];
      if (e < 0 || e >= num_phys) continue;
      const float* hk = hs + k * inter;
      float d = 0.0f;
      if (ex.dn_blocks)
        d = mx_dot_partial(ex.dn_blocks, ex.dn_scales, e * hidden + j, inter, hk, lane);
      else
        for (int64_t c = lane; c < inter; c += 32) d += w_down[(e * hidden + j) * inter + c] * hk[c];
      d = warp_sum(d);
      if (ex.b_down) d += ex.b_down[e * hidden + j];
      acc += topk_w[t * top_k + k] * d;
    }
    if (lane == 0) orow[j] = acc;
  }
}

// The most tokens that take the spread router (above 64 experts); ROLLOUTD_ROUTER_SPREAD_MAX_TOKENS
// (0 to kRouterFusedMaxTokens) overrides it for an A/B; read once per process.
int64_t router_spread_max_tokens() {
  static const int64_t n = [] {
    constexpr int64_t kDefault = 16;
    const char* v = std::getenv("ROLLOUTD_ROUTER_SPREAD_MAX_TOKENS");
    if (v == nullptr || *v == '\0') return kDefault;
    char* end = nullptr;
    const long long parsed = std::strtoll(v, &end, 10);
    if (*end != '\0' || parsed < 0 || parsed > kRouterFusedMaxTokens) return kDefault;
    return static_cast<int64_t>(parsed);
  }();
  return n;
}

// ROLLOUTD_ROUTER_SPREAD_FEW_EXPERTS=1: up to 64 experts too, every fused call (up to
// kRouterFusedMaxTokens tokens, so that a row's bits still do not depend on its batch) takes the
// spread kernels, whose one warp a row sums in another order than the cluster kernel's parts. An
// A/B switch, read once per process; off by default.
bool router_spread_few_experts() {
  static const bool on = [] {
    const char* v = std::getenv("ROLLOUTD_ROUTER_SPREAD_FEW_EXPERTS");
    return v != nullptr && v[0] == '1' && v[1] == '\0';
  }();
  return on;
}

}  // namespace

Status router_softmax_topk(const ExecContext& ctx, TensorView ids, TensorView weights,
                           TensorView logits, bool renormalize) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::router_softmax_topk(ctx, ids, weights, logits));
  const int64_t num_tokens = logits.size(0);
  if (logits.size(1) > INT_MAX)
    return Status(ErrorCode::kUnimplemented, "more than INT_MAX experts", "logits");
  if (num_tokens == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const unsigned int blocks = static_cast<unsigned int>(
      (num_tokens + kRouterWarpsPerBlock - 1) / kRouterWarpsPerBlock);
  router_softmax_topk_kernel<<<blocks, kRouterWarpsPerBlock * 32, 0, stream_of(ctx)>>>(
      ids.as<int32_t>(), weights.as<float>(), logits.as<const float>(), num_tokens,
      static_cast<int>(logits.size(1)), static_cast<int>(ids.size(1)), renormalize);
  RD_CUDA_CHECK_LAUNCH("router_softmax_topk_kernel");
  return Status::Ok();
}

Status router(const ExecContext& ctx, const RouterArgs& a) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::router(ctx, a));
  const int64_t num_tokens = a.x.size(0), num_experts = a.w.size(0), hidden = a.w.size(1);
  if (num_tokens == 0) return Status::Ok();
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool fused = num_tokens <= kRouterFusedMaxTokens && num_experts <= kRouterFusedMaxExperts &&
                     hidden % 4 == 0 && hidden <= kRouterFusedMaxHidden && aligned(a.x.data) && aligned(a.w.data);
  if (!fused) {
    // Prefill-sized steps: cuBLAS's GEMM, the bias, the selection kernel.
    RD_RETURN_IF_ERROR(linear(ctx, a.logits, a.x, a.w));
    if (a.bias.data != nullptr) RD_RETURN_IF_ERROR(add_bias(ctx, a.logits, a.bias));
    return router_softmax_topk(ctx, a.ids, a.weights, a.logits, a.renormalize);
  }
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const dim3 grid(kRouterCluster, static_cast<unsigned int>(num_tokens));
  // More experts than 8-warp CTAs have warps: the wide kernel (same parts, 1, so the same bits).
  const int warps = num_experts > kRouterCluster * kRouterFusedWarps ? kRouterWideWarps : kRouterFusedWarps;
  int parts = 1;  // items per expert: the cluster's warps all busy when experts are few
  while (parts * 2 * num_experts <= kRouterCluster * warps) parts *= 2;
  if ((warps == kRouterWideWarps && num_tokens <= router_spread_max_tokens()) ||
      (warps != kRouterWideWarps && router_spread_few_experts())) {
    const dim3 sgrid(static_cast<unsigned int>((num_experts + kRouterSpreadWarps - 1) / kRouterSpreadWarps),
                     static_cast<unsigned int>(num_tokens));
    (void)launch_dependent(router_spread_kernel, sgrid, kRouterSpreadWarps * 32, static_cast<size_t>(hidden) * 4,
                           stream_of(ctx), a.logits.as<float>(), a.x.as<const float>(), a.w.as<const float>(),
                           static_cast<int>(hidden), static_cast<int>(num_experts));
    RD_CUDA_CHECK_LAUNCH("router_spread_kernel");
    const auto select = [&](auto kernel) {
      return launch_dependent(kernel,
                              static_cast<unsigned int>((num_tokens + kRouterSelectWarps - 1) / kRouterSelectWarps),
                              kRouterSelectWarps * 32, 0, stream_of(ctx), a.ids.as<int32_t>(), a.weights.as<float>(),
                              a.logits.as<float>(), a.bias.data != nullptr ? a.bias.as<const float>() : nullptr,
                              num_tokens, static_cast<int>(num_experts), static_cast<int>(a.ids.size(1)),
                              a.renormalize);
    };
    (void)(num_experts <= 32    ? select(router_select_kernel<1>)
           : num_experts <= 64  ? select(router_select_kernel<2>)
           : num_experts <= 128 ? select(router_select_kernel<4>)
           : num_experts <= 256 ? select(router_select_kernel<8>)
                                : select(router_select_kernel<32>));
    RD_CUDA_CHECK_LAUNCH("router_select_kernel");
    return Status::Ok();
  }
  const auto launch = [&](auto kernel) {
    return launch_dependent(kernel, grid, warps * 32, 0, stream_of(ctx), a.ids.as<int32_t>(), a.weights.as<float>(),
                            a.logits.as<float>(), a.x.as<const float>(), a.w.as<const float>(),
                            a.bias.data != nullptr ? a.bias.as<const float>() : nullptr, static_cast<int>(hidden),
                            static_cast<int>(num_experts), parts, static_cast<int>(a.ids.size(1)), a.renormalize);
  };
  (void)(warps == kRouterWideWarps ? launch(router_fused_kernel<kRouterWideWarps>)
                                   : launch(router_fused_kernel<kRouterFusedWarps>));
  RD_CUDA_CHECK_LAUNCH("router_fused_kernel");
  return Status::Ok();
}

Status moe_experts(const ExecContext& ctx, const MoeExpertsArgs& a) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::moe_experts(ctx, a));
  const int64_t num_tokens = a.x.size(0);
  const bool mx = a.w_gate_up_blocks.data != nullptr;
  const int64_t inter = (mx ? a.w_gate_up_blocks.size(1) : a.w_gate_up.size(1)) / 2;
  const int64_t e_phys = mx ? a.w_gate_up_blocks.size(0) : a.w_gate_up.size(0);
  if (a.topk_ids.size(1) > INT_MAX || a.logical_to_physical.size(0) > INT_MAX || e_phys > INT_MAX ||
      num_tokens > INT_MAX)
    return Status(ErrorCode::kUnimplemented, "MoE dimensions above INT_MAX", "x");
  if (num_tokens == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const int top_k = static_cast<int>(a.topk_ids.size(1));
  const ExpertExtras ex{a.b_gate_up.data ? a.b_gate_up.as<const float>() : nullptr,
                        a.b_down.data ? a.b_down.as<const float>() : nullptr,
                        a.activation == MoeExpertsArgs::Activation::kGptOss, a.swiglu_limit, a.swiglu_alpha,
                        mx ? a.w_gate_up_blocks.as<const uint8_t>() : nullptr,
                        mx ? a.w_gate_up_scales.as<const uint8_t>() : nullptr,
                        mx ? a.w_down_blocks.as<const uint8_t>() : nullptr,
                        mx ? a.w_down_scales.as<const uint8_t>() : nullptr};
  const size_t smem2 = static_cast<size_t>(top_k * inter) * sizeof(float);
  int limit2 = 0;
  RD_CUDA_CHECK(cudaDeviceGetAttribute(&limit2, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx.device.index));
  // The two-kernel path stages one token's K x I activations in shared memory; past the limit,
  // the one-block-per-token path below (I floats) still runs.
  if (a.workspace.data != nullptr && smem2 <= static_cast<size_t>(limit2)) {
    if (smem2 > 48 * 1024)
      RD_CUDA_CHECK(cudaFuncSetAttribute(moe_down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem2)));
    const int num_logical = static_cast<int>(a.logical_to_physical.size(0));
    const int num_phys = static_cast<int>(e_phys);
    const int32_t* nvd = a.num_valid_device.as<const int32_t>();
    const int64_t nv = op_checks::moe_valid_rows(a);
    const dim3 grid1(static_cast<unsigned int>(num_tokens * top_k),
                     static_cast<unsigned int>((inter + kRowsPerBlock - 1) / kRowsPerBlock));
    moe_gate_up_kernel<<<grid1, kMoeThreads, 0, stream_of(ctx)>>>(
        a.workspace.as<float>(), a.x.as<const float>(), a.w_gate_up.as<const float>(), a.topk_ids.as<const int32_t>(),
        a.logical_to_physical.as<const int32_t>(), nv, nvd, a.x.size(1), inter, top_k, num_logical, num_phys,
        a.gate_up_interleaved, ex);
    RD_CUDA_CHECK_LAUNCH("moe_gate_up_kernel");
    const dim3 grid2(static_cast<unsigned int>(num_tokens),
                     static_cast<unsigned int>((a.x.size(1) + kRowsPerBlock - 1) / kRowsPerBlock));
    moe_down_kernel<<<grid2, kMoeThreads, smem2, stream_of(ctx)>>>(
        a.out.as<float>(), a.workspace.as<const float>(), a.w_down.as<const float>(), a.topk_ids.as<const int32_t>(),
        a.topk_weights.as<const float>(), a.logical_to_physical.as<const int32_t>(), nv, nvd, a.x.size(1), inter,
        top_k, num_logical, num_phys, ex);
    RD_CUDA_CHECK_LAUNCH("moe_down_kernel");
    return Status::Ok();
  }
  const size_t smem = static_cast<size_t>(inter) * sizeof(float);
  int smem_limit = 0;
  RD_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                             ctx.device.index));
  if (smem > static_cast<size_t>(smem_limit))
    return Status(ErrorCode::kUnimplemented,
                  "intermediate size " + std::to_string(inter) +
                      " exceeds the shared memory of the simple CUDA MoE kernel",
                  "w_gate_up");
  if (smem > 48 * 1024)  // above the default carve-out a kernel must opt in
    RD_CUDA_CHECK(cudaFuncSetAttribute(moe_experts_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  moe_experts_kernel<<<static_cast<unsigned int>(num_tokens), kMoeThreads, smem,
                       stream_of(ctx)>>>(
      a.out.as<float>(), a.x.as<const float>(), a.w_gate_up.as<const float>(),
      a.w_down.as<const float>(), a.topk_ids.as<const int32_t>(),
      a.topk_weights.as<const float>(), a.logical_to_physical.as<const int32_t>(),
      op_checks::moe_valid_rows(a), a.num_valid_device.as<const int32_t>(), a.x.size(1), inter, static_cast<int>(a.topk_ids.size(1)),
      static_cast<int>(a.logical_to_physical.size(0)), static_cast<int>(e_phys),
      a.gate_up_interleaved, ex);
  RD_CUDA_CHECK_LAUNCH("moe_experts_kernel");
  return Status::Ok();
}

}  // namespace rolloutd::cuda
