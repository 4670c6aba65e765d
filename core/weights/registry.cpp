#include "core/weights/registry.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "kernels/bf16.hpp"
#include "kernels/quant/quant_ops.hpp"

namespace rolloutd::core {
namespace {

bool convertible(DType dst, DType src) {
  if (dst == src) return true;
  return (dst == DType::kF32 && src == DType::kBF16) || (dst == DType::kBF16 && src == DType::kF32);
}

// Converts `n` elements of `src` (src_dtype) into `dst` (dst_dtype), host memory.
void convert(void* dst, DType dst_dtype, const uint8_t* src, DType src_dtype, size_t n) {
  if (dst_dtype == src_dtype) {
    std::memcpy(dst, src, n * dtype_size(dst_dtype));
  } else if (dst_dtype == DType::kF32 && src_dtype == DType::kBF16) {
    auto* d = static_cast<float*>(dst);
    for (size_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, src + 2 * i, 2);
      d[i] = bf16_bits_to_f32(b);
    }
  } else {  // BF16 <- FP32
    auto* d = static_cast<uint16_t*>(dst);
    for (size_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, src + 4 * i, 4);
      d[i] = f32_to_bf16_bits(f);
    }
  }
}

std::string shape_string(std::span<const int64_t> s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

RowGeometry row_geometry(const TensorView& s) {
  if (s.rank() >= 3) {
    int64_t cols = 1;
    for (int i = 2; i < s.rank(); ++i) cols *= s.size(i);
    return {s.size(0), s.size(1), cols};
  }
  if (s.rank() == 2) return {1, s.size(0), s.size(1)};
  return {1, 1, s.numel()};
}

bool WeightRegistry::all_kernel_layout() const {
  for (const auto& p : params_)
    if (p.layout != Layout::kKernel) return false;
  return true;
}

Status WeightRegistry::add(std::string name, TensorView storage, std::unique_ptr<QuantMethod> method,
                           bool whole_name_alias) {
  if (param_index_.count(name) || tensors_.count(name))
    return Status(ErrorCode::kInternal, "parameter registered twice", name);
  const size_t index = params_.size();
  const RowGeometry g = row_geometry(storage);
  CheckpointTensor whole;
  whole.name = name;
  whole.shape.assign(storage.shape.data(), storage.shape.data() + storage.rank());
  for (int64_t e = 0; e < g.experts; ++e) {
    RowCopy c;
    c.param = index;
    c.expert = storage.rank() >= 3 ? e : -1;
    c.src_start = e * g.rows;
    c.count = g.rows;
    whole.pieces.push_back(c);
  }
  if (whole_name_alias) tensors_.emplace(name, std::move(whole));
  param_index_.emplace(name, index);
  RegisteredParameter p;
  p.name = std::move(name);
  p.storage = storage;
  p.method = method ? std::move(method) : std::make_unique<IdentityMethod>();
  params_.push_back(std::move(p));
  return Status::Ok();
}

bool CheckpointTensor::quantizes_from(DType src_dtype) const {
  return mxfp4 || (fp8 && (src_dtype == DType::kBF16 || src_dtype == DType::kF32));
}

int64_t WeightRegistry::mark_selected(std::span<const std::string> prefixes, std::vector<bool>& mask) const {
  struct Named {
    std::string_view name;
    size_t param;                  // a stored parameter's index, when `tensor` is null
    const CheckpointTensor* tensor;
  };
  std::vector<Named> names;
  names.reserve(params_.size() + tensors_.size());
  for (size_t i = 0; i < params_.size(); ++i) names.push_back({params_[i].name, i, nullptr});
  for (const auto& [name, t] : tensors_) names.push_back({name, 0, &t});
  std::sort(names.begin(), names.end(), [](const Named& a, const Named& b) { return a.name < b.name; });
  auto mark = [&](size_t p) {
    if (p < mask.size()) mask[p] = true;
  };
  for (size_t k = 0; k < prefixes.size(); ++k) {
    const std::string_view prefix = prefixes[k];
    auto it = std::lower_bound(names.begin(), names.end(), prefix,
                               [](const Named& n, std::string_view p) { return n.name < p; });
    const auto first = it;
    for (; it != names.end() && it->name.substr(0, prefix.size()) == prefix; ++it) {
      if (it->tensor == nullptr) {
        mark(it->param);
        continue;
      }
      const CheckpointTensor& t = *it->tensor;
      for (const RowCopy& c : t.pieces) mark(c.param);
      if (t.mxfp4) mark(t.mxfp4->blocks), mark(t.mxfp4->scales);
      if (t.fp8) mark(t.fp8->q), mark(t.fp8->scale_inv);
    }
    if (it == first) return static_cast<int64_t>(k);
  }
  return -1;
}

std::vector<size_t> CheckpointTensor::targets(DType src_dtype) const {
  if (mxfp4) return {mxfp4->blocks, mxfp4->scales};
  if (fp8 && quantizes_from(src_dtype)) return {fp8->q, fp8->scale_inv};
  std::vector<size_t> out;
  for (const RowCopy& c : pieces) out.push_back(c.param);
  return out;
}

Status WeightRegistry::add_mxfp4(std::string name, std::span<const int64_t> shape, TensorView blocks,
                                 TensorView scales, bool quantize_on_arrival,
                                 std::unique_ptr<QuantMethod> blocks_method,
                                 std::unique_ptr<QuantMethod> scales_method) {
  if (shape.empty() || shape.back() <= 0 || shape.back() % quant::kMxBlockSize != 0)
    return Status(ErrorCode::kInternal, "an MXFP4 parameter needs a last dimension that is a multiple of 32", name);
  if (tensors_.count(name) || param_index_.count(name))
    return Status(ErrorCode::kInternal, "checkpoint name registered twice", name);
  const int64_t kb = shape.back() / quant::kMxBlockSize;
  const int r = static_cast<int>(shape.size());
  bool ok = blocks.dtype == DType::kU8 && scales.dtype == DType::kU8 && blocks.rank() == r + 1 && scales.rank() == r &&
            blocks.size(r - 1) == kb && blocks.size(r) == 16 && scales.size(r - 1) == kb;
  for (int i = 0; ok && i + 1 < r; ++i) ok = blocks.size(i) == shape[i] && scales.size(i) == shape[i];
  if (!ok) return Status(ErrorCode::kInternal, "MXFP4 blocks/scales storage does not match the shape", name);
  const size_t b = params_.size();
  RD_RETURN_IF_ERROR(add(name + "_blocks", blocks, std::move(blocks_method)));
  RD_RETURN_IF_ERROR(add(name + "_scales", scales, std::move(scales_method)));
  if (!quantize_on_arrival) return Status::Ok();
  CheckpointTensor t;
  t.name = std::move(name);
  t.shape.assign(shape.begin(), shape.end());
  t.mxfp4 = CheckpointTensor::Mxfp4Target{b, b + 1};
  std::string key = t.name;
  tensors_.emplace(std::move(key), std::move(t));
  return Status::Ok();
}

Result<CheckpointTensor::Mxfp4Target> WeightRegistry::mxfp4_target(const std::string& name,
                                                                   std::string_view mxfp4_name) const {
  if (tensors_.count(name) || param_index_.count(name))
    return Status(ErrorCode::kInternal, "checkpoint name registered twice", name);
  const std::string base(mxfp4_name);
  const size_t b = index_of(base + "_blocks"), sc = index_of(base + "_scales");
  if (b == SIZE_MAX || sc != b + 1 || params_[b].storage.rank() != 4)
    return Status(ErrorCode::kInternal, "no MXFP4 parameter '" + base + "' (add_mxfp4 first)", name);
  return CheckpointTensor::Mxfp4Target{b, sc};
}

Status WeightRegistry::add_mxfp4_target(std::string name, std::span<const int64_t> shape,
                                        CheckpointTensor::Mxfp4Target target) {
  CheckpointTensor t;
  t.name = std::move(name);
  t.shape.assign(shape.begin(), shape.end());
  t.mxfp4 = target;
  std::string key = t.name;
  tensors_.emplace(std::move(key), std::move(t));
  return Status::Ok();
}

Status WeightRegistry::add_mxfp4_rows(std::string name, std::span<const int64_t> shape, std::string_view mxfp4_name,
                                      int64_t expert, int64_t row_start) {
  RD_ASSIGN_OR_RETURN(CheckpointTensor::Mxfp4Target target, mxfp4_target(name, mxfp4_name));
  const TensorView& blocks = params_[target.blocks].storage;
  const bool ok = shape.size() == 2 && shape[0] > 0 && shape[1] > 0 && shape[1] % quant::kMxBlockSize == 0 &&
                  blocks.size(2) == shape[1] / quant::kMxBlockSize && expert >= 0 && expert < blocks.size(0) &&
                  row_start >= 0 && row_start + shape[0] <= blocks.size(1);
  if (!ok)
    return Status(ErrorCode::kInternal, "MXFP4 expert rows out of bounds of '" + std::string(mxfp4_name) + "'", name);
  target.expert = expert;
  target.row_start = row_start;
  return add_mxfp4_target(std::move(name), shape, target);
}

Status WeightRegistry::add_mxfp4_input_major(std::string name, std::span<const int64_t> shape,
                                             std::string_view mxfp4_name) {
  RD_ASSIGN_OR_RETURN(CheckpointTensor::Mxfp4Target target, mxfp4_target(name, mxfp4_name));
  const TensorView& blocks = params_[target.blocks].storage;
  // [E, K, N] against blocks [E, N, K/32, 16].
  const bool ok = shape.size() == 3 && shape[0] == blocks.size(0) &&
                  shape[1] == blocks.size(2) * quant::kMxBlockSize && shape[2] == blocks.size(1);
  if (!ok)
    return Status(ErrorCode::kInternal, "input-major shape does not transpose onto '" + std::string(mxfp4_name) + "'",
                  name);
  target.input_major = true;
  return add_mxfp4_target(std::move(name), shape, target);
}

std::vector<RowCopy> WeightRegistry::rows_written(const CheckpointTensor& t, DType src_dtype) const {
  if (!t.quantizes_from(src_dtype)) return t.pieces;
  std::vector<RowCopy> out;
  if (t.mxfp4 && t.mxfp4->expert >= 0) {
    for (size_t p : {t.mxfp4->blocks, t.mxfp4->scales})
      out.push_back(RowCopy{p, t.mxfp4->expert, 0, 1, t.mxfp4->row_start, 1, t.shape[0]});
    return out;
  }
  // Whole-tensor quantization: every row of both outputs.
  for (size_t p : t.targets(src_dtype)) {
    const TensorView& s = params_[p].storage;
    const RowGeometry g = row_geometry(s);
    for (int64_t e = 0; e < g.experts; ++e) out.push_back(RowCopy{p, s.rank() >= 3 ? e : -1, 0, 1, 0, 1, g.rows});
  }
  return out;
}

Status WeightRegistry::add_fp8_blockwise(std::string name, TensorView q, TensorView scale_inv) {
  const int r = q.rank();
  bool ok = q.dtype == DType::kF8E4M3 && scale_inv.dtype == DType::kF32 && r >= 2 && scale_inv.rank() == r &&
            q.is_contiguous() && scale_inv.is_contiguous();
  for (int i = 0; ok && i < r; ++i) {
    const int64_t want = i + 2 < r ? q.size(i) : (q.size(i) + quant::kFp8BlockK - 1) / quant::kFp8BlockK;
    ok = scale_inv.size(i) == want;
  }
  if (!ok)
    return Status(ErrorCode::kInternal,
                  "an FP8 parameter needs float8_e4m3fn storage [.., N, K] and float32 scales [.., N/128, K/128]", name);
  const size_t qi = params_.size();
  RD_RETURN_IF_ERROR(add(name, q, nullptr));
  RD_RETURN_IF_ERROR(add(name + "_scale_inv", scale_inv, nullptr));
  tensors_.at(name).fp8 = CheckpointTensor::Fp8Target{qi, qi + 1};
  return Status::Ok();
}

Status WeightRegistry::add_alias(CheckpointTensor alias) {
  if (tensors_.count(alias.name)) return Status(ErrorCode::kInternal, "checkpoint name registered twice", alias.name);
  int64_t src_rows = 1, cols = -1;
  for (size_t i = 0; i + 1 < alias.shape.size(); ++i) src_rows *= alias.shape[i];
  for (const RowCopy& c : alias.pieces) {
    if (c.param >= params_.size()) return Status(ErrorCode::kInternal, "alias targets an unknown parameter", alias.name);
    const RowGeometry g = row_geometry(params_[c.param].storage);
    if (cols >= 0 && cols != g.cols) return Status(ErrorCode::kInternal, "alias pieces differ in row width", alias.name);
    cols = g.cols;
    const int64_t last_src = c.src_start + (c.count - 1) * c.src_stride;
    const int64_t last_dst = c.dst_start + (c.count - 1) * c.dst_stride;
    if (c.count <= 0 || c.src_start < 0 || last_src >= src_rows || c.dst_start < 0 || last_dst >= g.rows ||
        c.expert >= g.experts || (c.expert < 0 && params_[c.param].storage.rank() >= 3))
      return Status(ErrorCode::kInternal, "alias row copy out of bounds", alias.name);
  }
  if (alias.shape.empty() || alias.shape.back() != cols)
    return Status(ErrorCode::kInternal, "alias row width differs from its target", alias.name);
  std::string key = alias.name;
  tensors_.emplace(std::move(key), std::move(alias));
  return Status::Ok();
}

const CheckpointTensor* WeightRegistry::resolve(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const RegisteredParameter* WeightRegistry::find(std::string_view name) const {
  const size_t i = index_of(name);
  return i == SIZE_MAX ? nullptr : &params_[i];
}

size_t WeightRegistry::index_of(std::string_view name) const {
  auto it = param_index_.find(std::string(name));
  return it == param_index_.end() ? SIZE_MAX : it->second;
}

Status WeightRegistry::check_load(const CheckpointTensor& t, DType src_dtype, std::span<const int64_t> shape,
                                  size_t src_bytes) const {
  if (shape.size() != t.shape.size() || !std::equal(shape.begin(), shape.end(), t.shape.begin()))
    return Status(ErrorCode::kInvalidArgument,
                  "shape " + shape_string(shape) + " does not match " + t.name + " " + shape_string(t.shape),
                  "shape");
  uint64_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
  if (numel * dtype_size(src_dtype) != src_bytes)
    return Status(ErrorCode::kInvalidArgument, "byte count does not match shape and dtype", "nbytes");
  if (t.fp8 && !t.quantizes_from(src_dtype) && src_dtype != DType::kF8E4M3)
    return Status(ErrorCode::kInvalidArgument,
                  t.name + " is stored in FP8: send it as bfloat16 or float32 (quantized on arrival) or as "
                           "float8_e4m3fn with its _scale_inv, not " + std::string(dtype_name(src_dtype)),
                  "dtype");
  if (t.quantizes_from(src_dtype)) {
    if (src_dtype != DType::kBF16 && src_dtype != DType::kF32)
      return Status(ErrorCode::kInvalidArgument,
                    t.name + " is quantized to MXFP4 on arrival: send it as bfloat16 or float32, not " +
                        std::string(dtype_name(src_dtype)),
                    "dtype");
    for (size_t i : t.targets(src_dtype))
      if (params_[i].layout != Layout::kCheckpoint)
        return Status(ErrorCode::kFailedPrecondition,
                      "parameter " + params_[i].name + " is in kernel layout: it was not selected by begin_weight_update",
                      "name");
    return Status::Ok();
  }
  for (const RowCopy& c : t.pieces) {
    const RegisteredParameter& p = params_[c.param];
    if (!convertible(p.storage.dtype, src_dtype))
      return Status(ErrorCode::kInvalidArgument,
                    std::string("cannot load ") + std::string(dtype_name(src_dtype)) + " into " +
                        std::string(dtype_name(p.storage.dtype)) + " parameter " + p.name,
                    "dtype");
    if (p.layout != Layout::kCheckpoint)
      return Status(ErrorCode::kFailedPrecondition,
                    "parameter " + p.name + " is in kernel layout: it was not selected by begin_weight_update",
                    "name");
  }
  return Status::Ok();
}

Status WeightRegistry::load(const CheckpointTensor& t, DType src_dtype, std::span<const int64_t> shape,
                            std::span<const uint8_t> src, bool src_on_device) {
  RD_RETURN_IF_ERROR(check_load(t, src_dtype, shape, src.size()));
  if (src_on_device && ctx_.device.kind != DeviceKind::kCuda)
    return Status(ErrorCode::kInvalidArgument, "device-resident bytes for a model on the CPU", "source");
  if (t.quantizes_from(src_dtype)) return load_quantized(t, src_dtype, shape, src, src_on_device);
  std::vector<CopyRun> runs;
  append_copy_runs(t, src_dtype, src, runs);
  return copy_runs(runs, src_on_device);
}

void WeightRegistry::append_copy_runs(const CheckpointTensor& t, DType src_dtype, std::span<const uint8_t> src,
                                      std::vector<CopyRun>& runs) const {
  const size_t src_elem = dtype_size(src_dtype);
  for (const RowCopy& c : t.pieces) {
    const RegisteredParameter& p = params_[c.param];
    const RowGeometry g = row_geometry(p.storage);
    const size_t src_row_bytes = static_cast<size_t>(g.cols) * src_elem;
    const size_t dst_row_bytes = static_cast<size_t>(g.cols) * dtype_size(p.storage.dtype);
    char* base = static_cast<char*>(p.storage.data) +
                 dst_row_bytes * static_cast<size_t>((c.expert < 0 ? 0 : c.expert) * g.rows);
    // Contiguous rows are one run; strided ones (interleaved gate/up) a run per row.
    const int64_t run = (c.src_stride == 1 && c.dst_stride == 1) ? c.count : 1;
    for (int64_t i = 0; i < c.count; i += run) {
      runs.push_back(CopyRun{c.param, base + dst_row_bytes * static_cast<size_t>(c.dst_start + i * c.dst_stride),
                             src.data() + src_row_bytes * static_cast<size_t>(c.src_start + i * c.src_stride),
                             static_cast<size_t>(g.cols * run), src_dtype, static_cast<uint64_t>(run)});
    }
  }
}

Status WeightRegistry::copy_runs(std::span<const CopyRun> runs, bool src_on_device, size_t* failed_run) {
  if (src_on_device && ctx_.device.kind != DeviceKind::kCuda)
    return Status(ErrorCode::kInvalidArgument, "device-resident bytes for a model on the CPU", "source");
  // NOTES: one backend call per merged run. On CUDA each call is a cudaMemcpyAsync or a convert
  // kernel (2-3 us of host time): a bucket of 10,000 small tensors spent ~5 us per tensor here,
  // one call each, although the trainer packs them in order and the model stores them in order
  // (issue 7). Merging never reorders: runs join only the run directly before them in the list.
  size_t k = 0;
  while (k < runs.size()) {
    const CopyRun& first = runs[k];
    const TensorView& storage = params_[first.param].storage;
    const DType dst_dtype = storage.dtype, src_dtype = first.src_dtype;
    const bool dst_on_host = storage.device.kind == DeviceKind::kCpu;
    const size_t src_elem = dtype_size(src_dtype), dst_elem = dtype_size(dst_dtype);
    size_t n = first.elements, end = k + 1;
    for (; end < runs.size(); ++end) {
      const CopyRun& r = runs[end];
      const TensorView& next = params_[r.param].storage;
      const bool joins = r.elements == 0 ||
                         (r.src_dtype == src_dtype && next.dtype == dst_dtype &&
                          (next.device.kind == DeviceKind::kCpu) == dst_on_host && r.src == first.src + n * src_elem &&
                          r.dst == first.dst + n * dst_elem);
      if (!joins) break;
      n += r.elements;
    }
    if (n > 0) {
      ++num_copy_calls_;
      if (Status s = copy_elements(first.dst, dst_dtype, dst_on_host, first.src, src_dtype, n, src_on_device);
          !s.ok()) {
        if (failed_run) *failed_run = k;
        return s;
      }
    }
    for (size_t i = k; i < end; ++i) params_[runs[i].param].loads += runs[i].rows;
    k = end;
  }
  // Device-to-device work stays queued: the caller synchronizes once per bucket.
  if (ctx_.device.kind != DeviceKind::kCpu && !src_on_device) RD_RETURN_IF_ERROR(backend_.synchronize(ctx_));
  return Status::Ok();
}

Status WeightRegistry::copy_elements(char* d, DType dst_dtype, bool dst_on_host, const uint8_t* s, DType src_dtype,
                                     size_t n, bool src_on_device) {
  if (src_on_device) return backend_.convert(ctx_, d, dst_dtype, s, src_dtype, n);
  if (dst_on_host) {
    convert(d, dst_dtype, s, src_dtype, n);
    return Status::Ok();
  }
  const size_t dst_bytes = n * dtype_size(dst_dtype);
  if (dst_dtype == src_dtype) return backend_.copy(ctx_, d, s, dst_bytes, CopyKind::kHostToDevice);
  scratch_.resize(dst_bytes);
  convert(scratch_.data(), dst_dtype, s, src_dtype, n);
  RD_RETURN_IF_ERROR(backend_.copy(ctx_, d, scratch_.data(), dst_bytes, CopyKind::kHostToDevice));
  return backend_.synchronize(ctx_);  // scratch_ is reused by the next run
}

Status WeightRegistry::load_quantized(const CheckpointTensor& t, DType src_dtype, std::span<const int64_t> shape,
                                      std::span<const uint8_t> src, bool src_on_device) {
  if (t.mxfp4 && t.mxfp4->input_major) return load_input_major(t, src_dtype, shape, src, src_on_device);
  RegisteredParameter& out0 = params_[t.mxfp4 ? t.mxfp4->blocks : t.fp8->q];
  RegisteredParameter& out1 = params_[t.mxfp4 ? t.mxfp4->scales : t.fp8->scale_inv];
  TensorView dst0 = out0.storage, dst1 = out1.storage;
  uint64_t rows0 = 0, rows1 = 0;  // rows written (the loads counters)
  if (t.mxfp4 && t.mxfp4->expert >= 0) {
    // One expert's rows of the stacked blocks [E, R, K/32, 16] and scales [E, R, K/32]:
    // contiguous, so plain views at the first row.
    const int64_t rows = shape[0], kb = dst0.size(2), first = t.mxfp4->expert * dst0.size(1) + t.mxfp4->row_start;
    dst0 = TensorView::contiguous(static_cast<uint8_t*>(dst0.data) + first * kb * 16, DType::kU8, Shape{rows, kb, 16},
                                  dst0.device);
    dst1 = TensorView::contiguous(static_cast<uint8_t*>(dst1.data) + first * kb, DType::kU8, Shape{rows, kb},
                                  dst1.device);
    rows0 = rows1 = static_cast<uint64_t>(rows);
  } else {
    const RowGeometry g0 = row_geometry(out0.storage), g1 = row_geometry(out1.storage);
    rows0 = static_cast<uint64_t>(g0.rows * g0.experts);
    rows1 = static_cast<uint64_t>(g1.rows * g1.experts);
  }
  Shape sh = Shape::of(shape.data(), static_cast<int>(shape.size()));
  const bool cuda = ctx_.device.kind == DeviceKind::kCuda;
  // Host bytes for a model on the GPU go up first (into memory held for this call only).
  void* dev = nullptr;
  const void* x = src.data();
  if (cuda && !src_on_device) {
    RD_RETURN_IF_ERROR(backend_.alloc(ctx_, src.size(), &dev));
    Status s = backend_.copy(ctx_, dev, src.data(), src.size(), CopyKind::kHostToDevice);
    if (!s.ok()) {
      (void)backend_.free(ctx_, dev);
      return s;
    }
    x = dev;
  }
  TensorView xv = TensorView::contiguous(const_cast<void*>(x), src_dtype, sh, cuda ? ctx_.device : Device::cpu());
  Status s = t.mxfp4 ? quant::quantize_mxfp4(ctx_, xv, dst0, dst1)
                    : quant::quantize_fp8_blockwise(ctx_, xv, quant::Fp8ScaleBlock::k128x128, dst0, dst1, TensorView{});
  if (dev) {
    // The quantization reads `dev` asynchronously: wait before freeing it.
    if (Status w = backend_.synchronize(ctx_); s.ok()) s = w;
    (void)backend_.free(ctx_, dev);
  }
  RD_RETURN_IF_ERROR(s);
  out0.loads += rows0;
  out1.loads += rows1;
  return Status::Ok();
}

Status WeightRegistry::load_input_major(const CheckpointTensor& t, DType src_dtype, std::span<const int64_t> shape,
                                        std::span<const uint8_t> src, bool src_on_device) {
  RegisteredParameter& blocks = params_[t.mxfp4->blocks];
  RegisteredParameter& scales = params_[t.mxfp4->scales];
  const int64_t E = shape[0], K = shape[1], N = shape[2], kb = K / quant::kMxBlockSize;
  const size_t elem = dtype_size(src_dtype);
  const size_t expert_bytes = static_cast<size_t>(K * N) * elem;
  const int64_t group = std::max<int64_t>(1, std::min<int64_t>(E, static_cast<int64_t>(staging_bytes_ / expert_bytes)));
  const size_t staged = expert_bytes * static_cast<size_t>(group);
  const bool cuda = ctx_.device.kind == DeviceKind::kCuda;
  const Device dev = cuda ? ctx_.device : Device::cpu();
  // tr: a group transposed to [n, N, K]; up: host bytes of a group uploaded for a model on the
  // GPU (device bytes, and host bytes for a model on the CPU, are transposed where they lie).
  // On the GPU both live in the layout methods' staging buffer (device_staging: kept between
  // calls, given back with the weights memory), not a cudaMalloc and a synchronizing cudaFree
  // per tensor: a gpt-oss-120b update loads 72 of these tensors.
  void* tr = nullptr;
  void* up = nullptr;
  std::vector<uint8_t> host_tr;
  if (cuda) {
    RD_ASSIGN_OR_RETURN(void* buf, device_staging(backend_, ctx_, src_on_device ? staged : 2 * staged));
    tr = buf;
    if (!src_on_device) up = static_cast<uint8_t*>(buf) + staged;
  } else {
    host_tr.resize(staged);
    tr = host_tr.data();
  }
  Status s;
  for (int64_t e0 = 0; e0 < E && s.ok(); e0 += group) {
    const int64_t n = std::min(group, E - e0);
    const uint8_t* from = src.data() + expert_bytes * static_cast<size_t>(e0);
    if (up) {
      // Stream order keeps `up` and `tr` from being overwritten before the previous group's
      // transpose and quantization have read them.
      s = backend_.copy(ctx_, up, from, expert_bytes * static_cast<size_t>(n), CopyKind::kHostToDevice);
      if (!s.ok()) break;
      from = static_cast<const uint8_t*>(up);
    }
    const TensorView x = TensorView::contiguous(const_cast<uint8_t*>(from), src_dtype, Shape{n, K, N}, dev);
    const TensorView xt = TensorView::contiguous(tr, src_dtype, Shape{n, N, K}, dev);
    s = backend_.transpose(ctx_, xt, x);
    if (!s.ok()) break;
    const TensorView b = TensorView::contiguous(static_cast<uint8_t*>(blocks.storage.data) + e0 * N * kb * 16,
                                                DType::kU8, Shape{n, N, kb, 16}, blocks.storage.device);
    const TensorView sv = TensorView::contiguous(static_cast<uint8_t*>(scales.storage.data) + e0 * N * kb,
                                                 DType::kU8, Shape{n, N, kb}, scales.storage.device);
    s = quant::quantize_mxfp4(ctx_, xt, b, sv);
  }
  if (cuda) {
    // The staging is read asynchronously: wait before its next user writes it.
    if (Status w = backend_.synchronize(ctx_); s.ok()) s = w;
  }
  RD_RETURN_IF_ERROR(s);
  blocks.loads += static_cast<uint64_t>(E * N);
  scales.loads += static_cast<uint64_t>(E * N);
  return Status::Ok();
}

namespace {
Status released_status(const std::string& name) {
  return Status(ErrorCode::kFailedPrecondition,
                "the weights memory is released (release_memory): resume_memory{weights} before touching " + name);
}
}  // namespace

Status WeightRegistry::restore(size_t i) {
  RegisteredParameter& p = params_[i];
  if (!resident_) return released_status(p.name);
  if (p.layout == Layout::kCheckpoint) {
    ++counters_.refused_restores;
    return Status::Ok();
  }
  RD_RETURN_IF_ERROR(p.method->restore_before_load(backend_, ctx_, p.storage));
  p.layout = Layout::kCheckpoint;
  return Status::Ok();
}

Status WeightRegistry::postprocess(size_t i) {
  RegisteredParameter& p = params_[i];
  if (!resident_) return released_status(p.name);
  if (p.layout == Layout::kKernel) {
    ++counters_.refused_postprocesses;
    return Status::Ok();
  }
  RD_RETURN_IF_ERROR(p.method->postprocess_after_load(backend_, ctx_, p.storage));
  p.layout = Layout::kKernel;
  p.loads = 0;
  return Status::Ok();
}

Status WeightRegistry::postprocess_all() {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].layout == Layout::kCheckpoint) RD_RETURN_IF_ERROR(postprocess(i));
  // Some methods only queue their moves (Mxfp4BlocksMethod): done when this returns.
  return synchronize();
}

Status WeightRegistry::synchronize() { return resident_ ? backend_.synchronize(ctx_) : Status::Ok(); }

Status WeightRegistry::read_checkpoint(size_t i, std::vector<uint8_t>& out) const {
  const RegisteredParameter& p = params_[i];
  if (!resident_) return released_status(p.name);
  const RowGeometry g = row_geometry(p.storage);
  const size_t row_bytes = static_cast<size_t>(g.cols) * dtype_size(p.storage.dtype);
  out.resize(row_bytes * static_cast<size_t>(g.rows * g.experts));
  const CopyKind kind = p.storage.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kDeviceToHost;
  if (p.layout == Layout::kCheckpoint || !p.method->transforms_layout()) {
    RD_RETURN_IF_ERROR(backend_.copy(ctx_, out.data(), p.storage.data, out.size(), kind));
    if (kind == CopyKind::kDeviceToHost) RD_RETURN_IF_ERROR(backend_.synchronize(ctx_));
    return Status::Ok();
  }
  // Kernel layout: one copy of the storage, then the method maps it back on the host.
  std::vector<uint8_t> kernel(out.size());
  RD_RETURN_IF_ERROR(backend_.copy(ctx_, kernel.data(), p.storage.data, kernel.size(), kind));
  if (kind == CopyKind::kDeviceToHost) RD_RETURN_IF_ERROR(backend_.synchronize(ctx_));
  p.method->kernel_to_checkpoint_host(kernel.data(), out.data(), g.experts, g.rows, row_bytes,
                                      dtype_size(p.storage.dtype));
  return Status::Ok();
}

}  // namespace rolloutd::core
