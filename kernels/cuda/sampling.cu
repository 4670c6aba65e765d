// CUDA twin of the sampling op (Backend::sample): one block per row, nothing copied back but
// the token and its log-prob.
//
// NOTES:
// - The kept set is core::Sampler's: p_i = float(float(exp((l_i - max) / T)) / z) with the
//   exp and z in double, ordered by (p descending, id ascending). Instead of a sort, each
//   filter's boundary is a threshold on the 64-bit key (bits(p) << 32 | ~id), found by a radix
//   select (8 bits per pass, from the top) on counts (top-k) or on the mass in 2^-60 fixed
//   point (top-p); min-p is a threshold on bits(p) alone. The kept set is every key >= the
//   largest of the three thresholds: the shortest of the three prefixes, as the CPU's
//   top-k -> top-p -> min-p chain keeps. A pass after the first touches only the elements
//   whose logit can still land in the selected bucket (a window on the logit with a 1e-5
//   margin in log space, far above the ~2e-7 the float roundings of p can move it), so it
//   costs a read of the row, not a double exp per element.
// - The draw is an inverse CDF in id order over the kept set (weights p_i), with the uniform
//   of (seed, draw_index) that core::Sampler uses: the sums run in a fixed tree per block,
//   so the token depends on the row and its parameters alone, never on the batch. It is not
//   the CPU's token (that walks the probability order).
// - Where the CPU's cumulative sum and this one can disagree: a top-p boundary whose exact
//   cumulative mass lies within ~1e-13 of top_p, or a p whose double quotient lies within
//   ~1e-16 of a float rounding boundary. Neither is seen in practice; documented, not tested.
// - Top log-probs (optional) rank by the raw logit, not by p, and reuse the row's log-sum-exp,
//   so a sampled token's top entry equals its log-prob bit for bit.
// - Every pass over the row loads kBatch logits per thread into registers, then handles them
//   one by one in the order of a plain strided loop (the same bits). In a plain loop each load
//   sits behind the previous element's data-dependent branches, so a thread's ~300 elements at
//   a 151,936 vocabulary cost ~300 serial L2/DRAM round trips instead of ~40. The draw's walk
//   inside the chosen tile (q <= 4 elements per lane up to a 262,144 vocabulary, one warp,
//   stopping at the hit) keeps its plain loads.
#include <cfloat>
#include <climits>
#include <cstdint>

#include "kernels/cpu/op_checks.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace rolloutd::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;             // radix digit: 8 bits
constexpr int kMaxTiles = 4 * kThreads;  // the draw's tiles: each thread scans 4
constexpr double kMassScale = 1152921504606846976.0;  // 2^60: fixed-point unit of top-p mass
constexpr double kWindowMargin = 1e-5;  // log-space margin of the logit window (see NOTES)
constexpr int kBatch = 8;              // logits a thread loads before handling them (see NOTES)

struct SampleSmem {
  unsigned int count[kBins];
  unsigned long long mass[kBins];
  double tile_sum[kMaxTiles];
  double red_d[kWarps];
  float red_f[kWarps];
  int red_i[kWarps];
  unsigned long long red_u[kWarps];
  uint64_t prefix;
  unsigned long long above;
  int chosen_digit;  // -1: no bucket reaches the target
  int chosen_tile;
  int token;
  bool single;
};

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, the same tree for every call (deterministic); every thread gets it.
__device__ double block_sum(double v, SampleSmem& sm) {
  v = warp_sum_d(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // red_d may still be read by a previous call
  if (lane == 0) sm.red_d[warp] = v;
  __syncthreads();
  double t = 0;
  for (int w = 0; w < kWarps; ++w) t += sm.red_d[w];
  return t;
}

// Max logit, the lowest id holding it, and the sum of exp(l - max): the online softmax
// (Milakov & Gimelshein 2018), so the log-prob needs no pass of its own. NaN and -inf logits add
// nothing and never win.
struct RowMax {
  float m;
  int id;
  double s;
};

// Commutative (bitwise), so every lane of a butterfly ends with the same value.
__device__ __forceinline__ void merge(RowMax& a, const RowMax& b) {
  const float M = fmaxf(a.m, b.m);
  const double fa = a.m == M ? 1.0 : exp(static_cast<double>(a.m) - M);
  const double fb = b.m == M ? 1.0 : exp(static_cast<double>(b.m) - M);
  if (b.m > a.m || (b.m == a.m && b.id < a.id)) a.id = b.id;
  a.s = a.s * fa + b.s * fb;
  a.m = M;
}

__device__ RowMax block_max_sum(RowMax v, SampleSmem& sm) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const RowMax other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.id, o),
                       __shfl_xor_sync(0xffffffffu, v.s, o)};
    merge(v, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // red_* may still be read by a previous reduction
  if (lane == 0) sm.red_f[warp] = v.m, sm.red_i[warp] = v.id, sm.red_d[warp] = v.s;
  __syncthreads();
  RowMax t{sm.red_f[0], sm.red_i[0], sm.red_d[0]};
  for (int w = 1; w < kWarps; ++w) merge(t, RowMax{sm.red_f[w], sm.red_i[w], sm.red_d[w]});
  __syncthreads();
  return t;
}

// Adds one element per lane (digit d, or none with d < 0) to the histogram, one atomic per
// distinct digit in the warp: a row's tail crowds into a few digits, and an atomic per element
// on the same shared word (64-bit ones are compare-and-swap loops) serialises the whole pass.
__device__ __forceinline__ void histogram_add(int d, unsigned long long mass, bool by_mass, SampleSmem& sm) {
  const int lane = threadIdx.x % 32;
  const unsigned active = __ballot_sync(0xffffffffu, d >= 0);
  if (active == 0) return;
  unsigned group = 0;
  if (d >= 0) group = __match_any_sync(active, d);
  const int n = __popc(group);
  if (d >= 0 && lane == __ffs(group) - 1) atomicAdd(&sm.count[d], static_cast<unsigned>(n));
  if (!by_mass) return;
  if (n == 1) atomicAdd(&sm.mass[d], mass);
  unsigned multi = __ballot_sync(0xffffffffu, n > 1);
  while (multi) {  // each group of several lanes: a warp sum, added by its lowest lane
    const int src = __ffs(multi) - 1;
    const unsigned g = __shfl_sync(0xffffffffu, group, src);
    unsigned long long v = ((g >> lane) & 1u) ? mass : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == src) atomicAdd(&sm.mass[d], v);
    multi &= ~g;
  }
}

// core::Sampler's uniform draw (kernels/cpu/cpu_sampling.cpp): two SplitMix64 rounds.
__device__ double uniform_draw(uint64_t seed, uint64_t draw_index) {
  uint64_t state = seed ^ (draw_index * 0xD1B54A32D192ED03ull);
  uint64_t bits = 0;
  for (int round = 0; round < 2; ++round) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    bits = z ^ (z >> 31);
  }
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);
}

// The row's probability arithmetic, shared by every pass so each computes the same p.
struct RowProb {
  float max_logit;
  double inv_t;
  double z;
  // (l - max) / T in double, as core::Sampler computes it.
  __device__ double x_of(float l) const { return (static_cast<double>(l) - max_logit) * inv_t; }
  // float(float(exp(x)) / z); a NaN logit has probability 0.
  __device__ float p_of(double x) const {
    if (!(x <= 0.0)) return 0.0f;  // NaN (x <= 0 holds for every other logit: max is the row's max)
    const float e = static_cast<float>(exp(x));
    return static_cast<float>(static_cast<double>(e) / z);
  }
  // The x window outside which p cannot lie in [p_lo, p_hi] (see NOTES).
  // Below FLT_MIN the rounding of p to a subnormal moves it by up to 2^-150 absolute, far more
  // than the relative margin covers: a bound in that range opens the window on its side.
  __device__ double x_low(float p_lo) const {
    return p_lo >= FLT_MIN ? log(static_cast<double>(p_lo) * z) - kWindowMargin : -INFINITY;
  }
  __device__ double x_high(float p_hi) const {
    return isfinite(p_hi) ? log(static_cast<double>(fmaxf(p_hi, FLT_MIN)) * z) + kWindowMargin : INFINITY;
  }
};

__device__ __forceinline__ uint64_t key_of(float p, int64_t i) {
  return (static_cast<uint64_t>(__float_as_uint(p)) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

// The key at which a running total over the keys, descending, first reaches `target` (counts
// with by_mass false, fixed-point mass otherwise): every key >= the result is kept. 0 (keep
// everything) when the total never reaches it. `target` >= 1. One radix digit per pass; a pass stops the
// search as soon as the selected bucket holds one element.
__device__ uint64_t select_threshold(const float* __restrict__ l, int64_t V, const RowProb& rp, bool by_mass,
                                     unsigned long long target, SampleSmem& sm) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid == 0) sm.prefix = 0, sm.above = 0;
  __syncthreads();
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int b = tid; b < kBins; b += kThreads) sm.count[b] = 0, sm.mass[b] = 0;
    __syncthreads();
    const uint64_t prefix = sm.prefix;
    const int known = 56 - shift;  // top bits of the key fixed by earlier passes
    // Logit window of the candidates: bits(p) lies in [lo, hi] once the prefix fixes its top bits.
    double xl = -INFINITY, xh = INFINITY;
    if (known > 0) {
      const int pk = known < 32 ? known : 32;
      const uint32_t lo = static_cast<uint32_t>(prefix >> 32) & (pk == 32 ? 0xFFFFFFFFu : ~(0xFFFFFFFFu >> pk));
      const uint32_t hi = lo | (pk == 32 ? 0u : (0xFFFFFFFFu >> pk));
      xl = rp.x_low(__uint_as_float(lo));
      xh = hi >= 0x7F800000u ? INFINITY : rp.x_high(__uint_as_float(hi));
    }
    // Warps walk the row in step (i0 is the same for all lanes) for histogram_add's collectives.
    // The loads are batched as in the max pass (see NOTES); the elements keep their order.
    for (int64_t b0 = tid - lane; b0 < V; b0 += kBatch * kThreads) {
      float v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t i = b0 + u * kThreads + lane;
        v[u] = l[i < V ? i : V - 1];
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t i0 = b0 + u * kThreads;
        if (i0 >= V) break;  // the same for all lanes
        const int64_t i = i0 + lane;
        int d = -1;
        unsigned long long mass = 0;
        if (i < V) {
          const double x = rp.x_of(v[u]);
          if (!(x < xl || x > xh)) {
            const float p = rp.p_of(x);
            const uint64_t key = key_of(p, i);
            if (known == 0 || (key >> (64 - known)) == (prefix >> (64 - known))) {
              d = static_cast<int>((key >> shift) & 0xFF);
              mass = static_cast<unsigned long long>(static_cast<double>(p) * kMassScale);
            }
          }
        }
        histogram_add(d, mass, by_mass, sm);
      }
    }
    __syncthreads();
    if (warp == 0) {
      // Lane j holds digits 255 - 8j down to 248 - 8j: lanes in key order, descending.
      unsigned long long part = 0;
      for (int q = 0; q < 8; ++q) {
        const int d = 255 - 8 * lane - q;
        part += by_mass ? sm.mass[d] : sm.count[d];
      }
      unsigned long long incl = part;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
      }
      const unsigned long long above = sm.above;
      const unsigned ballot = __ballot_sync(0xffffffffu, above + incl >= target);
      if (ballot == 0) {
        if (lane == 0) sm.chosen_digit = -1;
      } else if (lane == __ffs(ballot) - 1) {
        unsigned long long acc = above + (incl - part);
        int chosen = 255 - 8 * lane - 7;
        for (int q = 0; q < 8; ++q) {
          const int d = 255 - 8 * lane - q;
          const unsigned long long w = by_mass ? sm.mass[d] : sm.count[d];
          if (acc + w >= target && sm.count[d] > 0) {
            chosen = d;
            break;
          }
          acc += w;
        }
        sm.chosen_digit = chosen;
        sm.above = acc;
        sm.prefix = prefix | (static_cast<uint64_t>(chosen) << shift);
        sm.single = sm.count[chosen] == 1;
      }
    }
    __syncthreads();
    const int digit = sm.chosen_digit;
    const bool single = sm.single;
    const uint64_t found = sm.prefix;
    __syncthreads();  // everyone has read the results before the next pass or call rewrites them
    if (digit < 0) return 0;  // the total falls short of the target: keep everything
    if (single || shift == 0) return found;
  }
  return 0;  // not reached: the last pass (shift 0) returns
}

// kernels/cpu/cpu_sampling.cpp's top_key: (logit, id) as one integer, larger = more likely, NaN
// lowest, -0.0 as +0.0, the lower id first on a tie.
__device__ __forceinline__ uint64_t top_key(float l, int64_t id) {
  uint32_t u = 0;  // NaN
  if (!isnan(l)) {
    const uint32_t bits = l != 0.0f ? __float_as_uint(l) : 0u;
    u = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  return (static_cast<uint64_t>(u) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(id));
}

// Calls f(value, i) for i = first, first + kThreads, ... below V, in that order, with the loads
// issued kBatch at a time ahead of the calls: each element's branches depend on its value, so a
// load issued after them would wait a full round trip (see NOTES). Past the row's end a load
// reads l[V - 1] (no branch) and is not used.
template <typename F>
__device__ __forceinline__ void for_each_strided(const float* __restrict__ l, int64_t V, int64_t first, F&& f) {
  for (int64_t i0 = first; i0 < V; i0 += kBatch * kThreads) {
    float v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t i = i0 + u * kThreads;
      v[u] = l[i < V ? i : V - 1];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t i = i0 + u * kThreads;
      if (i >= V) break;
      f(v[u], i);
    }
  }
}

// The row's n most likely tokens (SampleArgs::top_ids), 1 <= n <= min(V, kMaxTopLogprobs):
// each thread keeps the n largest keys of its stride, then n rounds of a block maximum take
// the heads of those lists in order (keys are distinct, so one thread owns each maximum).
// Kept out of line: its per-thread list lives in local memory, not in the sampler's registers.
__device__ __noinline__ void top_logprobs_block(const float* __restrict__ l, int64_t V, double log_z, int n,
                                                int32_t* __restrict__ ids, float* __restrict__ lps, SampleSmem& sm) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  uint64_t best[kMaxTopLogprobs];
  for (int j = 0; j < n; ++j) best[j] = 0;
  uint64_t floor_key = 0;  // best[n - 1]
  for_each_strided(l, V, tid, [&](float v, int64_t i) {
    const uint64_t key = top_key(v, i);
    if (key <= floor_key) return;
    int j = n - 1;
    while (j > 0 && best[j - 1] < key) {
      best[j] = best[j - 1];
      --j;
    }
    best[j] = key;
    floor_key = best[n - 1];
  });
  int head = 0;
  for (int round = 0; round < n; ++round) {
    const unsigned long long mine = head < n ? best[head] : 0ull;
    unsigned long long m = mine;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, m, o);
      m = other > m ? other : m;
    }
    __syncthreads();  // red_u may still be read by the previous round
    if (lane == 0) sm.red_u[warp] = m;
    __syncthreads();
    unsigned long long top = 0;
    for (int w = 0; w < kWarps; ++w) top = sm.red_u[w] > top ? sm.red_u[w] : top;
    if (mine == top) ++head;
    if (tid == 0) {
      const int id = static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(top));
      ids[round] = id;
      lps[round] = static_cast<float>(static_cast<double>(l[id]) - log_z);
    }
  }
  __syncthreads();
}

// Two blocks per SM (64 registers): 256 rows run in one wave on an H200's 132 SMs, not two.
__global__ void __launch_bounds__(kThreads, 2) sample_kernel(int32_t* __restrict__ tokens, float* __restrict__ logprobs,
                                                          const float* __restrict__ logits,
                                                          const SamplingRow* __restrict__ rows, int64_t V,
                                                          int top_n, int32_t* __restrict__ top_ids,
                                                          float* __restrict__ top_lps) {
  __shared__ SampleSmem sm;
  pdl_begin();
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t r = blockIdx.x;
  const float* __restrict__ l = logits + r * V;
  const SamplingRow p = rows[r];

  // Max, argmax (lowest id; an all-NaN or all -inf row gives id 0) and the log-sum-exp of the
  // raw logits, in one pass.
  RowMax mx{-INFINITY, INT_MAX, 0.0};
  for_each_strided(l, V, tid, [&](float v, int64_t i) {
    if (v > mx.m) {
      mx.s = mx.s * static_cast<double>(__expf(mx.m - v)) + 1.0;
      mx.m = v;
      mx.id = static_cast<int>(i);
    } else if (v <= mx.m && v != -INFINITY) {
      mx.s += static_cast<double>(__expf(v - mx.m));
    }
  });
  mx = block_max_sum(mx, sm);
  const float m = mx.m;
  const int am = mx.id < V ? mx.id : 0;
  const double log_z = static_cast<double>(m) + log(mx.s);

  const float t = p.temperature;
  const bool greedy = !(t > 0.0f) || !isfinite(t) || !isfinite(m);
  RowProb rp{m, greedy ? 1.0 : 1.0 / static_cast<double>(t), 0.0};
  if (!greedy) {  // z: the double sum of the double exps at T, as core::Sampler's
    double z = 0;
    for_each_strided(l, V, tid, [&](float v, int64_t) { z += (!(v <= m)) ? 0.0 : exp(rp.x_of(v)); });
    rp.z = block_sum(z, sm);
  }

  int token = am;
  if (!greedy) {
    // The filters' thresholds (see NOTES); disabled or out-of-range values keep everything.
    int64_t top_k = p.top_k;
    float top_p = p.top_p;
    if (!(top_p > 0.0f)) {  // top_p <= 0 keeps one token (NaN: off)
      if (top_p <= 0.0f) top_k = 1;
      top_p = 1.0f;
    }
    uint64_t cut = 0;
    if (top_k > 0 && top_k < V) {
      const uint64_t c = select_threshold(l, V, rp, false, static_cast<unsigned long long>(top_k), sm);
      cut = c > cut ? c : cut;
    }
    if (top_p < 1.0f) {
      auto target = static_cast<unsigned long long>(static_cast<double>(top_p) * kMassScale);
      target = target > 0 ? target : 1;  // a target of 0 would pick an empty bucket
      const uint64_t c = select_threshold(l, V, rp, true, target, sm);
      cut = c > cut ? c : cut;
    }
    const float min_p = p.min_p;
    if (min_p > 0.0f) {  // NaN: off
      const float thr = (min_p < 1.0f ? min_p : 1.0f) * rp.p_of(0.0);  // p of the max logit
      const uint64_t c = static_cast<uint64_t>(__float_as_uint(thr)) << 32;
      cut = c > cut ? c : cut;
    }

    // Inverse CDF in id order over the kept keys: tiles of 32 * q consecutive ids, one warp per
    // tile for the sums, one thread per 4 tiles for the scan, one warp inside the chosen tile.
    const int64_t q = (V + 32LL * kMaxTiles - 1) / (32LL * kMaxTiles);
    const int64_t tile = 32 * q;
    const int num_tiles = static_cast<int>((V + tile - 1) / tile);
    const double xl = cut ? rp.x_low(__uint_as_float(static_cast<uint32_t>(cut >> 32))) : -INFINITY;
    // The weight of element i, whose logit is li (not read when i >= V).
    const auto weight_of = [&](int64_t i, float li) -> double {
      if (i >= V) return 0.0;
      const double x = rp.x_of(li);
      if (x < xl) return 0.0;
      const float pi = rp.p_of(x);
      return key_of(pi, i) >= cut ? static_cast<double>(pi) : 0.0;
    };
    const auto weight = [&](int64_t i) -> double { return weight_of(i, i < V ? l[i] : 0.0f); };
    // Each warp sums its tiles k = warp, warp + kWarps, ..., each over j = 0..q-1, in that
    // order; the loads are batched as in the max pass (see NOTES), kBatch elements of that
    // walk at a time, across tile ends. (k, j) is the same for all lanes of a warp.
    {
      int k = warp;
      int64_t j = 0;
      double s = 0;
      while (k < num_tiles) {
        float v[kBatch];
        int kl = k;
        int64_t jl = j;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int64_t i = kl * tile + jl * 32 + lane;
          v[u] = l[i < V ? i : V - 1];  // past the last tile i >= V too
          if (++jl == q) jl = 0, kl += kWarps;
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (k >= num_tiles) break;
          s += weight_of(k * tile + j * 32 + lane, v[u]);
          if (++j == q) {
            s = warp_sum_d(s);
            if (lane == 0) sm.tile_sum[k] = s;
            s = 0;
            j = 0, k += kWarps;
          }
        }
      }
    }
    __syncthreads();
    double local = 0;
    for (int j = 0; j < 4; ++j) {
      const int k = 4 * tid + j;
      if (k < num_tiles) local += sm.tile_sum[k];
    }
    // Exclusive scan of `local` over the threads (warp scans, then the warps' totals).
    double incl = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const double n = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += n;
    }
    if (lane == 31) sm.red_d[warp] = incl;
    if (tid == 0) sm.chosen_tile = INT_MAX;
    __syncthreads();
    double warp_base = 0, total = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) warp_base += sm.red_d[w];
      total += sm.red_d[w];
    }
    const double target = uniform_draw(p.seed, p.draw_index) * total;
    double acc = warp_base + incl - local;
    for (int j = 0; j < 4; ++j) {
      const int k = 4 * tid + j;
      if (k >= num_tiles) break;
      const double w = sm.tile_sum[k];
      // Rounding can make neighbouring threads' intervals overlap by an ulp: the lowest tile
      // wins, so the choice stays deterministic.
      if (w > 0 && target >= acc && target < acc + w) atomicMin(&sm.chosen_tile, k);
      acc += w;
    }
    __syncthreads();
    if (tid == 0 && sm.chosen_tile == INT_MAX) {
      sm.chosen_tile = -1;
      // Rounding put the target at or past the last sum: the last tile with weight.
      for (int k = num_tiles - 1; k >= 0; --k)
        if (sm.tile_sum[k] > 0) {
          sm.chosen_tile = k;
          break;
        }
    }
    __syncthreads();
    const int ct = sm.chosen_tile;
    if (warp == 0 && ct >= 0) {
      // The tile's start in the same order the scan summed: all tiles before it.
      double base = 0;
      for (int k = lane; k < ct; k += 32) base += sm.tile_sum[k];
      base = warp_sum_d(base);
      int found = -1, last = -1;
      for (int64_t j = 0; j < q && found < 0; ++j) {
        const int64_t i = ct * tile + j * 32 + lane;
        const double w = weight(i);
        double c = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const double n = __shfl_up_sync(0xffffffffu, c, o);
          if (lane >= o) c += n;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, w > 0 && base + c > target);
        const unsigned pos = __ballot_sync(0xffffffffu, w > 0);
        if (hit) found = static_cast<int>(ct * tile + j * 32 + __ffs(hit) - 1);
        if (pos) last = static_cast<int>(ct * tile + j * 32 + 31 - __clz(pos));
        base += __shfl_sync(0xffffffffu, c, 31);
      }
      if (lane == 0) sm.token = found >= 0 ? found : last;
    }
    __syncthreads();
    // No tile with weight cannot happen (the max logit is always kept); the argmax stays as guard.
    if (ct >= 0 && sm.token >= 0) token = sm.token;
  }
  if (tid == 0) {
    tokens[r] = token;
    logprobs[r] = static_cast<float>(static_cast<double>(l[token]) - log_z);
  }
  if (top_n > 0) top_logprobs_block(l, V, log_z, top_n, top_ids + r * top_n, top_lps + r * top_n, sm);
}

}  // namespace

Status sample(const ExecContext& ctx, const SampleArgs& a) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::sample(ctx, a));
  const int64_t rows = a.logits.size(0), V = a.logits.size(1);
  if (rows == 0) return Status::Ok();
  if (rows > INT32_MAX) return Status(ErrorCode::kInvalidArgument, "more than INT32_MAX rows", "logits");
  const int top_n = a.top_ids.data != nullptr ? static_cast<int>(a.top_ids.size(1)) : 0;
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  (void)launch_dependent(
      sample_kernel, static_cast<unsigned int>(rows), kThreads, 0, stream_of(ctx), a.tokens.as<int32_t>(),
      a.logprobs.as<float>(), a.logits.as<const float>(),
      static_cast<const SamplingRow*>(a.rows.data), V, top_n, top_n > 0 ? a.top_ids.as<int32_t>() : nullptr,
      top_n > 0 ? a.top_logprobs.as<float>() : nullptr);
  RD_CUDA_CHECK_LAUNCH("sample_kernel");
  return Status::Ok();
}

}  // namespace rolloutd::cuda
