#pragma once
// Quant methods: how a registered parameter moves between its checkpoint layout
// (what the trainer sends, what checksums and get_weights_by_name report) and its
// kernel layout (what the forward pass reads). Three hooks, each in place:
//   restore_before_load     kernel layout -> checkpoint layout
//   load                    write checkpoint-layout rows, converting dtype where allowed
//   postprocess_after_load  checkpoint layout -> kernel layout
// A per-parameter state flag makes the pair safe to call in any order: restoring a
// parameter already in checkpoint layout and postprocessing one already in kernel
// layout are refused no-ops (counted), never a second permutation -- the bug where a
// partial session permuted an already-permuted weight.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/quant/mxfp4.hpp"
#include "kernels/status.hpp"
#include "kernels/tensor_view.hpp"

namespace rolloutd::core {

enum class Layout : uint8_t { kCheckpoint, kKernel };

// A block of rows copied from a source tensor into a parameter (checkpoint coordinates).
// Rows are the last dimension's vectors; `expert` selects the slice of a stacked [E, R, C]
// parameter (-1 for unstacked parameters).
struct RowCopy {
  size_t param = 0;
  int64_t expert = -1;
  int64_t src_start = 0, src_stride = 1;
  int64_t dst_start = 0, dst_stride = 1;
  int64_t count = 0;
};

class QuantMethod {
 public:
  virtual ~QuantMethod() = default;
  virtual const char* name() const = 0;
  // True when restore/postprocess actually move data (begin_weight_update restores these).
  virtual bool transforms_layout() const = 0;
  virtual Status restore_before_load(const Backend& b, const ExecContext& ctx, TensorView storage) = 0;
  virtual Status postprocess_after_load(const Backend& b, const ExecContext& ctx, TensorView storage) = 0;
  // Checkpoint row `r` of expert `e` lives at kernel row kernel_row(r) (identity by default).
  virtual int64_t kernel_row(int64_t checkpoint_row) const { return checkpoint_row; }
  // The checkpoint-layout bytes of a parameter from a host copy of its kernel-layout storage
  // (`experts` slices of `rows` checkpoint rows of `row_bytes`), for reads while the parameter
  // is in kernel layout (weights_checksum, get_weights_by_name). The default follows
  // kernel_row(); methods that are not row permutations override it.
  virtual void kernel_to_checkpoint_host(const uint8_t* kernel, uint8_t* checkpoint, int64_t experts, int64_t rows,
                                         size_t row_bytes, size_t elem_bytes) const;
  // Non-checkpoint state the method owns (permutations, constants): backed up across memory
  // release later; exposed so tests can check it is bit-identical afterwards.
  virtual std::vector<int32_t> static_state() const { return {}; }
};

// A device buffer of at least `bytes` for in-place layout permutations on ctx's device, shared
// by every method of the process (the engine thread uses it; callers synchronize before the
// next use). Kept across sessions; release_device_staging gives it back (memory release of
// the weights), and the next permutation allocates it again.
Result<void*> device_staging(const Backend& b, const ExecContext& ctx, size_t bytes);
// Frees the staging buffer of ctx's device (the host buffer for a CPU context), if any; returns
// its size.
Result<size_t> release_device_staging(const ExecContext& ctx);

// Unquantized parameters: both layouts are the same bytes.
class IdentityMethod final : public QuantMethod {
 public:
  const char* name() const override { return "identity"; }
  bool transforms_layout() const override { return false; }
  Status restore_before_load(const Backend&, const ExecContext&, TensorView) override { return Status::Ok(); }
  Status postprocess_after_load(const Backend&, const ExecContext&, TensorView) override { return Status::Ok(); }
};

// Stacked expert gate/up weights [E, 2I, H]: the checkpoint concatenates gate rows [0, I)
// and up rows [I, 2I); the kernel layout interleaves them (gate j at row 2j, up j at 2j + 1)
// so one pass over an expert reads each gate/up pair together -- the layout the fused
// MXFP4 expert GEMM will want. The permutation is applied in place, a group of experts at a
// time: the group is staged in a buffer of at most `max_staging_bytes` (one expert when an
// expert is larger), then written back by two strided 3D copies (Backend::copy_3d, every
// expert of the group at once) -- three asynchronous calls per group, no tensor-sized buffer.
// (One 2D copy per expert cost ~1.5 ms of every session's begin and end on the GPU for the
// 4-layer embedded model, and would cost tens of ms for a 36-layer, 128-expert one.)
class InterleaveGateUpMethod final : public QuantMethod {
 public:
  static constexpr size_t kDefaultMaxStagingBytes = size_t{64} << 20;
  explicit InterleaveGateUpMethod(int64_t intermediate, size_t max_staging_bytes = kDefaultMaxStagingBytes);
  const char* name() const override { return "interleave_gate_up"; }
  bool transforms_layout() const override { return true; }
  Status restore_before_load(const Backend& b, const ExecContext& ctx, TensorView storage) override;
  Status postprocess_after_load(const Backend& b, const ExecContext& ctx, TensorView storage) override;
  int64_t kernel_row(int64_t checkpoint_row) const override {
    return kernel_of_checkpoint_[static_cast<size_t>(checkpoint_row)];
  }
  std::vector<int32_t> static_state() const override { return kernel_of_checkpoint_; }

 private:
  enum class Direction { kToKernel, kToCheckpoint };
  Status permute(const Backend& b, const ExecContext& ctx, TensorView storage, Direction to);
  int64_t inter_;
  size_t max_staging_bytes_;
  std::vector<int32_t> kernel_of_checkpoint_;      // checkpoint row -> kernel row
  std::vector<int32_t> checkpoint_of_kernel_;      // kernel row -> checkpoint row
};

// Stacked matrices stored input-major in the checkpoint, [E, A, B] (gpt-oss experts as
// transformers saves them: gate_up_proj [E, H, 2I], down_proj [E, I, H], used as x @ W[e]),
// whose kernel layout is the transpose [E, B, A] (one output row per expert row, what the
// expert op reads). The transpose runs in place through the shared staging buffer, a group of
// experts at a time (Backend::transpose). The parameter is registered with the checkpoint shape
// [E, A, B]; the forward pass views the same memory as [E, B, A].
class TransposeMethod final : public QuantMethod {
 public:
  explicit TransposeMethod(size_t max_staging_bytes = InterleaveGateUpMethod::kDefaultMaxStagingBytes)
      : max_staging_bytes_(max_staging_bytes) {}
  const char* name() const override { return "transpose"; }
  bool transforms_layout() const override { return true; }
  Status restore_before_load(const Backend& b, const ExecContext& ctx, TensorView storage) override;
  Status postprocess_after_load(const Backend& b, const ExecContext& ctx, TensorView storage) override;
  void kernel_to_checkpoint_host(const uint8_t* kernel, uint8_t* checkpoint, int64_t experts, int64_t rows,
                                 size_t row_bytes, size_t elem_bytes) const override;

 private:
  Status run(const Backend& b, const ExecContext& ctx, TensorView storage, bool to_kernel);
  size_t max_staging_bytes_;
};

// Stacked MXFP4 blocks [E, N, K/32, 16] (gpt-oss `*_blocks`, or blocks quantized on arrival):
// the kernel layout is the tiled one moe::experts reads (kernels/quant/mxfp4.hpp), made and undone
// in place by quant::mxfp4_blocks_to_kernel_layout / _to_checkpoint_layout; `order` is the
// checkpoint's row order (gate/up interleaved or concatenated, or plain for down_proj).
class Mxfp4BlocksMethod final : public QuantMethod {
 public:
  explicit Mxfp4BlocksMethod(quant::Mxfp4RowOrder order) : order_(order) {}
  const char* name() const override { return "mxfp4_blocks"; }
  bool transforms_layout() const override { return true; }
  Status restore_before_load(const Backend& b, const ExecContext& ctx, TensorView storage) override;
  Status postprocess_after_load(const Backend& b, const ExecContext& ctx, TensorView storage) override;
  void kernel_to_checkpoint_host(const uint8_t* kernel, uint8_t* checkpoint, int64_t experts, int64_t rows,
                                 size_t row_bytes, size_t elem_bytes) const override;

 private:
  quant::Mxfp4RowOrder order_;
};

// The scales beside Mxfp4BlocksMethod's blocks: the parameter itself never moves (checkpoint
// layout always, which reads and checksums see); postprocess writes the kernel-layout copy into
// `kernel_scales` (same shape, weights memory the model owns, not a checkpoint tensor), so every
// session that wrote the scales re-derives it, and a restore has nothing to undo.
class Mxfp4ScalesMethod final : public QuantMethod {
 public:
  Mxfp4ScalesMethod(quant::Mxfp4RowOrder order, TensorView kernel_scales)
      : order_(order), kernel_scales_(kernel_scales) {}
  const char* name() const override { return "mxfp4_scales"; }
  bool transforms_layout() const override { return false; }
  Status restore_before_load(const Backend&, const ExecContext&, TensorView) override { return Status::Ok(); }
  Status postprocess_after_load(const Backend& b, const ExecContext& ctx, TensorView storage) override;

 private:
  quant::Mxfp4RowOrder order_;
  TensorView kernel_scales_;
};

}  // namespace rolloutd::core
