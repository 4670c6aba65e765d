#include "core/moe/routed_experts.hpp"

#include <algorithm>
#include <string>

namespace rolloutd::core {

RoutedExpertRecorder::RoutedExpertRecorder(int64_t num_moe_layers, int64_t top_k, int64_t max_tokens)
    : num_layers_(num_moe_layers), top_k_(top_k), max_tokens_(max_tokens) {
  rows_.reserve(static_cast<size_t>(max_tokens * num_moe_layers * top_k));
  staging_.reserve(static_cast<size_t>(max_tokens * top_k * num_moe_layers));
  seen_.assign(static_cast<size_t>(num_moe_layers), 0);
}

Status RoutedExpertRecorder::begin_step(int64_t num_valid_tokens) {
  if (num_valid_tokens < 0 || num_valid_tokens > max_tokens_)
    return Status(ErrorCode::kOutOfRange, "token count outside the recorder's capacity",
                  "num_valid_tokens");
  num_valid_ = num_valid_tokens;
  layers_captured_ = 0;
  rows_.assign(static_cast<size_t>(num_valid_ * num_layers_ * top_k_), -1);
  std::fill(seen_.begin(), seen_.end(), 0);
  return Status::Ok();
}

Status RoutedExpertRecorder::capture(const Backend& backend, const ExecContext& ctx,
                                     int64_t moe_layer, TensorView ids) {
  if (moe_layer < 0 || moe_layer >= num_layers_)
    return Status(ErrorCode::kInternal, "MoE layer index out of range", "moe_layer");
  if (seen_[static_cast<size_t>(moe_layer)])
    return Status(ErrorCode::kInternal, "MoE layer captured twice in one step",
                  "moe_layer." + std::to_string(moe_layer));
  if (ids.dtype != DType::kI32 || ids.rank() != 2 || ids.size(1) != top_k_ ||
      ids.size(0) < num_valid_)
    return Status(ErrorCode::kInternal, "capture expects int32 [>=tokens, top_k] ids", "ids");
  seen_[static_cast<size_t>(moe_layer)] = 1;
  ++layers_captured_;
  if (num_valid_ == 0) return Status::Ok();
  const size_t n = static_cast<size_t>(num_valid_ * top_k_);
  staging_.resize(n);
  const CopyKind kind =
      ids.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kDeviceToHost;
  RD_RETURN_IF_ERROR(backend.copy(ctx, staging_.data(), ids.data, n * sizeof(int32_t), kind));
  if (kind == CopyKind::kDeviceToHost) RD_RETURN_IF_ERROR(backend.synchronize(ctx));
  for (int64_t t = 0; t < num_valid_; ++t)
    for (int64_t k = 0; k < top_k_; ++k)
      rows_[static_cast<size_t>((t * num_layers_ + moe_layer) * top_k_ + k)] =
          staging_[static_cast<size_t>(t * top_k_ + k)];
  return Status::Ok();
}

Status RoutedExpertRecorder::capture_layer_major(const int32_t* table, int64_t stride) {
  if (layers_captured_ != 0)
    return Status(ErrorCode::kInternal, "a MoE layer was already captured this step", "moe_layer");
  if (stride < num_valid_) return Status(ErrorCode::kInternal, "record table stride below the step's rows", "table");
  if (table == nullptr && num_layers_ > 0 && num_valid_ > 0)
    return Status(ErrorCode::kInternal, "no record table for a step with rows", "table");
  std::fill(seen_.begin(), seen_.end(), 1);
  layers_captured_ = num_layers_;
  // Layer-major on the device, token-major for the trainer.
  for (int64_t l = 0; l < num_layers_; ++l)
    for (int64_t t = 0; t < num_valid_; ++t)
      std::copy_n(table + (l * stride + t) * top_k_, top_k_, rows_.data() + (t * num_layers_ + l) * top_k_);
  return Status::Ok();
}

}  // namespace rolloutd::core
