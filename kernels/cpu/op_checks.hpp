#pragma once
// Argument checks for every op of the backend seam: device, dtype, rank, shape and
// contiguity of each view, before any element is read. The CPU reference defines what a
// valid call is; the CUDA backend runs these same checks on the host before a launch, so
// both backends reject a bad call with the same code and field.
//
// Value checks (ids inside their range) need the data and therefore stay with each
// backend: the CPU one reads them, the CUDA one cannot without a synchronisation.
#include "kernels/backend.hpp"

namespace rolloutd::op_checks {

// The context must name a device of the backend's kind.
Status context(const ExecContext& ctx, DeviceKind backend_kind);

Status embedding(const ExecContext& ctx, const TensorView& out, const TensorView& table,
                 const TensorView& ids);
Status rmsnorm(const ExecContext& ctx, const TensorView& out, const TensorView& x,
               const TensorView& w, float eps);
Status linear(const ExecContext& ctx, const TensorView& y, const TensorView& x,
              const TensorView& w);
Status add(const ExecContext& ctx, const TensorView& out, const TensorView& a,
           const TensorView& b);
Status rope(const ExecContext& ctx, const TensorView& x, const TensorView& positions,
            float theta);
Status kv_store(const ExecContext& ctx, const TensorView& k_cache, const TensorView& v_cache,
                const TensorView& k, const TensorView& v, const TensorView& slot_mapping);
// paged_attention: q f32 [T, QH, D], caches f32 or bf16 (both) [blocks, block_size, KVH, D] (QH a multiple of
// KVH), out f32 or bf16 of q's shape overlapping none of the inputs, block_tables i32
// [S, max_blocks], seq_of and ctx_len i32 [T], scale finite.
Status paged_attention(const ExecContext& ctx, const TensorView& out, const TensorView& q,
                       const TensorView& k_cache, const TensorView& v_cache,
                       const TensorView& block_tables, const TensorView& seq_of,
                       const TensorView& ctx_len, float scale);
// paged_attention's checks plus the options': sinks f32 [QH] when given, window >= 0.
Status paged_attention_ex(const ExecContext& ctx, const TensorView& out, const TensorView& q,
                          const TensorView& k_cache, const TensorView& v_cache,
                          const TensorView& block_tables, const TensorView& seq_of,
                          const TensorView& ctx_len, float scale, const AttentionOptions& options);
Status rope_table(const ExecContext& ctx, const TensorView& x, const TensorView& positions,
                  const TensorView& inv_freq, float scale);
// add_rmsnorm: h f32 [..., H] (H > 0), r empty or h's shape, r_bias empty or f32 [H] (only with
// r), w f32 [H], out empty or f32 of h's shape, out_bf16 empty or bf16 of h's shape, eps as
// rmsnorm's; r, r_bias, out_bf16 and w never overlap h or out, out may alias h only exactly.
Status add_rmsnorm(const ExecContext& ctx, const TensorView& out, const TensorView& out_bf16,
                   const TensorView& h, const TensorView& r, const TensorView& r_bias, const TensorView& w,
                   float eps);
// rope_qk: rope's checks on q and on k (rope_table's with inv_freq), k's T and D equal to q's,
// scale finite and > 0, the norm weights both given or neither (f32 [D], eps as rmsnorm's);
// qkv and v both or neither: qkv f32 [T, (QH + 2 KVH) * D], v f32 [T, KVH, D], neither
// overlapping q, k or each other; q_bias, k_bias, v_bias all or none, only with qkv, f32
// [QH * D], [KVH * D], [KVH * D], none overlapping q, k or v.
Status rope_qk(const ExecContext& ctx, const RopeQkArgs& args);
Status add_bias(const ExecContext& ctx, const TensorView& y, const TensorView& bias);
Status transpose(const ExecContext& ctx, const TensorView& dst, const TensorView& src);
// router: see Backend::router.
Status router(const ExecContext& ctx, const RouterArgs& args);
Status router_softmax_topk(const ExecContext& ctx, const TensorView& ids,
                           const TensorView& weights, const TensorView& logits);
Status moe_experts(const ExecContext& ctx, const MoeExpertsArgs& args);
Status copy_valid_rows(const ExecContext& ctx, const TensorView& dst, const TensorView& src,
                       const TensorView& count);
Status sample(const ExecContext& ctx, const SampleArgs& args);
// Backend::copy_3d's shape: row pitches >= width, each slice pitch a multiple of its row
// pitch holding `height` rows.
Status copy_3d_shape(size_t dst_pitch, size_t dst_slice_pitch, size_t src_pitch, size_t src_slice_pitch,
                     size_t width, size_t height);

// Rows of `args.x` that are real tokens: num_valid_tokens, or every row when it is -1 (the
// device count, when given, is read by each backend on top of this).
// Only meaningful after moe_experts() accepted the arguments.
int64_t moe_valid_rows(const MoeExpertsArgs& args);

}  // namespace rolloutd::op_checks
