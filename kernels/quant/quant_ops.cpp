// The entry points of quant_ops.hpp: validate (quant_checks.cpp), then run the CPU reference
// or the CUDA kernels according to the context's device.
#include "kernels/quant/quant_ops.hpp"

#include "kernels/quant/quant_plan.hpp"

namespace rolloutd::quant {
namespace {

#if !defined(ROLLOUTD_WITH_CUDA)
Status no_cuda() {
  return Status(ErrorCode::kUnimplemented,
                "quantization on a CUDA context, but this build has no CUDA backend",
                "ctx.device");
}
#endif

// Runs `cpu(plan)` or `cuda(ctx, plan)`.
template <class Plan, class Cpu, class Cuda>
Status run(const ExecContext& ctx, const Plan& plan, Cpu cpu, Cuda cuda) {
  if (ctx.device.kind == DeviceKind::kCpu) {
    cpu(plan);
    return Status::Ok();
  }
#if defined(ROLLOUTD_WITH_CUDA)
  return cuda(ctx, plan);
#else
  (void)cuda;
  return no_cuda();
#endif
}

#if defined(ROLLOUTD_WITH_CUDA)
#define RD_QUANT_CUDA(fn) detail::fn
#else
// Never called: run() reports kUnimplemented before it would be.
#define RD_QUANT_CUDA(fn) [](const ExecContext&, const auto&) { return Status::Ok(); }
#endif

}  // namespace

Status quantize_mxfp4(const ExecContext& ctx, TensorView x, TensorView blocks, TensorView scales) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan, detail::check_quantize_mx(ctx, x, blocks, scales, true));
  return run(ctx, plan, detail::cpu_quantize_mx, RD_QUANT_CUDA(cuda_quantize_mx));
}

Status quantize_mxfp4_to_kernel_layout(const ExecContext& ctx, TensorView x, TensorView blocks,
                                       TensorView scales, TensorView kernel_scales,
                                       Mxfp4RowOrder order) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan, detail::check_quantize_mxfp4_kernel(
                                           ctx, x, blocks, scales, kernel_scales, order));
  return run(ctx, plan, detail::cpu_quantize_mx, RD_QUANT_CUDA(cuda_quantize_mx));
}

Status dequantize_mxfp4(const ExecContext& ctx, TensorView blocks, TensorView scales,
                        TensorView out) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan, detail::check_dequantize_mx(ctx, blocks, scales, out, true));
  return run(ctx, plan, detail::cpu_dequantize_mx, RD_QUANT_CUDA(cuda_dequantize_mx));
}

Status mxfp4_blocks_to_kernel_layout(const ExecContext& ctx, TensorView blocks,
                                     Mxfp4RowOrder order) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan, detail::check_layout(ctx, blocks, order, true));
  return run(ctx, plan, detail::cpu_layout, RD_QUANT_CUDA(cuda_layout));
}

Status mxfp4_blocks_to_checkpoint_layout(const ExecContext& ctx, TensorView blocks,
                                         Mxfp4RowOrder order) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan, detail::check_layout(ctx, blocks, order, false));
  return run(ctx, plan, detail::cpu_layout, RD_QUANT_CUDA(cuda_layout));
}

Status mxfp4_scales_to_kernel_layout(const ExecContext& ctx, TensorView scales,
                                     TensorView kernel_scales, Mxfp4RowOrder order) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan,
                      detail::check_scales_layout(ctx, scales, "scales", kernel_scales,
                                                  "kernel_scales", order, true));
  return run(ctx, plan, detail::cpu_scales_layout, RD_QUANT_CUDA(cuda_scales_layout));
}

Status mxfp4_scales_to_checkpoint_layout(const ExecContext& ctx, TensorView kernel_scales,
                                         TensorView scales, Mxfp4RowOrder order) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan,
                      detail::check_scales_layout(ctx, kernel_scales, "kernel_scales", scales,
                                                  "scales", order, false));
  return run(ctx, plan, detail::cpu_scales_layout, RD_QUANT_CUDA(cuda_scales_layout));
}

Status quantize_mxfp8(const ExecContext& ctx, TensorView x, TensorView q, TensorView scales) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan, detail::check_quantize_mx(ctx, x, q, scales, false));
  return run(ctx, plan, detail::cpu_quantize_mx, RD_QUANT_CUDA(cuda_quantize_mx));
}

Status dequantize_mxfp8(const ExecContext& ctx, TensorView q, TensorView scales, TensorView out) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan, detail::check_dequantize_mx(ctx, q, scales, out, false));
  return run(ctx, plan, detail::cpu_dequantize_mx, RD_QUANT_CUDA(cuda_dequantize_mx));
}

Status quantize_fp8_blockwise(const ExecContext& ctx, TensorView x, Fp8ScaleBlock block,
                              TensorView q, TensorView scales, TensorView scales_ue8m0) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan,
                      detail::check_quantize_fp8(ctx, x, block, q, scales, scales_ue8m0));
  return run(ctx, plan, detail::cpu_quantize_fp8, RD_QUANT_CUDA(cuda_quantize_fp8));
}

Status dequantize_fp8_blockwise(const ExecContext& ctx, TensorView q, TensorView scales,
                                Fp8ScaleBlock block, TensorView out) {
  RD_RETURN_IF_ERROR(detail::check_context(ctx));
  RD_ASSIGN_OR_RETURN(const auto plan, detail::check_dequantize_fp8(ctx, q, scales, block, out));
  return run(ctx, plan, detail::cpu_dequantize_fp8, RD_QUANT_CUDA(cuda_dequantize_fp8));
}

}  // namespace rolloutd::quant
