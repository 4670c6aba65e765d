#pragma once
// The CUDA twins of the CPU reference ops, one host entry point per op of the Backend
// table (cuda_backend.cu assembles the table). Each validates its views on the host with
// kernels/cpu/op_checks.hpp, then launches on the context's stream and returns without
// waiting. Internal to kernels/cuda/.
#include "kernels/backend.hpp"

namespace rolloutd::cuda {

// elementwise.cu
Status embedding(const ExecContext&, TensorView out, TensorView table, TensorView ids);
Status rmsnorm(const ExecContext&, TensorView out, TensorView x, TensorView w, float eps);
Status add(const ExecContext&, TensorView out, TensorView a, TensorView b);
Status rope(const ExecContext&, TensorView x, TensorView positions, float theta);
Status kv_store(const ExecContext&, TensorView k_cache, TensorView v_cache, TensorView k,
                TensorView v, TensorView slot_mapping);
// cuda_backend.cu (cuBLAS)
Status linear(const ExecContext&, TensorView y, TensorView x, TensorView w);
// linear_decode.cu: linear's BF16 path at decode shapes (1-4 rows of x, K % 8 == 0, N <= 8192,
// 16-byte aligned operands), which linear takes when linear_decode_applies(); the views already
// checked. ROLLOUTD_DENSE_DECODE=0 (read once) turns it off.
bool linear_decode_applies(const TensorView& y, const TensorView& x, const TensorView& w);
Status linear_decode(const ExecContext&, TensorView y, TensorView x, TensorView w);
// attention.cu
Status paged_attention(const ExecContext&, TensorView out, TensorView q, TensorView k_cache,
                       TensorView v_cache, TensorView block_tables, TensorView seq_of,
                       TensorView ctx_len, float scale);
// moe.cu
Status router_softmax_topk(const ExecContext&, TensorView ids, TensorView weights,
                           TensorView logits, bool renormalize);
Status moe_experts(const ExecContext&, const MoeExpertsArgs& args);
// attention.cu
Status paged_attention_ex(const ExecContext&, TensorView out, TensorView q, TensorView k_cache,
                          TensorView v_cache, TensorView block_tables, TensorView seq_of,
                          TensorView ctx_len, float scale, const AttentionOptions& options);
// elementwise.cu
Status rope_table(const ExecContext&, TensorView x, TensorView positions, TensorView inv_freq, float scale);
Status add_bias(const ExecContext&, TensorView y, TensorView bias);
Status transpose(const ExecContext&, TensorView dst, TensorView src);
Status copy_valid_rows(const ExecContext&, TensorView dst, TensorView src, TensorView count, int32_t fill);
Status add_rmsnorm(const ExecContext&, TensorView out, TensorView out_bf16, TensorView h, TensorView r,
                   TensorView r_bias, TensorView w, float eps);
Status rope_qk(const ExecContext&, const RopeQkArgs& args);
Status router(const ExecContext&, const RouterArgs& args);
// Backend::router takes one launch up to this many tokens (decode steps), cuBLAS + two kernels above.
inline constexpr int64_t kRouterFusedMaxTokens = 64;
Status convert(const ExecContext&, void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t n);
// sampling.cu
Status sample(const ExecContext&, const SampleArgs& args);

}  // namespace rolloutd::cuda
