// Argument checks of the MoE ops, run before any data is touched, turning the views into the
// plans both backends consume. A rejected call names the offending view in `field`.
#include <algorithm>
#include <climits>
#include <initializer_list>
#include <utility>
#include <cmath>
#include <string>
#include <string_view>

#include "kernels/moe/moe_plan.hpp"

namespace rolloutd::moe::detail {
namespace {

Status invalid(std::string_view field, std::string message) {
  return Status(ErrorCode::kInvalidArgument, std::string(field) + ": " + message,
                std::string(field));
}

// Device, rank, non-negative dimensions, data unless empty, contiguity, dtype, shape.
Status view(const ExecContext& ctx, const TensorView& v, std::string_view name,
            std::initializer_list<DType> dtypes, const Shape& shape) {
  const bool device_ok =
      v.device.kind == ctx.device.kind &&
      (ctx.device.kind == DeviceKind::kCpu || v.device.index == ctx.device.index);
  if (!device_ok)
    return invalid(name, "lives on " + v.device.to_string() + " but the context runs on " +
                             ctx.device.to_string());
  bool dtype_ok = false;
  std::string wanted;
  for (DType d : dtypes) {
    dtype_ok = dtype_ok || v.dtype == d;
    wanted += (wanted.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  if (v.dtype == DType::kI8)
    return invalid(name, "signed int8 view; pass " + wanted +
                             " (a signed view sign-extends packed codes)");
  if (!dtype_ok) return invalid(name, "expected " + wanted + ", got " + v.describe());
  if (!(v.shape == shape))
    return invalid(name, "expected shape " + shape.to_string() + ", got " + v.describe());
  if (v.data == nullptr && v.numel() > 0) return invalid(name, "null data for " + v.describe());
  if (!v.is_contiguous())
    return invalid(name, "must be contiguous, strides " + v.strides.to_string() +
                             " for shape " + v.shape.to_string());
  return Status::Ok();
}

Status rank2(const TensorView& v, std::string_view name) {
  if (v.rank() != 2) return invalid(name, "expected rank 2, got " + v.describe());
  for (int i = 0; i < 2; ++i)
    if (v.size(i) < 0) return invalid(name, "negative dimension in " + v.describe());
  return Status::Ok();
}

bool finite(float f) { return std::isfinite(f); }

const void* overlap_end(const TensorView& v) {
  return static_cast<const uint8_t*>(v.data) + v.nbytes();
}
bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.data == nullptr || b.data == nullptr || a.numel() == 0 || b.numel() == 0) return false;
  return a.data < overlap_end(b) && b.data < overlap_end(a);
}

size_t align_up(size_t v) { return (v + 255) & ~size_t{255}; }

}  // namespace

Status check_context(const ExecContext& ctx) {
  if (ctx.device.kind != DeviceKind::kCpu && ctx.device.kind != DeviceKind::kCuda)
    return invalid("ctx.device", "unknown device kind");
  if (ctx.device.kind == DeviceKind::kCuda && ctx.device.index < 0)
    return invalid("ctx.device", "negative CUDA device index");
  return Status::Ok();
}

Result<RouterPlan> check_route(const ExecContext& ctx, const RouterParams& params,
                               const RouterArgs& a) {
  RD_RETURN_IF_ERROR(rank2(a.logits, "logits"));
  const int64_t t = a.logits.size(0), e = a.logits.size(1);
  RD_RETURN_IF_ERROR(view(ctx, a.logits, "logits", {DType::kF32}, Shape{t, e}));
  if (e < 1 || e > kMaxExperts)
    return invalid("logits", "expert count " + std::to_string(e) + " outside [1, " +
                                 std::to_string(kMaxExperts) + "]");
  RD_RETURN_IF_ERROR(rank2(a.ids, "ids"));
  const int64_t k = a.ids.size(1);
  RD_RETURN_IF_ERROR(view(ctx, a.ids, "ids", {DType::kI32}, Shape{t, k}));
  RD_RETURN_IF_ERROR(view(ctx, a.weights, "weights", {DType::kF32}, Shape{t, k}));
  if (k < 1 || k > e)
    return invalid("ids", "top_k " + std::to_string(k) + " outside [1, " + std::to_string(e) +
                              "] (the expert count)");
  if (overlaps(a.ids, a.weights)) return invalid("weights", "aliases ids");

  RouterPlan p;
  p.params = params;
  p.num_tokens = t;
  p.num_experts = e;
  p.top_k = static_cast<int>(k);
  p.ids = a.ids.as<int32_t>();
  p.weights = a.weights.as<float>();
  p.logits = a.logits.as<const float>();
  if (!a.logit_bias.absent()) {
    RD_RETURN_IF_ERROR(view(ctx, a.logit_bias, "logit_bias", {DType::kF32}, Shape{e}));
    p.logit_bias = a.logit_bias.as<const float>();
  }
  const RouterKind kind = params.kind;
  const bool biased =
      kind == RouterKind::kSigmoidGroupedTopK || kind == RouterKind::kSqrtSoftplusTopK;
  if (!a.correction_bias.absent()) {
    if (!biased)
      return invalid("correction_bias", std::string("only the biased routers use it, not ") +
                                            router_kind_name(kind));
    RD_RETURN_IF_ERROR(view(ctx, a.correction_bias, "correction_bias", {DType::kF32}, Shape{e}));
    p.correction_bias = a.correction_bias.as<const float>();
  }
  switch (kind) {
    case RouterKind::kSoftmaxTopK:
    case RouterKind::kTopKSoftmax:
      break;
    case RouterKind::kSigmoidGroupedTopK:
    case RouterKind::kSqrtSoftplusTopK: {
      const int64_t ng = params.n_group, tg = params.topk_group;
      if (ng < 1 || e % ng != 0)
        return invalid("params.n_group", std::to_string(ng) + " groups do not divide " +
                                             std::to_string(e) + " experts");
      if (tg < 1 || tg > ng)
        return invalid("params.topk_group",
                       std::to_string(tg) + " outside [1, n_group = " + std::to_string(ng) + "]");
      if (k > tg * (e / ng))
        return invalid("ids", "top_k " + std::to_string(k) + " exceeds the " +
                                  std::to_string(tg * (e / ng)) +
                                  " experts of the topk_group selected groups");
      break;
    }
    case RouterKind::kHash: {
      RD_RETURN_IF_ERROR(rank2(a.tid2eid, "tid2eid"));
      const int64_t v = a.tid2eid.size(0);
      RD_RETURN_IF_ERROR(view(ctx, a.tid2eid, "tid2eid", {DType::kI32}, Shape{v, k}));
      RD_RETURN_IF_ERROR(view(ctx, a.token_ids, "token_ids", {DType::kI32}, Shape{t}));
      if (v < 1) return invalid("tid2eid", "empty table");
      p.tid2eid = a.tid2eid.as<const int32_t>();
      p.token_ids = a.token_ids.as<const int32_t>();
      p.vocab = v;
      if (params.hash_score != ScoreFunc::kSqrtSoftplus && params.hash_score != ScoreFunc::kSigmoid &&
          params.hash_score != ScoreFunc::kSoftmax)
        return invalid("params.hash_score", "unknown score function");
      break;
    }
    default:
      return invalid("params.kind", "unknown router kind " +
                                        std::to_string(static_cast<int>(kind)));
  }
  if ((biased || kind == RouterKind::kHash) && !finite(params.routed_scaling_factor))
    return invalid("params.routed_scaling_factor", "must be finite");
  return p;
}

ExpertsWorkspace experts_workspace(int64_t num_tokens, int64_t top_k, int64_t hidden,
                                   int64_t inter, int64_t num_physical, ActPrecision precision) {
  ExpertsWorkspace w;
  const int64_t t = num_tokens < 0 ? 0 : num_tokens;
  const size_t p = static_cast<size_t>(t * top_k);
  w.max_pairs = static_cast<int64_t>(p);
  w.max_tiles = max_m_tiles(w.max_pairs, num_physical, 16);
  size_t o = 0;
  auto take = [&](size_t bytes) {
    const size_t at = o;
    o = align_up(o + bytes);
    return at;
  };
  w.pair_expert = take(p * 4);
  w.pair_pos = take(p * 4);
  w.sorted_pair = take(p * 4);
  w.expert_offsets = take(static_cast<size_t>(num_physical + 1) * 4);
  w.tile_expert = take(static_cast<size_t>(w.max_tiles) * 4);
  w.tile_row0 = take(static_cast<size_t>(w.max_tiles) * 4);
  w.meta = take(16);
  const size_t th = static_cast<size_t>(t * hidden), pi = p * static_cast<size_t>(inter);
  if (precision == ActPrecision::kMXFP8) {
    w.xa = take(th);
    w.xa_scales = take(th / 32);
    w.h = take(pi * 4);
    // e4m3 codes, or (a decode launch with BF16 rows, the default) h through MXFP8 as bf16 rows:
    // 2 bytes a value for the pairs a decode launch can have, fewer than 48 an expert.
    const size_t decode_pairs = std::min(p, static_cast<size_t>(kDecodeMaxPairsPerExpert * num_physical));
    w.h_q = take(std::max(pi, decode_pairs * static_cast<size_t>(inter) * 2));
    w.h_scales = take(pi / 32);
  } else {
    w.xa = take(th * 2);
    w.h = take(pi * 2);
  }
  w.y = take(p * static_cast<size_t>(hidden) * 4);
  w.total = o;
  return w;
}

Result<ExpertsPlan> check_experts(const ExecContext& ctx, const ExpertsArgs& a) {
  RD_RETURN_IF_ERROR(rank2(a.x, "x"));
  const int64_t t = a.x.size(0), h = a.x.size(1);
  RD_RETURN_IF_ERROR(view(ctx, a.x, "x", {DType::kF32, DType::kBF16}, Shape{t, h}));
  RD_RETURN_IF_ERROR(view(ctx, a.out, "out", {DType::kF32}, Shape{t, h}));
  if (overlaps(a.out, a.x)) return invalid("out", "aliases x");
  RD_RETURN_IF_ERROR(rank2(a.topk_ids, "topk_ids"));
  const int64_t k = a.topk_ids.size(1);
  RD_RETURN_IF_ERROR(view(ctx, a.topk_ids, "topk_ids", {DType::kI32}, Shape{t, k}));
  RD_RETURN_IF_ERROR(view(ctx, a.topk_weights, "topk_weights", {DType::kF32}, Shape{t, k}));
  if (k < 1) return invalid("topk_ids", "top_k must be >= 1, got " + a.topk_ids.describe());
  if (a.logical_to_physical.rank() != 1)
    return invalid("logical_to_physical", "expected rank 1, got " + a.logical_to_physical.describe());
  const int64_t el = a.logical_to_physical.size(0);
  RD_RETURN_IF_ERROR(
      view(ctx, a.logical_to_physical, "logical_to_physical", {DType::kI32}, Shape{el}));
  if (el < 1) return invalid("logical_to_physical", "empty map");
  if (a.num_valid_tokens < -1 || a.num_valid_tokens > t)
    return invalid("num_valid_tokens", std::to_string(a.num_valid_tokens) + " outside [-1, " +
                                           std::to_string(t) + "]");

  const ExpertWeights& w = a.weights;
  if (w.gate_up.rank() < 3) return invalid("weights.gate_up", "expected rank >= 3, got " + w.gate_up.describe());
  const int64_t ep = w.gate_up.size(0), two_i = w.gate_up.size(1), inter = two_i / 2;
  if (ep < 1) return invalid("weights.gate_up", "no expert slots");
  if (two_i < 2 || two_i % 2 != 0)
    return invalid("weights.gate_up", "row count must be 2 * intermediate, got " + w.gate_up.describe());
  if (h % kKAlign != 0 || h == 0)
    return invalid("x", "hidden size " + std::to_string(h) + " must be a positive multiple of " +
                            std::to_string(kKAlign));
  if (inter % kKAlign != 0)
    return invalid("weights.gate_up", "intermediate size " + std::to_string(inter) +
                                          " must be a multiple of " + std::to_string(kKAlign));
  if (ep > kMaxExperts)
    return invalid("weights.gate_up", "more than " + std::to_string(kMaxExperts) + " expert slots");
  if (t * k > INT_MAX / 2 || t * h > (int64_t{1} << 40))
    return invalid("x", "too many rows for one call");

  ExpertsPlan p;
  p.num_tokens = t;
  p.num_valid = a.num_valid_tokens < 0 ? t : a.num_valid_tokens;
  p.hidden = h;
  p.inter = inter;
  p.top_k = k;
  p.num_logical = el;
  p.num_physical = ep;
  p.out = a.out.as<float>();
  p.x = a.x.data;
  p.x_bf16 = a.x.dtype == DType::kBF16;
  p.ids = a.topk_ids.as<const int32_t>();
  p.topk_weights = a.topk_weights.as<const float>();
  p.l2p = a.logical_to_physical.as<const int32_t>();
  if (!a.num_valid_device.absent()) {
    RD_RETURN_IF_ERROR(view(ctx, a.num_valid_device, "num_valid_device", {DType::kI32}, Shape{1}));
    p.num_valid_device = a.num_valid_device.as<const int32_t>();
  }
  p.format = w.format;
  p.order = w.gate_up_order;
  if (w.gate_up_order != GateUpOrder::kConcatenated && w.gate_up_order != GateUpOrder::kInterleaved)
    return invalid("weights.gate_up_order", "unknown gate/up row order");
  switch (w.format) {
    case WeightFormat::kBF16:
      RD_RETURN_IF_ERROR(view(ctx, w.gate_up, "weights.gate_up", {DType::kBF16, DType::kU16},
                              Shape{ep, two_i, h}));
      RD_RETURN_IF_ERROR(
          view(ctx, w.down, "weights.down", {DType::kBF16, DType::kU16}, Shape{ep, h, inter}));
      if (!w.gate_up_scales.absent() || !w.down_scales.absent())
        return invalid("weights.gate_up_scales", "bfloat16 weights take no scales");
      p.gate_up_bf16 = w.gate_up.as<const uint16_t>();
      p.down_bf16 = w.down.as<const uint16_t>();
      break;
    case WeightFormat::kMXFP4:
      RD_RETURN_IF_ERROR(view(ctx, w.gate_up, "weights.gate_up", {DType::kFP4x2, DType::kU8},
                              Shape{ep, two_i, h / 32, 16}));
      RD_RETURN_IF_ERROR(view(ctx, w.gate_up_scales, "weights.gate_up_scales",
                              {DType::kE8M0, DType::kU8}, Shape{ep, two_i, h / 32}));
      RD_RETURN_IF_ERROR(view(ctx, w.down, "weights.down", {DType::kFP4x2, DType::kU8},
                              Shape{ep, h, inter / 32, 16}));
      RD_RETURN_IF_ERROR(view(ctx, w.down_scales, "weights.down_scales",
                              {DType::kE8M0, DType::kU8}, Shape{ep, h, inter / 32}));
      p.gate_up_blocks = w.gate_up.as<const uint8_t>();
      p.gate_up_scales = w.gate_up_scales.as<const uint8_t>();
      p.down_blocks = w.down.as<const uint8_t>();
      p.down_scales = w.down_scales.as<const uint8_t>();
      break;
    default:
      return invalid("weights.format", "unknown weight format");
  }
  if (!w.gate_up_bias.absent()) {
    RD_RETURN_IF_ERROR(
        view(ctx, w.gate_up_bias, "weights.gate_up_bias", {DType::kF32}, Shape{ep, two_i}));
    p.gate_up_bias = w.gate_up_bias.as<const float>();
  }
  if (!w.down_bias.absent()) {
    RD_RETURN_IF_ERROR(view(ctx, w.down_bias, "weights.down_bias", {DType::kF32}, Shape{ep, h}));
    p.down_bias = w.down_bias.as<const float>();
  }
  for (const auto& [v, name] : {std::pair{&a.x, "x"}, std::pair{&a.topk_ids, "topk_ids"},
                                std::pair{&a.topk_weights, "topk_weights"},
                                std::pair{&w.gate_up, "weights.gate_up"},
                                std::pair{&w.down, "weights.down"}})
    if (overlaps(a.out, *v)) return invalid("out", std::string("aliases ") + name);

  const ActivationParams& act = a.activation;
  if (act.kind != ActivationKind::kSwiGLU && act.kind != ActivationKind::kGptOssSwiGLU &&
      act.kind != ActivationKind::kClampedSwiGLU)
    return invalid("activation.kind", "unknown activation");
  if (act.kind != ActivationKind::kSwiGLU && !(finite(act.limit) && act.limit > 0.0f))
    return invalid("activation.limit", "must be finite and positive, got " + std::to_string(act.limit));
  if (act.kind == ActivationKind::kGptOssSwiGLU && !finite(act.alpha))
    return invalid("activation.alpha", "must be finite");
  p.act = act;
  if (a.precision != ActPrecision::kF32 && a.precision != ActPrecision::kBF16 &&
      a.precision != ActPrecision::kMXFP8)
    return invalid("precision", "unknown activation precision");
  p.precision = a.precision;
  p.accumulate = a.accumulate;

  if (ctx.device.kind == DeviceKind::kCuda) {
    if (a.precision == ActPrecision::kF32)
      return Status(ErrorCode::kUnimplemented,
                    "precision: float32 GEMM inputs are the CPU reference's exact mode; the CUDA "
                    "kernels take bfloat16 or MXFP8 activations",
                    "precision");
    const ExpertsWorkspace ws = experts_workspace(t, k, h, inter, ep, a.precision);
    if (a.workspace.rank() != 1)
      return invalid("workspace", "expected a rank-1 uint8 buffer of " + std::to_string(ws.total) +
                                      " bytes, got " + a.workspace.describe());
    RD_RETURN_IF_ERROR(
        view(ctx, a.workspace, "workspace", {DType::kU8}, Shape{a.workspace.size(0)}));
    if (static_cast<size_t>(a.workspace.size(0)) < ws.total)
      return invalid("workspace", "needs " + std::to_string(ws.total) + " bytes, got " +
                                      std::to_string(a.workspace.size(0)));
    if (reinterpret_cast<uintptr_t>(a.workspace.data) % 256 != 0)
      return invalid("workspace", "must be 256-byte aligned");
    for (const auto& [v, name] : {std::pair{&a.out, "out"}, std::pair{&a.x, "x"}})
      if (overlaps(a.workspace, *v)) return invalid("workspace", std::string("aliases ") + name);
    // The kernels move 16-byte vectors.
    for (const auto& [v, name] :
         {std::pair{&a.out, "out"}, std::pair{&a.x, "x"}, std::pair{&w.gate_up, "weights.gate_up"},
          std::pair{&w.down, "weights.down"}})
      if (reinterpret_cast<uintptr_t>(v->data) % 16 != 0)
        return invalid(name, "must be 16-byte aligned on CUDA");
    // The MXFP4 kernels copy scales as 4-byte words.
    if (w.format == WeightFormat::kMXFP4)
      for (const auto& [v, name] : {std::pair{&w.gate_up_scales, "weights.gate_up_scales"},
                                    std::pair{&w.down_scales, "weights.down_scales"}})
        if (reinterpret_cast<uintptr_t>(v->data) % 4 != 0)
          return invalid(name, "must be 4-byte aligned on CUDA");
    p.workspace = a.workspace.as<uint8_t>();
    p.workspace_bytes = a.workspace.size(0);
  }
  return p;
}

}  // namespace rolloutd::moe::detail
