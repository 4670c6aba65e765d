#include "core/weights/quant_method.hpp"

#include <cstring>

namespace rolloutd::core {
namespace {
// Cycles of the permutation "row k receives row src_of[k]" (fixed points omitted).
std::vector<std::vector<int32_t>> cycles_of(const std::vector<int32_t>& src_of) {
  std::vector<std::vector<int32_t>> cycles;
  std::vector<uint8_t> seen(src_of.size(), 0);
  for (size_t start = 0; start < src_of.size(); ++start) {
    if (seen[start] || src_of[start] == static_cast<int32_t>(start)) continue;
    std::vector<int32_t> c;
    for (int32_t k = static_cast<int32_t>(start); !seen[static_cast<size_t>(k)]; k = src_of[static_cast<size_t>(k)]) {
      seen[static_cast<size_t>(k)] = 1;
      c.push_back(k);
    }
    cycles.push_back(std::move(c));
  }
  return cycles;
}
}  // namespace

InterleaveGateUpMethod::InterleaveGateUpMethod(int64_t intermediate) : inter_(intermediate) {
  const size_t rows = static_cast<size_t>(2 * intermediate);
  kernel_of_checkpoint_.resize(rows);
  checkpoint_of_kernel_.resize(rows);
  for (int64_t j = 0; j < intermediate; ++j) {
    kernel_of_checkpoint_[static_cast<size_t>(j)] = static_cast<int32_t>(2 * j);                  // gate j
    kernel_of_checkpoint_[static_cast<size_t>(intermediate + j)] = static_cast<int32_t>(2 * j + 1);  // up j
  }
  for (size_t r = 0; r < rows; ++r) checkpoint_of_kernel_[static_cast<size_t>(kernel_of_checkpoint_[r])] = static_cast<int32_t>(r);
  // postprocess: kernel row k receives checkpoint row checkpoint_of_kernel_[k];
  // restore: checkpoint row r receives kernel row kernel_of_checkpoint_[r].
  to_kernel_cycles_ = cycles_of(checkpoint_of_kernel_);
  to_checkpoint_cycles_ = cycles_of(kernel_of_checkpoint_);
}

Status InterleaveGateUpMethod::permute(const Backend& b, const ExecContext& ctx, TensorView s,
                                       const std::vector<int32_t>& src_of,
                                       const std::vector<std::vector<int32_t>>& cycles) {
  if (s.rank() != 3 || s.size(1) != 2 * inter_)
    return Status(ErrorCode::kInternal, "interleave method expects [E, 2I, H] storage", "storage");
  const size_t row_bytes = static_cast<size_t>(s.size(2)) * dtype_size(s.dtype);
  const size_t expert_bytes = row_bytes * static_cast<size_t>(2 * inter_);
  const bool host = s.device.kind == DeviceKind::kCpu;
  const CopyKind d2d = host ? CopyKind::kHostToHost : CopyKind::kDeviceToDevice;
  void* tmp = nullptr;
  if (host) {
    row_tmp_.resize(row_bytes);
    tmp = row_tmp_.data();
  } else {
    RD_RETURN_IF_ERROR(b.alloc(ctx, row_bytes, &tmp));
  }
  Status st;
  for (int64_t e = 0; e < s.size(0) && st.ok(); ++e) {
    char* base = static_cast<char*>(s.data) + expert_bytes * static_cast<size_t>(e);
    auto row = [&](int32_t r) { return base + row_bytes * static_cast<size_t>(r); };
    for (const auto& c : cycles) {
      // Save the first row of the cycle, shift the others along, close with the saved row.
      st = b.copy(ctx, tmp, row(c[0]), row_bytes, d2d);
      for (size_t i = 0; st.ok() && i + 1 < c.size(); ++i) st = b.copy(ctx, row(c[i]), row(src_of[static_cast<size_t>(c[i])]), row_bytes, d2d);
      if (st.ok()) st = b.copy(ctx, row(c.back()), tmp, row_bytes, d2d);
      if (!st.ok()) break;
    }
  }
  if (!host) {
    Status sync = b.synchronize(ctx);
    (void)b.free(ctx, tmp);
    if (st.ok()) st = sync;
  }
  return st;
}

Status InterleaveGateUpMethod::postprocess_after_load(const Backend& b, const ExecContext& ctx, TensorView s) {
  return permute(b, ctx, s, checkpoint_of_kernel_, to_kernel_cycles_);
}

Status InterleaveGateUpMethod::restore_before_load(const Backend& b, const ExecContext& ctx, TensorView s) {
  return permute(b, ctx, s, kernel_of_checkpoint_, to_checkpoint_cycles_);
}

}  // namespace rolloutd::core
