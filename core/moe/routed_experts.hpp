#pragma once
// Routed-expert capture: the one place where the trainer's routing-replay
// records are taken. The MoE layer calls capture() with the router's *logical*
// top-k ids, before any logical->physical remap, and with the real token count
// so rows that only pad a batch are never recorded. A layer built for a draft
// (speculative) module gets no recorder at all: it cannot write target records.
#include <cstdint>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/status.hpp"
#include "kernels/tensor_view.hpp"

namespace rolloutd::core {

class RoutedExpertRecorder {
 public:
  RoutedExpertRecorder(int64_t num_moe_layers, int64_t top_k, int64_t max_tokens);

  // Starts a step of `num_valid_tokens` real rows (padding rows beyond are ignored).
  Status begin_step(int64_t num_valid_tokens);
  // Copies ids[0:num_valid, 0:top_k] (int32, logical) of MoE layer `moe_layer` to the host
  // buffer. `ids` may live on any device the backend can copy from.
  Status capture(const Backend& backend, const ExecContext& ctx, int64_t moe_layer, TensorView ids);
  // Takes the step's rows of every MoE layer at once from a host copy of a record table,
  // layer-major: table[(l * stride + t) * top_k + k] for rows t in [0, num_valid) (stride >=
  // num_valid), and marks every layer captured: the form a padded or graph-replayed step fills
  // on the device and copies back in one piece. `table` may be null only when there are no MoE
  // layers or no rows.
  Status capture_layer_major(const int32_t* table, int64_t stride);
  // Rows of the current step: [num_valid_tokens, num_moe_layers, top_k] int32 (token-major).
  const std::vector<int32_t>& rows() const { return rows_; }
  int64_t num_valid_tokens() const { return num_valid_; }
  int64_t num_moe_layers() const { return num_layers_; }
  int64_t top_k() const { return top_k_; }
  // Layers captured this step; the engine checks that every MoE layer reported.
  int64_t num_layers_captured() const { return layers_captured_; }

 private:
  int64_t num_layers_;
  int64_t top_k_;
  int64_t max_tokens_;
  int64_t num_valid_ = 0;
  int64_t layers_captured_ = 0;
  std::vector<int32_t> rows_;     // [T, L, K]
  std::vector<int32_t> staging_;  // [T, K] for one layer
  std::vector<uint8_t> seen_;     // per layer, this step
};

}  // namespace rolloutd::core
