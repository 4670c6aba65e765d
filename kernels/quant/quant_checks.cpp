// Argument checks of every quantization op, run before any data is touched, turning the views
// into the plans both backends consume. A rejected call names the offending view in `field`.
#include <string>
#include <string_view>

#include "kernels/cpu/op_checks.hpp"
#include "kernels/quant/quant_plan.hpp"

namespace rolloutd::quant::detail {
namespace {

Status invalid(std::string_view field, std::string message) {
  return Status(ErrorCode::kInvalidArgument, std::string(field) + ": " + message,
                std::string(field));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// What every view satisfies: the context's device, sane dimensions, data unless empty.
Status basic(const ExecContext& ctx, const TensorView& v, std::string_view name) {
  const bool device_ok =
      v.device.kind == ctx.device.kind &&
      (ctx.device.kind == DeviceKind::kCpu || v.device.index == ctx.device.index);
  if (!device_ok)
    return invalid(name, "lives on " + v.device.to_string() + " but the context runs on " +
                             ctx.device.to_string());
  if (v.rank() < 1) return invalid(name, "rank 0 (missing view?), got " + v.describe());
  for (int i = 0; i < v.rank(); ++i)
    if (v.size(i) < 0) return invalid(name, "negative dimension in " + v.describe());
  if (v.data == nullptr && v.numel() > 0) return invalid(name, "null data for " + v.describe());
  return Status::Ok();
}

Status contiguous(const TensorView& v, std::string_view name) {
  if (v.is_contiguous()) return Status::Ok();
  return invalid(name, "must be contiguous, strides " + v.strides.to_string() + " for shape " +
                           v.shape.to_string());
}

// A bfloat16/float32 input of rank >= min_rank, any non-negative strides.
Status float_input(const ExecContext& ctx, const TensorView& v, std::string_view name,
                   int min_rank) {
  RD_RETURN_IF_ERROR(basic(ctx, v, name));
  if (v.dtype != DType::kBF16 && v.dtype != DType::kF32)
    return invalid(name, "expected bfloat16 or float32, got " + v.describe());
  if (v.rank() < min_rank)
    return invalid(name, "expected rank >= " + std::to_string(min_rank) + ", got " + v.describe());
  for (int i = 0; i < v.rank(); ++i)
    if (v.strides[i] < 0) return invalid(name, "negative stride " + v.strides.to_string());
  return Status::Ok();
}

// A contiguous bfloat16/float32 output.
Status float_output(const ExecContext& ctx, const TensorView& v, std::string_view name,
                    int min_rank) {
  RD_RETURN_IF_ERROR(float_input(ctx, v, name, min_rank));
  return contiguous(v, name);
}

// A contiguous byte view of codes: the format's own dtype or uint8. int8 is the signed-view
// bug this library exists to refuse.
Status codes(const ExecContext& ctx, const TensorView& v, std::string_view name, DType code) {
  RD_RETURN_IF_ERROR(basic(ctx, v, name));
  if (v.dtype == DType::kI8)
    return invalid(name, "signed int8 view of " + std::string(dtype_name(code)) +
                             " codes; pass uint8 or " + std::string(dtype_name(code)) +
                             " (a signed view sign-extends the high bits)");
  if (v.dtype != code && v.dtype != DType::kU8)
    return invalid(name, "expected " + std::string(dtype_name(code)) + " or uint8, got " +
                             v.describe());
  return contiguous(v, name);
}

Status typed(const ExecContext& ctx, const TensorView& v, std::string_view name, DType dtype) {
  RD_RETURN_IF_ERROR(basic(ctx, v, name));
  if (v.dtype != dtype)
    return invalid(name, "expected " + std::string(dtype_name(dtype)) + ", got " + v.describe());
  return contiguous(v, name);
}

Status shape_is(const TensorView& v, const Shape& expected, std::string_view name,
                std::string_view source) {
  if (v.shape == expected) return Status::Ok();
  return invalid(name, "shape " + v.shape.to_string() + ", expected " + expected.to_string() +
                           " from " + std::string(source));
}

// shape[:-drop] + tail
Result<Shape> derived(const Shape& s, int drop, std::initializer_list<int64_t> tail,
                      std::string_view name) {
  const int rank = s.rank() - drop + static_cast<int>(tail.size());
  if (rank > kMaxDims)
    return invalid(name, "would need rank " + std::to_string(rank) + " > " +
                             std::to_string(kMaxDims));
  int64_t dims[kMaxDims] = {};
  int n = 0;
  for (int i = 0; i < s.rank() - drop; ++i) dims[n++] = s[i];
  for (int64_t t : tail) dims[n++] = t;
  return Shape::of(dims, n);
}

StridedRows rows_of(const TensorView& x) {
  StridedRows r;
  r.data = x.data;
  r.bf16 = x.dtype == DType::kBF16;
  r.contiguous = x.is_contiguous();
  r.cols = x.size(x.rank() - 1);
  r.rows = x.numel() / (r.cols == 0 ? 1 : r.cols);
  if (r.cols == 0) {
    r.rows = 1;
    for (int i = 0; i + 1 < x.rank(); ++i) r.rows *= x.size(i);
  }
  r.lead_rank = x.rank() - 1;
  for (int i = 0; i < r.lead_rank; ++i) {
    r.lead_size[i] = x.size(i);
    r.lead_stride[i] = x.strides[i];
  }
  r.col_stride = x.strides[x.rank() - 1];
  return r;
}

Status order_ok(Mxfp4RowOrder order) {
  if (order == Mxfp4RowOrder::kPlain || order == Mxfp4RowOrder::kGateUpInterleaved ||
      order == Mxfp4RowOrder::kGateUpConcatenated)
    return Status::Ok();
  return invalid("order", "unknown Mxfp4RowOrder " + std::to_string(static_cast<int>(order)));
}

// The kernel-layout shape rules on N rows of K/32 blocks.
Status layout_dims(int64_t n, int64_t kb, Mxfp4RowOrder order, std::string_view name) {
  if (kb % 2 != 0)
    return invalid(name, "K = " + std::to_string(kb * 32) +
                             " is not a multiple of 64 (the kernel layout's K tile)");
  const int g = mxfp4_row_multiple(order);
  if (n % g != 0)
    return invalid(name, "N = " + std::to_string(n) + " rows is not a multiple of " +
                             std::to_string(g) +
                             (order == Mxfp4RowOrder::kPlain
                                  ? " (the kernel layout's row tile)"
                                  : " (16 gate and 16 up rows per kernel group)"));
  return Status::Ok();
}

bool overlaps(const TensorView& a, const TensorView& b) {
  const auto* a0 = static_cast<const char*>(a.data);
  const auto* b0 = static_cast<const char*>(b.data);
  return a.nbytes() > 0 && b.nbytes() > 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

Status fp8_block_ok(Fp8ScaleBlock block) {
  if (block == Fp8ScaleBlock::k1x128 || block == Fp8ScaleBlock::k128x128) return Status::Ok();
  return invalid("block", "unknown Fp8ScaleBlock " + std::to_string(static_cast<int>(block)));
}

// Geometry of a blockwise-FP8 tensor of shape `s`.
Fp8Geometry fp8_geometry(const Shape& s, Fp8ScaleBlock block) {
  Fp8Geometry g;
  g.cols = s[s.rank() - 1];
  g.rows = 1;
  for (int i = 0; i + 1 < s.rank(); ++i) g.rows *= s[i];
  if (block == Fp8ScaleBlock::k128x128) {
    g.rows_per_batch = s[s.rank() - 2];
    g.block_rows = kFp8WeightBlockN;
    g.row_blocks_per_batch = ceil_div(g.rows_per_batch, kFp8WeightBlockN);
    if (g.rows_per_batch == 0) g.rows_per_batch = 1;  // no rows at all: keep divisions defined
  }
  g.num_kb = ceil_div(g.cols, kFp8BlockK);
  g.packed_row_bytes = 4 * ceil_div(g.num_kb, 4);
  return g;
}

Result<Shape> fp8_scale_shape(const Shape& s, Fp8ScaleBlock block, int64_t last,
                              std::string_view name) {
  if (block == Fp8ScaleBlock::k1x128) return derived(s, 1, {last}, name);
  return derived(s, 2, {ceil_div(s[s.rank() - 2], kFp8WeightBlockN), last}, name);
}

// An MX tensor's codes and scales against its float twin `f` (named `fname`, [.., K], num_kb =
// ceil(K/32) blocks a row): blocks [.., num_kb, 16] (fp4) or q shaped like f (E4M3), and scales
// [.., num_kb].
Status mx_codes_match(const ExecContext& ctx, const TensorView& q, const TensorView& scales, const TensorView& f,
                      std::string_view fname, int64_t num_kb, bool fp4) {
  // The message's "from" text is built only for a mismatch (these checks run on every call).
  auto same = [&](const TensorView& v, const Shape& want, std::string_view name, std::string_view rule) {
    return v.shape == want ? Status::Ok() : shape_is(v, want, name, std::string(fname) + std::string(rule));
  };
  if (fp4) {
    RD_RETURN_IF_ERROR(codes(ctx, q, "blocks", DType::kFP4x2));
    RD_ASSIGN_OR_RETURN(const Shape bs, derived(f.shape, 1, {num_kb, kMxfp4BytesPerBlock}, "blocks"));
    RD_RETURN_IF_ERROR(same(q, bs, "blocks", " [.., K] -> [.., ceil(K/32), 16]"));
  } else {
    RD_RETURN_IF_ERROR(codes(ctx, q, "q", DType::kF8E4M3));
    RD_RETURN_IF_ERROR(shape_is(q, f.shape, "q", fname));
  }
  RD_RETURN_IF_ERROR(codes(ctx, scales, "scales", DType::kE8M0));
  RD_ASSIGN_OR_RETURN(const Shape ss, derived(f.shape, 1, {num_kb}, "scales"));
  return same(scales, ss, "scales", " [.., K] -> [.., ceil(K/32)]");
}

}  // namespace

Status check_context(const ExecContext& ctx) {
  return op_checks::context(ctx, ctx.device.kind);
}

Result<MxQuantPlan> check_quantize_mx(const ExecContext& ctx, const TensorView& x,
                                      const TensorView& q, const TensorView& scales, bool fp4) {
  RD_RETURN_IF_ERROR(float_input(ctx, x, "x", 1));
  const int64_t k = x.size(x.rank() - 1), num_kb = ceil_div(k, kMxBlockSize);
  RD_RETURN_IF_ERROR(mx_codes_match(ctx, q, scales, x, "x", num_kb, fp4));
  MxQuantPlan p;
  p.x = rows_of(x);
  p.fp4 = fp4;
  p.num_kb = num_kb;
  if (fp4) p.blocks = static_cast<Fp4x2*>(q.data);
  else p.q = static_cast<E4M3*>(q.data);
  p.scales = static_cast<E8M0*>(scales.data);
  return p;
}

Result<MxQuantPlan> check_quantize_mxfp4_kernel(const ExecContext& ctx, const TensorView& x,
                                                const TensorView& blocks,
                                                const TensorView& scales,
                                                const TensorView& kernel_scales,
                                                Mxfp4RowOrder order) {
  RD_RETURN_IF_ERROR(order_ok(order));
  RD_RETURN_IF_ERROR(float_input(ctx, x, "x", 2));
  RD_ASSIGN_OR_RETURN(MxQuantPlan p, check_quantize_mx(ctx, x, blocks, scales, true));
  const int64_t n = x.size(x.rank() - 2);
  RD_RETURN_IF_ERROR(layout_dims(n, p.num_kb, order, "x"));
  RD_RETURN_IF_ERROR(codes(ctx, kernel_scales, "kernel_scales", DType::kE8M0));
  RD_RETURN_IF_ERROR(shape_is(kernel_scales, scales.shape, "kernel_scales", "scales"));
  if (overlaps(kernel_scales, scales))
    return invalid("kernel_scales", "overlaps scales (the checkpoint scales must stay intact)");
  p.kernel_layout = true;
  p.kernel_scales = static_cast<E8M0*>(kernel_scales.data);
  p.order = order;
  p.rows_per_expert = n;
  return p;
}

Result<MxDequantPlan> check_dequantize_mx(const ExecContext& ctx, const TensorView& q,
                                          const TensorView& scales, const TensorView& out,
                                          bool fp4) {
  RD_RETURN_IF_ERROR(float_output(ctx, out, "out", 1));
  const int64_t k = out.size(out.rank() - 1), num_kb = ceil_div(k, kMxBlockSize);
  RD_RETURN_IF_ERROR(mx_codes_match(ctx, q, scales, out, "out", num_kb, fp4));
  MxDequantPlan p;
  p.fp4 = fp4;
  if (fp4) p.blocks = static_cast<const Fp4x2*>(q.data);
  else p.q = static_cast<const E4M3*>(q.data);
  p.scales = static_cast<const E8M0*>(scales.data);
  p.out = out.data;
  p.out_bf16 = out.dtype == DType::kBF16;
  p.cols = k;
  p.rows = 1;
  for (int i = 0; i + 1 < out.rank(); ++i) p.rows *= out.size(i);
  p.num_kb = num_kb;
  return p;
}

Result<LayoutPlan> check_layout(const ExecContext& ctx, const TensorView& blocks,
                                Mxfp4RowOrder order, bool to_kernel) {
  RD_RETURN_IF_ERROR(order_ok(order));
  RD_RETURN_IF_ERROR(codes(ctx, blocks, "blocks", DType::kFP4x2));
  const int r = blocks.rank();
  if (r < 3 || blocks.size(r - 1) != kMxfp4BytesPerBlock)
    return invalid("blocks", "expected [.., N, K/32, 16], got " + blocks.describe());
  RD_RETURN_IF_ERROR(layout_dims(blocks.size(r - 3), blocks.size(r - 2), order, "blocks"));
  LayoutPlan p;
  p.blocks = static_cast<Fp4x2*>(blocks.data);
  p.experts = 1;
  for (int i = 0; i < r - 3; ++i) p.experts *= blocks.size(i);
  p.n = blocks.size(r - 3);
  p.row_bytes = blocks.size(r - 2) * kMxfp4BytesPerBlock;
  p.order = order;
  p.to_kernel = to_kernel;
  return p;
}

Result<ScalesLayoutPlan> check_scales_layout(const ExecContext& ctx, const TensorView& src,
                                             const char* src_name, const TensorView& dst,
                                             const char* dst_name, Mxfp4RowOrder order,
                                             bool to_kernel) {
  RD_RETURN_IF_ERROR(order_ok(order));
  RD_RETURN_IF_ERROR(codes(ctx, src, src_name, DType::kE8M0));
  const int r = src.rank();
  if (r < 2) return invalid(src_name, "expected [.., N, K/32], got " + src.describe());
  RD_RETURN_IF_ERROR(layout_dims(src.size(r - 2), src.size(r - 1), order, src_name));
  RD_RETURN_IF_ERROR(codes(ctx, dst, dst_name, DType::kE8M0));
  RD_RETURN_IF_ERROR(shape_is(dst, src.shape, dst_name, src_name));
  if (overlaps(src, dst)) return invalid(dst_name, std::string("overlaps ") + src_name);
  ScalesLayoutPlan p;
  p.src = static_cast<const E8M0*>(src.data);
  p.dst = static_cast<E8M0*>(dst.data);
  p.experts = 1;
  for (int i = 0; i < r - 2; ++i) p.experts *= src.size(i);
  p.n = src.size(r - 2);
  p.row_blocks = src.size(r - 1);
  p.order = order;
  p.to_kernel = to_kernel;
  return p;
}

Result<Fp8QuantPlan> check_quantize_fp8(const ExecContext& ctx, const TensorView& x,
                                        Fp8ScaleBlock block, const TensorView& q,
                                        const TensorView& scales,
                                        const TensorView& scales_ue8m0) {
  RD_RETURN_IF_ERROR(fp8_block_ok(block));
  RD_RETURN_IF_ERROR(float_input(ctx, x, "x", block == Fp8ScaleBlock::k128x128 ? 2 : 1));
  RD_RETURN_IF_ERROR(codes(ctx, q, "q", DType::kF8E4M3));
  RD_RETURN_IF_ERROR(shape_is(q, x.shape, "q", "x"));
  Fp8QuantPlan p;
  p.x = rows_of(x);
  p.g = fp8_geometry(x.shape, block);
  p.q = static_cast<E4M3*>(q.data);
  if (scales.absent() && scales_ue8m0.absent())
    return invalid("scales", "neither scales nor scales_ue8m0 given: nothing could dequantize q");
  if (!scales.absent()) {
    RD_RETURN_IF_ERROR(typed(ctx, scales, "scales", DType::kF32));
    RD_ASSIGN_OR_RETURN(const Shape ss, fp8_scale_shape(x.shape, block, p.g.num_kb, "scales"));
    RD_RETURN_IF_ERROR(shape_is(scales, ss, "scales", "x and the 128-wide blocks"));
    p.scales = static_cast<float*>(scales.data);
  }
  if (!scales_ue8m0.absent()) {
    RD_RETURN_IF_ERROR(typed(ctx, scales_ue8m0, "scales_ue8m0", DType::kI32));
    RD_ASSIGN_OR_RETURN(const Shape ps, fp8_scale_shape(x.shape, block, p.g.packed_row_bytes / 4,
                                                        "scales_ue8m0"));
    RD_RETURN_IF_ERROR(shape_is(scales_ue8m0, ps, "scales_ue8m0",
                                "x, 128-wide blocks packed four per int32"));
    p.packed = static_cast<E8M0*>(scales_ue8m0.data);
  }
  return p;
}

Result<Fp8DequantPlan> check_dequantize_fp8(const ExecContext& ctx, const TensorView& q,
                                            const TensorView& scales, Fp8ScaleBlock block,
                                            const TensorView& out) {
  RD_RETURN_IF_ERROR(fp8_block_ok(block));
  RD_RETURN_IF_ERROR(float_output(ctx, out, "out", block == Fp8ScaleBlock::k128x128 ? 2 : 1));
  RD_RETURN_IF_ERROR(codes(ctx, q, "q", DType::kF8E4M3));
  RD_RETURN_IF_ERROR(shape_is(q, out.shape, "q", "out"));
  Fp8DequantPlan p;
  p.g = fp8_geometry(out.shape, block);
  p.q = static_cast<const E4M3*>(q.data);
  p.out = out.data;
  p.out_bf16 = out.dtype == DType::kBF16;
  RD_RETURN_IF_ERROR(basic(ctx, scales, "scales"));
  if (scales.dtype == DType::kF32) {
    RD_RETURN_IF_ERROR(contiguous(scales, "scales"));
    RD_ASSIGN_OR_RETURN(const Shape ss, fp8_scale_shape(out.shape, block, p.g.num_kb, "scales"));
    RD_RETURN_IF_ERROR(shape_is(scales, ss, "scales", "out and the 128-wide blocks"));
    p.scales = static_cast<const float*>(scales.data);
  } else if (scales.dtype == DType::kI32) {
    RD_RETURN_IF_ERROR(contiguous(scales, "scales"));
    RD_ASSIGN_OR_RETURN(const Shape ps,
                        fp8_scale_shape(out.shape, block, p.g.packed_row_bytes / 4, "scales"));
    RD_RETURN_IF_ERROR(shape_is(scales, ps, "scales", "out, 128-wide blocks packed four per int32"));
    p.packed = static_cast<const E8M0*>(scales.data);
  } else {
    return invalid("scales", "expected float32 scales or int32 packed UE8M0, got " +
                                 scales.describe());
  }
  return p;
}

}  // namespace rolloutd::quant::detail
