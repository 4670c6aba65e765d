#pragma once
// One MoE block of any supported family: gate GEMM (FP32) -> router -> the one routed-expert
// capture point -> routed experts over the logical->physical map -> shared experts (always on,
// added). All compute goes through kernels/ (Backend::linear, moe::route, moe::experts), so the
// same layer runs on the CPU reference and on CUDA.
//
// Capture (DESIGN.md, "Routed-expert records"):
// - the recorder gets the router's logical ids, rows [0, num_valid) only, before anything
//   remaps them (the remap happens inside moe::experts, on the way to the physical slots);
//   hash-routed layers record their table ids like any other layer;
// - a draft (speculative) layer records nothing: built with draft=true it must not ask to
//   record, and a forward handed a recorder is refused (kFailedPrecondition, nothing written);
// - a configuration under which recorded ids would be physical is refused at build with a
//   message naming the conflicting options (shared_expert_fusion with record_routed_experts).
//
// Families (the configs tests/unit/core/moe_layer builds):
//   Qwen3-MoE / Mixtral  kSoftmaxTopK (renormalize = norm_topk_prob), kSwiGLU, concatenated
//   gpt-oss              kTopKSoftmax + router_bias, kGptOssSwiGLU (limit 7, alpha 1.702),
//                        interleaved gate/up, expert_bias
//   DeepSeek-V3          kSigmoidGroupedTopK (n_group, topk_group, scaling) + correction_bias,
//                        kSwiGLU, one shared expert of moe_intermediate * n_shared
//   DeepSeek-V4          kSqrtSoftplusTopK + correction_bias (or kHash + tid2eid for the
//                        hash_moe layers), kClampedSwiGLU (limit 10) for routed and shared
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/moe/expert_map.hpp"
#include "core/moe/routed_experts.hpp"
#include "core/storage/arena.hpp"
#include "kernels/backend.hpp"
#include "kernels/moe/moe_ops.hpp"

namespace rolloutd::core {

struct MoeLayerConfig {
  std::string name = "moe";  // prefix of error fields, e.g. "model.layers.3.mlp"
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;     // of one routed expert
  int64_t num_experts = 0;           // logical experts (router outputs, records)
  int64_t num_physical_experts = 0;  // slots of the expert weights (replicas); 0: num_experts
  int64_t top_k = 0;
  moe::RouterParams router;
  bool router_bias = false;      // a logit bias [E] (gpt-oss)
  bool correction_bias = false;  // e_score_correction_bias [E] (DeepSeek), selection only
  int64_t vocab_size = 0;        // kHash: rows of tid2eid
  // Per-layer static constants (clamp limit, alpha): state of the layer, not checkpoint tensors.
  moe::ActivationParams activation;
  moe::WeightFormat weight_format = moe::WeightFormat::kBF16;
  moe::GateUpOrder gate_up_order = moe::GateUpOrder::kConcatenated;
  moe::ActPrecision act_precision = moe::ActPrecision::kBF16;
  bool expert_bias = false;  // gate_up / down biases of the routed experts (gpt-oss)
  int64_t num_shared_experts = 0;
  int64_t shared_intermediate_size = 0;  // of one shared expert
  moe::ActivationParams shared_activation;
  int64_t max_tokens = 0;  // rows of the largest forward (workspaces are sized for it)
  // Capture.
  int64_t moe_layer_index = 0;  // this layer's slot in RoutedExpertRecorder rows
  bool record_routed_experts = true;
  bool draft = false;  // built for a draft / speculative module: never records
  // Shared experts appended to the routed experts as extra slots with remapped ids (a fused
  // single pass, as some engines do): the ids it would record are physical, so it is refused
  // with record_routed_experts, and not implemented otherwise (the shared experts run as a
  // separate always-on pass).
  bool shared_expert_fusion = false;

  // Every rule above, including the conflicting combinations (kInvalidArgument, the message
  // names both options; fields are prefixed with `name`).
  Status validate() const;
};

struct MoeLayerWeights {
  TensorView router;           // [E, H] float32
  TensorView router_bias;      // [E] float32 when config.router_bias
  TensorView correction_bias;  // [E] float32 when config.correction_bias
  TensorView tid2eid;          // [vocab, K] int32 for kHash
  moe::ExpertWeights experts;  // [E_phys, ...] in config.weight_format / gate_up_order
  moe::ExpertWeights shared;   // [num_shared, ...] (any format), no biases
};

class MoeLayer {
 public:
  // Validates the config and the weights' shapes, allocates the step workspace once (stable
  // addresses) and installs the identity map over the logical experts.
  static Result<std::unique_ptr<MoeLayer>> create(const MoeLayerConfig& config,
                                                  const MoeLayerWeights& weights,
                                                  const Backend& backend, ExecContext ctx);
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // out[T, H] float32 = MoE(x[T, H] float32) for rows [0, num_valid); rows past it are padding:
  // written zero, never read (nor their token ids). token_ids [T] int32 on the context's device
  // (hash layers; others may pass TensorView{}). T <= max_tokens. With a recorder (whose step
  // must hold num_valid rows), the router's logical ids are captured for this layer.
  Status forward(TensorView out, TensorView x, TensorView token_ids, int64_t num_valid,
                 RoutedExpertRecorder* recorder);

  // Replaces the logical -> physical map (num_logical == num_experts, num_physical == the
  // weights' slots). Stream-ordered: forwards already enqueued use the old map. Outputs do not
  // change as long as every slot the map names holds its logical expert's weights.
  Status set_expert_map(const ExpertMap& map);
  const ExpertMap& expert_map() const { return map_; }

  const MoeLayerConfig& config() const { return config_; }
  bool records() const { return config_.record_routed_experts && !config_.draft; }
  // The last forward's router outputs, rows [0, num_valid) (tests, debugging). The logits are
  // the gate GEMM's, without the logit bias, except where a CUDA layer routes a softmax family
  // through Backend::router (forward()), which stores them with the bias added.
  TensorView router_logits() const { return logits_; }
  TensorView topk_ids() const { return ids_; }
  TensorView topk_weights() const { return weights_; }

  // The layer's static (non-checkpoint) state: backed up and restored with memory release.
  struct StaticState {
    moe::ActivationParams activation;
    moe::ActivationParams shared_activation;
    float routed_scaling_factor = 1.0f;
  };
  StaticState static_state() const;
  void restore_static_state(const StaticState& s);

 private:
  MoeLayer(const MoeLayerConfig& c, const MoeLayerWeights& w, const Backend& b, ExecContext ctx);
  Status allocate();
  Status upload(const TensorView& dst, const void* src, size_t bytes);

  MoeLayerConfig config_;
  MoeLayerWeights w_;
  const Backend& backend_;
  ExecContext ctx_;
  int64_t num_physical_ = 0;
  std::unique_ptr<StableArena> arena_;
  TensorView logits_, ids_, weights_, l2p_;                // [T, E], [T, K] x2, [E]
  TensorView shared_ids_, shared_weights_, shared_l2p_;  // [T, S] x2, [S]
  TensorView workspace_;                                 // CUDA experts scratch
  ExpertMap map_;
  std::vector<int32_t> map_host_;  // source of the last map upload
};

}  // namespace rolloutd::core
