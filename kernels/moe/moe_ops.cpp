// The entry points of moe_ops.hpp: validate (moe_checks.cpp), then run the CPU reference or the
// CUDA kernels according to the context's device.
#include "kernels/moe/moe_ops.hpp"

#include "kernels/moe/moe_math.hpp"
#include "kernels/moe/moe_plan.hpp"

namespace rolloutd::moe {
#if !defined(ROLLOUTD_WITH_CUDA)
namespace {

Status no_cuda() {
  return Status(ErrorCode::kUnimplemented,
                "MoE op on a CUDA context, but this build has no CUDA backend", "ctx.device");
}

}  // namespace
#endif

Status route(const ExecContext& ctx, const RouterParams& params, const RouterArgs& args) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const detail::RouterPlan plan, detail::check_route(ctx, params, args));
  if (ctx.device.kind == DeviceKind::kCpu) return detail::cpu_route(plan);
#if defined(ROLLOUTD_WITH_CUDA)
  return detail::cuda_route(ctx, plan);
#else
  return no_cuda();
#endif
}

int64_t experts_workspace_bytes(int64_t num_tokens, int64_t top_k, int64_t hidden,
                                int64_t intermediate, int64_t num_physical_experts,
                                ActPrecision precision) {
  return static_cast<int64_t>(detail::experts_workspace(num_tokens, top_k, hidden, intermediate,
                                                        num_physical_experts, precision)
                                  .total);
}

Status experts(const ExecContext& ctx, const ExpertsArgs& args) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const detail::ExpertsPlan plan, detail::check_experts(ctx, args));
  if (ctx.device.kind == DeviceKind::kCpu) return detail::cpu_experts(plan);
#if defined(ROLLOUTD_WITH_CUDA)
  return detail::cuda_experts(ctx, plan);
#else
  return no_cuda();
#endif
}

float apply_activation(const ActivationParams& p, float gate, float up) {
  return math::activate(static_cast<int>(p.kind), p.limit, p.alpha, gate, up);
}

const char* router_kind_name(RouterKind k) {
  switch (k) {
    case RouterKind::kSoftmaxTopK: return "softmax_topk";
    case RouterKind::kTopKSoftmax: return "topk_softmax";
    case RouterKind::kSigmoidGroupedTopK: return "sigmoid_grouped_topk";
    case RouterKind::kSqrtSoftplusTopK: return "sqrt_softplus_topk";
    case RouterKind::kHash: return "hash";
  }
  return "unknown";
}

const char* activation_kind_name(ActivationKind k) {
  switch (k) {
    case ActivationKind::kSwiGLU: return "swiglu";
    case ActivationKind::kGptOssSwiGLU: return "gpt_oss_swiglu";
    case ActivationKind::kClampedSwiGLU: return "clamped_swiglu";
  }
  return "unknown";
}

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kBF16: return "bf16";
    case WeightFormat::kMXFP4: return "mxfp4";
  }
  return "unknown";
}

const char* act_precision_name(ActPrecision p) {
  switch (p) {
    case ActPrecision::kF32: return "f32";
    case ActPrecision::kBF16: return "bf16";
    case ActPrecision::kMXFP8: return "mxfp8";
  }
  return "unknown";
}

}  // namespace rolloutd::moe
