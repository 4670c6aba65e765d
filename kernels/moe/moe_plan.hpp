#pragma once
// Internal to kernels/moe/: the validated form of each operation's arguments ("plans": typed
// pointers plus geometry), built by moe_checks.cpp before any data is touched and consumed by the
// CPU reference (cpu_moe_*.cpp) and the CUDA kernels (cuda_moe_*.cu) alike, so both backends
// accept and reject exactly the same calls.
#include <cstddef>
#include <cstdint>

#include "kernels/moe/moe_ops.hpp"

namespace rolloutd::moe::detail {

inline constexpr int64_t kMaxExperts = 4096;  // router: per-warp shared memory; permutation too
inline constexpr int kKAlign = 64;            // H and I: multiples of the MXFP4 tile width

struct RouterPlan {
  RouterParams params;
  int64_t num_tokens = 0, num_experts = 0;
  int top_k = 0;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  const float* logits = nullptr;
  const float* logit_bias = nullptr;       // nullable
  const float* correction_bias = nullptr;  // nullable
  const int32_t* token_ids = nullptr;      // kHash
  const int32_t* tid2eid = nullptr;        // kHash
  int64_t vocab = 0;                       // kHash
};

struct ExpertsPlan {
  int64_t num_tokens = 0, num_valid = 0, hidden = 0, inter = 0, top_k = 0;
  int64_t num_logical = 0, num_physical = 0;
  float* out = nullptr;
  const void* x = nullptr;
  bool x_bf16 = false;
  const int32_t* ids = nullptr;
  const float* topk_weights = nullptr;
  const int32_t* l2p = nullptr;
  const int32_t* num_valid_device = nullptr;  // nullable [1]: min(num_valid, *it) rows are real
  WeightFormat format = WeightFormat::kBF16;
  GateUpOrder order = GateUpOrder::kConcatenated;
  const uint16_t* gate_up_bf16 = nullptr;  // [E, 2I, H]
  const uint16_t* down_bf16 = nullptr;     // [E, H, I]
  const uint8_t* gate_up_blocks = nullptr;  // MXFP4 kernel layout
  const uint8_t* gate_up_scales = nullptr;
  const uint8_t* down_blocks = nullptr;
  const uint8_t* down_scales = nullptr;
  const float* gate_up_bias = nullptr;  // nullable [E, 2I]
  const float* down_bias = nullptr;     // nullable [E, H]
  ActivationParams act;
  ActPrecision precision = ActPrecision::kBF16;
  bool accumulate = false;
  uint8_t* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

// A launch whose pairs average fewer than this many an active expert takes the CUDA decode
// kernel (tiles of 16 rows); more, the tiled kernels (64 or more).
constexpr int64_t kDecodeMaxPairsPerExpert = 48;

// Byte offsets of the CUDA experts scratch; P = num_tokens * top_k pairs.
struct ExpertsWorkspace {
  int64_t max_pairs = 0;
  int64_t max_tiles = 0;  // M tiles of the smallest tile height (16) over all experts
  size_t pair_expert = 0, pair_pos = 0, sorted_pair = 0;  // int32 [P]
  size_t expert_offsets = 0;                              // int32 [E + 1]
  size_t tile_expert = 0, tile_row0 = 0;                  // int32 [max_tiles]
  size_t meta = 0;                                        // int32 [4]: number of tiles, ...
  size_t xa = 0, xa_scales = 0;   // kBF16: bf16 [T, H]; kMXFP8: e4m3 [T, H] + e8m0 [T, H/32]
  size_t h = 0;                   // kBF16: bf16 [P, I]; kMXFP8: float32 [P, I]
  size_t h_q = 0, h_scales = 0;   // kMXFP8: e4m3 [P, I] (decode: bf16 rows; experts_workspace) + e8m0 [P, I/32]
  size_t y = 0;                   // float32 [P, H]
  size_t total = 0;
};
ExpertsWorkspace experts_workspace(int64_t num_tokens, int64_t top_k, int64_t hidden,
                                   int64_t inter, int64_t num_physical, ActPrecision precision);

// Largest tile count for `pairs` pairs over `experts` experts with M tiles of `bm` rows:
// each expert with work has at most one partial tile.
inline int64_t max_m_tiles(int64_t pairs, int64_t experts, int64_t bm) {
  return (pairs + bm - 1) / bm + (pairs < experts ? pairs : experts);
}

// Checkpoint row of feature j's gate and up rows in a [2I, H] gate_up matrix.
inline int64_t gate_row(int64_t j, int64_t inter, GateUpOrder o) {
  return o == GateUpOrder::kInterleaved ? 2 * j : j;
}
inline int64_t up_row(int64_t j, int64_t inter, GateUpOrder o) {
  return o == GateUpOrder::kInterleaved ? 2 * j + 1 : inter + j;
}

// ---- validation (moe_checks.cpp) ----------------------------------------------------------
Status check_context(const ExecContext& ctx);
Result<RouterPlan> check_route(const ExecContext& ctx, const RouterParams& params,
                               const RouterArgs& args);
Result<ExpertsPlan> check_experts(const ExecContext& ctx, const ExpertsArgs& args);

// ---- CPU reference (cpu_moe_router.cpp, cpu_moe_experts.cpp) --------------------------------
Status cpu_route(const RouterPlan& p);
Status cpu_experts(const ExpertsPlan& p);

#if defined(ROLLOUTD_WITH_CUDA)
// ---- CUDA (cuda_moe_router.cu, cuda_moe_experts.cu): asynchronous on ctx's stream ----------
Status cuda_route(const ExecContext& ctx, const RouterPlan& p);
Status cuda_experts(const ExecContext& ctx, const ExpertsPlan& p);
#endif

}  // namespace rolloutd::moe::detail
