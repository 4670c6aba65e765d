#pragma once
// Internal to kernels/quant/: the validated form of each operation's arguments ("plans",
// typed pointers plus geometry), built by quant_checks.cpp before any data is touched and
// consumed by the CPU reference (cpu_quant.cpp) and the CUDA kernels (cuda_quant.cu) alike,
// so both backends accept and reject exactly the same calls.
#include <cstdint>

#include "kernels/quant/quant_ops.hpp"

namespace rolloutd::quant::detail {

// A bfloat16/float32 input read as rows of K elements through its strides.
struct StridedRows {
  const void* data = nullptr;
  bool bf16 = true;
  bool contiguous = true;  // row r starts at r * cols, unit column stride
  int64_t rows = 0;        // product of every dimension but the last
  int64_t cols = 0;        // K
  int lead_rank = 0;       // rank - 1
  int64_t lead_size[kMaxDims] = {};
  int64_t lead_stride[kMaxDims] = {};
  int64_t col_stride = 1;

  RD_HOST_DEVICE int64_t row_offset(int64_t r) const {
    if (contiguous) return r * cols;
    int64_t off = 0;
    for (int d = lead_rank - 1; d >= 0; --d) {
      off += (r % lead_size[d]) * lead_stride[d];
      r /= lead_size[d];
    }
    return off;
  }
  // FP32 bits of element (row offset `ro` from row_offset, column k).
  RD_HOST_DEVICE uint32_t load_bits(int64_t ro, int64_t k) const {
    const int64_t i = ro + k * col_stride;
    return bf16 ? static_cast<uint32_t>(static_cast<const uint16_t*>(data)[i]) << 16
                : static_cast<const uint32_t*>(data)[i];
  }
};

// MXFP4 / MXFP8 quantization.
struct MxQuantPlan {
  StridedRows x;
  bool fp4 = true;
  int64_t num_kb = 0;  // ceil(K / 32)
  Fp4x2* blocks = nullptr;  // fp4: [rows, num_kb * 16]
  E4M3* q = nullptr;        // fp8: [rows, K]
  E8M0* scales = nullptr;   // [rows, num_kb], checkpoint layout
  // MXFP4 straight into the kernel layout (blocks permuted, kernel_scales written too).
  bool kernel_layout = false;
  E8M0* kernel_scales = nullptr;
  Mxfp4RowOrder order = Mxfp4RowOrder::kPlain;
  int64_t rows_per_expert = 0;  // N
};

struct MxDequantPlan {
  bool fp4 = true;
  const Fp4x2* blocks = nullptr;  // fp4
  const E4M3* q = nullptr;        // fp8
  const E8M0* scales = nullptr;
  void* out = nullptr;
  bool out_bf16 = true;
  int64_t rows = 0, cols = 0, num_kb = 0;
};

// Scale row of input row r: (r / rows_per_batch) * row_blocks_per_batch + (r % rows_per_batch)
// / block_rows. k1x128 is rows_per_batch = block_rows = 1.
struct Fp8Geometry {
  int64_t rows = 0, cols = 0;
  int64_t rows_per_batch = 1, block_rows = 1, row_blocks_per_batch = 1;
  int64_t num_kb = 0;            // ceil(K / 128)
  int64_t packed_row_bytes = 0;  // 4 * ceil(num_kb / 4)
  RD_HOST_DEVICE int64_t scale_row(int64_t r) const {
    return (r / rows_per_batch) * row_blocks_per_batch + (r % rows_per_batch) / block_rows;
  }
  int64_t num_scale_rows() const { return rows / rows_per_batch * row_blocks_per_batch; }
};

struct Fp8QuantPlan {
  StridedRows x;
  Fp8Geometry g;
  E4M3* q = nullptr;        // [rows, K]
  float* scales = nullptr;  // optional [scale rows, num_kb]
  E8M0* packed = nullptr;   // optional, the int32 tensor's bytes [scale rows, packed_row_bytes]
};

struct Fp8DequantPlan {
  Fp8Geometry g;
  const E4M3* q = nullptr;
  const float* scales = nullptr;  // one of these two
  const E8M0* packed = nullptr;
  void* out = nullptr;
  bool out_bf16 = true;
};

// In-place MXFP4 value permutation of `experts` matrices of n rows x row_bytes.
struct LayoutPlan {
  Fp4x2* blocks = nullptr;
  int64_t experts = 0, n = 0, row_bytes = 0;
  Mxfp4RowOrder order = Mxfp4RowOrder::kPlain;
  bool to_kernel = true;
};

struct ScalesLayoutPlan {
  const E8M0* src = nullptr;
  E8M0* dst = nullptr;
  int64_t experts = 0, n = 0, row_blocks = 0;
  Mxfp4RowOrder order = Mxfp4RowOrder::kPlain;
  bool to_kernel = true;
};

// ---- validation (quant_checks.cpp) --------------------------------------------------------
Status check_context(const ExecContext& ctx);
Result<MxQuantPlan> check_quantize_mx(const ExecContext& ctx, const TensorView& x,
                                      const TensorView& q, const TensorView& scales, bool fp4);
Result<MxQuantPlan> check_quantize_mxfp4_kernel(const ExecContext& ctx, const TensorView& x,
                                                const TensorView& blocks,
                                                const TensorView& scales,
                                                const TensorView& kernel_scales,
                                                Mxfp4RowOrder order);
Result<MxDequantPlan> check_dequantize_mx(const ExecContext& ctx, const TensorView& q,
                                          const TensorView& scales, const TensorView& out,
                                          bool fp4);
Result<LayoutPlan> check_layout(const ExecContext& ctx, const TensorView& blocks,
                                Mxfp4RowOrder order, bool to_kernel);
Result<ScalesLayoutPlan> check_scales_layout(const ExecContext& ctx, const TensorView& src,
                                             const char* src_name, const TensorView& dst,
                                             const char* dst_name, Mxfp4RowOrder order,
                                             bool to_kernel);
Result<Fp8QuantPlan> check_quantize_fp8(const ExecContext& ctx, const TensorView& x,
                                        Fp8ScaleBlock block, const TensorView& q,
                                        const TensorView& scales,
                                        const TensorView& scales_ue8m0);
Result<Fp8DequantPlan> check_dequantize_fp8(const ExecContext& ctx, const TensorView& q,
                                            const TensorView& scales, Fp8ScaleBlock block,
                                            const TensorView& out);

// ---- CPU reference (cpu_quant.cpp) --------------------------------------------------------
void cpu_quantize_mx(const MxQuantPlan& p);
void cpu_dequantize_mx(const MxDequantPlan& p);
void cpu_layout(const LayoutPlan& p);
void cpu_scales_layout(const ScalesLayoutPlan& p);
void cpu_quantize_fp8(const Fp8QuantPlan& p);
void cpu_dequantize_fp8(const Fp8DequantPlan& p);

#if defined(ROLLOUTD_WITH_CUDA)
// ---- CUDA (cuda_quant.cu): asynchronous on ctx's stream -----------------------------------
Status cuda_quantize_mx(const ExecContext& ctx, const MxQuantPlan& p);
Status cuda_dequantize_mx(const ExecContext& ctx, const MxDequantPlan& p);
Status cuda_layout(const ExecContext& ctx, const LayoutPlan& p);
Status cuda_scales_layout(const ExecContext& ctx, const ScalesLayoutPlan& p);
Status cuda_quantize_fp8(const ExecContext& ctx, const Fp8QuantPlan& p);
Status cuda_dequantize_fp8(const ExecContext& ctx, const Fp8DequantPlan& p);
#endif

}  // namespace rolloutd::quant::detail
