// CUDA twin of paged causal attention, with an optional learned sink per head in the
// denominator (gpt-oss) and a sliding window (the last `window` positions of the context).
//
// One CTA of 128 threads per (token, query head). The context is taken in chunks of
// kAttnChunk keys: every thread scores its keys (the whole q . k dot product in registers,
// q broadcast from shared memory), the CTA reduces the chunk's max and sum, then thread
// (group g, dimension d) accumulates p_j * v_j[d] over the chunk's keys j = g (mod groups),
// coalesced along d; a running max rescales the accumulators between chunks (online softmax at
// chunk granularity). At decode (one token, tens to thousands of keys) the keys of a head run in
// parallel instead of one after another, which is what the first kernel (one warp per
// (token, head), one key at a time: ~25 us per layer at 48 keys) spent its time on.
// A (token, head)'s result does not depend on the other rows of the step, so a request gets
// the same output alone or in any batch.
//
// Index values are on the device and not checked on the host: a token whose sequence id is
// outside [0, S) gets a zero row, ctx_len is clamped to [0, max_blocks * block_size], and
// positions whose block id is outside [0, blocks) are skipped. Nothing is read out of bounds.
#include <climits>
#include <cmath>
#include <cstdint>

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
};

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnChunk = 2 * kAttnThreads;  // keys per chunk: two per thread
constexpr int kAttnMaxDim = 512;

__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
  v = is_max ? warp_max(v) : warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // red[] may still be read by the previous reduction
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int w = 1; w < kAttnWarps; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

// kPer: head dimensions per thread in the p.v phase (1 for D <= 128, else ceil(D / 128));
// kVec: D % 4 == 0 and 16-byte aligned rows, so q.k reads float4.
template <int kPer, bool kVec>
__global__ void __launch_bounds__(kAttnThreads)
    paged_attention_kernel(float* __restrict__ out, const float* __restrict__ q,
                           const float* __restrict__ k_cache, const float* __restrict__ v_cache,
                           const int32_t* __restrict__ block_tables,
                           const int32_t* __restrict__ seq_of, const int32_t* __restrict__ ctx_len,
                           AttentionShape s, int dim_lanes) {
  __shared__ __align__(16) float q_s[kAttnMaxDim];
  __shared__ float p_s[kAttnChunk];
  __shared__ int64_t row_s[kAttnChunk];  // cache row (block * block_size + offset) of a key, -1: skipped
  __shared__ float red[kAttnWarps];
  __shared__ float acc_s[kAttnThreads * kPer];
  const int64_t t = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int tid = threadIdx.x;
  const int64_t D = s.head_dim;
  const int64_t kvh = h / (s.q_heads / s.kv_heads);
  const float* qr = q + (t * s.q_heads + h) * D;
  float* orow = out + (t * s.q_heads + h) * D;
  for (int64_t d = tid; d < D; d += kAttnThreads) q_s[d] = qr[d];

  const int64_t seq = seq_of[t];
  int64_t len = ctx_len[t];
  if (seq < 0 || seq >= s.num_seqs) len = 0;
  len = len < 0 ? 0 : (len > s.max_blocks * s.block_size ? s.max_blocks * s.block_size : len);
  const int32_t* table = block_tables + (len > 0 ? seq * s.max_blocks : 0);
  const int64_t first = s.window > 0 && len > s.window ? len - s.window : 0;
  const int64_t row_stride = s.kv_heads * D;  // floats between consecutive cache rows

  // p.v layout: thread = (group g, lane d0); dims d0 + dim_lanes * i, keys j = g (mod groups).
  const int groups = kAttnThreads / dim_lanes;
  const int g = tid / dim_lanes, d0 = tid - g * dim_lanes;
  float acc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) acc[i] = 0.0f;
  // A sink is one more logit with no value: it starts the running max and the denominator.
  float running_max = s.sinks && len > 0 ? s.sinks[h] : -INFINITY;
  float denom = s.sinks && len > 0 ? 1.0f : 0.0f;  // sum of exp(score - running_max)
  __syncthreads();  // q_s

  for (int64_t c0 = first; c0 < len; c0 += kAttnChunk) {
    const int n = len - c0 < kAttnChunk ? static_cast<int>(len - c0) : kAttnChunk;
    float local_max = -INFINITY;
    float score[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int jj = tid + r * kAttnThreads;
      score[r] = -INFINITY;
      int64_t row = -1;
      if (jj < n) {
        const int64_t j = c0 + jj;
        const int64_t block = table[j / s.block_size];
        if (block >= 0 && block < s.num_blocks) {
          row = block * s.block_size + j % s.block_size;
          const float* kr = k_cache + row * row_stride + kvh * D;
          float dot = 0.0f;
          if constexpr (kVec) {
            const float4* k4 = reinterpret_cast<const float4*>(kr);
            const float4* q4 = reinterpret_cast<const float4*>(q_s);
            const int n4 = static_cast<int>(D / 4);
#pragma unroll 16
            for (int i = 0; i < n4; ++i) {
              const float4 a = __ldg(k4 + i), b = q4[i];
              dot += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
          } else {
#pragma unroll 8
            for (int d = 0; d < static_cast<int>(D); ++d) dot += __ldg(kr + d) * q_s[d];
          }
          score[r] = dot * s.scale;
          local_max = fmaxf(local_max, score[r]);
        }
      }
      row_s[jj] = row;
    }
    const float chunk_max = block_reduce(local_max, red, true);
    const float new_max = fmaxf(running_max, chunk_max);
    // Every key so far skipped and no sink: nothing to add (and -inf - -inf would be NaN).
    if (new_max == -INFINITY) continue;
    const float correction = expf(running_max - new_max);  // 0 while running_max is -inf
    float local_sum = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int jj = tid + r * kAttnThreads;
      const float p = jj < n ? expf(score[r] - new_max) : 0.0f;  // exp(-inf) = 0 for skipped keys
      p_s[jj] = p;
      local_sum += p;
    }
    denom = denom * correction + block_reduce(local_sum, red, false);  // its barriers publish p_s, row_s
    running_max = new_max;
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[i] *= correction;
    if (d0 < D) {
#pragma unroll 4
      for (int jj = g; jj < n; jj += groups) {
        const int64_t row = row_s[jj];
        if (row < 0) continue;
        const float p = p_s[jj];
        const float* vr = v_cache + row * row_stride + kvh * D;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int64_t d = d0 + static_cast<int64_t>(dim_lanes) * i;
          if (d < D) acc[i] += p * __ldg(vr + d);
        }
      }
    }
    __syncthreads();  // p_s and row_s are rewritten by the next chunk
  }
  // Groups' partial sums, added in group order; a row that saw nothing is zero, not 0/0.
#pragma unroll
  for (int i = 0; i < kPer; ++i) acc_s[i * kAttnThreads + tid] = acc[i];
  __syncthreads();
  const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
  if (g == 0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t d = d0 + static_cast<int64_t>(dim_lanes) * i;
      if (d >= D) continue;
      float v = acc_s[i * kAttnThreads + d0];
      for (int gg = 1; gg < groups; ++gg) v += acc_s[i * kAttnThreads + gg * dim_lanes + d0];
      orow[d] = v * inv;
    }
  }
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
                         options.sinks.data ? options.sinks.as<const float>() : nullptr, options.window};
  if (s.head_dim > 512)
    return Status(ErrorCode::kUnimplemented,
                  "head dimension " + std::to_string(s.head_dim) +
                      " above 512 is not supported by the CUDA attention kernel",
                  "q");
  if (s.q_heads > 65535 || num_tokens > INT_MAX)
    return Status(ErrorCode::kUnimplemented, "attention grid too large", "q");
  if (num_tokens == 0) return Status::Ok();
  DeviceGuard guard;
  RD_RETURN_IF_ERROR(guard.set(ctx.device.index));
  const dim3 grid(static_cast<unsigned int>(num_tokens), static_cast<unsigned int>(s.q_heads));
  // Lanes along the head dimension in the p.v phase: D rounded up to a power of two (>= 32) up
  // to 128, the rest of the CTA's threads taking other keys; above 128 every thread takes
  // ceil(D / 128) dimensions.
  int dim_lanes = 32;
  while (dim_lanes < s.head_dim && dim_lanes < kAttnThreads) dim_lanes *= 2;
  const int per = static_cast<int>((s.head_dim + kAttnThreads - 1) / kAttnThreads);
  const bool vec = s.head_dim % 4 == 0 && reinterpret_cast<uintptr_t>(k_cache.data) % 16 == 0;
  auto launch = [&](auto kernel) {
    kernel<<<grid, kAttnThreads, 0, stream_of(ctx)>>>(out.as<float>(), q.as<const float>(),
                                                      k_cache.as<const float>(), v_cache.as<const float>(),
                                                      block_tables.as<const int32_t>(),
                                                      seq_of.as<const int32_t>(),
                                                      ctx_len.as<const int32_t>(), s, dim_lanes);
  };
  if (per <= 1) vec ? launch(paged_attention_kernel<1, true>) : launch(paged_attention_kernel<1, false>);
  else if (per <= 2) vec ? launch(paged_attention_kernel<2, true>) : launch(paged_attention_kernel<2, false>);
  else vec ? launch(paged_attention_kernel<4, true>) : launch(paged_attention_kernel<4, false>);
  RD_CUDA_CHECK_LAUNCH("paged_attention_kernel");
  return Status::Ok();
}

}  // namespace rolloutd::cuda
