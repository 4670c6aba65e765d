// CUDA twin of paged causal attention, with an optional learned sink per head in the
// denominator (gpt-oss) and a sliding window (the last `window` positions of the context).
//
// One CTA of 128 threads per (token, KV head, group of up to kAttnHeads query heads that read
// that KV head; kAttnFewHeads in small grids): a key's K and V rows are read once for every
// query head of the group (GQA).
// The context is taken in chunks of kAttnChunk keys: every thread scores one key for each head
// of the group (q . k in registers, q broadcast from shared memory), the CTA reduces each head's
// chunk max and sum, then thread (key group g, lane d) accumulates p_j[h] * v_j over the chunk's
// keys j = g (mod groups) for every head h, for its dimensions (4 consecutive ones on the float4
// path, d + lanes * i on the scalar one), coalesced along the lanes; a running max per head
// rescales the accumulators between chunks (online softmax at chunk granularity). The first
// kernel (one warp per (token, head), one key at a time) took ~25 us per layer at 48 keys and
// one token, and re-read each K/V row once per query head.
// Without a split (below) a (token, head)'s result does not depend on the other rows of the step,
// so a request gets the same output alone or in any batch. Long rows of small grids (decode at
// a few tokens) are split over several CTAs (flash-decoding): a split row has the same bits in
// every split launch, other bits than unsplit, and whether a launch splits depends on its grid.
//
// The caches are FP32 or BF16 (one kernel each, KV = float or uint16_t bits): BF16 rows are
// loaded as stored (half the bytes) and widened to FP32 where used; the arithmetic is the same.
// BF16 caches at D = 64 (gpt-oss) take the tensor-core kernel at the end of this file instead,
// every launch (split or unsplit by the same rule, into the same parts: a split row has the same
// bits in every split launch); it rounds q and p to BF16, so a request's rows differ between
// split and unsplit steps by rounding, as FP32 rows do.
//
// Index values are on the device and not checked on the host: a token whose sequence id is
// outside [0, S) gets a zero row, ctx_len is clamped to [0, max_blocks * block_size], and
// positions whose block id is outside [0, blocks) are skipped. Nothing is read out of bounds.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include <cuda_bf16.h>

#include "kernels/bf16.hpp"
#include "kernels/cpu/op_checks.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace rolloutd::cuda {
namespace {

struct AttentionShape {
  int64_t q_heads, kv_heads, head_dim;
  int64_t num_blocks, block_size;
  int64_t num_seqs, max_blocks;
  float scale;
  const float* sinks;  // [q_heads] or nullptr
  int64_t window;      // 0: whole context
  int head_groups;     // CTAs per KV head: ceil((q_heads / kv_heads) / kAttnHeads)
  bool out_bf16;       // out holds BF16 (the FP32 result rounded once) instead of FP32
};

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnChunk = kAttnThreads;  // keys per chunk: one per thread
constexpr int kAttnHeads = 8;             // query heads per CTA (at most; kAttnFewHeads at small grids)
constexpr int kAttnFewHeads = 2;          // query heads per CTA when 8 would leave the GPU mostly idle
constexpr int kAttnFewMaxCtas = 64;       // ... that is, when 8 would give at most this many CTAs
constexpr int kAttnMaxDim = 512;
constexpr int kAttnBatch = 8;             // keys whose V loads a thread issues together
// chunks in a split part, at least
constexpr int kAttnSplitMinChunks = static_cast<int>(kAttentionSplitMinKeys / kAttnChunk);
constexpr int kAttnMaxSplits = static_cast<int>(kAttentionMaxSplits);
constexpr int kAttnSplitTargetWaves = 4;  // split rows: CTAs per SM the grid is brought to
// The shared-memory V path up to this head dimension: kAttnChunk x 64 floats is 32 KiB, ~54 KiB a
// CTA with the static part (8 heads at 168 registers: 3 CTAs an SM by registers; at 186, the
// register path held 2). At 128 (Qwen3) it would be 64 KiB: not measured, so not taken.
constexpr int kAttnSmemVMaxDim = 64;

// An integer knob from the environment (atoi), `unset` where it is absent or empty.
inline int env_int(const char* name, int unset) {
  const char* e = std::getenv(name);
  return e == nullptr || *e == '\0' ? unset : std::atoi(e);
}
// ROLLOUTD_ATTN_SPLIT: unset -1 (split small grids given a workspace, CTAs chosen per launch),
// 0 off, N > 0 every launch with a workspace splits, N CTAs per row unless the call sets
// split_ctas; read once per process.
inline int attn_split_env() {
  static const int v = env_int("ROLLOUTD_ATTN_SPLIT", -1);
  return v;
}
// ROLLOUTD_ATTN_SPLIT_FEW (an A/B of the float4 kernel's split launches' heads per CTA; the
// tensor-core kernel always has 16): unset -1 (the rule in paged_attention_ex), 0 never
// kAttnFewHeads when split, 1 as unsplit launches choose; read once.
inline int attn_split_few_env() {
  static const int v = env_int("ROLLOUTD_ATTN_SPLIT_FEW", -1);
  return v;
}
// ROLLOUTD_ATTN_SMEM_V=0: V through registers on every launch (an A/B of the kSmemV path, which
// gives the same bits); read once.
inline bool attn_smem_v_env() {
  static const bool on = env_int("ROLLOUTD_ATTN_SMEM_V", 1) != 0;
  return on;
}
// ROLLOUTD_ATTN_K_PREFETCH=0: never the kKPre variant (an A/B; same bits).
inline bool attn_k_prefetch_env() {
  static const bool on = env_int("ROLLOUTD_ATTN_K_PREFETCH", 1) != 0;
  return on;
}
static_assert(kAttentionSplitMinKeys % kAttnChunk == 0 && kAttnMaxSplits <= kAttnChunk,
              "splits are whole chunks; a head's split weights fit one row of p_s");

// Split rows (AttentionOptions::workspace): the parts of a row of `keys` keys (after the window),
// a function of `keys` alone so that a row's bits do not depend on the grid. Up to
// kAttnSplitMinChunks chunks: one part (the unsplit kernel, bit for bit). Else at most
// kAttnMaxSplits parts of `per` whole chunks each (the last one shorter), every part non-empty.
struct SplitPlan {
  int parts, per;  // per: chunks per part
};
__host__ __device__ inline SplitPlan split_plan(int64_t keys) {
  const int64_t chunks = (keys + kAttnChunk - 1) / kAttnChunk;
  if (chunks <= kAttnSplitMinChunks) return {1, static_cast<int>(chunks)};
  int64_t parts = (chunks + kAttnSplitMinChunks - 1) / kAttnSplitMinChunks;
  parts = parts < kAttnMaxSplits ? parts : kAttnMaxSplits;
  const int64_t per = (chunks + parts - 1) / parts;
  return {static_cast<int>((chunks + per - 1) / per), static_cast<int>(per)};
}

// The workspace as the kernel sees it (layout: paged_attention_workspace_bytes for its capacity
// C >= T tokens; the launch uses the first T tokens' rows of each region). ctas == 0: off.
struct AttnSplit {
  int32_t* counters;  // [C, QH]: parts finished, at (token, first head of the CTA); zero between launches
  float* o;           // [C, QH, kAttnMaxSplits, D]: a part's unnormalized sum of p * v
  float* ml;          // [C, QH, kAttnMaxSplits, 2]: a part's running max and sum of exp(score - max)
                      // (the tensor-core kernel: max in log2 units, sum of exp2)
  int ctas;           // CTAs per row (grid.z), each taking parts z, z + ctas, ...
};

// A token's row: its context length (0 for a sequence id outside [0, S), clamped to what the
// table can hold), its sequence's block table and the first key it sees (the window's start).
struct AttnRow {
  int64_t len, first;
  const int32_t* table;
};
__device__ __forceinline__ AttnRow attn_row(const AttentionShape& s, const int32_t* block_tables,
                                            const int32_t* seq_of, const int32_t* ctx_len, int64_t t) {
  const int64_t seq = seq_of[t];
  int64_t len = ctx_len[t];
  if (seq < 0 || seq >= s.num_seqs) len = 0;
  len = len < 0 ? 0 : (len > s.max_blocks * s.block_size ? s.max_blocks * s.block_size : len);
  return {len, s.window > 0 && len > s.window ? len - s.window : 0, block_tables + (len > 0 ? seq * s.max_blocks : 0)};
}

// Per-head block reductions of v[0..kH) (max or sum); every thread gets the results.
template <bool kMax, int kH>
__device__ __forceinline__ void block_reduce_heads(float (&v)[kH], float (*red)[kH]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int h = 0; h < kH; ++h) v[h] = kMax ? warp_max(v[h]) : warp_sum(v[h]);
  __syncthreads();  // red[] may still be read by the previous reduction
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < kH; ++h) red[warp][h] = v[h];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    float r = red[0][h];
#pragma unroll
    for (int w = 1; w < kAttnWarps; ++w) r = kMax ? fmaxf(r, red[w][h]) : r + red[w][h];
    v[h] = r;
  }
}

// Keys of a chunk whose loads a thread issues together: K rows in the score phase (float4 of the
// head dimension each, kVec), V rows of the p.v phase issued before the chunk's softmax
// reductions. More at small grids (a latency chain per CTA), fewer at 8 heads per CTA (registers:
// occupancy at large grids).
// kSmemV: V goes to shared memory by cp.async (kV unused); 2-head CTAs then load K 8 float4 at a
// time as well (16 held 196 registers: 2 CTAs an SM, 5 % slower at one long sequence).
// Counts are of 4-value units (KvIo::Raw): a BF16 cache takes twice as many K units in flight as
// FP32, the same bytes of registers for them (so a 64-wide BF16 K row arrives in one round of
// loads, not two); ptxas does not always match: the 2-head BF16 variant holds 212 registers (FP32
// 168) and the 8-head shared-memory one spills 36 bytes (FP32 20). Those run only in split or
// few-head launches, which measured 2-4 % faster with BF16 caches than FP32 all the same.
template <int kH, bool kSmemV = false, class KV = float>
struct AttnBatches {
  static constexpr int kWiden = static_cast<int>(sizeof(float) / sizeof(KV));
  static constexpr int kK = (kH <= kAttnFewHeads && !kSmemV ? 16 : 8) * kWiden;  // units of a K row in flight
  static constexpr int kV = kH <= kAttnFewHeads ? 8 : 4;              // V rows prefetched before the reductions
};

// Four consecutive values of a cache row as loaded (Raw: 16 bytes of FP32, 8 of BF16) and as
// used (widen: FP32; a BF16 value is the high half of its FP32, exactly). Loads are kept raw until
// their use so that issuing one never waits for it.
template <class KV>
struct KvIo;
template <>
struct KvIo<float> {
  using Raw = float4;
  static __device__ __forceinline__ Raw load(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
  static __device__ __forceinline__ Raw zero() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
  static __device__ __forceinline__ float4 widen(Raw r) { return r; }
  static __device__ __forceinline__ float widen1(float v) { return v; }
};
template <>
struct KvIo<uint16_t> {  // BF16 bits
  using Raw = uint2;
  static __device__ __forceinline__ Raw load(const uint16_t* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
  static __device__ __forceinline__ Raw zero() { return make_uint2(0u, 0u); }
  static __device__ __forceinline__ float4 widen(Raw r) {  // little-endian: value 4i + 0 in x's low half
    return make_float4(__uint_as_float(r.x << 16), __uint_as_float(r.x & 0xffff0000u), __uint_as_float(r.y << 16),
                       __uint_as_float(r.y & 0xffff0000u));
  }
  static __device__ __forceinline__ float widen1(uint16_t v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }
};

// kH: query heads per CTA (kAttnHeads, or kAttnFewHeads where the grid would be small: at one
// token and 8 KV heads, 8 CTAs of 8 heads each left the GPU idle behind one long chain of loads
// and reductions per CTA); kPer: head dimensions per thread in the scalar p.v phase (1 for
// D <= 128, else ceil(D / 128)); kVec: D % 4 == 0 and 16-byte aligned rows, so q.k and p.v read
// float4 (dim_lanes is then D / 4 rounded up to a power of two: lanes of 4 dimensions).
//
// NOTES (the chain a decode CTA waits through): at a few tokens the kernel is one wave of short
// CTAs, so its time is the chain of dependent memory round trips in one CTA, not bytes. The
// vector path keeps that chain at: q's loads and the block table's (after the token's sequence id
// and length) in flight together; then the first V rows of the chunk and every K row (V does not
// depend on the scores, only on the table); then reductions and arithmetic from registers and
// shared memory. The first version waited for the
// table after q, for K in two rounds and for V in rounds of 8 keys per 2 thread groups after the
// reductions (14 us a layer at 32 tokens and ~48 keys).
// kSmemV (kVec only, D / 4 a power of two, D <= kAttnSmemVMaxDim): the chunk's V rows are copied
// into dynamic shared memory (kAttnChunk x D floats) by cp.async, issued right after the chunk's
// K loads, whole rows per warp (coalesced), so the p.v phase no longer waits for rounds of V loads
// after the reductions: at D = 64 a chunk waits for the table and K's two batches (V arrives
// meanwhile) instead of those and three rounds of V. The p.v sums
// run over the same keys in the same order, so the bits are the same as without it.
// kKPre (on top of kSmemV): the next chunk's cache row and first K loads are issued once this
// chunk's scores are computed, so they arrive during its reductions and p.v. At 8 heads it holds
// ~70 more registers (236: 2 CTAs an SM instead of 3), so the host takes it only for grids of at
// most two CTAs an SM, where that is all the grid can use (at 2 heads it costs ~30 and stays at
// 3; the same rule, not measured apart).
// K and V are read with __ldg / cp.async although the previous kernel (rope_qk) writes the cache
// (cuda_common.cuh asks for ordinary loads after pdl_wait): every such address depends on the
// block table and ctx_len, read with ordinary loads after pdl_begin, so none can be issued
// before the wait.
template <class KV, int kH, int kPer, bool kVec, bool kSmemV = false, bool kKPre = false>
__global__ void __launch_bounds__(kAttnThreads)
    paged_attention_kernel(void* __restrict__ out, const float* __restrict__ q,
                           const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                           const int32_t* __restrict__ block_tables,
                           const int32_t* __restrict__ seq_of, const int32_t* __restrict__ ctx_len,
                           AttentionShape s, int dim_lanes, AttnSplit sp) {
  constexpr int kPRows = kH > kPer ? kH : kPer;  // p_s also holds the groups' partial sums at the end (scalar path)
  static_assert(!kSmemV || kVec, "the shared-memory V path is a float4 path");
  static_assert(!kKPre || kSmemV, "the K prefetch is part of the shared-memory V path");
  using Io = KvIo<KV>;
  using Raw = typename Io::Raw;
  constexpr int kKB = AttnBatches<kH, kSmemV, KV>::kK;
  constexpr int kVB = AttnBatches<kH, kSmemV, KV>::kV;
  extern __shared__ float4 v_s[];  // kSmemV: [kAttnChunk][D * sizeof(KV) / 16], the chunk's V rows as stored
  __shared__ __align__(16) float q_s[kH][kAttnMaxDim];
  __shared__ float p_s[kPRows][kAttnChunk];
  __shared__ int64_t row_s[kAttnChunk];  // cache row (block * block_size + offset) of a key, -1: skipped
  __shared__ float red[kAttnWarps][kH];
  pdl_begin();
  const int64_t t = blockIdx.x;
  const int64_t kvh = blockIdx.y / s.head_groups;
  const int64_t per_kv = s.q_heads / s.kv_heads;
  const int64_t h0 = kvh * per_kv + (blockIdx.y % s.head_groups) * kH;
  const int nh = static_cast<int>(per_kv - (h0 - kvh * per_kv) < kH ? per_kv - (h0 - kvh * per_kv) : kH);
  const int tid = threadIdx.x;
  const int64_t D = s.head_dim;
  // Heads past nh get zeros: the loops below run all kH heads without branches (so their
  // loads can be issued together) and those heads' results are never written.
  auto load_q = [&] {
    if constexpr (kVec) {
      const int d4n = static_cast<int>(D / 4);
      for (int i = tid; i < kH * d4n; i += kAttnThreads) {
        const int hh = i / d4n, d4 = i - hh * d4n;
        reinterpret_cast<float4*>(q_s[hh])[d4] =
            hh < nh ? *reinterpret_cast<const float4*>(q + (t * s.q_heads + h0 + hh) * D + 4 * d4)
                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    } else {
      for (int hh = 0; hh < kH; ++hh)
        for (int64_t d = tid; d < D; d += kAttnThreads) q_s[hh][d] = hh < nh ? q[(t * s.q_heads + h0 + hh) * D + d] : 0.0f;
    }
  };
  load_q();

  const AttnRow ar = attn_row(s, block_tables, seq_of, ctx_len, t);
  const int64_t len = ar.len, first = ar.first;
  const int32_t* table = ar.table;
  // Split rows (vector path only; the host enables it): this CTA takes parts z, z + ctas, ...
  SplitPlan plan{1, 0};
  if constexpr (kVec) {
    if (sp.ctas > 0) plan = split_plan(len - first);
  }
  if (static_cast<int>(blockIdx.z) >= plan.parts) return;  // uniform across the CTA
  const bool split = plan.parts > 1;
  const int64_t row_stride = s.kv_heads * D;  // values between consecutive cache rows
  // The cache row of key j (>= 0), -1 where its block id is outside [0, blocks).
  auto row_of = [&](int64_t j) -> int64_t {
    const int64_t block = table[j / s.block_size];
    return block >= 0 && block < s.num_blocks ? block * s.block_size + j % s.block_size : -1;
  };

  // p.v layout: thread = (group g, lane d0); dims d0 + dim_lanes * i (scalar) or 4 d0 .. 4 d0 + 3
  // (kVec), keys j = g (mod groups).
  const int groups = kAttnThreads / dim_lanes;
  const int g = tid / dim_lanes, d0 = tid - g * dim_lanes;
  const bool vlane = kVec ? 4 * d0 < D : d0 < D;  // the lane has dimensions (kVec: 4 of them)
  constexpr int kAcc = kVec ? 4 : kPer;
  const int d4n = static_cast<int>(D / 4);
  // The final row (h, 4 dimensions from 4 * d4), v already divided by the denominator.
  auto store4 = [&](int h, int d4, float4 v) {
    const int64_t o = (t * s.q_heads + h0 + h) * D + 4 * d4;
    if (s.out_bf16) {
      const uint32_t lo = f32_to_bf16_bits(v.x) | (static_cast<uint32_t>(f32_to_bf16_bits(v.y)) << 16);
      const uint32_t hi = f32_to_bf16_bits(v.z) | (static_cast<uint32_t>(f32_to_bf16_bits(v.w)) << 16);
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(out) + o) = make_uint2(lo, hi);
    } else {
      *reinterpret_cast<float4*>(static_cast<float*>(out) + o) = v;
    }
  };
  // Where a part's partials go: [(token, head), part] rows.
  auto part_row = [&](int h, int part) { return (t * s.q_heads + h0 + h) * kAttnMaxSplits + part; };
  float acc[kH][kAcc];
  float running_max[kH], denom[kH];

  for (int part = blockIdx.z; part < plan.parts; part += gridDim.z) {
    if (part != static_cast<int>(blockIdx.z)) {  // the previous part's epilogue overwrote q_s
      __syncthreads();
      load_q();
    }
    // Keys [kb, ke): the whole row, or this part's chunks.
    const int64_t kb = split ? first + static_cast<int64_t>(part) * plan.per * kAttnChunk : first;
    const int64_t ke = split && kb + static_cast<int64_t>(plan.per) * kAttnChunk < len
                           ? kb + static_cast<int64_t>(plan.per) * kAttnChunk
                           : len;
    // A sink is one more logit with no value: it starts the running max and the denominator (a
    // split row's is added once, in the combine).
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      const bool sink = s.sinks && len > 0 && h < nh && !split;
      running_max[h] = sink ? s.sinks[h0 + h] : -INFINITY;
      denom[h] = sink ? 1.0f : 0.0f;  // sum of exp(score - running_max)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[h][i] = 0.0f;
    }

    bool q_ready = false;
    // kKPre: the next chunk's cache row and first kKB float4 of K.
    Raw knext[kKPre ? kKB : 1];
    int64_t row_next = -1;
    bool have_next = false;  // uniform: a function of c0 and ke
    for (int64_t c0 = kb; c0 < ke; c0 += kAttnChunk) {
      const int n = ke - c0 < kAttnChunk ? static_cast<int>(ke - c0) : kAttnChunk;
      const int64_t row = kKPre && have_next ? row_next : tid < n ? row_of(c0 + tid) : -1;
      // kSmemV: this thread's first kKB float4 of its K row, issued before the barrier that
      // publishes row_s; then the chunk's V rows to shared memory, d4n float4 a row, consecutive
      // threads taking consecutive float4 of a row (every key's row from row_s; zeros for a
      // skipped key or one past the chunk, which have p = 0).
      Raw kpre[kSmemV ? kKB : 1];
      if constexpr (kSmemV) {
        const KV* kr = k_cache + (row < 0 ? 0 : row) * row_stride + kvh * D;
#pragma unroll
        for (int u = 0; u < kKB; ++u) {
          if (kKPre && have_next) kpre[u] = knext[u];
          else kpre[u] = row >= 0 && u < d4n ? Io::load(kr + 4 * u) : Io::zero();
        }
        row_s[tid] = row;
        __syncthreads();  // row_s (the previous chunk's readers passed the barrier at its end); q_s
        q_ready = true;
        // 16-byte pieces of a row as stored (pn a power of two <= 16, the host's condition).
        constexpr int kPiece = static_cast<int>(16 / sizeof(KV));  // values per piece
        const int pn = static_cast<int>(D / kPiece);
        const int per_pass = kAttnThreads / pn;  // keys per pass
        const int c = tid & (pn - 1);
        for (int key = tid / pn; key < kAttnChunk; key += per_pass) {
          const int64_t r = key < n ? row_s[key] : -1;
          cp_async16_ca_zfill(&v_s[key * pn + c], r >= 0 ? v_cache + r * row_stride + kvh * D + kPiece * c : v_cache,
                              r >= 0);
        }
        cp_async_commit();
      }
      // kVec: this thread's first kVB V rows of the chunk (keys g + groups * u), loaded now.
      Raw vpre[kVec && !kSmemV ? kVB : 1];
      if constexpr (kVec && !kSmemV) {
#pragma unroll
        for (int u = 0; u < kVB; ++u) {
          const int jj = g + u * groups;
          const int64_t r = jj < n ? row_of(c0 + jj) : -1;
          vpre[u] = r >= 0 && vlane ? Io::load(v_cache + r * row_stride + kvh * D + 4 * d0) : Io::zero();
        }
      }
      if (!q_ready) {  // the same in every thread: the first chunk publishes q_s
        __syncthreads();
        q_ready = true;
      }
      float score[kH];
#pragma unroll
      for (int h = 0; h < kH; ++h) score[h] = -INFINITY;
      if (row >= 0) {
        const KV* kr = k_cache + row * row_stride + kvh * D;
        float dot[kH];
#pragma unroll
        for (int h = 0; h < kH; ++h) dot[h] = 0.0f;
        if constexpr (kVec) {
          const int n4 = static_cast<int>(D / 4);
          for (int i0 = 0; i0 < n4; i0 += kKB) {
            Raw a[kKB];
#pragma unroll
            for (int u = 0; u < kKB; ++u) {
              if (kSmemV && i0 == 0) a[u] = kpre[u];  // issued before the barrier
              else a[u] = i0 + u < n4 ? Io::load(kr + 4 * (i0 + u)) : Io::zero();
            }
#pragma unroll
            for (int u = 0; u < kKB; ++u) {
              if (i0 + u >= n4) break;
              const float4 av = Io::widen(a[u]);
#pragma unroll
              for (int h = 0; h < kH; ++h) {
                const float4 b = reinterpret_cast<const float4*>(q_s[h])[i0 + u];
                dot[h] += av.x * b.x + av.y * b.y + av.z * b.z + av.w * b.w;
              }
            }
          }
        } else {
#pragma unroll 4
          for (int d = 0; d < static_cast<int>(D); ++d) {
            const float a = Io::widen1(__ldg(kr + d));
#pragma unroll
            for (int h = 0; h < kH; ++h) {
              dot[h] += a * q_s[h][d];
            }
          }
        }
#pragma unroll
        for (int h = 0; h < kH; ++h)
          if (h < nh) score[h] = dot[h] * s.scale;
      }
      if constexpr (!kSmemV) row_s[tid] = row;
      have_next = false;
      if constexpr (kKPre) {
        if (c0 + kAttnChunk < ke) {
          const int64_t c1 = c0 + kAttnChunk;
          row_next = tid < ke - c1 ? row_of(c1 + tid) : -1;
          const KV* kr = k_cache + (row_next < 0 ? 0 : row_next) * row_stride + kvh * D;
#pragma unroll
          for (int u = 0; u < kKB; ++u) knext[u] = row_next >= 0 && u < d4n ? Io::load(kr + 4 * u) : Io::zero();
          have_next = true;
        }
      }
      float m[kH];
#pragma unroll
      for (int h = 0; h < kH; ++h) m[h] = score[h];
      block_reduce_heads<true, kH>(m, red);
      float sum[kH], correction[kH];
      bool any = false;
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        const float new_max = fmaxf(running_max[h], m[h]);
        // Every key so far skipped and no sink: nothing to add (and -inf - -inf would be NaN).
        const bool live = new_max != -INFINITY;
        any |= live;
        correction[h] = live ? expf(running_max[h] - new_max) : 1.0f;  // 0 while running_max is -inf
        const float p = live && tid < n ? expf(score[h] - new_max) : 0.0f;  // exp(-inf) = 0: skipped keys
        p_s[h][tid] = p;
        sum[h] = p;
        if (live) running_max[h] = new_max;
      }
      if constexpr (kSmemV) cp_async_wait_all();  // this thread's V copies; the barriers below publish all
      block_reduce_heads<false, kH>(sum, red);  // its barriers also publish p_s and row_s (and v_s)
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        denom[h] = denom[h] * correction[h] + sum[h];
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[h][i] *= correction[h];
      }
      if (any && vlane) {
        if constexpr (kSmemV) {
          // Keys g, g + groups, ... in that order, as the register path below takes them.
#pragma unroll 4
          for (int jj = g; jj < n; jj += groups) {
            const float4 vv = Io::widen(reinterpret_cast<const Raw*>(v_s)[jj * d4n + d0]);
#pragma unroll
            for (int h = 0; h < kH; ++h) {
              const float p = p_s[h][jj];
              acc[h][0] += p * vv.x;
              acc[h][1] += p * vv.y;
              acc[h][2] += p * vv.z;
              acc[h][3] += p * vv.w;
            }
          }
        } else if constexpr (kVec) {
          // Keys g + groups * u in u order: the prefetched ones, then kVB at a time from row_s
          // (a skipped key, or one past the chunk, loads nothing and has p = 0).
          auto add = [&](const Raw (&raw)[kVB], int jb) {
#pragma unroll
            for (int u = 0; u < kVB; ++u) {
              const int jj = jb + u * groups;
              if (jj >= n) break;
              const float4 vv = Io::widen(raw[u]);
#pragma unroll
              for (int h = 0; h < kH; ++h) {
                const float p = p_s[h][jj];
                acc[h][0] += p * vv.x;
                acc[h][1] += p * vv.y;
                acc[h][2] += p * vv.z;
                acc[h][3] += p * vv.w;
              }
            }
          };
          add(vpre, g);
          for (int jb = g + kVB * groups; jb < n; jb += kVB * groups) {
            Raw vv[kVB];
#pragma unroll
            for (int u = 0; u < kVB; ++u) {
              const int jj = jb + u * groups;
              const int64_t r = jj < n ? row_s[jj] : -1;
              vv[u] = r >= 0 ? Io::load(v_cache + r * row_stride + kvh * D + 4 * d0) : Io::zero();
            }
            add(vv, jb);
          }
        } else {
          // kAttnBatch keys per round, their V loads issued before any is used.
          for (int jb = g; jb < n; jb += kAttnBatch * groups) {
            float vv[kAttnBatch][kPer];
#pragma unroll
            for (int u = 0; u < kAttnBatch; ++u) {
              const int jj = jb + u * groups;
              const int64_t r = jj < n ? row_s[jj] : -1;
              const KV* vr = v_cache + (r < 0 ? 0 : r) * row_stride + kvh * D;
#pragma unroll
              for (int i = 0; i < kPer; ++i) {
                const int64_t d = d0 + static_cast<int64_t>(dim_lanes) * i;
                vv[u][i] = r >= 0 && d < D ? Io::widen1(__ldg(vr + d)) : 0.0f;
              }
            }
#pragma unroll
            for (int u = 0; u < kAttnBatch; ++u) {
              const int jj = jb + u * groups;
              if (jj >= n) break;
#pragma unroll
              for (int h = 0; h < kH; ++h) {
                const float p = p_s[h][jj];
#pragma unroll
                for (int i = 0; i < kPer; ++i) acc[h][i] += p * vv[u][i];
              }
            }
          }
        }
      }
      __syncthreads();  // p_s and row_s are rewritten by the next chunk
    }
    if constexpr (kVec) {
      // Every head's group partial sums at once in q_s (kH heads x 128 threads x 4 floats: its
      // size; nothing reads q after the last chunk), then each (head, 4 dimensions) summed in group
      // order by one thread: two barriers for all heads where the scalar path takes two per head.
      __syncthreads();  // no chunk ran: the q_s stores above finish before the partials overwrite them
#pragma unroll
      for (int h = 0; h < kH; ++h)
        reinterpret_cast<float4*>(q_s[h])[tid] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
      // 1 / denominator per head (every thread holds the same ones), for the threads below that
      // finish another head; a row that saw nothing is zero, not 0/0. A part of a split row keeps
      // its running max and sum for the combine instead.
      if (tid == 0) {
#pragma unroll
        for (int h = 0; h < kH; ++h) {
          red[0][h] = denom[h] > 0.0f ? 1.0f / denom[h] : 0.0f;
          if (split && h < nh) {
            sp.ml[2 * part_row(h, part)] = running_max[h];
            sp.ml[2 * part_row(h, part) + 1] = denom[h];
          }
        }
      }
      __syncthreads();
      for (int i = tid; i < nh * d4n; i += kAttnThreads) {
        const int h = i / d4n, d4 = i - h * d4n;
        float4 v = reinterpret_cast<const float4*>(q_s[h])[d4];
        for (int gg = 1; gg < groups; ++gg) {
          const float4 w = reinterpret_cast<const float4*>(q_s[h])[gg * dim_lanes + d4];
          v.x += w.x;
          v.y += w.y;
          v.z += w.z;
          v.w += w.w;
        }
        if (split) {
          reinterpret_cast<float4*>(sp.o + part_row(h, part) * D)[d4] = v;
        } else {
          const float iv = red[0][h];
          store4(h, d4, make_float4(v.x * iv, v.y * iv, v.z * iv, v.w * iv));
        }
      }
    } else {
      // Groups' partial sums, added in group order through shared memory (p_s is free now: one
      // head at a time); a row that saw nothing is zero, not 0/0.
      float* part = &p_s[0][0];  // kPRows * kAttnChunk floats >= kPer * kAttnThreads
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        if (h >= nh) break;  // uniform across the CTA (the barriers below)
        const float inv = denom[h] > 0.0f ? 1.0f / denom[h] : 0.0f;
        const int64_t orow = (t * s.q_heads + h0 + h) * D;
#pragma unroll
        for (int i = 0; i < kPer; ++i) part[i * kAttnThreads + tid] = acc[h][i];
        __syncthreads();
        if (g == 0) {
#pragma unroll
          for (int i = 0; i < kPer; ++i) {
            const int64_t d = d0 + static_cast<int64_t>(dim_lanes) * i;
            if (d >= D) continue;
            float v = part[i * kAttnThreads + d0];
            for (int gg = 1; gg < groups; ++gg) v += part[i * kAttnThreads + gg * dim_lanes + d0];
            // BF16: rounded here as the convert before o_proj did (kernels/bf16.hpp), one launch fewer.
            if (s.out_bf16)
              static_cast<uint16_t*>(out)[orow + d] = f32_to_bf16_bits(v * inv);
            else
              static_cast<float*>(out)[orow + d] = v * inv;
          }
        }
        __syncthreads();  // part is rewritten for the next head
      }
    }
  }  // parts

  // A split row: the CTA that finishes its last part combines every part, in part order (the
  // threadFenceReduction pattern: partials, a fence, a counter; the last CTA to count reads
  // them all through L2). M = the largest part max (and the sink), each part weighted by
  // exp(m_i - M), the denominator the weighted sum of the parts' sums plus exp(sink - M).
  if constexpr (kVec) {
    if (!split) return;
    __shared__ int last_s;
    __threadfence();
    __syncthreads();
    int32_t* counter = sp.counters + t * s.q_heads + h0;
    if (tid == 0) {
      const int mine = (plan.parts - 1 - static_cast<int>(blockIdx.z)) / static_cast<int>(gridDim.z) + 1;
      last_s = atomicAdd(counter, mine) + mine == plan.parts;
    }
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    if (tid < nh) {
      const int h = tid;
      const float sink = s.sinks ? s.sinks[h0 + h] : -INFINITY;
      float m = sink;
      for (int p = 0; p < plan.parts; ++p) m = fmaxf(m, __ldcg(sp.ml + 2 * part_row(h, p)));
      float l = s.sinks ? expf(sink - m) : 0.0f;
      for (int p = 0; p < plan.parts; ++p) {
        const float mp = __ldcg(sp.ml + 2 * part_row(h, p));
        const float w = mp == -INFINITY ? 0.0f : expf(mp - m);  // a part that saw nothing; never -inf - -inf
        p_s[h][p] = w;
        l += w * __ldcg(sp.ml + 2 * part_row(h, p) + 1);
      }
      red[0][h] = l > 0.0f ? 1.0f / l : 0.0f;
    }
    __syncthreads();
    for (int i = tid; i < nh * d4n; i += kAttnThreads) {
      const int h = i / d4n, d4 = i - h * d4n;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int p = 0; p < plan.parts; ++p) {
        const float w = p_s[h][p];
        const float4 o = __ldcg(reinterpret_cast<const float4*>(sp.o + part_row(h, p) * D) + d4);
        v.x += w * o.x;
        v.y += w * o.y;
        v.z += w * o.z;
        v.w += w * o.w;
      }
      const float iv = red[0][h];
      store4(h, d4, make_float4(v.x * iv, v.y * iv, v.z * iv, v.w * iv));
    }
    if (tid == 0) *counter = 0;  // for the next launch (kernel boundaries order it)
  }
}

// ---- Tensor-core attention over BF16 caches (kMma) ------------------------------------------------
// Taken for BF16 caches at D = 64 (gpt-oss), split (flash-decoding, the float4 kernel's parts
// and workspace: a part's max is kept in log2 units, so the two kernels' partials never mix) or
// unsplit. The float4 kernel above spends its time issuing ~1,500 instructions a warp per
// 128-key chunk (a q.k and a p.v FMA per head and key, shared-memory reads of q and p) with 8 warps an SM, and
// halving the bytes (BF16) took only ~5 % off a long-context step. Here q.k and p.v are
// mma.sync m16n8k16: the CTA's query heads (up to 16, the M rows) against 8 keys (q.k) or 8
// output dimensions (p.v), as flash-attention does for prefill: 32 mma a warp per 32 keys.
// Numerics: q and p are rounded to BF16 for the tensor cores (as a BF16 model's attention
// does); scores, the softmax and the sums stay FP32. So these rows are within BF16 tolerance of
// the FP32-q reference, not FP32's (the parity cases say which).
// Layout: 4 warps, each its own keys of the row or part (tiles of 32, warp w taking tiles w,
// w + 4, ...) through its own kMmaStages-deep cp.async ring (no block barrier until the row's or
// part's end); each warp keeps an online softmax per head (running max, its lanes' partial sums,
// accumulators), and the 4 are combined in shared memory at the end, with the sink for an
// unsplit row (a split row's joins once, in the combine of its parts).
constexpr int kMmaWarps = 4;
constexpr int kMmaKeys = 32;    // keys a warp takes per tile (4 n-tiles of 8)
constexpr int kMmaStages = 3;   // tiles in flight per warp
constexpr int kMmaHeads = 16;   // query heads per CTA: the mma's M
// The head dimension it is built for. A D = 128 form (Qwen3; 2 tiles in flight a warp, 128 KiB a
// CTA, 168 registers) passed the same parity and needle tests on an H200 but ran a Qwen3-30B-shaped
// step at 32 sequences of 4,096 tokens in 3.729 ms against the float4 kernel's 3.738 (no gain, and
// BF16 q and p where the float4 kernel keeps FP32), so it was not kept (tests/bench/NOTES.md).
constexpr int kMmaDim = 64;

template <int D>
struct MmaLayout {
  static constexpr int kPieces = D / 8;                    // 16-byte pieces of a BF16 row
  static constexpr int kTileBytes = kMmaKeys * D * 2;      // K or V rows of a tile
  static constexpr int kStageBytes = 2 * kTileBytes;       // K then V
  static constexpr int kWarpBytes = kMmaStages * kStageBytes;
  static constexpr int kBytes = kMmaWarps * kWarpBytes;    // dynamic shared memory of a CTA
  // The end's combine reuses it: max and sum [warps][heads], accumulators [warps][heads][D].
  static constexpr int kCombineBytes = (2 * kMmaWarps * kMmaHeads + kMmaWarps * kMmaHeads * D) * 4;
  static_assert(kCombineBytes <= kBytes, "the combine fits the ring");
  static_assert(kPieces == 8, "the XOR swizzle below permutes 8 pieces a row");
};

// Byte offset of (row r, 16-byte piece c) in a tile: pieces XOR-swizzled by r % 8 so that the 8
// rows an ldmatrix reads at one logical piece fall in 8 different bank groups.
__device__ __forceinline__ int mma_tile_offset(int r, int c, int row_bytes) { return r * row_bytes + ((c ^ (r & 7)) << 4); }

// Two values rounded to nearest even into BF16x2, lo in the low half: one cvt.rn.bf16x2 (the same
// bits as kernels/bf16.hpp for every non-NaN value).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// A finished row's 4 values at element o of out (FP32, or BF16 rounded to nearest even).
__device__ __forceinline__ void mma_store4(void* out, const AttentionShape& s, int64_t o, float4 v) {
  if (s.out_bf16)
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(out) + o) = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
  else
    *reinterpret_cast<float4*>(static_cast<float*>(out) + o) = v;
}

template <int D>
__global__ void __launch_bounds__(kMmaWarps * 32, 2)
    paged_attention_mma_kernel(void* __restrict__ out, const float* __restrict__ q,
                               const uint16_t* __restrict__ k_cache, const uint16_t* __restrict__ v_cache,
                               const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_of,
                               const int32_t* __restrict__ ctx_len, AttentionShape s, AttnSplit sp) {
  using L = MmaLayout<D>;
  constexpr int kRowBytes = D * 2;
  constexpr int kKs = D / 16;  // k-steps of q.k
  constexpr int kNd = D / 8;   // n-tiles of p.v's output dimensions
  extern __shared__ __align__(128) uint8_t mma_smem[];
  __shared__ uint32_t vmask[kMmaWarps][kMmaStages];  // per tile: keys with a cache row
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c2 = 2 * (lane & 3);  // fragment row (head) and column pair
  const int64_t t = blockIdx.x;
  const int64_t kvh = blockIdx.y / s.head_groups;
  const int64_t per_kv = s.q_heads / s.kv_heads;
  const int64_t h0 = kvh * per_kv + (blockIdx.y % s.head_groups) * kMmaHeads;
  const int nh = static_cast<int>(per_kv - (h0 - kvh * per_kv) < kMmaHeads ? per_kv - (h0 - kvh * per_kv) : kMmaHeads);
  const AttnRow ar = attn_row(s, block_tables, seq_of, ctx_len, t);
  const int64_t len = ar.len, first = ar.first;
  const int32_t* table = ar.table;
  const int64_t row_stride = s.kv_heads * D;

  // q as the A operand: rows = the CTA's heads (zeros past nh), rounded to BF16 once.
  uint32_t qa[kKs][4];
  {
    auto pair = [&](int r, int c) -> uint32_t {
      if (r >= nh) return 0u;
      const float2 v = *reinterpret_cast<const float2*>(q + (t * s.q_heads + h0 + r) * D + c);
      return pack_bf16x2(v.x, v.y);
    };
#pragma unroll
    for (int ks = 0; ks < kKs; ++ks) {
      qa[ks][0] = pair(g, 16 * ks + c2);
      qa[ks][1] = pair(g + 8, 16 * ks + c2);
      qa[ks][2] = pair(g, 16 * ks + c2 + 8);
      qa[ks][3] = pair(g + 8, 16 * ks + c2 + 8);
    }
  }

  // Keys fit an int here (the host takes this kernel only for tables of fewer than 2^31 positions).
  const int ilen = static_cast<int>(len), ifirst = static_cast<int>(first), bsz = static_cast<int>(s.block_size);
  // Scores in log2 units (scale * log2 e), so every exponential below is one exp2.
  const float scale_log2 = s.scale * 1.4426950408889634f;
  // Split rows (sp.ctas > 0): the parts of split_plan, as the float4 kernel cuts them (so a row's
  // bits do not depend on the grid); this CTA takes parts z, z + ctas, ...
  const SplitPlan plan = sp.ctas > 0 ? split_plan(len - first) : SplitPlan{1, 0};
  if (static_cast<int>(blockIdx.z) >= plan.parts) return;  // uniform across the CTA
  const bool split = plan.parts > 1;
  auto part_row = [&](int h, int part) { return (t * s.q_heads + h0 + h) * kAttnMaxSplits + part; };
  uint8_t* ring = mma_smem + warp * L::kWarpBytes;
  for (int part = blockIdx.z; part < plan.parts; part += gridDim.z) {
    if (part != static_cast<int>(blockIdx.z)) __syncthreads();  // the last part's combine read the ring
    // Keys [kb, ke): the whole row, or this part's chunks.
    const int kb = split ? ifirst + part * plan.per * kAttnChunk : ifirst;
    const int64_t kend = static_cast<int64_t>(kb) + static_cast<int64_t>(plan.per) * kAttnChunk;  // may pass 2^31
    const int ke = split && kend < ilen ? static_cast<int>(kend) : ilen;
    const int tiles = (ke - kb + kMmaKeys - 1) / kMmaKeys;
    const int mine = tiles > warp ? (tiles - warp + kMmaWarps - 1) / kMmaWarps : 0;
    // Tile j of this warp (keys kb + 32 (warp + 4 j) ..) into stage st: lane l finds key l's
    // cache row (-1: past the context or a block outside the cache: zero-filled, masked).
    auto issue = [&](int j, int st) {
      const int key = kb + (warp + kMmaWarps * j) * kMmaKeys + lane;
      int64_t row = -1;
      if (key < ke) {
        const int64_t block = table[key / bsz];
        if (block >= 0 && block < s.num_blocks) row = block * s.block_size + key % bsz;
      }
      const uint32_t mask = __ballot_sync(0xffffffffu, row >= 0);
      if (lane == 0) vmask[warp][st] = mask;
      uint8_t* kt = ring + st * L::kStageBytes;
#pragma unroll
      for (int u = 0; u < L::kPieces; ++u) {  // 32 rows x kPieces pieces, a row's pieces on consecutive lanes
        const int i = u * 32 + lane, r = i / L::kPieces, c = i % L::kPieces;
        const int64_t rr = __shfl_sync(0xffffffffu, row, r);
        const int64_t at = (rr < 0 ? 0 : rr) * row_stride + kvh * D + 8 * c;
        cp_async16_zfill(kt + mma_tile_offset(r, c, kRowBytes), k_cache + at, rr >= 0);
        cp_async16_zfill(kt + L::kTileBytes + mma_tile_offset(r, c, kRowBytes), v_cache + at, rr >= 0);
      }
    };
#pragma unroll
    for (int st = 0; st < kMmaStages - 1; ++st) {
      if (st < mine) issue(st, st);
      cp_async_commit();
    }

    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // rows g and g + 8
    float acc[kNd][4];
#pragma unroll
    for (int nd = 0; nd < kNd; ++nd) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.0f;

    for (int j = 0; j < mine; ++j) {
      const int st = j % kMmaStages;
      if (j + kMmaStages - 1 < mine) issue(j + kMmaStages - 1, (j + kMmaStages - 1) % kMmaStages);
      cp_async_commit();  // possibly empty: keeps the group count in step
      cp_async_wait<kMmaStages - 1>();
      __syncwarp();  // every lane's copies of tile j (and its mask) visible to the warp
      const uint32_t mask = vmask[warp][st];
      const uint8_t* kt = ring + st * L::kStageBytes;
      const uint8_t* vt = kt + L::kTileBytes;

      // Scores: 4 n-tiles of 8 keys; per pair of k-steps one ldmatrix.x4 (keys nt*8 + lane % 8,
      // pieces 4 kp + lane / 8).
      float sc[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
        for (int kp = 0; kp < kKs / 2; ++kp) {
          uint32_t b[4];
          const int r = nt * 8 + (lane & 7);
          ldmatrix_x4(b, kt + mma_tile_offset(r, 4 * kp + (lane >> 3), kRowBytes));
          mma_bf16_16816(sc[nt], qa[2 * kp], b[0], b[1]);
          mma_bf16_16816(sc[nt], qa[2 * kp + 1], b[2], b[3]);
        }
      }
      // Online softmax per head row (g: elements 0, 1; g + 8: 2, 3), over this warp's keys; maxima
      // in log2 units like the scores (and the sink at the end).
      float p[4][4];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = nt * 8 + c2 + e;
            float& v = sc[nt][2 * half + e];
            v = (mask >> key) & 1u ? v * scale_log2 : -INFINITY;
            mx = fmaxf(mx, v);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float new_m = fmaxf(m_run[half], mx);
        const bool live = new_m != -INFINITY;  // -inf - -inf would be NaN
        const float corr = live ? exp2f(m_run[half] - new_m) : 1.0f;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = live ? exp2f(sc[nt][2 * half + e] - new_m) : 0.0f;
            p[nt][2 * half + e] = pv;
            sum += pv;
          }
        l_run[half] = l_run[half] * corr + sum;
        if (live) m_run[half] = new_m;
#pragma unroll
        for (int nd = 0; nd < kNd; ++nd) {
          acc[nd][2 * half] *= corr;
          acc[nd][2 * half + 1] *= corr;
        }
      }
      // p.v: two k-steps of 16 keys; p's accumulator layout is the A fragment's (n-tiles 2 kk and
      // 2 kk + 1 side by side); V rows by ldmatrix.trans (keys 16 kk + 8 (m % 2) + lane % 8,
      // pieces 2 dp + m / 2 for matrix m = lane / 8).
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const uint32_t pa[4] = {pack_bf16x2(p[2 * kk][0], p[2 * kk][1]), pack_bf16x2(p[2 * kk][2], p[2 * kk][3]),
                                pack_bf16x2(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                                pack_bf16x2(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        const int m = lane >> 3;
        const int r = 16 * kk + 8 * (m & 1) + (lane & 7);
#pragma unroll
        for (int dp = 0; dp < kNd / 2; ++dp) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vt + mma_tile_offset(r, 2 * dp + (m >> 1), kRowBytes));
          mma_bf16_16816(acc[2 * dp], pa, b[0], b[1]);
          mma_bf16_16816(acc[2 * dp + 1], pa, b[2], b[3]);
        }
      }
      __syncwarp();  // every lane done with stage st before a later tile is copied into it
    }
    cp_async_wait_all();

    // The 4 lanes of a row hold partial sums of its p: the row's sum.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      l_run[half] += __shfl_xor_sync(0xffffffffu, l_run[half], 1);
      l_run[half] += __shfl_xor_sync(0xffffffffu, l_run[half], 2);
    }
    __syncthreads();  // every warp is done with its ring: the combine reuses it
    float* cm = reinterpret_cast<float*>(mma_smem);  // [warp][head] running max
    float* cl = cm + kMmaWarps * kMmaHeads;           // [warp][head] sum
    float* ca = cl + kMmaWarps * kMmaHeads;           // [warp][head][D] accumulators
    if ((lane & 3) == 0) {
      cm[warp * kMmaHeads + g] = m_run[0];
      cm[warp * kMmaHeads + g + 8] = m_run[1];
      cl[warp * kMmaHeads + g] = l_run[0];
      cl[warp * kMmaHeads + g + 8] = l_run[1];
    }
#pragma unroll
    for (int nd = 0; nd < kNd; ++nd) {
      float* r0 = ca + (warp * kMmaHeads + g) * D + nd * 8 + c2;
      float* r1 = ca + (warp * kMmaHeads + g + 8) * D + nd * 8 + c2;
      r0[0] = acc[nd][0];
      r0[1] = acc[nd][1];
      r1[0] = acc[nd][2];
      r1[1] = acc[nd][3];
    }
    __syncthreads();
    // Each (head, 4 dimensions): the warps in order, weighted by exp(m_w - M); the sink (a logit
    // without a value) joins the maximum and the denominator; a row that saw nothing is zero.
    constexpr int kD4 = D / 4;
    for (int i = threadIdx.x; i < nh * kD4; i += kMmaWarps * 32) {
      const int h = i / kD4, d4 = i - h * kD4;
      // A split row's sink joins once, in the combine of its parts below.
      const bool sink = s.sinks != nullptr && len > 0 && !split;
      const float sv = sink ? s.sinks[h0 + h] * 1.4426950408889634f : -INFINITY;  // log2 units, as cm
      float M = sv;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) M = fmaxf(M, cm[w * kMmaHeads + h]);
      float l = sink && M != -INFINITY ? exp2f(sv - M) : 0.0f;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) {
        const float mw = cm[w * kMmaHeads + h];
        const float wt = mw == -INFINITY ? 0.0f : exp2f(mw - M);
        l += wt * cl[w * kMmaHeads + h];
        const float4 a = *reinterpret_cast<const float4*>(ca + (w * kMmaHeads + h) * D + 4 * d4);
        v.x += wt * a.x;
        v.y += wt * a.y;
        v.z += wt * a.z;
        v.w += wt * a.w;
      }
      if (split) {  // the part's unnormalized sum, its max (log2 units) and denominator
        reinterpret_cast<float4*>(sp.o + part_row(h, part) * D)[d4] = v;
        if (d4 == 0) {
          sp.ml[2 * part_row(h, part)] = M;
          sp.ml[2 * part_row(h, part) + 1] = l;
        }
        continue;
      }
      const float iv = l > 0.0f ? 1.0f / l : 0.0f;
      mma_store4(out, s, (t * s.q_heads + h0 + h) * D + 4 * d4, make_float4(v.x * iv, v.y * iv, v.z * iv, v.w * iv));
    }
  }  // parts
  if (!split) return;

  // The CTA that finishes a split row's last part combines its parts in part order, as the float4
  // kernel does (partials, a fence, a counter), in log2 units with exp2.
  __shared__ int last_s;
  __threadfence();
  __syncthreads();
  int32_t* counter = sp.counters + t * s.q_heads + h0;
  if (threadIdx.x == 0) {
    const int done = (plan.parts - 1 - static_cast<int>(blockIdx.z)) / static_cast<int>(gridDim.z) + 1;
    last_s = atomicAdd(counter, done) + done == plan.parts;
  }
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  constexpr int kD4 = D / 4;
  float* wts = reinterpret_cast<float*>(mma_smem);  // [head][part] weights, then [head] 1 / denominator
  float* inv = wts + kMmaHeads * kAttnMaxSplits;
  if (static_cast<int>(threadIdx.x) < nh) {
    const int h = threadIdx.x;
    const float sv = s.sinks != nullptr ? s.sinks[h0 + h] * 1.4426950408889634f : -INFINITY;
    float M = sv;
    for (int p = 0; p < plan.parts; ++p) M = fmaxf(M, __ldcg(sp.ml + 2 * part_row(h, p)));
    float l = s.sinks != nullptr && M != -INFINITY ? exp2f(sv - M) : 0.0f;
    for (int p = 0; p < plan.parts; ++p) {
      const float mp = __ldcg(sp.ml + 2 * part_row(h, p));
      const float w = mp == -INFINITY ? 0.0f : exp2f(mp - M);  // a part that saw nothing
      wts[h * kAttnMaxSplits + p] = w;
      l += w * __ldcg(sp.ml + 2 * part_row(h, p) + 1);
    }
    inv[h] = l > 0.0f ? 1.0f / l : 0.0f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nh * kD4; i += kMmaWarps * 32) {
    const int h = i / kD4, d4 = i - h * kD4;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int p = 0; p < plan.parts; ++p) {
      const float w = wts[h * kAttnMaxSplits + p];
      const float4 o = __ldcg(reinterpret_cast<const float4*>(sp.o + part_row(h, p) * D) + d4);
      v.x += w * o.x;
      v.y += w * o.y;
      v.z += w * o.z;
      v.w += w * o.w;
    }
    const float iv = inv[h];
    mma_store4(out, s, (t * s.q_heads + h0 + h) * D + 4 * d4, make_float4(v.x * iv, v.y * iv, v.z * iv, v.w * iv));
  }
  if (threadIdx.x == 0) *counter = 0;  // for the next launch (kernel boundaries order it)
}

// ROLLOUTD_ATTN_MMA=0: never the tensor-core kernel (an A/B; other bits, BF16-close); read once.
inline bool attn_mma_env() {
  static const bool on = env_int("ROLLOUTD_ATTN_MMA", 1) != 0;
  return on;
}
// ROLLOUTD_ATTN_MMA_FEW=0: unsplit grids of at most kAttnFewMaxCtas 8-head CTAs keep the float4
// kernel's 2-head CTAs (the rule before 2026-12-04; an A/B); read once.
inline bool attn_mma_few_env() {
  static const bool on = env_int("ROLLOUTD_ATTN_MMA_FEW", 1) != 0;
  return on;
}

}  // namespace

Status paged_attention(const ExecContext& ctx, TensorView out, TensorView q, TensorView k_cache,
                       TensorView v_cache, TensorView block_tables, TensorView seq_of,
                       TensorView ctx_len, float scale) {
  return paged_attention_ex(ctx, out, q, k_cache, v_cache, block_tables, seq_of, ctx_len, scale, AttentionOptions{});
}

Status paged_attention_ex(const ExecContext& ctx, TensorView out, TensorView q, TensorView k_cache,
                          TensorView v_cache, TensorView block_tables, TensorView seq_of,
                          TensorView ctx_len, float scale, const AttentionOptions& options) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCuda));
  RD_RETURN_IF_ERROR(op_checks::paged_attention_ex(ctx, out, q, k_cache, v_cache, block_tables,
                                                   seq_of, ctx_len, scale, options));
  const int64_t num_tokens = q.size(0);
  const AttentionShape s{q.size(1),       k_cache.size(2),      q.size(2),
                         k_cache.size(0), k_cache.size(1),      block_tables.size(0),
                         block_tables.size(1), scale,
                         options.sinks.data ? options.sinks.as<const float>() : nullptr, options.window,
                         0, out.dtype == DType::kBF16};
  if (s.head_dim > 512)
    return Status(ErrorCode::kUnimplemented,
                  "head dimension " + std::to_string(s.head_dim) +
                      " above 512 is not supported by the CUDA attention kernel",
                  "q");
  // kAttnFewHeads query heads per CTA while the grid with kAttnHeads would be at most
  // kAttnFewMaxCtas (decode steps of up to 8 tokens at 8 KV heads): more, shorter CTAs. At 32
  // tokens (256 CTAs of 8 heads) 8 heads measured faster: the 2-head grid's 1,024 CTAs of 168
  // registers did not fit one wave (tests/bench/NOTES.md, "Attention"). Each head's arithmetic is
  // the same either way (the heads of a CTA never mix; CudaBackend.AttentionRowsAreTheSameBits...).
  const int64_t per_kv = s.q_heads / s.kv_heads;
  const int64_t rows8 = num_tokens * s.kv_heads * ((per_kv + kAttnHeads - 1) / kAttnHeads);  // 8-head CTAs
  bool few = rows8 <= kAttnFewMaxCtas && per_kv > kAttnFewHeads;
  if (s.kv_heads * ((per_kv + (few ? kAttnFewHeads : kAttnHeads) - 1) / (few ? kAttnFewHeads : kAttnHeads)) > 65535 ||
      num_tokens > INT_MAX)
    return Status(ErrorCode::kUnimplemented, "attention grid too large", "q");
  if (num_tokens == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  // The float4 path: D % 4 == 0 and every row aligned for 4 values at a time (q 16 bytes, the
  // caches 16 (FP32) or 8 (BF16), an FP32 out 16, a BF16 out 8). Its p.v lanes are D / 4 rounded
  // up to a power of two.
  auto aligned = [](const TensorView& v, uintptr_t a) { return reinterpret_cast<uintptr_t>(v.data) % a == 0; };
  const bool kv_bf16 = k_cache.dtype == DType::kBF16;
  const size_t kv_bytes = kv_bf16 ? 2 : 4;
  const bool vec = s.head_dim % 4 == 0 && aligned(q, 16) && aligned(k_cache, 4 * kv_bytes) &&
                   aligned(v_cache, 4 * kv_bytes) && aligned(out, s.out_bf16 ? 8 : 16);
  // Otherwise lanes along the head dimension: D rounded up to a power of two (>= 32) up to 128,
  // the rest of the CTA's threads taking other keys; above 128 every thread takes ceil(D / 128)
  // dimensions.
  int dim_lanes = vec ? 1 : 32;
  const int64_t lanes_for = vec ? s.head_dim / 4 : s.head_dim;
  while (dim_lanes < lanes_for && dim_lanes < kAttnThreads) dim_lanes *= 2;
  const int per = vec ? 1 : static_cast<int>((s.head_dim + kAttnThreads - 1) / kAttnThreads);
  // Split rows (AttentionOptions::workspace): options.split_ctas (or ROLLOUTD_ATTN_SPLIT) CTAs
  // per row. Else only where the unsplit grid of kAttnHeads-head CTAs (the tensor-core kernel's:
  // kMmaHeads) is smaller than the GPU's SM count, CTAs per row a power of two that brings the
  // grid to kAttnSplitTargetWaves CTAs per SM (the tensor-core kernel holds 2 an SM; 4, 8 and 16
  // CTAs a row measured alike at p4096 batches 8 and 16). Either way at most the parts of the
  // longest row the tables can hold (after the window), so a layer whose rows are at most 256
  // keys (a window of 128) never splits. Larger grids stay unsplit: at 256 such CTAs (32 gpt-oss
  // tokens) a split step measured 6-8% slower (every part restarts the chunk loop and writes
  // partials; tests/bench/NOTES.md). Off on the scalar path.
  // A float4 split launch keeps kAttnHeads heads per CTA (every K/V row read once per GQA group) unless
  // even those CTAs times the most parts a row can have would not reach one per SM (one token at
  // gpt-oss's 8 KV heads): the parts give the parallelism that few heads gave.
  // The tensor-core kernel: BF16 caches at D = kMmaDim, rows 16-byte aligned, tables of fewer
  // than 2^31 positions; every such launch, split or unsplit as below (so that a request's BF16
  // rows never move between the two kernels' arithmetic with the size of its step).
  const bool mma_ok = kv_bf16 && s.head_dim == kMmaDim && vec && aligned(k_cache, 16) && aligned(v_cache, 16) &&
                      s.max_blocks * s.block_size < INT_MAX && attn_mma_env();
  const int64_t rows16 = num_tokens * s.kv_heads * ((per_kv + kMmaHeads - 1) / kMmaHeads);  // 16-head CTAs
  AttnSplit sp{nullptr, nullptr, nullptr, 0};
  const int64_t longest = s.window > 0 ? std::min(s.window, s.max_blocks * s.block_size) : s.max_blocks * s.block_size;
  const int max_parts = split_plan(longest).parts;
  if (vec && options.workspace.data != nullptr && max_parts > 1 && attn_split_env() != 0) {
    int sms = 0;
    RD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx.device.index));
    int ctas = options.split_ctas > 0 ? options.split_ctas : attn_split_env();
    const bool size_here = ctas <= 0;
    if (size_here) ctas = (mma_ok ? rows16 : rows8) < sms ? 1 : 0;  // 0: unsplit
    if (ctas > 0) {
      const int few_env = attn_split_few_env();
      if (few && (mma_ok || (few_env != 1 && (few_env == 0 || rows8 * max_parts >= sms)))) few = false;
      const int64_t rows = mma_ok ? rows16
                                  : num_tokens * s.kv_heads * ((per_kv + (few ? kAttnFewHeads : kAttnHeads) - 1) /
                                                               (few ? kAttnFewHeads : kAttnHeads));
      if (size_here)
        while (ctas < max_parts && rows * ctas < static_cast<int64_t>(kAttnSplitTargetWaves) * sms) ctas *= 2;
      sp.ctas = std::min(ctas, max_parts);
      // Laid out for the workspace's capacity C (the most tokens its size holds), not for this
      // launch's tokens: a workspace reused by steps of other sizes keeps its counters where the
      // last launch left them at zero, and never under another step's partials.
      auto* base = static_cast<uint8_t*>(options.workspace.data);
      const int64_t heads =
          paged_attention_workspace_tokens(options.workspace.size(0), s.q_heads, s.head_dim) * s.q_heads;
      sp.counters = reinterpret_cast<int32_t*>(base);
      sp.o = reinterpret_cast<float*>(base + paged_attention_workspace_counter_bytes(heads, 1));
      sp.ml = sp.o + heads * kAttnMaxSplits * s.head_dim;
    }
  }
  if (mma_ok && (sp.ctas > 0 || !few || attn_mma_few_env())) {
    using L = MmaLayout<kMmaDim>;
    AttentionShape sm = s;
    sm.head_groups = static_cast<int>((per_kv + kMmaHeads - 1) / kMmaHeads);
    const dim3 mgrid(static_cast<unsigned int>(num_tokens), static_cast<unsigned int>(s.kv_heads * sm.head_groups),
                     static_cast<unsigned int>(sp.ctas > 0 ? sp.ctas : 1));
    static std::atomic<uint64_t> opted{0};
    RD_RETURN_IF_ERROR(opt_in_smem(opted, paged_attention_mma_kernel<kMmaDim>, L::kBytes, ctx.device.index));
    (void)launch_dependent(paged_attention_mma_kernel<kMmaDim>, mgrid, kMmaWarps * 32, L::kBytes, stream_of(ctx),
                           out.data, q.as<const float>(), k_cache.as<const uint16_t>(), v_cache.as<const uint16_t>(),
                           block_tables.as<const int32_t>(), seq_of.as<const int32_t>(), ctx_len.as<const int32_t>(),
                           sm, sp);
    RD_CUDA_CHECK_LAUNCH("paged_attention_mma_kernel");
    return Status::Ok();
  }
  const int heads = few ? kAttnFewHeads : kAttnHeads;
  AttentionShape sh = s;
  sh.head_groups = static_cast<int>((per_kv + heads - 1) / heads);
  const dim3 grid(static_cast<unsigned int>(num_tokens), static_cast<unsigned int>(s.kv_heads * sh.head_groups),
                  static_cast<unsigned int>(sp.ctas > 0 ? sp.ctas : 1));
  // kSmemV: the float4 path at D <= kAttnSmemVMaxDim whose rows are a power of two of 16-byte
  // pieces (D / 4 for FP32, D / 8 for BF16) from 16-byte aligned caches (cp.async 16).
  const int64_t pieces = s.head_dim * static_cast<int64_t>(kv_bytes) / 16;
  const bool smem_v = vec && s.head_dim <= kAttnSmemVMaxDim && s.head_dim * static_cast<int64_t>(kv_bytes) % 16 == 0 &&
                      pieces > 0 && (pieces & (pieces - 1)) == 0 && aligned(k_cache, 16) && aligned(v_cache, 16) &&
                      attn_smem_v_env();
  const size_t smem = smem_v ? static_cast<size_t>(kAttnChunk) * s.head_dim * kv_bytes : 0;
  // kKPre where the grid has at most two CTAs an SM (its occupancy) and a row can span chunks.
  bool k_pre = false;
  if (smem_v && longest > kAttnChunk && attn_k_prefetch_env()) {
    int sms = 0;
    RD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx.device.index));
    k_pre = static_cast<int64_t>(grid.x) * grid.y * grid.z <= 2 * static_cast<int64_t>(sms);
  }
  auto launch = [&](auto kernel, auto kv) {
    using KV = typename decltype(kv)::type;
    (void)launch_dependent(kernel, grid, kAttnThreads, smem, stream_of(ctx), out.data, q.as<const float>(),
                           k_cache.as<const KV>(), v_cache.as<const KV>(), block_tables.as<const int32_t>(),
                           seq_of.as<const int32_t>(), ctx_len.as<const int32_t>(), sh, dim_lanes, sp);
  };
  auto launch_heads = [&](auto kh, auto kv) -> Status {
    constexpr int kH = decltype(kh)::value;
    using KV = typename decltype(kv)::type;
    if (smem_v) {
      // Opted in at the most any head dimension asks (above 48 KiB with the static part); one
      // mask per kernel (statics: this lambda is instantiated once per kH and KV).
      const int bytes = static_cast<int>(kAttnChunk * kAttnSmemVMaxDim * sizeof(KV));
      if (k_pre) {
        static std::atomic<uint64_t> opted{0};
        RD_RETURN_IF_ERROR(
            opt_in_smem(opted, paged_attention_kernel<KV, kH, 1, true, true, true>, bytes, ctx.device.index));
        launch(paged_attention_kernel<KV, kH, 1, true, true, true>, kv);
      } else {
        static std::atomic<uint64_t> opted{0};
        RD_RETURN_IF_ERROR(opt_in_smem(opted, paged_attention_kernel<KV, kH, 1, true, true>, bytes, ctx.device.index));
        launch(paged_attention_kernel<KV, kH, 1, true, true>, kv);
      }
    } else if (vec) {
      launch(paged_attention_kernel<KV, kH, 1, true>, kv);
    } else if (per <= 1) {
      launch(paged_attention_kernel<KV, kH, 1, false>, kv);
    } else if (per <= 2) {
      launch(paged_attention_kernel<KV, kH, 2, false>, kv);
    } else {
      launch(paged_attention_kernel<KV, kH, 4, false>, kv);
    }
    return Status::Ok();
  };
  // BF16 caches: their bits (uint16_t), widened to FP32 as read.
  auto launch_kv = [&](auto kv) -> Status {
    if (few) return launch_heads(std::integral_constant<int, kAttnFewHeads>{}, kv);
    return launch_heads(std::integral_constant<int, kAttnHeads>{}, kv);
  };
  if (kv_bf16) RD_RETURN_IF_ERROR(launch_kv(std::type_identity<uint16_t>{}));
  else RD_RETURN_IF_ERROR(launch_kv(std::type_identity<float>{}));
  RD_CUDA_CHECK_LAUNCH("paged_attention_kernel");
  return Status::Ok();
}

}  // namespace rolloutd::cuda
