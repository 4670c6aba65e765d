#pragma once
// The weight registry: every parameter registered once at model build under its
// Hugging Face checkpoint name, with its stored dtype/shape, its stable storage,
// its quant method and its layout flag; plus the loader mappings that real
// checkpoints need (per-expert tensors into a stacked [E, ...] parameter, fused
// gate/up in concatenated or interleaved order, fused QKV) as checkpoint-name
// aliases that resolve to row copies.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/storage/static_state.hpp"
#include "core/weights/quant_method.hpp"
#include "kernels/backend.hpp"
#include "kernels/status.hpp"

namespace rolloutd::core {

struct RegisteredParameter {
  std::string name;
  TensorView storage;                    // stored dtype/shape; address fixed for the model's life
  std::unique_ptr<QuantMethod> method;
  Layout layout = Layout::kCheckpoint;   // freshly allocated storage holds checkpoint data
  uint64_t loads = 0;                    // rows written since the last postprocess
};

// A checkpoint tensor the registry accepts: its name, shape, and where its rows land.
struct CheckpointTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<RowCopy> pieces;
  // Online quantization: instead of row copies, the tensor (BF16 or FP32, [.., K]) is quantized
  // to MXFP4 on arrival, into these two parameters (blocks [.., K/32, 16], scales [.., K/32],
  // the gpt-oss checkpoint layout) -- on the device when the model is on one. `expert` >= 0: the
  // tensor ([rows, K]) is one expert's rows of stacked blocks [E, R, K/32, 16] / scales
  // [E, R, K/32], written from row `row_start` of that expert (a per-expert checkpoint tensor;
  // MXFP4 quantizes each row on its own, so a slice quantizes to the bytes of the whole).
  // `input_major`: the tensor arrives [E, K, N] (transformers' GptOssExperts in BF16: x @ W[e])
  // and each expert is transposed to [N, K] before it quantizes, as transformers transposes the
  // dequantized [E, N, K] blocks of the published checkpoint into that tensor.
  struct Mxfp4Target {
    size_t blocks = 0, scales = 0;
    int64_t expert = -1, row_start = 0;
    bool input_major = false;
  };
  std::optional<Mxfp4Target> mxfp4 = std::nullopt;
  // Online FP8: the tensor ([.., N, K]) arrives in BF16/FP32 and is quantized to E4M3 with one
  // power-of-two (UE8M0) scale per 128 x 128 block into the stored parameter of its own name
  // and `<name>_scale_inv` (FP32 [.., ceil(N/128), ceil(K/128)]: the DeepSeek-V3 checkpoint
  // layout); float8_e4m3fn bytes go straight into the stored parameter (`pieces`).
  struct Fp8Target {
    size_t q = 0, scale_inv = 0;
  };
  std::optional<Fp8Target> fp8 = std::nullopt;
  // True when a load from `src_dtype` quantizes (MXFP4 or FP8 on arrival).
  bool quantizes_from(DType src_dtype) const;
  // Every parameter a load of this tensor from `src_dtype` writes.
  std::vector<size_t> targets(DType src_dtype) const;
};

struct RegistryCounters {
  uint64_t refused_restores = 0;       // restore on a parameter already in checkpoint layout
  uint64_t refused_postprocesses = 0;  // postprocess on a parameter already in kernel layout
};

class WeightRegistry {
 public:
  WeightRegistry(const Backend& backend, ExecContext ctx) : backend_(backend), ctx_(ctx), static_state_(backend, ctx) {}

  // Registers a stored parameter (and its own name as a whole-tensor checkpoint name).
  // `whole_name_alias` = false leaves the name free for an add_alias() with another row
  // order (a fused tensor whose checkpoint interleaves what the parameter concatenates).
  Status add(std::string name, TensorView storage, std::unique_ptr<QuantMethod> method,
             bool whole_name_alias = true);
  // True when every parameter is in kernel layout (what the forward pass may read).
  bool all_kernel_layout() const;
  // Registers an extra checkpoint name (an alias) made of row copies into parameters.
  Status add_alias(CheckpointTensor alias);
  // Registers `name` ([.., K] in BF16/FP32 from the trainer, K a multiple of 32) as quantized to
  // MXFP4 on arrival into two stored uint8 parameters `<name>_blocks` [.., K/32, 16] and
  // `<name>_scales` [.., K/32] (which also take MXFP4 bytes directly, as gpt-oss ships them).
  // quantize_on_arrival = false registers only the two stored names (no BF16/FP32 `name`): for
  // a checkpoint whose unquantized tensor has another orientation than the blocks (gpt-oss experts
  // as transformers saves them), where quantizing along the wrong axis would go unnoticed.
  // blocks_method / scales_method: how the two stored parameters move to kernel layout (null:
  // they stay as stored; Mxfp4BlocksMethod / Mxfp4ScalesMethod for the expert op's tiled layout).
  Status add_mxfp4(std::string name, std::span<const int64_t> shape, TensorView blocks, TensorView scales,
                   bool quantize_on_arrival = true, std::unique_ptr<QuantMethod> blocks_method = nullptr,
                   std::unique_ptr<QuantMethod> scales_method = nullptr);
  // Registers `name` ([rows, K] in BF16/FP32) as rows [row_start, row_start + rows) of expert
  // `expert` of the stacked MXFP4 parameter `mxfp4_name` (registered by add_mxfp4, blocks
  // [E, R, K/32, 16]), quantized on arrival: a per-expert checkpoint tensor
  // (`mlp.experts.E.gate_proj.weight`) of experts stored as MXFP4.
  Status add_mxfp4_rows(std::string name, std::span<const int64_t> shape, std::string_view mxfp4_name,
                        int64_t expert, int64_t row_start);
  // Registers `name` ([E, K, N] in BF16/FP32: experts stored input-major, as transformers keeps
  // gpt-oss's unquantized gate_up_proj / down_proj) as quantized on arrival into the stacked MXFP4
  // parameter `mxfp4_name` (registered by add_mxfp4, blocks [E, N, K/32, 16]): each expert is
  // transposed to [N, K] on the way, so the blocks are those of the published MXFP4 checkpoint.
  // Transposed and quantized a few experts at a time through staging of at most
  // staging_bytes() per buffer (or one expert's bytes; on the GPU the layout methods' shared
  // device_staging buffer, on the CPU one held for that load): a 128-expert
  // gpt-oss-120b layer is ~4 GB in BF16.
  Status add_mxfp4_input_major(std::string name, std::span<const int64_t> shape, std::string_view mxfp4_name);
  size_t staging_bytes() const { return staging_bytes_; }
  void set_staging_bytes(size_t bytes) { staging_bytes_ = bytes; }  // tests: several expert groups
  // Registers `name` as a stored float8_e4m3fn parameter `q` [.., N, K] quantized on arrival
  // from BF16/FP32 (blockwise 128 x 128, UE8M0 scales into `scale_inv` [.., ceil(N/128),
  // ceil(K/128)] FP32, registered as `<name>_scale_inv`); FP8 bytes and scales load directly.
  Status add_fp8_blockwise(std::string name, TensorView q, TensorView scale_inv);

  const CheckpointTensor* resolve(std::string_view checkpoint_name) const;
  // The parameters name prefixes select: those whose own name starts with one, and those any
  // checkpoint name starting with one writes (per-expert tensors, fused q/k/v parts, online
  // quantization targets), so a trainer may select by the names it pushes. Marks them in `mask`
  // (parameters().size() long); returns the index of the first prefix that names nothing, or -1.
  // One sort of the names, then a range per prefix (a selector may list 65,536 prefixes).
  int64_t mark_selected(std::span<const std::string> prefixes, std::vector<bool>& mask) const;
  // The rows a load of `t` from `src_dtype` writes, as row copies into parameters (`param`,
  // `expert`, `dst_start`, `dst_stride`, `count`; the source fields are not meaningful for
  // quantized loads): its `pieces`, or the rows of the quantized outputs. What a loader
  // checks coverage and overlap with.
  std::vector<RowCopy> rows_written(const CheckpointTensor& t, DType src_dtype) const;
  const RegisteredParameter* find(std::string_view param_name) const;
  size_t index_of(std::string_view param_name) const;  // SIZE_MAX if unknown
  const std::vector<RegisteredParameter>& parameters() const { return params_; }
  size_t size() const { return params_.size(); }

  // Writes checkpoint-layout data for one checkpoint tensor (or quantizes it: CheckpointTensor::mxfp4). `src` holds the tensor in
  // `src_dtype`, row-major, `shape` must equal the tensor's shape. Conversions allowed: FP32
  // storage <- BF16/FP32, BF16 storage <- FP32 (round to nearest even)/BF16; other dtypes
  // must match. Every target parameter must be in checkpoint layout (restored).
  // `src_on_device`: the bytes live on the registry's CUDA device (an NCCL staging buffer, a
  // CUDA IPC mapping); copies and conversions then run on the device.
  Status load(const CheckpointTensor& t, DType src_dtype, std::span<const int64_t> shape,
              std::span<const uint8_t> src, bool src_on_device = false);
  // Checks load() would accept (dtype, shape, layout) without writing anything.
  Status check_load(const CheckpointTensor& t, DType src_dtype, std::span<const int64_t> shape,
                    size_t src_bytes) const;

  // A bucket's plain loads, written together: load() of a tensor that does not quantize is a
  // list of copy runs (one per contiguous run of rows, in its `pieces` order), and a bucket's
  // runs, copied in the bucket's order with adjacent runs merged, write exactly what load() of
  // each tensor in turn would (see copy_runs). `elements` elements of `src_dtype` at `src` go to
  // parameter `param` at `dst`, converted to its stored dtype; `rows` counts them for `loads`.
  struct CopyRun {
    size_t param = 0;
    char* dst = nullptr;
    const uint8_t* src = nullptr;
    size_t elements = 0;
    DType src_dtype = DType::kF32;
    uint64_t rows = 0;
  };
  // Appends the runs of load(t, src_dtype, shape, src): check_load() must have accepted it and
  // it must not quantize (!t.quantizes_from(src_dtype)).
  void append_copy_runs(const CheckpointTensor& t, DType src_dtype, std::span<const uint8_t> src,
                        std::vector<CopyRun>& runs) const;
  // Copies `runs` in order. A run whose source and destination both start where the previous
  // one's end (same source and stored dtypes) joins that copy, so a bucket whose tensors lie in
  // the same order and back to back in the bucket and in storage is one backend call, not one
  // per tensor. Merged runs write disjoint, consecutive bytes, so the result is that of copying
  // the runs one by one. On failure `*failed_run` (if given) is the first run of the failed copy.
  Status copy_runs(std::span<const CopyRun> runs, bool src_on_device, size_t* failed_run = nullptr);
  // Backend calls copy_runs() made since construction (merged copies count once): for tests and
  // benchmarks.
  uint64_t num_copy_calls() const { return num_copy_calls_; }

  // Layout transitions; refused no-ops when the flag says the move was already made.
  Status restore(size_t param);
  Status postprocess(size_t param);
  Status postprocess_all();
  // Waits for the layout work queued on the registry's stream (restores, postprocesses): a session's
  // begin and end reply only after their layout moves have run (and report a device fault as theirs).
  Status synchronize();

  // The parameter's checkpoint-layout bytes in its stored dtype (independent of the current
  // layout: kernel-layout rows are read back through the method's row map).
  Status read_checkpoint(size_t param, std::vector<uint8_t>& out) const;

  // Device state of the model that is not a checkpoint tensor (expert maps' device copies,
  // constants): backed up across a release of its memory, never written by a session.
  StaticState& static_state() { return static_state_; }
  const StaticState& static_state() const { return static_state_; }
  // False while the weights memory is released: parameter storage is unmapped, so reads
  // (read_checkpoint) and layout moves are refused with kFailedPrecondition.
  void set_resident(bool resident) { resident_ = resident; }
  bool resident() const { return resident_; }

  const RegistryCounters& counters() const { return counters_; }
  const Backend& backend() const { return backend_; }
  const ExecContext& context() const { return ctx_; }

 private:
  // Quantizes one checkpoint tensor (MXFP4 or FP8 on arrival), host bytes uploaded first for a
  // model on the GPU.
  Status load_quantized(const CheckpointTensor& t, DType src_dtype, std::span<const int64_t> shape,
                        std::span<const uint8_t> src, bool src_on_device);
  // The stacked MXFP4 parameter `mxfp4_name` (add_mxfp4) as a target for checkpoint name `name`
  // (not registered yet); add_mxfp4_target() registers `name` onto it.
  Result<CheckpointTensor::Mxfp4Target> mxfp4_target(const std::string& name, std::string_view mxfp4_name) const;
  Status add_mxfp4_target(std::string name, std::span<const int64_t> shape, CheckpointTensor::Mxfp4Target target);
  // load_quantized() of an input-major tensor (Mxfp4Target::input_major): expert groups through
  // staging, transposed, then quantized into their slice of the blocks and scales.
  Status load_input_major(const CheckpointTensor& t, DType src_dtype, std::span<const int64_t> shape,
                          std::span<const uint8_t> src, bool src_on_device);
  // One (merged) run: `n` elements from src into parameter memory at dst.
  Status copy_elements(char* dst, DType dst_dtype, bool dst_on_host, const uint8_t* src, DType src_dtype, size_t n,
                       bool src_on_device);

  const Backend& backend_;
  ExecContext ctx_;
  std::vector<RegisteredParameter> params_;
  std::unordered_map<std::string, size_t> param_index_;
  // Looked up by string_view (transparent hash): resolving a bucket entry's name allocates nothing.
  struct NameHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, CheckpointTensor, NameHash, std::equal_to<>> tensors_;
  RegistryCounters counters_;
  std::vector<uint8_t> scratch_;
  StaticState static_state_;
  bool resident_ = true;
  uint64_t num_copy_calls_ = 0;
  size_t staging_bytes_ = size_t{64} << 20;
};

// Rows and row width of a stored parameter as the row copies see it: [E, R, C] -> (E, R, C);
// [R, C] -> (1, R, C); [C] -> (1, 1, C).
struct RowGeometry {
  int64_t experts, rows, cols;
};
RowGeometry row_geometry(const TensorView& storage);

}  // namespace rolloutd::core
