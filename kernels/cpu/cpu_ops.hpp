#pragma once
// The CPU reference ops, one definition per op of the Backend table (cpu_backend.cpp
// assembles the table). Internal to kernels/cpu/.
#include <cstdint>

#include "kernels/backend.hpp"

namespace rolloutd::cpu {

// FP32 dot product with eight independent partial sums: the compiler can keep them in
// one vector register, and the reference stays deterministic (fixed summation order).
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

Status embedding(const ExecContext&, TensorView out, TensorView table, TensorView ids);
Status rmsnorm(const ExecContext&, TensorView out, TensorView x, TensorView w, float eps);
Status linear(const ExecContext&, TensorView y, TensorView x, TensorView w);
Status add(const ExecContext&, TensorView out, TensorView a, TensorView b);
Status rope(const ExecContext&, TensorView x, TensorView positions, float theta);
Status kv_store(const ExecContext&, TensorView k_cache, TensorView v_cache, TensorView k,
                TensorView v, TensorView slot_mapping);
Status paged_attention(const ExecContext&, TensorView out, TensorView q, TensorView k_cache,
                       TensorView v_cache, TensorView block_tables, TensorView seq_of,
                       TensorView ctx_len, float scale);
Status paged_attention_ex(const ExecContext&, TensorView out, TensorView q, TensorView k_cache,
                          TensorView v_cache, TensorView block_tables, TensorView seq_of,
                          TensorView ctx_len, float scale, const AttentionOptions& options);
Status rope_table(const ExecContext&, TensorView x, TensorView positions, TensorView inv_freq, float scale);
Status add_bias(const ExecContext&, TensorView y, TensorView bias);
Status transpose(const ExecContext&, TensorView dst, TensorView src);
Status router_softmax_topk(const ExecContext&, TensorView ids, TensorView weights,
                           TensorView logits, bool renormalize);
Status moe_experts(const ExecContext&, const MoeExpertsArgs& args);

Status add_rmsnorm(const ExecContext&, TensorView out, TensorView out_bf16, TensorView h, TensorView r,
                   TensorView r_bias, TensorView w, float eps);
Status rope_qk(const ExecContext&, const RopeQkArgs& args);
Status router(const ExecContext&, const RouterArgs& args);

Status convert(const ExecContext&, void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t n);

}  // namespace rolloutd::cpu
