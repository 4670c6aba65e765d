#include "kernels/cpu/op_checks.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

namespace rolloutd::op_checks {
namespace {

constexpr int kAnyRank = 0;  // rank >= 1, every leading dimension is a row

Status invalid(std::string_view field, std::string message) {
  return Status(ErrorCode::kInvalidArgument, std::move(message), std::string(field));
}

// What every view must satisfy before an op looks at its data. `layout` names the
// dimensions for the message ("[T, H]").
Status view(const ExecContext& ctx, const TensorView& v, std::string_view name, DType dtype,
            int rank, std::string_view layout) {
  const bool rank_ok = rank == kAnyRank ? v.rank() >= 1 : v.rank() == rank;
  // A CPU pointer handed to a CUDA kernel (or the reverse) is the "host-only fast path
  // reached with device tensors" bug; the device tag is the only defence we have here.
  const bool device_ok =
      v.device.kind == ctx.device.kind &&
      (ctx.device.kind == DeviceKind::kCpu || v.device.index == ctx.device.index);
  if (!rank_ok || v.dtype != dtype || !device_ok) {
    return invalid(name, std::string(name) + ": expected " + std::string(dtype_name(dtype)) +
                             " " + std::string(layout) + " on " + ctx.device.to_string() +
                             ", got " + v.describe());
  }
  for (int i = 0; i < v.rank(); ++i) {
    if (v.size(i) < 0)
      return invalid(name, std::string(name) + ": negative dimension in " + v.describe());
  }
  if (!v.is_contiguous())
    return invalid(name, std::string(name) + ": must be contiguous, strides " +
                             v.strides.to_string() + " for shape " + v.shape.to_string());
  if (v.data == nullptr && v.numel() > 0)
    return invalid(name, std::string(name) + ": null data for " + v.describe());
  return Status::Ok();
}

// Dimension `i` of `v` must equal `expected` (taken from `source`).
Status dim(const TensorView& v, int i, int64_t expected, std::string_view name,
           std::string_view what, std::string_view source) {
  if (v.size(i) == expected) return Status::Ok();
  return invalid(name, std::string(name) + ": dimension " + std::to_string(i) + " (" +
                           std::string(what) + ") is " + std::to_string(v.size(i)) +
                           ", expected " + std::to_string(expected) + " from " +
                           std::string(source) + "; shape " + v.shape.to_string());
}

Status positive(const TensorView& v, int i, std::string_view name, std::string_view what) {
  if (v.size(i) > 0) return Status::Ok();
  return invalid(name, std::string(name) + ": dimension " + std::to_string(i) + " (" +
                           std::string(what) + ") must be positive; shape " +
                           v.shape.to_string());
}

Status same_shape(const TensorView& v, const TensorView& ref, std::string_view name,
                  std::string_view ref_name) {
  if (v.shape == ref.shape) return Status::Ok();
  return invalid(name, std::string(name) + ": shape " + v.shape.to_string() + " differs from " +
                           std::string(ref_name) + " " + ref.shape.to_string());
}

// Byte ranges of two contiguous views intersect (empty views never do).
bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.data == nullptr || b.data == nullptr || a.numel() == 0 || b.numel() == 0) return false;
  const auto* a0 = static_cast<const char*>(a.data);
  const auto* b0 = static_cast<const char*>(b.data);
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// An optional view: nothing given at all (no data, no shape).
}  // namespace

Status context(const ExecContext& ctx, DeviceKind backend_kind) {
  if (ctx.device.kind != backend_kind)
    return invalid("ctx.device", "context device " + ctx.device.to_string() +
                                     " does not belong to this backend");
  if (ctx.device.index < 0)
    return invalid("ctx.device", "negative device index " + std::to_string(ctx.device.index));
  return Status::Ok();
}

Status embedding(const ExecContext& ctx, const TensorView& out, const TensorView& table,
                 const TensorView& ids) {
  RD_RETURN_IF_ERROR(view(ctx, table, "table", DType::kF32, 2, "[V, H]"));
  RD_RETURN_IF_ERROR(positive(table, 1, "table", "H"));
  RD_RETURN_IF_ERROR(view(ctx, ids, "ids", DType::kI32, 1, "[T]"));
  RD_RETURN_IF_ERROR(view(ctx, out, "out", DType::kF32, 2, "[T, H]"));
  RD_RETURN_IF_ERROR(dim(out, 0, ids.size(0), "out", "T", "ids"));
  return dim(out, 1, table.size(1), "out", "H", "table");
}

Status rmsnorm(const ExecContext& ctx, const TensorView& out, const TensorView& x,
               const TensorView& w, float eps) {
  RD_RETURN_IF_ERROR(view(ctx, x, "x", DType::kF32, kAnyRank, "[..., H]"));
  RD_RETURN_IF_ERROR(positive(x, x.rank() - 1, "x", "H"));
  RD_RETURN_IF_ERROR(view(ctx, w, "w", DType::kF32, 1, "[H]"));
  RD_RETURN_IF_ERROR(dim(w, 0, x.size(x.rank() - 1), "w", "H", "x"));
  RD_RETURN_IF_ERROR(view(ctx, out, "out", DType::kF32, kAnyRank, "[..., H]"));
  RD_RETURN_IF_ERROR(same_shape(out, x, "out", "x"));
  if (!std::isfinite(eps) || eps < 0.0f)
    return invalid("eps", "eps must be finite and >= 0, got " + std::to_string(eps));
  return Status::Ok();
}

Status linear(const ExecContext& ctx, const TensorView& y, const TensorView& x,
              const TensorView& w) {
  // FP32 x FP32, or BF16 x BF16 (FP32 accumulation); y is FP32 either way.
  const DType in = w.dtype == DType::kBF16 ? DType::kBF16 : DType::kF32;
  RD_RETURN_IF_ERROR(view(ctx, w, "w", in, 2, "[N, K]"));
  RD_RETURN_IF_ERROR(positive(w, 0, "w", "N"));
  RD_RETURN_IF_ERROR(positive(w, 1, "w", "K"));
  RD_RETURN_IF_ERROR(view(ctx, x, "x", in, kAnyRank, "[..., K]"));
  RD_RETURN_IF_ERROR(dim(x, x.rank() - 1, w.size(1), "x", "K", "w"));
  RD_RETURN_IF_ERROR(view(ctx, y, "y", DType::kF32, x.rank(), "[..., N]"));
  for (int i = 0; i + 1 < x.rank(); ++i) RD_RETURN_IF_ERROR(dim(y, i, x.size(i), "y", "M", "x"));
  return dim(y, y.rank() - 1, w.size(0), "y", "N", "w");
}

Status add(const ExecContext& ctx, const TensorView& out, const TensorView& a,
           const TensorView& b) {
  RD_RETURN_IF_ERROR(view(ctx, a, "a", DType::kF32, kAnyRank, "[...]"));
  RD_RETURN_IF_ERROR(view(ctx, b, "b", DType::kF32, kAnyRank, "[...]"));
  RD_RETURN_IF_ERROR(same_shape(b, a, "b", "a"));
  RD_RETURN_IF_ERROR(view(ctx, out, "out", DType::kF32, kAnyRank, "[...]"));
  return same_shape(out, a, "out", "a");
}

namespace {
// A tensor that rotary embedding rotates: f32 [T, heads, D], D even and positive.
Status rotary_input(const ExecContext& ctx, const TensorView& x, std::string_view name) {
  RD_RETURN_IF_ERROR(view(ctx, x, name, DType::kF32, 3, "[T, heads, D]"));
  RD_RETURN_IF_ERROR(positive(x, 2, name, "D"));
  if (x.size(2) % 2 != 0)
    return invalid(name, std::string(name) + ": head dimension must be even for rotate_half pairing, got " +
                             std::to_string(x.size(2)));
  return Status::Ok();
}
Status rope_theta(float theta) {
  if (!std::isfinite(theta) || theta <= 0.0f)
    return invalid("theta", "theta must be finite and > 0, got " + std::to_string(theta));
  return Status::Ok();
}
}  // namespace

namespace {
// The K and V caches: [blocks, block_size, KVH, D], FP32 or BF16, both of one dtype and shape.
Status kv_caches(const ExecContext& ctx, const TensorView& k_cache, const TensorView& v_cache) {
  const DType dt = k_cache.dtype == DType::kBF16 ? DType::kBF16 : DType::kF32;
  const char* layout = dt == DType::kBF16 ? "[blocks, block_size, KVH, D]" : "(or bf16) [blocks, block_size, KVH, D]";
  RD_RETURN_IF_ERROR(view(ctx, k_cache, "k_cache", dt, 4, layout));
  RD_RETURN_IF_ERROR(positive(k_cache, 1, "k_cache", "block_size"));
  RD_RETURN_IF_ERROR(positive(k_cache, 2, "k_cache", "KVH"));
  if (v_cache.dtype != k_cache.dtype)
    return invalid("v_cache", "v_cache: " + std::string(dtype_name(v_cache.dtype)) + ", k_cache " +
                                  std::string(dtype_name(k_cache.dtype)) + ": the caches must have one dtype");
  RD_RETURN_IF_ERROR(view(ctx, v_cache, "v_cache", dt, 4, layout));
  return same_shape(v_cache, k_cache, "v_cache", "k_cache");
}
}  // namespace

Status rope(const ExecContext& ctx, const TensorView& x, const TensorView& positions,
            float theta) {
  RD_RETURN_IF_ERROR(rotary_input(ctx, x, "x"));
  RD_RETURN_IF_ERROR(view(ctx, positions, "positions", DType::kI32, 1, "[T]"));
  RD_RETURN_IF_ERROR(dim(positions, 0, x.size(0), "positions", "T", "x"));
  return rope_theta(theta);
}

Status kv_store(const ExecContext& ctx, const TensorView& k_cache, const TensorView& v_cache,
                const TensorView& k, const TensorView& v, const TensorView& slot_mapping) {
  RD_RETURN_IF_ERROR(kv_caches(ctx, k_cache, v_cache));
  RD_RETURN_IF_ERROR(positive(k_cache, 3, "k_cache", "D"));
  RD_RETURN_IF_ERROR(view(ctx, k, "k", DType::kF32, 3, "[T, KVH, D]"));
  RD_RETURN_IF_ERROR(dim(k, 1, k_cache.size(2), "k", "KVH", "k_cache"));
  RD_RETURN_IF_ERROR(dim(k, 2, k_cache.size(3), "k", "D", "k_cache"));
  RD_RETURN_IF_ERROR(view(ctx, v, "v", DType::kF32, 3, "[T, KVH, D]"));
  RD_RETURN_IF_ERROR(same_shape(v, k, "v", "k"));
  RD_RETURN_IF_ERROR(view(ctx, slot_mapping, "slot_mapping", DType::kI32, 1, "[T]"));
  return dim(slot_mapping, 0, k.size(0), "slot_mapping", "T", "k");
}

Status paged_attention(const ExecContext& ctx, const TensorView& out, const TensorView& q,
                       const TensorView& k_cache, const TensorView& v_cache,
                       const TensorView& block_tables, const TensorView& seq_of,
                       const TensorView& ctx_len, float scale) {
  RD_RETURN_IF_ERROR(view(ctx, q, "q", DType::kF32, 3, "[T, QH, D]"));
  RD_RETURN_IF_ERROR(positive(q, 1, "q", "QH"));
  RD_RETURN_IF_ERROR(positive(q, 2, "q", "D"));
  RD_RETURN_IF_ERROR(kv_caches(ctx, k_cache, v_cache));
  RD_RETURN_IF_ERROR(dim(k_cache, 3, q.size(2), "k_cache", "D", "q"));
  if (q.size(1) % k_cache.size(2) != 0)
    return invalid("q", "q: " + std::to_string(q.size(1)) +
                            " query heads are not a multiple of " +
                            std::to_string(k_cache.size(2)) + " kv heads");
  // out: FP32, or BF16 when it feeds a BF16 projection (o_proj) directly.
  const bool out_bf16 = out.dtype == DType::kBF16;
  RD_RETURN_IF_ERROR(view(ctx, out, "out", out_bf16 ? DType::kBF16 : DType::kF32, 3,
                          out_bf16 ? "[T, QH, D]" : "(or bf16) [T, QH, D]"));
  RD_RETURN_IF_ERROR(same_shape(out, q, "out", "q"));
  RD_RETURN_IF_ERROR(
      view(ctx, block_tables, "block_tables", DType::kI32, 2, "[S, max_blocks]"));
  RD_RETURN_IF_ERROR(view(ctx, seq_of, "seq_of", DType::kI32, 1, "[T]"));
  RD_RETURN_IF_ERROR(dim(seq_of, 0, q.size(0), "seq_of", "T", "q"));
  RD_RETURN_IF_ERROR(view(ctx, ctx_len, "ctx_len", DType::kI32, 1, "[T]"));
  RD_RETURN_IF_ERROR(dim(ctx_len, 0, q.size(0), "ctx_len", "T", "q"));
  if (!std::isfinite(scale))
    return invalid("scale", "scale must be finite, got " + std::to_string(scale));
  // The kernels read the inputs while other CTAs write out.
  for (auto [v, name] : {std::pair{&q, "q"}, std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"},
                         std::pair{&block_tables, "block_tables"}, std::pair{&seq_of, "seq_of"},
                         std::pair{&ctx_len, "ctx_len"}})
    if (overlaps(out, *v)) return invalid("out", std::string("out: overlaps ") + name);
  return Status::Ok();
}

Status paged_attention_ex(const ExecContext& ctx, const TensorView& out, const TensorView& q,
                          const TensorView& k_cache, const TensorView& v_cache,
                          const TensorView& block_tables, const TensorView& seq_of,
                          const TensorView& ctx_len, float scale, const AttentionOptions& options) {
  RD_RETURN_IF_ERROR(paged_attention(ctx, out, q, k_cache, v_cache, block_tables, seq_of, ctx_len, scale));
  if (options.sinks.data != nullptr) {
    RD_RETURN_IF_ERROR(view(ctx, options.sinks, "sinks", DType::kF32, 1, "[QH]"));
    RD_RETURN_IF_ERROR(dim(options.sinks, 0, q.size(1), "sinks", "QH", "q"));
    if (overlaps(out, options.sinks)) return invalid("out", "out: overlaps sinks");
  }
  if (options.window < 0)
    return invalid("window", "window must be >= 0 (0: no sliding window), got " + std::to_string(options.window));
  if (options.split_ctas < 0)
    return invalid("split_ctas", "split_ctas must be >= 0 (0: chosen by the backend), got " +
                                     std::to_string(options.split_ctas));
  if (options.workspace.data != nullptr) {
    RD_RETURN_IF_ERROR(view(ctx, options.workspace, "workspace", DType::kU8, 1, "[bytes]"));
    const int64_t need = paged_attention_workspace_bytes(q.size(0), q.size(1), q.size(2));
    if (options.workspace.size(0) < need)
      return invalid("workspace", "workspace: " + std::to_string(options.workspace.size(0)) + " bytes, " +
                                      std::to_string(need) + " needed for " + std::to_string(q.size(0)) +
                                      " tokens of " + std::to_string(q.size(1)) + " heads of " +
                                      std::to_string(q.size(2)));
    if (reinterpret_cast<uintptr_t>(options.workspace.data) % 16 != 0)
      return invalid("workspace", "workspace: not 16-byte aligned");
    for (auto [v, name] : {std::pair{&out, "out"}, std::pair{&q, "q"}, std::pair{&k_cache, "k_cache"},
                           std::pair{&v_cache, "v_cache"}, std::pair{&block_tables, "block_tables"},
                           std::pair{&seq_of, "seq_of"}, std::pair{&ctx_len, "ctx_len"},
                           std::pair{&options.sinks, "sinks"}})
      if (v->data != nullptr && overlaps(options.workspace, *v))
        return invalid("workspace", std::string("workspace: overlaps ") + name);
  }
  return Status::Ok();
}

Status rope_table(const ExecContext& ctx, const TensorView& x, const TensorView& positions,
                  const TensorView& inv_freq, float scale) {
  RD_RETURN_IF_ERROR(rope(ctx, x, positions, 1.0f));
  RD_RETURN_IF_ERROR(view(ctx, inv_freq, "inv_freq", DType::kF32, 1, "[D/2]"));
  RD_RETURN_IF_ERROR(dim(inv_freq, 0, x.size(2) / 2, "inv_freq", "D/2", "x"));
  if (!std::isfinite(scale) || scale <= 0.0f)
    return invalid("scale", "scale must be finite and > 0, got " + std::to_string(scale));
  return Status::Ok();
}

Status add_rmsnorm(const ExecContext& ctx, const TensorView& out, const TensorView& out_bf16,
                   const TensorView& h, const TensorView& r, const TensorView& r_bias, const TensorView& w,
                   float eps) {
  RD_RETURN_IF_ERROR(view(ctx, h, "h", DType::kF32, kAnyRank, "[..., H]"));
  RD_RETURN_IF_ERROR(positive(h, h.rank() - 1, "h", "H"));
  if (!r.absent()) {
    RD_RETURN_IF_ERROR(view(ctx, r, "r", DType::kF32, kAnyRank, "[..., H]"));
    RD_RETURN_IF_ERROR(same_shape(r, h, "r", "h"));
  }
  if (!r_bias.absent()) {
    if (r.absent()) return invalid("r_bias", "r_bias: given without r");
    RD_RETURN_IF_ERROR(view(ctx, r_bias, "r_bias", DType::kF32, 1, "[H]"));
    RD_RETURN_IF_ERROR(dim(r_bias, 0, h.size(h.rank() - 1), "r_bias", "H", "h"));
  }
  RD_RETURN_IF_ERROR(view(ctx, w, "w", DType::kF32, 1, "[H]"));
  RD_RETURN_IF_ERROR(dim(w, 0, h.size(h.rank() - 1), "w", "H", "h"));
  if (!out.absent()) {
    RD_RETURN_IF_ERROR(view(ctx, out, "out", DType::kF32, kAnyRank, "[..., H]"));
    RD_RETURN_IF_ERROR(same_shape(out, h, "out", "h"));
  }
  if (!out_bf16.absent()) {
    RD_RETURN_IF_ERROR(view(ctx, out_bf16, "out_bf16", DType::kBF16, kAnyRank, "[..., H]"));
    RD_RETURN_IF_ERROR(same_shape(out_bf16, h, "out_bf16", "h"));
  }
  if (!std::isfinite(eps) || eps < 0.0f)
    return invalid("eps", "eps must be finite and >= 0, got " + std::to_string(eps));
  // h is written (h += r) while r and w are read, and the outputs are written after: only out
  // == h exactly is defined (every element is read before it is overwritten).
  if (overlaps(out, h) && out.data != h.data) return invalid("out", "out: overlaps h without aliasing it exactly");
  const std::pair<const TensorView*, const char*> views[] = {
      {&r, "r"}, {&r_bias, "r_bias"}, {&w, "w"}, {&out_bf16, "out_bf16"}};
  constexpr size_t kViews = sizeof(views) / sizeof(views[0]);
  for (size_t i = 0; i < kViews; ++i) {
    const auto& [v, name] = views[i];
    if (overlaps(*v, h)) return invalid(name, std::string(name) + ": overlaps h");
    if (overlaps(*v, out)) return invalid(name, std::string(name) + ": overlaps out");
    for (size_t j = i + 1; j < kViews; ++j)
      if (overlaps(*v, *views[j].first))
        return invalid(views[j].second, std::string(views[j].second) + ": overlaps " + name);
  }
  return Status::Ok();
}

Status rope_qk(const ExecContext& ctx, const RopeQkArgs& a) {
  RD_RETURN_IF_ERROR(rotary_input(ctx, a.q, "q"));
  RD_RETURN_IF_ERROR(rotary_input(ctx, a.k, "k"));
  RD_RETURN_IF_ERROR(dim(a.k, 0, a.q.size(0), "k", "T", "q"));
  RD_RETURN_IF_ERROR(dim(a.k, 2, a.q.size(2), "k", "D", "q"));
  RD_RETURN_IF_ERROR(view(ctx, a.positions, "positions", DType::kI32, 1, "[T]"));
  RD_RETURN_IF_ERROR(dim(a.positions, 0, a.q.size(0), "positions", "T", "q"));
  const int64_t d = a.q.size(2);
  if (!a.inv_freq.absent()) {
    RD_RETURN_IF_ERROR(view(ctx, a.inv_freq, "inv_freq", DType::kF32, 1, "[D/2]"));
    RD_RETURN_IF_ERROR(dim(a.inv_freq, 0, d / 2, "inv_freq", "D/2", "q"));
  } else {
    RD_RETURN_IF_ERROR(rope_theta(a.theta));
  }
  if (!std::isfinite(a.scale) || a.scale <= 0.0f)
    return invalid("scale", "scale must be finite and > 0, got " + std::to_string(a.scale));
  if (a.q_norm.absent() != a.k_norm.absent())
    return invalid(a.q_norm.absent() ? "q_norm" : "k_norm", "q_norm and k_norm: give both or neither");
  if (!a.q_norm.absent()) {
    RD_RETURN_IF_ERROR(view(ctx, a.q_norm, "q_norm", DType::kF32, 1, "[D]"));
    RD_RETURN_IF_ERROR(dim(a.q_norm, 0, d, "q_norm", "D", "q"));
    RD_RETURN_IF_ERROR(view(ctx, a.k_norm, "k_norm", DType::kF32, 1, "[D]"));
    RD_RETURN_IF_ERROR(dim(a.k_norm, 0, d, "k_norm", "D", "q"));
    if (!std::isfinite(a.eps) || a.eps < 0.0f)
      return invalid("eps", "eps must be finite and >= 0, got " + std::to_string(a.eps));
  }
  if (a.qkv.absent() != a.v.absent()) return invalid(a.qkv.absent() ? "qkv" : "v", "qkv and v: give both or neither");
  if (!a.qkv.absent()) {
    const int64_t t = a.q.size(0), width = (a.q.size(1) + 2 * a.k.size(1)) * d;
    RD_RETURN_IF_ERROR(view(ctx, a.qkv, "qkv", DType::kF32, 2, "[T, (QH + 2 KVH) * D]"));
    RD_RETURN_IF_ERROR(dim(a.qkv, 0, t, "qkv", "T", "q"));
    RD_RETURN_IF_ERROR(dim(a.qkv, 1, width, "qkv", "(QH + 2 KVH) * D", "q and k"));
    RD_RETURN_IF_ERROR(view(ctx, a.v, "v", DType::kF32, 3, "[T, KVH, D]"));
    RD_RETURN_IF_ERROR(dim(a.v, 0, t, "v", "T", "q"));
    RD_RETURN_IF_ERROR(dim(a.v, 1, a.k.size(1), "v", "KVH", "k"));
    RD_RETURN_IF_ERROR(dim(a.v, 2, d, "v", "D", "q"));
    for (auto [o, name] : {std::pair{&a.q, "q"}, std::pair{&a.k, "k"}, std::pair{&a.v, "v"}})
      if (overlaps(*o, a.qkv)) return invalid(name, std::string(name) + ": overlaps qkv");
    if (overlaps(a.v, a.q) || overlaps(a.v, a.k)) return invalid("v", "v: overlaps q or k");
  }
  const bool any_bias = !a.q_bias.absent() || !a.k_bias.absent() || !a.v_bias.absent();
  if (any_bias) {
    if (a.qkv.absent()) return invalid("q_bias", "q_bias, k_bias, v_bias: only with the fused qkv");
    for (auto [b, name, n] : {std::tuple{&a.q_bias, "q_bias", a.q.size(1) * d},
                              std::tuple{&a.k_bias, "k_bias", a.k.size(1) * d},
                              std::tuple{&a.v_bias, "v_bias", a.k.size(1) * d}}) {
      if (b->absent()) return invalid(name, "q_bias, k_bias, v_bias: give all three or none");
      RD_RETURN_IF_ERROR(view(ctx, *b, name, DType::kF32, 1, "[heads * D]"));
      RD_RETURN_IF_ERROR(dim(*b, 0, n, name, "heads * D", "q or k"));
      if (overlaps(*b, a.q) || overlaps(*b, a.k) || overlaps(*b, a.v))
        return invalid(name, std::string(name) + ": overlaps q, k or v");
    }
  }
  const bool any_store = !a.k_cache.absent() || !a.v_cache.absent() || !a.slot_mapping.absent();
  if (any_store) {
    if (a.qkv.absent()) return invalid("k_cache", "k_cache, v_cache, slot_mapping: only with the fused qkv");
    if (a.k_cache.absent() || a.v_cache.absent() || a.slot_mapping.absent())
      return invalid(a.k_cache.absent() ? "k_cache" : a.v_cache.absent() ? "v_cache" : "slot_mapping",
                     "k_cache, v_cache, slot_mapping: give all three or none");
    RD_RETURN_IF_ERROR(kv_store(ctx, a.k_cache, a.v_cache, a.k, a.v, a.slot_mapping));
    // The caches are written while every other view is read (or written, q/k/v).
    for (auto [c, name] : {std::pair{&a.k_cache, "k_cache"}, std::pair{&a.v_cache, "v_cache"}})
      for (const TensorView* o : {&a.q, &a.k, &a.v, &a.qkv, &a.positions, &a.inv_freq, &a.q_norm, &a.k_norm,
                                  &a.q_bias, &a.k_bias, &a.v_bias, &a.slot_mapping})
        if (overlaps(*c, *o)) return invalid(name, std::string(name) + ": overlaps another argument");
    if (overlaps(a.k_cache, a.v_cache)) return invalid("v_cache", "v_cache: overlaps k_cache");
  }
  // Rotated in place while the positions, frequencies and weights are read.
  if (overlaps(a.q, a.k)) return invalid("k", "k: overlaps q");
  for (auto [v, name] : {std::pair{&a.positions, "positions"}, std::pair{&a.inv_freq, "inv_freq"},
                         std::pair{&a.q_norm, "q_norm"}, std::pair{&a.k_norm, "k_norm"}})
    if (overlaps(*v, a.q) || overlaps(*v, a.k) || overlaps(*v, a.v))
      return invalid(name, std::string(name) + ": overlaps q, k or v");
  return Status::Ok();
}

Status add_bias(const ExecContext& ctx, const TensorView& y, const TensorView& bias) {
  RD_RETURN_IF_ERROR(view(ctx, y, "y", DType::kF32, kAnyRank, "[..., N]"));
  RD_RETURN_IF_ERROR(view(ctx, bias, "bias", DType::kF32, 1, "[N]"));
  return dim(bias, 0, y.size(y.rank() - 1), "bias", "N", "y");
}

Status transpose(const ExecContext& ctx, const TensorView& dst, const TensorView& src) {
  if (src.dtype != dst.dtype || (dtype_size(src.dtype) != 2 && dtype_size(src.dtype) != 4))
    return invalid("dst", "transpose: src and dst must share a 2- or 4-byte dtype, got " + src.describe() +
                              " and " + dst.describe());
  const int rank = src.rank();
  if (rank != 2 && rank != 3) return invalid("src", "src: expected [R, C] or [B, R, C], got " + src.describe());
  RD_RETURN_IF_ERROR(view(ctx, src, "src", src.dtype, rank, "[B, R, C]"));
  RD_RETURN_IF_ERROR(view(ctx, dst, "dst", src.dtype, rank, "[B, C, R]"));
  if (rank == 3) RD_RETURN_IF_ERROR(dim(dst, 0, src.size(0), "dst", "B", "src"));
  RD_RETURN_IF_ERROR(dim(dst, rank - 2, src.size(rank - 1), "dst", "C", "src"));
  RD_RETURN_IF_ERROR(dim(dst, rank - 1, src.size(rank - 2), "dst", "R", "src"));
  const auto* d = static_cast<const char*>(dst.data);
  const auto* s = static_cast<const char*>(src.data);
  const size_t bytes = static_cast<size_t>(src.numel()) * dtype_size(src.dtype);
  if (bytes > 0 && d < s + bytes && s < d + bytes) return invalid("dst", "dst: overlaps src");
  return Status::Ok();
}

Status router_softmax_topk(const ExecContext& ctx, const TensorView& ids,
                           const TensorView& weights, const TensorView& logits) {
  RD_RETURN_IF_ERROR(view(ctx, logits, "logits", DType::kF32, 2, "[T, E]"));
  RD_RETURN_IF_ERROR(positive(logits, 1, "logits", "E"));
  RD_RETURN_IF_ERROR(view(ctx, ids, "ids", DType::kI32, 2, "[T, K]"));
  RD_RETURN_IF_ERROR(dim(ids, 0, logits.size(0), "ids", "T", "logits"));
  RD_RETURN_IF_ERROR(positive(ids, 1, "ids", "K"));
  if (ids.size(1) > logits.size(1))
    return invalid("ids", "ids: top-k " + std::to_string(ids.size(1)) + " exceeds " +
                              std::to_string(logits.size(1)) + " experts");
  RD_RETURN_IF_ERROR(view(ctx, weights, "weights", DType::kF32, 2, "[T, K]"));
  return same_shape(weights, ids, "weights", "ids");
}

Status router(const ExecContext& ctx, const RouterArgs& a) {
  RD_RETURN_IF_ERROR(view(ctx, a.w, "w", DType::kF32, 2, "[E, H]"));
  RD_RETURN_IF_ERROR(positive(a.w, 0, "w", "E"));
  RD_RETURN_IF_ERROR(positive(a.w, 1, "w", "H"));
  RD_RETURN_IF_ERROR(view(ctx, a.x, "x", DType::kF32, 2, "[T, H]"));
  RD_RETURN_IF_ERROR(dim(a.x, 1, a.w.size(1), "x", "H", "w"));
  RD_RETURN_IF_ERROR(view(ctx, a.logits, "logits", DType::kF32, 2, "[T, E]"));
  RD_RETURN_IF_ERROR(dim(a.logits, 0, a.x.size(0), "logits", "T", "x"));
  RD_RETURN_IF_ERROR(dim(a.logits, 1, a.w.size(0), "logits", "E", "w"));
  if (a.bias.data != nullptr) {
    RD_RETURN_IF_ERROR(view(ctx, a.bias, "bias", DType::kF32, 1, "[E]"));
    RD_RETURN_IF_ERROR(dim(a.bias, 0, a.w.size(0), "bias", "E", "w"));
  }
  for (const auto& [v, name] : {std::pair<const TensorView*, const char*>{&a.x, "x"}, {&a.w, "w"}, {&a.bias, "bias"}})
    if (overlaps(a.logits, *v)) return invalid("logits", std::string("logits: overlaps ") + name);
  RD_RETURN_IF_ERROR(router_softmax_topk(ctx, a.ids, a.weights, a.logits));
  for (const auto& [v, name] : {std::pair<const TensorView*, const char*>{&a.x, "x"}, {&a.w, "w"},
                                {&a.bias, "bias"}, {&a.logits, "logits"}})
    if (overlaps(a.ids, *v) || overlaps(a.weights, *v))
      return invalid("ids", std::string("ids/weights: overlap ") + name);
  if (overlaps(a.ids, a.weights)) return invalid("weights", "weights: overlaps ids");
  return Status::Ok();
}

Status moe_experts(const ExecContext& ctx, const MoeExpertsArgs& a) {
  RD_RETURN_IF_ERROR(view(ctx, a.x, "x", DType::kF32, 2, "[T, H]"));
  RD_RETURN_IF_ERROR(positive(a.x, 1, "x", "H"));
  RD_RETURN_IF_ERROR(view(ctx, a.out, "out", DType::kF32, 2, "[T, H]"));
  RD_RETURN_IF_ERROR(same_shape(a.out, a.x, "out", "x"));
  int64_t inter = 0, e_phys = 0;
  if (a.w_gate_up_blocks.data != nullptr) {
    // MXFP4 experts: shapes from the blocks.
    const auto& gb = a.w_gate_up_blocks;
    RD_RETURN_IF_ERROR(view(ctx, gb, "w_gate_up_blocks", DType::kU8, 4, "[E_phys, 2*I, H/32, 16]"));
    RD_RETURN_IF_ERROR(positive(gb, 0, "w_gate_up_blocks", "E_phys"));
    RD_RETURN_IF_ERROR(positive(gb, 1, "w_gate_up_blocks", "2*I"));
    if (gb.size(1) % 64 != 0)
      return invalid("w_gate_up_blocks", "w_gate_up_blocks: 2*I must be a multiple of 64 (I of 32), got " +
                                             std::to_string(gb.size(1)));
    if (a.x.size(1) % 32 != 0) return invalid("x", "x: H must be a multiple of 32 for MXFP4 experts");
    RD_RETURN_IF_ERROR(dim(gb, 2, a.x.size(1) / 32, "w_gate_up_blocks", "H/32", "x"));
    RD_RETURN_IF_ERROR(dim(gb, 3, 16, "w_gate_up_blocks", "bytes per block", "MXFP4"));
    e_phys = gb.size(0);
    inter = gb.size(1) / 2;
    RD_RETURN_IF_ERROR(view(ctx, a.w_gate_up_scales, "w_gate_up_scales", DType::kU8, 3, "[E_phys, 2*I, H/32]"));
    for (int i = 0; i < 3; ++i) RD_RETURN_IF_ERROR(dim(a.w_gate_up_scales, i, gb.size(i), "w_gate_up_scales", "dim", "w_gate_up_blocks"));
    RD_RETURN_IF_ERROR(view(ctx, a.w_down_blocks, "w_down_blocks", DType::kU8, 4, "[E_phys, H, I/32, 16]"));
    RD_RETURN_IF_ERROR(dim(a.w_down_blocks, 0, e_phys, "w_down_blocks", "E_phys", "w_gate_up_blocks"));
    RD_RETURN_IF_ERROR(dim(a.w_down_blocks, 1, a.x.size(1), "w_down_blocks", "H", "x"));
    RD_RETURN_IF_ERROR(dim(a.w_down_blocks, 2, inter / 32, "w_down_blocks", "I/32", "w_gate_up_blocks"));
    RD_RETURN_IF_ERROR(dim(a.w_down_blocks, 3, 16, "w_down_blocks", "bytes per block", "MXFP4"));
    RD_RETURN_IF_ERROR(view(ctx, a.w_down_scales, "w_down_scales", DType::kU8, 3, "[E_phys, H, I/32]"));
    // CUDA reads the blocks 4 bytes at a time: a misaligned view would be a device fault.
    for (auto [v, name] : {std::pair{&a.w_gate_up_blocks, "w_gate_up_blocks"}, std::pair{&a.w_down_blocks, "w_down_blocks"}})
      if (reinterpret_cast<uintptr_t>(v->data) % 16 != 0)
        return invalid(name, std::string(name) + ": must be 16-byte aligned");
    for (int i = 0; i < 3; ++i) RD_RETURN_IF_ERROR(dim(a.w_down_scales, i, a.w_down_blocks.size(i), "w_down_scales", "dim", "w_down_blocks"));
  } else {
    RD_RETURN_IF_ERROR(view(ctx, a.w_gate_up, "w_gate_up", DType::kF32, 3, "[E_phys, 2*I, H]"));
    RD_RETURN_IF_ERROR(positive(a.w_gate_up, 0, "w_gate_up", "E_phys"));
    RD_RETURN_IF_ERROR(positive(a.w_gate_up, 1, "w_gate_up", "2*I"));
    if (a.w_gate_up.size(1) % 2 != 0)
      return invalid("w_gate_up", "w_gate_up: dimension 1 (2*I) is odd: " +
                                      std::to_string(a.w_gate_up.size(1)));
    RD_RETURN_IF_ERROR(dim(a.w_gate_up, 2, a.x.size(1), "w_gate_up", "H", "x"));
    inter = a.w_gate_up.size(1) / 2;
    e_phys = a.w_gate_up.size(0);
    RD_RETURN_IF_ERROR(view(ctx, a.w_down, "w_down", DType::kF32, 3, "[E_phys, H, I]"));
    RD_RETURN_IF_ERROR(dim(a.w_down, 0, a.w_gate_up.size(0), "w_down", "E_phys", "w_gate_up"));
    RD_RETURN_IF_ERROR(dim(a.w_down, 1, a.x.size(1), "w_down", "H", "x"));
    RD_RETURN_IF_ERROR(dim(a.w_down, 2, inter, "w_down", "I", "w_gate_up"));
  }
  RD_RETURN_IF_ERROR(view(ctx, a.topk_ids, "topk_ids", DType::kI32, 2, "[T, K]"));
  RD_RETURN_IF_ERROR(dim(a.topk_ids, 0, a.x.size(0), "topk_ids", "T", "x"));
  RD_RETURN_IF_ERROR(positive(a.topk_ids, 1, "topk_ids", "K"));
  RD_RETURN_IF_ERROR(view(ctx, a.topk_weights, "topk_weights", DType::kF32, 2, "[T, K]"));
  RD_RETURN_IF_ERROR(same_shape(a.topk_weights, a.topk_ids, "topk_weights", "topk_ids"));
  RD_RETURN_IF_ERROR(view(ctx, a.logical_to_physical, "logical_to_physical", DType::kI32, 1,
                          "[E_logical]"));
  RD_RETURN_IF_ERROR(positive(a.logical_to_physical, 0, "logical_to_physical", "E_logical"));
  if (a.num_valid_tokens < -1 || a.num_valid_tokens > a.x.size(0))
    return Status(ErrorCode::kOutOfRange,
                  "num_valid_tokens " + std::to_string(a.num_valid_tokens) +
                      " outside [-1, " + std::to_string(a.x.size(0)) + "]",
                  "num_valid_tokens");
  if (a.num_valid_device.data != nullptr) {
    RD_RETURN_IF_ERROR(view(ctx, a.num_valid_device, "num_valid_device", DType::kI32, 1, "[1]"));
    RD_RETURN_IF_ERROR(dim(a.num_valid_device, 0, 1, "num_valid_device", "count", "its contract"));
  }
  if (a.b_gate_up.data != nullptr) {
    RD_RETURN_IF_ERROR(view(ctx, a.b_gate_up, "b_gate_up", DType::kF32, 2, "[E_phys, 2*I]"));
    RD_RETURN_IF_ERROR(dim(a.b_gate_up, 0, e_phys, "b_gate_up", "E_phys", "w_gate_up"));
    RD_RETURN_IF_ERROR(dim(a.b_gate_up, 1, 2 * inter, "b_gate_up", "2*I", "w_gate_up"));
  }
  if (a.b_down.data != nullptr) {
    RD_RETURN_IF_ERROR(view(ctx, a.b_down, "b_down", DType::kF32, 2, "[E_phys, H]"));
    RD_RETURN_IF_ERROR(dim(a.b_down, 0, e_phys, "b_down", "E_phys", "w_gate_up"));
    RD_RETURN_IF_ERROR(dim(a.b_down, 1, a.x.size(1), "b_down", "H", "x"));
  }
  if (a.activation != MoeExpertsArgs::Activation::kSilu && a.activation != MoeExpertsArgs::Activation::kGptOss)
    return invalid("activation", "activation: unknown value " + std::to_string(static_cast<int>(a.activation)));
  if (a.activation == MoeExpertsArgs::Activation::kGptOss &&
      (!std::isfinite(a.swiglu_limit) || a.swiglu_limit <= 0.0f || !std::isfinite(a.swiglu_alpha)))
    return invalid("swiglu_limit", "swiglu_limit must be finite and > 0 and swiglu_alpha finite, got " +
                                       std::to_string(a.swiglu_limit) + " and " + std::to_string(a.swiglu_alpha));
  if (a.workspace.data != nullptr) {
    RD_RETURN_IF_ERROR(view(ctx, a.workspace, "workspace", DType::kF32, kAnyRank, "[>= T*K*I]"));
    const int64_t need = a.x.size(0) * a.topk_ids.size(1) * inter;
    if (a.workspace.numel() < need)
      return invalid("workspace", "workspace: " + std::to_string(a.workspace.numel()) + " floats, the op needs " +
                                      std::to_string(need) + " (T * K * I)");
  }
  return Status::Ok();
}

Status copy_valid_rows(const ExecContext& ctx, const TensorView& dst, const TensorView& src,
                       const TensorView& count) {
  RD_RETURN_IF_ERROR(view(ctx, src, "src", DType::kI32, 2, "[T, C]"));
  RD_RETURN_IF_ERROR(view(ctx, dst, "dst", DType::kI32, 2, "[T, C]"));
  RD_RETURN_IF_ERROR(same_shape(dst, src, "dst", "src"));
  RD_RETURN_IF_ERROR(view(ctx, count, "count", DType::kI32, 1, "[1]"));
  RD_RETURN_IF_ERROR(dim(count, 0, 1, "count", "count", "its contract"));
  if (dst.data != nullptr && dst.data == src.data) return invalid("dst", "dst: aliases src");
  return Status::Ok();
}

Status sample(const ExecContext& ctx, const SampleArgs& a) {
  RD_RETURN_IF_ERROR(view(ctx, a.logits, "logits", DType::kF32, 2, "[R, V]"));
  RD_RETURN_IF_ERROR(positive(a.logits, 1, "logits", "V"));
  if (a.logits.size(1) > INT32_MAX) return invalid("logits", "logits: V above INT32_MAX (token ids are int32)");
  const int64_t rows = a.logits.size(0);
  RD_RETURN_IF_ERROR(view(ctx, a.tokens, "tokens", DType::kI32, 1, "[R]"));
  RD_RETURN_IF_ERROR(dim(a.tokens, 0, rows, "tokens", "R", "logits"));
  RD_RETURN_IF_ERROR(view(ctx, a.logprobs, "logprobs", DType::kF32, 1, "[R]"));
  RD_RETURN_IF_ERROR(dim(a.logprobs, 0, rows, "logprobs", "R", "logits"));
  RD_RETURN_IF_ERROR(view(ctx, a.rows, "rows", DType::kU8, 2, "[R, 32]"));
  RD_RETURN_IF_ERROR(dim(a.rows, 0, rows, "rows", "R", "logits"));
  RD_RETURN_IF_ERROR(dim(a.rows, 1, static_cast<int64_t>(sizeof(SamplingRow)), "rows", "bytes per row",
                         "sizeof(SamplingRow)"));
  // The device reads rows as SamplingRow and writes 4-byte outputs: a misaligned view would be a
  // misaligned-address fault (a dead CUDA context), not an error.
  if (reinterpret_cast<uintptr_t>(a.rows.data) % alignof(SamplingRow) != 0)
    return invalid("rows", "rows: must be aligned to " + std::to_string(alignof(SamplingRow)) + " bytes");
  const bool top = a.top_ids.data != nullptr || a.top_logprobs.data != nullptr || a.top_ids.rank() != 0 ||
                   a.top_logprobs.rank() != 0;
  if (top) {
    RD_RETURN_IF_ERROR(view(ctx, a.top_ids, "top_ids", DType::kI32, 2, "[R, N]"));
    RD_RETURN_IF_ERROR(dim(a.top_ids, 0, rows, "top_ids", "R", "logits"));
    const int64_t n = a.top_ids.size(1);
    if (n < 1 || n > kMaxTopLogprobs || n > a.logits.size(1))
      return invalid("top_ids", "top_ids: N = " + std::to_string(n) + " outside [1, min(V, " +
                                    std::to_string(kMaxTopLogprobs) + ")]");
    RD_RETURN_IF_ERROR(view(ctx, a.top_logprobs, "top_logprobs", DType::kF32, 2, "[R, N]"));
    RD_RETURN_IF_ERROR(same_shape(a.top_logprobs, a.top_ids, "top_logprobs", "top_ids"));
  }
  for (auto [v, name] : {std::pair{&a.tokens, "tokens"}, std::pair{&a.logprobs, "logprobs"},
                         std::pair{&a.logits, "logits"}, std::pair{&a.top_ids, "top_ids"},
                         std::pair{&a.top_logprobs, "top_logprobs"}})
    if (reinterpret_cast<uintptr_t>(v->data) % 4 != 0) return invalid(name, std::string(name) + ": must be 4-byte aligned");
  if (rows > 0) {
    // Outputs are written while the inputs are read, and must not overlap each other.
    const auto bytes = [](const TensorView& v) {
      const auto* p = static_cast<const char*>(v.data);
      return std::pair{p, p + v.nbytes()};
    };
    const std::pair<const TensorView*, const char*> outs[] = {
        {&a.tokens, "tokens"}, {&a.logprobs, "logprobs"}, {&a.top_ids, "top_ids"}, {&a.top_logprobs, "top_logprobs"}};
    for (const auto& [out, name] : outs) {
      if (!top && (out == &a.top_ids || out == &a.top_logprobs)) continue;
      const auto [o0, o1] = bytes(*out);
      for (const TensorView* in : {&a.logits, &a.rows, &a.tokens, &a.logprobs, &a.top_ids, &a.top_logprobs}) {
        if (in == out || (!top && (in == &a.top_ids || in == &a.top_logprobs))) continue;
        const auto [i0, i1] = bytes(*in);
        if (o0 < i1 && i0 < o1) return invalid(name, std::string(name) + ": overlaps another argument");
      }
    }
  }
  return Status::Ok();
}

int64_t moe_valid_rows(const MoeExpertsArgs& a) {
  return a.num_valid_tokens < 0 ? a.x.size(0) : a.num_valid_tokens;
}

Status copy_3d_shape(size_t dst_pitch, size_t dst_slice_pitch, size_t src_pitch, size_t src_slice_pitch,
                     size_t width, size_t height) {
  if (dst_pitch < width || src_pitch < width)
    return Status(ErrorCode::kInvalidArgument, "a pitch is smaller than the row width", "pitch");
  for (auto [pitch, slice, field] : {std::tuple{dst_pitch, dst_slice_pitch, "dst_slice_pitch"},
                                     std::tuple{src_pitch, src_slice_pitch, "src_slice_pitch"}}) {
    if (pitch == 0 || slice % pitch != 0 || slice / pitch < height)
      return Status(ErrorCode::kInvalidArgument,
                    "a slice pitch must be a multiple of its row pitch holding every row of the slice", field);
  }
  return Status::Ok();
}

}  // namespace rolloutd::op_checks
