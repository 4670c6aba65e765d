#pragma once
// Quantization operations: MXFP4, MXFP8 and UE8M0 blockwise FP8 (the format facts are in
// mxfp4.hpp, mxfp8.hpp and fp8_blockwise.hpp), each a CPU reference and a CUDA kernel behind
// one entry point. The weight registry uses them as its quant-method hooks:
//   on arrival      quantize_mxfp4 (checkpoint layout) or quantize_fp8_blockwise;
//   postprocess     mxfp4_blocks_to_kernel_layout (in place) + mxfp4_scales_to_kernel_layout
//                   (a separate copy; the checkpoint scales stay untouched);
//   restore         mxfp4_blocks_to_checkpoint_layout (in place; kernel scales need nothing);
//   full reload     quantize_mxfp4_to_kernel_layout writes both layouts in one pass.
//
// Conventions:
// - The backend is the context's device: ctx.device.kind == kCpu runs the reference, kCuda
//   the kernels, asynchronously on ctx.stream (kUnimplemented when the CUDA backend is not
//   built). Every view must live on ctx.device; a host view handed to a CUDA context (or the
//   reverse) is kInvalidArgument, before any byte is touched.
// - Arguments are validated before data is read or written: a bad dtype, rank, shape,
//   contiguity or device gives kInvalidArgument with `field` naming the view ("x", "blocks",
//   "scales", "kernel_scales", "q", "scales_ue8m0", "out"), and nothing is written.
// - Inputs `x` are bfloat16 or float32 and may be strided (any strides, e.g. a transposed
//   view of a [E, K, N] export); every other view must be contiguous.
// - Byte views carry their code in the dtype: packed E2M1 is float4_e2m1fn_x2 or uint8, E8M0
//   is float8_e8m0fnu or uint8, E4M3 is float8_e4m3fn or uint8, packed UE8M0 is int32. A
//   signed int8 view is refused (it sign-extends the high nibble of packed FP4).
// - Outputs never alias inputs, except the in-place layout permutations.
// - An absent optional output is an empty view: TensorView{} (null data, rank 0).
#include "kernels/backend.hpp"
#include "kernels/quant/fp8_blockwise.hpp"
#include "kernels/quant/mxfp4.hpp"
#include "kernels/quant/mxfp8.hpp"

namespace rolloutd::quant {

// ---- MXFP4 --------------------------------------------------------------------------------

// x [.., K] -> blocks [.., ceil(K/32), 16], scales [.., ceil(K/32)] (checkpoint layout).
Status quantize_mxfp4(const ExecContext& ctx, TensorView x, TensorView blocks, TensorView scales);

// x [.., N, K] -> blocks in the kernel layout (shape [.., N, K/32, 16]: the storage of the
// checkpoint layout, 4-byte words permuted and the bits of each word arranged), scales in the checkpoint layout [.., N, K/32] and the
// kernel-layout scales [.., N, K/32]. The same bytes as quantize_mxfp4 followed by
// mxfp4_blocks_to_kernel_layout and mxfp4_scales_to_kernel_layout, in one pass.
Status quantize_mxfp4_to_kernel_layout(const ExecContext& ctx, TensorView x, TensorView blocks,
                                       TensorView scales, TensorView kernel_scales,
                                       Mxfp4RowOrder order);

// blocks [.., ceil(K/32), 16] + scales [.., ceil(K/32)] (checkpoint layout) -> out [.., K]
// (bfloat16 or float32; K taken from out).
Status dequantize_mxfp4(const ExecContext& ctx, TensorView blocks, TensorView scales,
                        TensorView out);

// In place on blocks [.., N, K/32, 16] (every leading dimension an expert): checkpoint layout
// to kernel layout, and back; `order` names the checkpoint's row order (mxfp4.hpp). The
// inverse undoes the forward exactly; neither is idempotent. Extra memory: one group of 16
// (kPlain) or 32 rows (gate/up orders) of K/2 bytes. CUDA stages that group in a block's
// shared memory (227 KiB on H100/H200: K up to 14,528), else kUnimplemented.
Status mxfp4_blocks_to_kernel_layout(const ExecContext& ctx, TensorView blocks,
                                     Mxfp4RowOrder order);
Status mxfp4_blocks_to_checkpoint_layout(const ExecContext& ctx, TensorView blocks,
                                         Mxfp4RowOrder order);

// scales [.., N, K/32] (checkpoint, read only) -> kernel_scales [.., N, K/32] (kernel layout),
// and the inverse copy.
Status mxfp4_scales_to_kernel_layout(const ExecContext& ctx, TensorView scales,
                                     TensorView kernel_scales, Mxfp4RowOrder order);
Status mxfp4_scales_to_checkpoint_layout(const ExecContext& ctx, TensorView kernel_scales,
                                         TensorView scales, Mxfp4RowOrder order);

// ---- MXFP8 --------------------------------------------------------------------------------

// x [.., K] -> q [.., K] (E4M3), scales [.., ceil(K/32)].
Status quantize_mxfp8(const ExecContext& ctx, TensorView x, TensorView q, TensorView scales);
// q [.., K] + scales [.., ceil(K/32)] -> out [.., K] (bfloat16 or float32).
Status dequantize_mxfp8(const ExecContext& ctx, TensorView q, TensorView scales, TensorView out);

// ---- blockwise FP8, UE8M0 scales ----------------------------------------------------------

// k128x128: x [.., N, K] (rank >= 2), scales [.., ceil(N/128), ceil(K/128)] float32,
//           scales_ue8m0 [.., ceil(N/128), ceil(ceil(K/128)/4)] int32;
// k1x128:   x [.., K] (rank >= 1), scales [.., ceil(K/128)] float32,
//           scales_ue8m0 [.., ceil(ceil(K/128)/4)] int32.
// q has x's shape (E4M3). Either scale output may be absent (TensorView{}), not both. This is
// also the online requantization of activations: any shape, partial blocks included.
Status quantize_fp8_blockwise(const ExecContext& ctx, TensorView x, Fp8ScaleBlock block,
                              TensorView q, TensorView scales, TensorView scales_ue8m0);

// q + scales (float32, or packed UE8M0 int32, shapes as above) -> out (q's shape, bfloat16 or
// float32).
Status dequantize_fp8_blockwise(const ExecContext& ctx, TensorView q, TensorView scales,
                                Fp8ScaleBlock block, TensorView out);

}  // namespace rolloutd::quant
