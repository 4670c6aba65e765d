#pragma once
// MoE operations: the routers of every supported model family, the SwiGLU variants, and the
// routed-expert computation (token permutation by physical expert, grouped GEMMs over the
// experts that received tokens, weighted combine). Each is a CPU FP32 reference and a CUDA twin
// behind one entry point (the context's device picks), like kernels/quant/quant_ops.hpp.
//
// Conventions (as quant_ops.hpp):
// - ctx.device.kind == kCpu runs the reference, kCuda the kernels, asynchronously on ctx.stream
//   (kUnimplemented when the CUDA backend is not built). Every view lives on ctx.device.
// - Arguments are validated before any data is read (moe_checks.cpp, shared by both backends):
//   a bad dtype, rank, shape, contiguity or device is kInvalidArgument with `field` naming the
//   view; nothing is written.
// - Index values (expert ids, map entries, token ids, tid2eid entries) are checked by the CPU
//   backend (kOutOfRange naming the tensor, outputs untouched). CUDA cannot read them without a
//   synchronisation: a bad id contributes nothing (experts) or yields id -1 with weight 0
//   (hash router), and is never used to address memory.
// - An absent optional view is TensorView{} (null data, rank 0).
//
// Numerics shared by both backends (moe_math.hpp): exp, log1p, sigmoid, softplus are one
// FMA-explicit implementation compiled for host and device, and every operation that decides a
// routing (the ranking value of an expert) is computed with correctly rounded +, *, /, sqrt, so
// the CPU reference and CUDA select the same experts bit for bit from the same logits.
#include <cstdint>

#include "kernels/backend.hpp"

namespace rolloutd::moe {

// ---- routers --------------------------------------------------------------------------------
//
// Tie policy (every kind): experts are ranked by their selection value, descending; NaN ranks
// last; equal values rank the lower expert id first. ids[t, :] lists the picks in rank order.
// This is torch.topk's order where the reference asks for a sorted result (sorted=True:
// Qwen3-MoE, Mixtral, gpt-oss). torch does not document how it orders exact ties; lower index
// first is what its CPU kernel does in practice, and the goldens keep a margin between the k-th
// and the (k+1)-th value so that they never depend on it. DeepSeek-V3/V4 call
// torch.topk(sorted=False): their order is unspecified, so compare those ids as sets (the
// golden tests do). Hash routing keeps the table's column order.
enum class RouterKind : uint8_t {
  // Softmax over all experts, top-k, optional renormalisation of the k weights (Qwen3-MoE
  // norm_topk_prob, Mixtral). Ranked on the logits (the probability order, immune to exp()
  // rounding); weights are the softmax probabilities.
  kSoftmaxTopK = 0,
  // Top-k of the raw logits (router bias added first), softmax over those k only (gpt-oss).
  kTopKSoftmax = 1,
  // scores = sigmoid(logits); selection on scores + correction_bias, optionally grouped
  // (n_group groups ranked by the sum of their two best biased scores, topk_group kept, experts
  // outside them never picked); weights = unbiased scores of the picks, normalised
  // (w / (sum + 1e-20)) when `renormalize`, times routed_scaling_factor (DeepSeek-V3).
  // Experts of unselected groups are excluded outright (-inf), as DeepSeek's reference and
  // vLLM/SGLang do; Hugging Face's port fills them with 0.0 instead, which differs only when an
  // allowed biased score is negative (documented in tests/reference/moe/make_hf_moe_golden.py).
  kSigmoidGroupedTopK = 2,
  // As kSigmoidGroupedTopK with scores = sqrt(softplus(logits)) (DeepSeek-V4; softplus is
  // torch's: x above 20 passes through). Grouping is allowed (n_group = 1 by default).
  kSqrtSoftplusTopK = 3,
  // DeepSeek-V4 hash layers: ids = tid2eid[token_ids[t], :]; weights = score_func(logits) at
  // those ids, normalised (w / (sum + 1e-20)) when `renormalize`, times routed_scaling_factor.
  kHash = 4,
};

// Score function of kHash (DeepSeek-V4 config.scoring_func).
enum class ScoreFunc : uint8_t { kSqrtSoftplus = 0, kSigmoid = 1, kSoftmax = 2 };

struct RouterParams {
  RouterKind kind = RouterKind::kSoftmaxTopK;
  // kSoftmaxTopK: w / sum(w) (norm_topk_prob); biased kinds and kHash: w / (sum(w) + 1e-20);
  // kTopKSoftmax: unused (its softmax over the k already sums to 1).
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;  // biased kinds and kHash
  int n_group = 1;                     // biased kinds: E % n_group == 0
  int topk_group = 1;                  // biased kinds: 1 <= topk_group <= n_group
  ScoreFunc hash_score = ScoreFunc::kSqrtSoftplus;
};

struct RouterArgs {
  TensorView ids;              // [T, K] int32, out: logical expert ids
  TensorView weights;          // [T, K] float32, out
  TensorView logits;           // [T, E] float32 (the gate GEMM's output)
  TensorView logit_bias;       // optional [E] float32, added to the logits first (gpt-oss)
  TensorView correction_bias;  // optional [E] float32, biased kinds only: selection only
  TensorView token_ids;        // kHash: [T] int32
  TensorView tid2eid;          // kHash: [V, K] int32
};

// K = ids.size(1): 1 <= K <= E (kHash: K = tid2eid.size(1)); biased kinds also
// K <= topk_group * E / n_group. E <= 4096.
Status route(const ExecContext& ctx, const RouterParams& params, const RouterArgs& args);

// ---- experts ----------------------------------------------------------------------------------

enum class ActivationKind : uint8_t {
  kSwiGLU = 0,         // silu(g) * u
  kGptOssSwiGLU = 1,   // g = min(g, limit), u = clamp(u, -limit, limit), g * sigmoid(alpha g) * (u + 1)
  kClampedSwiGLU = 2,  // silu(min(g, limit)) * clamp(u, -limit, limit) (DeepSeek-V4, limit 10)
};

// Per-layer static constants, passed explicitly (the layer registers them as static state).
struct ActivationParams {
  ActivationKind kind = ActivationKind::kSwiGLU;
  float limit = 7.0f;    // clamped kinds; > 0
  float alpha = 1.702f;  // kGptOssSwiGLU
};

enum class WeightFormat : uint8_t {
  kBF16 = 0,   // bfloat16 (or uint16 holding bf16 bits), checkpoint layout
  kMXFP4 = 1,  // MXFP4 in the tiled kernel layout of kernels/quant/mxfp4.hpp
};

// Precision at which the GEMMs consume activations (x, and the SwiGLU output h). The CPU
// reference rounds exactly as the kernels do, so CUDA-vs-CPU differences are accumulation order
// only. kF32 (no rounding) is the CPU reference's exact mode, used against FP32 goldens; CUDA
// answers kUnimplemented.
enum class ActPrecision : uint8_t {
  kF32 = 0,
  kBF16 = 1,   // round to nearest even
  kMXFP8 = 2,  // E4M3 + E8M0 per 32 along K (kernels/quant/mxfp8.hpp), quantized on the fly
};

// Checkpoint row order of a fused gate_up matrix [2I, H] (and of its bias).
enum class GateUpOrder : uint8_t {
  kConcatenated = 0,  // gate rows [0, I), up rows [I, 2I) (Qwen3-MoE, DeepSeek, transformers 5)
  kInterleaved = 1,   // gate j at row 2j, up j at 2j + 1 (gpt-oss)
};

// E experts (physical slots), hidden H, intermediate I; H % 64 == 0 and I % 64 == 0.
struct ExpertWeights {
  WeightFormat format = WeightFormat::kBF16;
  GateUpOrder gate_up_order = GateUpOrder::kConcatenated;
  // kBF16: gate_up [E, 2I, H], down [E, H, I]; scales absent.
  // kMXFP4: gate_up [E, 2I, H/32, 16] uint8|float4_e2m1fn_x2 in the kernel layout made from
  // `gate_up_order` (mxfp4_blocks_to_kernel_layout; its bytes are no longer nibble pairs, see
  // mxfp4.hpp step 4), gate_up_scales [E, 2I, H/32]
  // uint8|float8_e8m0fnu kernel-layout scales; down [E, H, I/32, 16] (kPlain), down_scales
  // [E, H, I/32].
  TensorView gate_up, gate_up_scales, down, down_scales;
  TensorView gate_up_bias;  // optional [E, 2I] float32, rows in `gate_up_order`
  TensorView down_bias;     // optional [E, H] float32
};

struct ExpertsArgs {
  TensorView out;                  // [T, H] float32
  TensorView x;                    // [T, H] float32 or bfloat16; rows >= num_valid never read
  TensorView topk_ids;             // [T, K] int32, logical expert ids
  TensorView topk_weights;         // [T, K] float32
  TensorView logical_to_physical;  // [E_logical] int32: slot computing each logical expert
  int64_t num_valid_tokens = -1;   // rows >= this are padding: written 0, never read; -1 = T
  // Optional int32 [1] on the context's device: the real row count read where the op runs, so a
  // CUDA graph captured at a padded bucket size masks each replay's padding rows (no expert work,
  // output 0). Rows >= min(num_valid_tokens, *num_valid_device) are padding. CPU: a count
  // outside [0, T] is kOutOfRange, nothing written; CUDA: clamped to [0, T].
  TensorView num_valid_device;
  ExpertWeights weights;
  ActivationParams activation;
  ActPrecision precision = ActPrecision::kBF16;
  // out[t] = (accumulate ? out[t] : 0) + sum_k w[t,k] * (down_e(act(gate_up_e(x_t) + b)) + b_d),
  // the k terms added in k order. Padding rows are zero either way.
  bool accumulate = false;
  // CUDA: uint8 [>= experts_workspace_bytes(...)] on the context's device (scratch for the
  // permutation, the quantized activations, h and the per-pair outputs). CPU: ignored.
  TensorView workspace;
};

// Bytes of ExpertsArgs::workspace for up to num_tokens rows.
int64_t experts_workspace_bytes(int64_t num_tokens, int64_t top_k, int64_t hidden,
                                int64_t intermediate, int64_t num_physical_experts,
                                ActPrecision precision);

// The routed experts: permutation of the valid (token, k) pairs by physical expert
// (e = logical_to_physical[id]), a grouped gate_up GEMM with the activation in its epilogue,
// a grouped down GEMM, and the weighted combine. Experts that received no token cost nothing.
Status experts(const ExecContext& ctx, const ExpertsArgs& args);

// One SwiGLU variant on (gate, up), the exact function both backends apply (tests use it).
float apply_activation(const ActivationParams& p, float gate, float up);

// Names for messages and test parameters: "softmax_topk", "gpt_oss_swiglu", "mxfp4", ...
const char* router_kind_name(RouterKind k);
const char* activation_kind_name(ActivationKind k);
const char* weight_format_name(WeightFormat f);
const char* act_precision_name(ActPrecision p);

}  // namespace rolloutd::moe
