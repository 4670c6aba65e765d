// CPU reference of causal attention over the paged KV cache (FP32 or BF16 caches): two passes
// per (token, head), scores then softmax-weighted sum of values, all in FP32. Optional learned sinks and
// sliding window (gpt-oss).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/bf16.hpp"
#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/op_checks.hpp"

namespace rolloutd::cpu {

Status paged_attention(const ExecContext& ctx, TensorView out, TensorView q, TensorView k_cache,
                       TensorView v_cache, TensorView block_tables, TensorView seq_of,
                       TensorView ctx_len, float scale) {
  return paged_attention_ex(ctx, out, q, k_cache, v_cache, block_tables, seq_of, ctx_len, scale, AttentionOptions{});
}

Status paged_attention_ex(const ExecContext& ctx, TensorView out, TensorView q, TensorView k_cache,
                          TensorView v_cache, TensorView block_tables, TensorView seq_of,
                          TensorView ctx_len, float scale, const AttentionOptions& options) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCpu));
  RD_RETURN_IF_ERROR(op_checks::paged_attention_ex(ctx, out, q, k_cache, v_cache, block_tables,
                                                   seq_of, ctx_len, scale, options));
  const float* sinks = options.sinks.data ? options.sinks.as<const float>() : nullptr;
  const int64_t window = options.window;
  // The first cache position token t sees: the last `window` positions of its context.
  auto first_visible = [&](int64_t n) { return window > 0 && n > window ? n - window : int64_t{0}; };
  const int64_t num_tokens = q.size(0), q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t kv_heads = k_cache.size(2);
  const int64_t num_seqs = block_tables.size(0), max_blocks = block_tables.size(1);
  const int32_t* table = block_tables.as<const int32_t>();
  const int32_t* seq = seq_of.as<const int32_t>();
  const int32_t* len = ctx_len.as<const int32_t>();

  // Every index this call will follow, before any output is written: a bad block id is
  // reported instead of reading outside the cache.
  int64_t longest = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (seq[t] < 0 || seq[t] >= num_seqs)
      return Status(ErrorCode::kOutOfRange,
                    "sequence " + std::to_string(seq[t]) + " of token " + std::to_string(t) +
                        " outside [0, " + std::to_string(num_seqs) + ")",
                    "seq_of");
    if (len[t] < 0 || len[t] > max_blocks * block_size)
      return Status(ErrorCode::kOutOfRange,
                    "context length " + std::to_string(len[t]) + " of token " +
                        std::to_string(t) + " outside [0, " +
                        std::to_string(max_blocks * block_size) + "]",
                    "ctx_len");
    const int64_t used_blocks = (len[t] + block_size - 1) / block_size;
    for (int64_t j = first_visible(len[t]) / block_size; j < used_blocks; ++j) {
      const int32_t b = table[seq[t] * max_blocks + j];
      if (b < 0 || b >= num_blocks)
        return Status(ErrorCode::kOutOfRange,
                      "block id " + std::to_string(b) + " at [" + std::to_string(seq[t]) +
                          ", " + std::to_string(j) + "] outside [0, " +
                          std::to_string(num_blocks) + ")",
                      "block_tables");
    }
    longest = std::max<int64_t>(longest, len[t]);
  }

  const int64_t group = q_heads / kv_heads;  // GQA: query heads sharing one kv head
  std::vector<float> score(static_cast<size_t>(longest));
  std::vector<float> acc(static_cast<size_t>(head_dim));
  std::vector<float> row(static_cast<size_t>(head_dim));  // one output row before it is stored
  // BF16 caches (kv_store's rounding): each row widened to FP32 once as it is read; the
  // arithmetic is the FP32 path's.
  const bool cache_bf16 = k_cache.dtype == DType::kBF16;
  std::vector<float> wide(static_cast<size_t>(cache_bf16 ? head_dim : 0));
  // A BF16 output holds the FP32 row rounded once (kernels/bf16.hpp), as a convert would.
  const bool out_bf16 = out.dtype == DType::kBF16;
  auto store = [&](int64_t t, int64_t h) {
    const int64_t base = (t * q_heads + h) * head_dim;
    if (out_bf16) {
      uint16_t* o = out.as<uint16_t>() + base;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = f32_to_bf16_bits(row[static_cast<size_t>(d)]);
    } else {
      std::copy(row.begin(), row.end(), out.as<float>() + base);
    }
  };
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t* row_table = table + seq[t] * max_blocks;
    const int64_t n = len[t];
    for (int64_t h = 0; h < q_heads; ++h) {
      const float* qr = q.as<const float>() + (t * q_heads + h) * head_dim;
      // A token that sees nothing (a padding row) gets zeros, not a 0/0.
      if (n == 0) {
        std::fill(row.begin(), row.end(), 0.0f);
        store(t, h);
        continue;
      }
      const int64_t kvh = h / group;
      auto cache_row = [&](const TensorView& cache, int64_t j) -> const float* {
        const int64_t slot = static_cast<int64_t>(row_table[j / block_size]) * block_size +
                             j % block_size;
        const int64_t at = (slot * kv_heads + kvh) * head_dim;
        if (!cache_bf16) return cache.as<const float>() + at;
        const uint16_t* r = cache.as<const uint16_t>() + at;
        for (int64_t d = 0; d < head_dim; ++d) wide[static_cast<size_t>(d)] = bf16_bits_to_f32(r[d]);
        return wide.data();
      };
      const int64_t j0 = first_visible(n);
      // A sink joins the softmax as one more logit with no value (Hugging Face's gpt-oss
      // eager attention: concatenate, subtract the max, softmax, drop the sink's column).
      float max_score = sinks ? sinks[h] : -INFINITY;
      for (int64_t j = j0; j < n; ++j) {
        score[static_cast<size_t>(j)] = dot(qr, cache_row(k_cache, j), head_dim) * scale;
        max_score = std::max(max_score, score[static_cast<size_t>(j)]);
      }
      float sum = sinks ? std::exp(sinks[h] - max_score) : 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = j0; j < n; ++j) {
        const float p = std::exp(score[static_cast<size_t>(j)] - max_score);
        sum += p;
        const float* vr = cache_row(v_cache, j);
        for (int64_t d = 0; d < head_dim; ++d) acc[static_cast<size_t>(d)] += p * vr[d];
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < head_dim; ++d) row[static_cast<size_t>(d)] = acc[static_cast<size_t>(d)] * inv;
      store(t, h);
    }
  }
  return Status::Ok();
}

}  // namespace rolloutd::cpu
