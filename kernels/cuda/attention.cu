// CUDA twin of paged causal attention: one warp per (token, query head), online softmax
// over the token's context (or its last `window` positions), one key at a time, with an
// optional learned sink per head in the denominator (gpt-oss). Simple and exact; the fast decode and
// prefill kernels come later and are checked against this one and the CPU reference.
//
// Index values are on the device and not checked on the host: a token whose sequence id is
// outside [0, S) gets a zero row, ctx_len is clamped to [0, max_blocks * block_size], and
// positions whose block id is outside [0, blocks) are skipped. Nothing is read out of bounds.
#include <climits>
#include <cmath>

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

// Lane l owns head dimensions l, l + 32, ...: kPerLane of them, held in registers.
template <int kPerLane>
__global__ void __launch_bounds__(32)
    paged_attention_kernel(float* __restrict__ out, const float* __restrict__ q,
                           const float* __restrict__ k_cache, const float* __restrict__ v_cache,
                           const int32_t* __restrict__ block_tables,
                           const int32_t* __restrict__ seq_of, const int32_t* __restrict__ ctx_len,
                           AttentionShape s) {
  const int64_t t = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int lane = threadIdx.x;
  const int64_t kvh = h / (s.q_heads / s.kv_heads);
  const float* qr = q + (t * s.q_heads + h) * s.head_dim;
  float* orow = out + (t * s.q_heads + h) * s.head_dim;

  float qv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t d = lane + 32 * i;
    qv[i] = d < s.head_dim ? qr[d] : 0.0f;
    acc[i] = 0.0f;
  }

  const int64_t seq = seq_of[t];
  int64_t len = ctx_len[t];
  if (seq < 0 || seq >= s.num_seqs) len = 0;
  len = len < 0 ? 0 : (len > s.max_blocks * s.block_size ? s.max_blocks * s.block_size : len);
  const int32_t* table = block_tables + (len > 0 ? seq * s.max_blocks : 0);

  // A sink is one more logit with no value: it starts the running max and the denominator.
  float running_max = s.sinks && len > 0 ? s.sinks[h] : -INFINITY;
  float denom = s.sinks && len > 0 ? 1.0f : 0.0f;  // exp(sink - running_max)
  const int64_t first = s.window > 0 && len > s.window ? len - s.window : 0;
  for (int64_t j = first; j < len; ++j) {
    const int64_t block = table[j / s.block_size];
    if (block < 0 || block >= s.num_blocks) continue;  // uniform across the warp
    const int64_t base =
        ((block * s.block_size + j % s.block_size) * s.kv_heads + kvh) * s.head_dim;
    float partial = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < s.head_dim) partial += qv[i] * k_cache[base + d];
    }
    const float score = warp_sum(partial) * s.scale;
    const float new_max = fmaxf(running_max, score);
    const float correction = expf(running_max - new_max);  // 0 on the first key
    const float p = expf(score - new_max);
    denom = denom * correction + p;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t d = lane + 32 * i;
      const float vv = d < s.head_dim ? v_cache[base + d] : 0.0f;
      acc[i] = acc[i] * correction + p * vv;
    }
    running_max = new_max;
  }
  // A row that saw nothing (padding, or every block skipped) is zero, not 0/0.
  const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t d = lane + 32 * i;
    if (d < s.head_dim) orow[d] = acc[i] * inv;
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
  const int per_lane = static_cast<int>((s.head_dim + 31) / 32);
  auto launch = [&](auto kernel) {
    kernel<<<grid, 32, 0, stream_of(ctx)>>>(out.as<float>(), q.as<const float>(),
                                             k_cache.as<const float>(), v_cache.as<const float>(),
                                             block_tables.as<const int32_t>(),
                                             seq_of.as<const int32_t>(),
                                             ctx_len.as<const int32_t>(), s);
  };
  // Registers per lane are a compile-time count: round the head dimension up to 32, 64,
  // 128, 256 or 512 (lanes past head_dim idle).
  if (per_lane <= 1) launch(paged_attention_kernel<1>);
  else if (per_lane <= 2) launch(paged_attention_kernel<2>);
  else if (per_lane <= 4) launch(paged_attention_kernel<4>);
  else if (per_lane <= 8) launch(paged_attention_kernel<8>);
  else launch(paged_attention_kernel<16>);
  RD_CUDA_CHECK_LAUNCH("paged_attention_kernel");
  return Status::Ok();
}

}  // namespace rolloutd::cuda
