#include "core/moe/layer/moe_layer.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>

namespace rolloutd::core {
namespace {

Status invalid(const std::string& prefix, const std::string& field, const std::string& message) {
  return Status(ErrorCode::kInvalidArgument, message, prefix + "." + field);
}

TensorView rows_of(const TensorView& v, int64_t rows) {
  Shape s = v.shape;
  s[0] = rows;
  return TensorView::contiguous(v.data, v.dtype, s, v.device);
}

std::string describe(const TensorView& v) {
  return std::string(dtype_name(v.dtype)) + " " + v.shape.to_string();
}

// A [rows, cols] (or [rows] when cols < 0) view of `dtype` on `device`.
Status expect_view(const std::string& prefix, const std::string& field, const TensorView& v,
                   DType dtype, int64_t rows, int64_t cols, Device device) {
  const Shape want = cols < 0 ? Shape{rows} : Shape{rows, cols};
  if (v.dtype != dtype || !(v.shape == want) || !v.is_contiguous() || !(v.device == device) ||
      (v.data == nullptr && v.numel() > 0))
    return invalid(prefix, field, "expected contiguous " + std::string(dtype_name(dtype)) + " " +
                                      want.to_string() + " on " + device.to_string() + ", got " +
                                      describe(v) + " on " + v.device.to_string());
  return Status::Ok();
}

bool biased(moe::RouterKind k) {
  return k == moe::RouterKind::kSigmoidGroupedTopK || k == moe::RouterKind::kSqrtSoftplusTopK;
}

// ROLLOUTD_MOE_LAYER_FUSED_ROUTER=0 (environment, read once): a CUDA layer routes as the CPU one
// does (gate GEMM, then moe::route) even where Backend::router could; for same-binary A/B runs.
bool fused_router_allowed() {
  static const bool on = [] {
    const char* s = std::getenv("ROLLOUTD_MOE_LAYER_FUSED_ROUTER");
    return s == nullptr || std::string_view(s) != "0";
  }();
  return on;
}

}  // namespace

Status MoeLayerConfig::validate() const {
  const std::string& p = name;
  // The capture rules first: they are what a wrong deployment gets wrong.
  if (draft && record_routed_experts)
    return invalid(p, "record_routed_experts",
                   "draft=true conflicts with record_routed_experts=true: a layer built for a "
                   "draft/speculative module must never write the target's routed-expert records");
  if (shared_expert_fusion && record_routed_experts)
    return invalid(p, "shared_expert_fusion",
                   "shared_expert_fusion=true conflicts with record_routed_experts=true: fused "
                   "shared experts ride along as extra routed slots with remapped (physical) ids, "
                   "and routed-expert records must hold logical ids only");
  if (shared_expert_fusion)
    return Status(ErrorCode::kUnimplemented,
                  "shared_expert_fusion is not implemented; shared experts run as a separate "
                  "always-on pass (set shared_expert_fusion=false)",
                  p + ".shared_expert_fusion");
  if (hidden_size <= 0) return invalid(p, "hidden_size", "must be positive");
  if (intermediate_size <= 0) return invalid(p, "intermediate_size", "must be positive");
  if (num_experts <= 0) return invalid(p, "num_experts", "must be positive");
  if (num_physical_experts != 0 && num_physical_experts < num_experts)
    return invalid(p, "num_physical_experts", "fewer physical slots than logical experts");
  if (top_k <= 0 || top_k > num_experts)
    return invalid(p, "top_k", "must be in [1, num_experts = " + std::to_string(num_experts) + "]");
  if (max_tokens <= 0) return invalid(p, "max_tokens", "must be positive");
  if (correction_bias && !biased(router.kind))
    return invalid(p, "correction_bias",
                   std::string("correction_bias=true needs a biased router, not ") +
                       moe::router_kind_name(router.kind));
  if (router.kind == moe::RouterKind::kHash && vocab_size <= 0)
    return invalid(p, "vocab_size", "a hash router needs the tid2eid table's vocabulary size");
  if (num_shared_experts < 0) return invalid(p, "num_shared_experts", "must be >= 0");
  if (num_shared_experts > 0 && shared_intermediate_size <= 0)
    return invalid(p, "shared_intermediate_size", "must be positive with shared experts");
  if (moe_layer_index < 0) return invalid(p, "moe_layer_index", "must be >= 0");
  return Status::Ok();
}

MoeLayer::MoeLayer(const MoeLayerConfig& c, const MoeLayerWeights& w, const Backend& b,
                   ExecContext ctx)
    : config_(c), w_(w), backend_(b), ctx_(ctx) {}

Result<std::unique_ptr<MoeLayer>> MoeLayer::create(const MoeLayerConfig& config,
                                                   const MoeLayerWeights& weights,
                                                   const Backend& backend, ExecContext ctx) {
  RD_RETURN_IF_ERROR(config.validate());
  const std::string& p = config.name;
  const int64_t e = config.num_experts, h = config.hidden_size, i = config.intermediate_size;
  const int64_t ep = config.num_physical_experts > 0 ? config.num_physical_experts : e;
  const Device dev = ctx.device;
  RD_RETURN_IF_ERROR(expect_view(p, "router", weights.router, DType::kF32, e, h, dev));
  if (config.router_bias)
    RD_RETURN_IF_ERROR(expect_view(p, "router_bias", weights.router_bias, DType::kF32, e, -1, dev));
  else if (!weights.router_bias.absent())
    return invalid(p, "router_bias", "given, but config.router_bias is false");
  if (config.correction_bias)
    RD_RETURN_IF_ERROR(
        expect_view(p, "correction_bias", weights.correction_bias, DType::kF32, e, -1, dev));
  else if (!weights.correction_bias.absent())
    return invalid(p, "correction_bias", "given, but config.correction_bias is false");
  if (config.router.kind == moe::RouterKind::kHash)
    RD_RETURN_IF_ERROR(expect_view(p, "tid2eid", weights.tid2eid, DType::kI32, config.vocab_size,
                                   config.top_k, dev));
  const moe::ExpertWeights& x = weights.experts;
  if (x.format != config.weight_format || x.gate_up_order != config.gate_up_order)
    return invalid(p, "experts", "format or gate/up order differs from the config");
  if (x.gate_up.rank() < 3 || x.gate_up.size(0) != ep || x.gate_up.size(1) != 2 * i ||
      x.down.rank() < 3 || x.down.size(0) != ep || x.down.size(1) != h)
    return invalid(p, "experts.gate_up",
                   "expected " + std::to_string(ep) + " slots of [2I = " + std::to_string(2 * i) +
                       ", H] gate_up and [H = " + std::to_string(h) + ", I] down, got " +
                       describe(x.gate_up) + " and " + describe(x.down));
  if (config.expert_bias != !x.gate_up_bias.absent() || config.expert_bias != !x.down_bias.absent())
    return invalid(p, "experts.gate_up_bias", "expert biases must be given exactly when config.expert_bias");
  const int64_t s = config.num_shared_experts;
  if (s > 0) {
    const moe::ExpertWeights& sh = weights.shared;
    if (sh.gate_up.rank() < 3 || sh.gate_up.size(0) != s ||
        sh.gate_up.size(1) != 2 * config.shared_intermediate_size || sh.down.rank() < 3 ||
        sh.down.size(0) != s || sh.down.size(1) != h)
      return invalid(p, "shared.gate_up",
                     "expected " + std::to_string(s) + " shared experts of intermediate size " +
                         std::to_string(config.shared_intermediate_size) + ", got " +
                         describe(sh.gate_up) + " and " + describe(sh.down));
    if (!sh.gate_up_bias.absent() || !sh.down_bias.absent())
      return invalid(p, "shared.gate_up_bias", "shared experts take no biases");
  }
  std::unique_ptr<MoeLayer> layer(new MoeLayer(config, weights, backend, ctx));
  layer->num_physical_ = ep;
  RD_RETURN_IF_ERROR(layer->allocate());
  std::vector<int32_t> identity(static_cast<size_t>(e));
  for (int64_t j = 0; j < e; ++j) identity[static_cast<size_t>(j)] = static_cast<int32_t>(j);
  RD_ASSIGN_OR_RETURN(ExpertMap map, ExpertMap::create(std::move(identity), ep));
  RD_RETURN_IF_ERROR(layer->set_expert_map(map));
  return layer;
}

Status MoeLayer::upload(const TensorView& dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  const CopyKind kind =
      ctx_.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kHostToDevice;
  RD_RETURN_IF_ERROR(backend_.copy(ctx_, dst.data, src, bytes, kind));
  // The host source may go away when we return.
  return backend_.synchronize(ctx_);
}

Status MoeLayer::allocate() {
  const auto& c = config_;
  const int64_t t = c.max_tokens, e = c.num_experts, k = c.top_k, s = c.num_shared_experts;
  arena_ = std::make_unique<StableArena>(backend_, ctx_, MemoryTag::kScratch, size_t{1} << 20);
  RD_ASSIGN_OR_RETURN(logits_, arena_->allocate(DType::kF32, Shape{t, e}));
  RD_ASSIGN_OR_RETURN(ids_, arena_->allocate(DType::kI32, Shape{t, k}));
  RD_ASSIGN_OR_RETURN(weights_, arena_->allocate(DType::kF32, Shape{t, k}));
  RD_ASSIGN_OR_RETURN(l2p_, arena_->allocate(DType::kI32, Shape{e}));
  int64_t ws = 0;
  if (ctx_.device.kind == DeviceKind::kCuda) {
    ws = moe::experts_workspace_bytes(t, k, c.hidden_size, c.intermediate_size, num_physical_,
                                      c.act_precision);
    if (s > 0)
      ws = std::max(ws, moe::experts_workspace_bytes(t, s, c.hidden_size,
                                                     c.shared_intermediate_size, s,
                                                     c.act_precision));
    RD_ASSIGN_OR_RETURN(workspace_, arena_->allocate(DType::kU8, Shape{ws}));
  }
  if (s > 0) {
    RD_ASSIGN_OR_RETURN(shared_ids_, arena_->allocate(DType::kI32, Shape{t, s}));
    RD_ASSIGN_OR_RETURN(shared_weights_, arena_->allocate(DType::kF32, Shape{t, s}));
    RD_ASSIGN_OR_RETURN(shared_l2p_, arena_->allocate(DType::kI32, Shape{s}));
    // Every token visits every shared expert with weight 1.
    std::vector<int32_t> ids(static_cast<size_t>(t * s)), l2p(static_cast<size_t>(s));
    std::vector<float> ones(static_cast<size_t>(t * s), 1.0f);
    for (int64_t j = 0; j < t * s; ++j) ids[static_cast<size_t>(j)] = static_cast<int32_t>(j % s);
    for (int64_t j = 0; j < s; ++j) l2p[static_cast<size_t>(j)] = static_cast<int32_t>(j);
    RD_RETURN_IF_ERROR(upload(shared_ids_, ids.data(), ids.size() * sizeof(int32_t)));
    RD_RETURN_IF_ERROR(upload(shared_weights_, ones.data(), ones.size() * sizeof(float)));
    RD_RETURN_IF_ERROR(upload(shared_l2p_, l2p.data(), l2p.size() * sizeof(int32_t)));
  }
  return Status::Ok();
}

Status MoeLayer::set_expert_map(const ExpertMap& map) {
  if (map.num_logical() != config_.num_experts || map.num_physical() != num_physical_)
    return invalid(config_.name, "expert_map",
                   "map of " + std::to_string(map.num_logical()) + " logical experts over " +
                       std::to_string(map.num_physical()) + " slots; the layer has " +
                       std::to_string(config_.num_experts) + " over " +
                       std::to_string(num_physical_));
  map_host_ = map.table();
  RD_RETURN_IF_ERROR(upload(l2p_, map_host_.data(), map_host_.size() * sizeof(int32_t)));
  map_ = map;
  return Status::Ok();
}

Status MoeLayer::forward(TensorView out, TensorView x, TensorView token_ids, int64_t num_valid,
                         RoutedExpertRecorder* recorder) {
  const auto& c = config_;
  const std::string& p = c.name;
  if (x.rank() != 2)
    return invalid(p, "x", "expected [T, H], got " + describe(x));
  const int64_t t = x.size(0);
  if (t > c.max_tokens)
    return invalid(p, "x", std::to_string(t) + " rows exceed max_tokens " + std::to_string(c.max_tokens));
  RD_RETURN_IF_ERROR(expect_view(p, "x", x, DType::kF32, t, c.hidden_size, ctx_.device));
  RD_RETURN_IF_ERROR(expect_view(p, "out", out, DType::kF32, t, c.hidden_size, ctx_.device));
  if (num_valid < 0 || num_valid > t)
    return invalid(p, "num_valid", std::to_string(num_valid) + " outside [0, " + std::to_string(t) + "]");
  if (recorder != nullptr && !records())
    return Status(ErrorCode::kFailedPrecondition,
                  c.draft ? "a draft (speculative) layer never writes routed-expert records"
                          : "this layer was built with record_routed_experts=false",
                  p + ".recorder");
  if (recorder != nullptr && recorder->num_valid_tokens() != num_valid)
    return Status(ErrorCode::kInternal,
                  "the recorder's step holds " + std::to_string(recorder->num_valid_tokens()) +
                      " rows, the forward " + std::to_string(num_valid),
                  p + ".recorder");
  const bool hash = c.router.kind == moe::RouterKind::kHash;
  if (hash) RD_RETURN_IF_ERROR(expect_view(p, "token_ids", token_ids, DType::kI32, t, -1, ctx_.device));

  const TensorView ids = rows_of(ids_, num_valid), weights = rows_of(weights_, num_valid);
  if (num_valid > 0) {
    const TensorView logits = rows_of(logits_, num_valid);
    // On CUDA the softmax-family routers take the decoder's router op: the gate GEMM, the logit
    // bias and the selection in one launch for decode-sized steps (Backend::router), instead of
    // cuBLAS's GEMV kernels and the selection kernel. gpt-oss's softmax over its k picks is the
    // renormalised softmax top-k (exp(l_i) / sum_k exp(l_k) either way; the k largest logits are
    // the k largest probabilities): the same picks for the same logits, weights that differ in
    // rounding, except that a NaN logit outside the k makes every weight NaN here (the softmax
    // sums over all experts) where the family's own arithmetic ignores it. The gate GEMM's
    // summation order differs from cuBLAS's, so near-tied logits may pick differently. The CPU
    // keeps each family's own arithmetic: it is the FP32 reference.
    const bool softmax_family =
        c.router.kind == moe::RouterKind::kSoftmaxTopK || c.router.kind == moe::RouterKind::kTopKSoftmax;
    if (ctx_.device.kind == DeviceKind::kCuda && softmax_family && !c.correction_bias && fused_router_allowed()) {
      RouterArgs ra;
      ra.ids = ids;
      ra.weights = weights;
      ra.logits = logits;
      ra.x = rows_of(x, num_valid);
      ra.w = w_.router;
      ra.bias = c.router_bias ? w_.router_bias : TensorView{};
      ra.renormalize = c.router.kind == moe::RouterKind::kTopKSoftmax || c.router.renormalize;
      RD_RETURN_IF_ERROR(backend_.router(ctx_, ra).with_field_prefix(p + ".router"));
    } else {
      RD_RETURN_IF_ERROR(backend_.linear(ctx_, logits, rows_of(x, num_valid), w_.router)
                             .with_field_prefix(p + ".router"));
      moe::RouterArgs ra;
      ra.ids = ids;
      ra.weights = weights;
      ra.logits = logits;
      ra.logit_bias = w_.router_bias;
      ra.correction_bias = w_.correction_bias;
      if (hash) {
        ra.token_ids = rows_of(token_ids, num_valid);
        ra.tid2eid = w_.tid2eid;
      }
      RD_RETURN_IF_ERROR(moe::route(ctx_, c.router, ra).with_field_prefix(p + ".gate"));
    }
  }
  // The single capture point: the router's logical ids, real rows only, before the
  // logical -> physical remap (which happens inside moe::experts).
  if (recorder != nullptr)
    RD_RETURN_IF_ERROR(recorder->capture(backend_, ctx_, c.moe_layer_index, ids));

  moe::ExpertsArgs ea;
  ea.out = out;
  ea.x = x;
  ea.topk_ids = rows_of(ids_, t);
  ea.topk_weights = rows_of(weights_, t);
  ea.logical_to_physical = l2p_;
  ea.num_valid_tokens = num_valid;
  ea.weights = w_.experts;
  ea.activation = c.activation;
  ea.precision = c.act_precision;
  ea.workspace = workspace_;
  RD_RETURN_IF_ERROR(moe::experts(ctx_, ea).with_field_prefix(p + ".experts"));
  if (c.num_shared_experts > 0) {
    ea.topk_ids = rows_of(shared_ids_, t);
    ea.topk_weights = rows_of(shared_weights_, t);
    ea.logical_to_physical = shared_l2p_;
    ea.weights = w_.shared;
    ea.activation = c.shared_activation;
    ea.accumulate = true;
    RD_RETURN_IF_ERROR(moe::experts(ctx_, ea).with_field_prefix(p + ".shared_experts"));
  }
  return Status::Ok();
}

MoeLayer::StaticState MoeLayer::static_state() const {
  return {config_.activation, config_.shared_activation, config_.router.routed_scaling_factor};
}

void MoeLayer::restore_static_state(const StaticState& s) {
  config_.activation = s.activation;
  config_.shared_activation = s.shared_activation;
  config_.router.routed_scaling_factor = s.routed_scaling_factor;
}

}  // namespace rolloutd::core
