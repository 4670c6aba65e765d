#include "core/weights/quant_method.hpp"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <map>
#include <mutex>

#include "kernels/quant/quant_ops.hpp"

namespace rolloutd::core {

namespace {
// One staging buffer per device for every layout permutation of the process, grown on demand
// and kept: a cudaMalloc/cudaFree pair per parameter per session cost more than the copies.
// Permutations run on the engine thread; the mutex covers tests that build several models.
struct DeviceStaging {
  const Backend* backend = nullptr;
  ExecContext ctx;
  void* ptr = nullptr;
  size_t bytes = 0;
};
std::mutex g_staging_mu;
std::map<int, DeviceStaging> g_staging;
std::vector<char> g_host_staging;  // the same for CPU storage (one buffer, not one per layer)
}  // namespace

char* host_staging(size_t bytes) {
  std::lock_guard<std::mutex> lock(g_staging_mu);
  if (g_host_staging.size() < bytes) g_host_staging.resize(bytes);
  return g_host_staging.data();
}

Result<void*> device_staging(const Backend& b, const ExecContext& ctx, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_staging_mu);
  DeviceStaging& s = g_staging[ctx.device.index];
  if (s.bytes >= bytes && s.backend == &b) return s.ptr;
  if (s.ptr) {
    RD_RETURN_IF_ERROR(s.backend->synchronize(s.ctx));
    (void)s.backend->free(s.ctx, s.ptr);
    s = DeviceStaging{};
  }
  void* p = nullptr;
  RD_RETURN_IF_ERROR(b.alloc(ctx, bytes, &p));
  s = DeviceStaging{&b, ctx, p, bytes};
  return p;
}

Result<size_t> release_device_staging(const ExecContext& ctx) {
  std::lock_guard<std::mutex> lock(g_staging_mu);
  if (ctx.device.kind == DeviceKind::kCpu) {  // the host buffer of CPU-backend permutations
    const size_t n = g_host_staging.size();
    std::vector<char>().swap(g_host_staging);
    return n;
  }
  auto it = g_staging.find(ctx.device.index);
  if (it == g_staging.end() || it->second.ptr == nullptr) return size_t{0};
  DeviceStaging s = it->second;
  g_staging.erase(it);
  RD_RETURN_IF_ERROR(s.backend->synchronize(s.ctx));
  RD_RETURN_IF_ERROR(s.backend->free(s.ctx, s.ptr));
  return s.bytes;
}

InterleaveGateUpMethod::InterleaveGateUpMethod(int64_t intermediate, size_t max_staging_bytes)
    : inter_(intermediate), max_staging_bytes_(max_staging_bytes) {
  const size_t rows = static_cast<size_t>(2 * intermediate);
  kernel_of_checkpoint_.resize(rows);
  checkpoint_of_kernel_.resize(rows);
  for (int64_t j = 0; j < intermediate; ++j) {
    kernel_of_checkpoint_[static_cast<size_t>(j)] = static_cast<int32_t>(2 * j);                  // gate j
    kernel_of_checkpoint_[static_cast<size_t>(intermediate + j)] = static_cast<int32_t>(2 * j + 1);  // up j
  }
  for (size_t r = 0; r < rows; ++r) checkpoint_of_kernel_[static_cast<size_t>(kernel_of_checkpoint_[r])] = static_cast<int32_t>(r);
}

Status InterleaveGateUpMethod::permute(const Backend& b, const ExecContext& ctx, TensorView s, Direction to) {
  if (s.rank() != 3 || s.size(1) != 2 * inter_)
    return Status(ErrorCode::kInternal, "interleave method expects [E, 2I, H] storage", "storage");
  const size_t rb = static_cast<size_t>(s.size(2)) * dtype_size(s.dtype);
  const size_t half = static_cast<size_t>(inter_);
  const size_t expert_bytes = rb * 2 * half;
  const size_t num_experts = static_cast<size_t>(s.size(0));
  const size_t group = std::max<size_t>(1, std::min(num_experts, max_staging_bytes_ / std::max<size_t>(expert_bytes, 1)));
  const size_t staging_bytes = expert_bytes * group;
  const bool host = s.device.kind == DeviceKind::kCpu;
  const CopyKind d2d = host ? CopyKind::kHostToHost : CopyKind::kDeviceToDevice;
  void* tmp = nullptr;
  if (host) {
    tmp = host_staging(staging_bytes);
  } else {
    RD_ASSIGN_OR_RETURN(tmp, device_staging(b, ctx, staging_bytes));
  }
  auto* t = static_cast<char*>(tmp);
  Status st;
  // Per group of experts (each a slice of 2I rows): stage it, then two strided copies back.
  for (size_t e0 = 0; e0 < num_experts && st.ok(); e0 += group) {
    const size_t n = std::min(group, num_experts - e0);
    char* base = static_cast<char*>(s.data) + expert_bytes * e0;
    st = b.copy(ctx, t, base, expert_bytes * n, d2d);
    if (!st.ok()) break;
    if (to == Direction::kToKernel) {
      // kernel row 2j <- checkpoint row j (gate), kernel row 2j+1 <- checkpoint row I+j (up).
      st = b.copy_3d(ctx, base, 2 * rb, expert_bytes, t, rb, expert_bytes, rb, half, n, d2d);
      if (st.ok()) st = b.copy_3d(ctx, base + rb, 2 * rb, expert_bytes, t + half * rb, rb, expert_bytes, rb, half, n, d2d);
    } else {
      st = b.copy_3d(ctx, base, rb, expert_bytes, t, 2 * rb, expert_bytes, rb, half, n, d2d);
      if (st.ok()) st = b.copy_3d(ctx, base + half * rb, rb, expert_bytes, t + rb, 2 * rb, expert_bytes, rb, half, n, d2d);
    }
  }
  if (!host) {
    // The staging buffer is read asynchronously: wait before anyone reuses it.
    Status sync = b.synchronize(ctx);
    if (st.ok()) st = sync;
  }
  return st;
}

Status InterleaveGateUpMethod::postprocess_after_load(const Backend& b, const ExecContext& ctx, TensorView s) {
  return permute(b, ctx, s, Direction::kToKernel);
}

Status InterleaveGateUpMethod::restore_before_load(const Backend& b, const ExecContext& ctx, TensorView s) {
  return permute(b, ctx, s, Direction::kToCheckpoint);
}

void QuantMethod::kernel_to_checkpoint_host(const uint8_t* kernel, uint8_t* checkpoint, int64_t experts,
                                            int64_t rows, size_t row_bytes, size_t) const {
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(checkpoint + row_bytes * static_cast<size_t>(e * rows + r),
                  kernel + row_bytes * static_cast<size_t>(e * rows + kernel_row(r)), row_bytes);
}

Status TransposeMethod::run(const Backend& b, const ExecContext& ctx, TensorView s, bool to_kernel) {
  if (s.rank() != 3) return Status(ErrorCode::kInternal, "transpose method expects [E, A, B] storage", "storage");
  const int64_t num_experts = s.size(0), a = s.size(1), bcols = s.size(2);
  const size_t elem = dtype_size(s.dtype);
  const size_t expert_bytes = static_cast<size_t>(a * bcols) * elem;
  const size_t group = std::max<size_t>(1, std::min(static_cast<size_t>(num_experts),
                                                    max_staging_bytes_ / std::max<size_t>(expert_bytes, 1)));
  const bool host = s.device.kind == DeviceKind::kCpu;
  const CopyKind d2d = host ? CopyKind::kHostToHost : CopyKind::kDeviceToDevice;
  void* tmp = nullptr;
  if (host) {
    tmp = host_staging(expert_bytes * group);
  } else {
    RD_ASSIGN_OR_RETURN(tmp, device_staging(b, ctx, expert_bytes * group));
  }
  // Checkpoint layout [A, B] per expert, kernel layout [B, A].
  const int64_t src_rows = to_kernel ? a : bcols, src_cols = to_kernel ? bcols : a;
  Status st;
  for (int64_t e0 = 0; e0 < num_experts && st.ok(); e0 += static_cast<int64_t>(group)) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(group), num_experts - e0);
    char* base = static_cast<char*>(s.data) + expert_bytes * static_cast<size_t>(e0);
    st = b.copy(ctx, tmp, base, expert_bytes * static_cast<size_t>(n), d2d);
    if (!st.ok()) break;
    const TensorView src = TensorView::contiguous(tmp, s.dtype, Shape{n, src_rows, src_cols}, s.device);
    const TensorView dst = TensorView::contiguous(base, s.dtype, Shape{n, src_cols, src_rows}, s.device);
    st = b.transpose(ctx, dst, src);
  }
  if (!host) {
    // The staging buffer is read asynchronously: wait before anyone reuses it.
    Status sync = b.synchronize(ctx);
    if (st.ok()) st = sync;
  }
  return st;
}

Status TransposeMethod::postprocess_after_load(const Backend& b, const ExecContext& ctx, TensorView s) {
  return run(b, ctx, s, true);
}

Status TransposeMethod::restore_before_load(const Backend& b, const ExecContext& ctx, TensorView s) {
  return run(b, ctx, s, false);
}

void TransposeMethod::kernel_to_checkpoint_host(const uint8_t* kernel, uint8_t* checkpoint, int64_t experts,
                                                int64_t rows, size_t row_bytes, size_t elem_bytes) const {
  // Checkpoint [E, rows, cols]; kernel [E, cols, rows].
  const int64_t cols = static_cast<int64_t>(row_bytes / elem_bytes);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        std::memcpy(checkpoint + ((e * rows + r) * cols + c) * static_cast<int64_t>(elem_bytes),
                    kernel + ((e * cols + c) * rows + r) * static_cast<int64_t>(elem_bytes), elem_bytes);
}

Status Mxfp4BlocksMethod::postprocess_after_load(const Backend&, const ExecContext& ctx, TensorView s) {
  return quant::mxfp4_blocks_to_kernel_layout(ctx, s, order_);
}

Status Mxfp4BlocksMethod::restore_before_load(const Backend&, const ExecContext& ctx, TensorView s) {
  return quant::mxfp4_blocks_to_checkpoint_layout(ctx, s, order_);
}

void Mxfp4BlocksMethod::kernel_to_checkpoint_host(const uint8_t* kernel, uint8_t* checkpoint, int64_t experts,
                                                  int64_t rows, size_t row_bytes, size_t) const {
  // Blocks [E, N, K/32, 16]: a row is K/2 bytes. The CPU inverse, in place on the copy.
  std::memcpy(checkpoint, kernel, row_bytes * static_cast<size_t>(experts * rows));
  const int64_t kb = static_cast<int64_t>(row_bytes / 16);
  const Status st = quant::mxfp4_blocks_to_checkpoint_layout(
      ExecContext{}, TensorView::contiguous(checkpoint, DType::kU8, Shape{experts, rows, kb, 16}), order_);
  // The same storage passed the forward move, so the inverse cannot be refused.
  assert(st.ok());
  (void)st;
}

Status Mxfp4ScalesMethod::postprocess_after_load(const Backend&, const ExecContext& ctx, TensorView s) {
  return quant::mxfp4_scales_to_kernel_layout(ctx, s, kernel_scales_, order_);
}

}  // namespace rolloutd::core
