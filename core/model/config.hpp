#pragma once
// Architecture of a MoE decoder as the engine needs it. Field names follow the
// Hugging Face config.json keys where one exists.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/status.hpp"

namespace rolloutd::core {

// How a MoE layer's router and experts are named and laid out in the checkpoint (and therefore
// in the weight registry).
enum class MoeLayout : uint8_t {
  // Router `mlp.gate.weight` [E, H], no bias. Experts output-major: stacked
  // `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows then up rows, or interleaved when
  // gate_up_checkpoint_interleaved) and `mlp.experts.down_proj` [E, H, I], or per expert
  // `mlp.experts.{e}.{gate,up,down}_proj.weight`; no expert biases. BF16/FP32, quantized to MXFP4
  // on arrival on request (Qwen3-MoE; Mixtral-style experts as transformers 5 names them).
  kOutputMajor,
  // Router `mlp.router.{weight,bias}`. Experts input-major with biases: `mlp.experts.gate_up_proj`
  // [E, H, 2I] (gate/up columns interleaved), `down_proj` [E, I, H], `*_bias`; or MXFP4
  // `*_blocks` / `*_scales` [E, out, in/32(, 16)] as published (gpt-oss).
  kInputMajorBiased,
};

// The experts' gated activation.
enum class ExpertActivation : uint8_t {
  kSiLU,           // silu(g) * u
  kClampedSwiGLU,  // gpt-oss: g = min(g, limit), u = clamp(u, +-limit), g * sigmoid(alpha * g) * (u + 1)
};

struct ModelConfig {
  std::string name = "tiny-moe";
  std::string family = "qwen3_moe";   // config.json's model_type (core/model/family.hpp)
  // Architecture traits, set by the family's parse_config (defaults: the Qwen3-MoE conventions
  // of the built-in models). The decoder reads these, never `family`.
  MoeLayout moe_layout = MoeLayout::kOutputMajor;
  bool attention_sinks = false;       // learned per-head sinks `self_attn.sinks` [QH] (gpt-oss)
  ExpertActivation expert_activation = ExpertActivation::kSiLU;
  double swiglu_alpha = 1.702;        // kClampedSwiGLU (GptOssExperts.alpha, not a config key)
  int64_t vocab_size = 256;
  int64_t hidden_size = 64;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 2;
  int64_t head_dim = 16;
  int64_t num_experts = 16;
  int64_t num_experts_per_tok = 4;     // top_k
  int64_t moe_intermediate_size = 32;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 4096;
  bool norm_topk_prob = true;
  // Qwen3: per-head RMSNorm of q and k (weights `self_attn.{q,k}_norm.weight` [head_dim]) after
  // the projections, before rotary. Off for the embedded model (its NumPy goldens have none).
  bool qk_norm = false;
  bool tie_word_embeddings = false;   // lm_head shares embed_tokens (not supported yet)
  bool attention_bias = false;        // q/k/v/o projections carry biases (gpt-oss)
  // Which layers are MoE: layer l is sparse unless l is in mlp_only_layers or
  // (l + 1) % decoder_sparse_step != 0 (Qwen2/3-MoE); dense layers are SwiGLU MLPs of
  // intermediate_size (mlp.{gate,up,down}_proj.weight).
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  int64_t intermediate_size = 0;
  // Rotary scaling: "default" (none) or "yarn" (gpt-oss) with its parameters.
  std::string rope_type = "default";
  double rope_factor = 1.0;
  int64_t rope_original_max_position_embeddings = 0;
  double rope_beta_fast = 32.0, rope_beta_slow = 1.0;
  bool rope_truncate = true;            // YaRN: floor/ceil the correction range (gpt-oss: false)
  double rope_attention_factor = 0.0;   // YaRN: cos/sin scale; 0 = derived from factor (and mscale)
  double rope_mscale = 0.0, rope_mscale_all_dim = 0.0;  // YaRN (DeepSeek); 0 = unset
  // gpt-oss: per-layer "sliding_attention" | "full_attention", the window, the SwiGLU clamp.
  std::vector<std::string> layer_types;
  int64_t sliding_window = 0;
  double swiglu_limit = 0.0;
  // Routed experts stored as MXFP4 (`mlp.experts.{gate_up,down}_proj_{blocks,scales}`) and
  // computed from those bytes, instead of FP32 (hidden_size and moe_intermediate_size multiples
  // of 32). Input-major experts (gpt_oss): as OpenAI publishes them (gate/up rows interleaved),
  // set by open_hf_model() when the checkpoint holds them (and by make-test-model
  // --experts-mxfp4). Output-major experts (qwen3_moe): on request (apply_expert_quantization,
  // the daemon's --quantize-experts mxfp4); the checkpoint's
  // BF16/FP32 expert tensors, per-expert or stacked, are quantized on arrival, at load and in
  // every weight update (gate rows then up rows, as the stacked gate_up_proj orders them).
  // Dense layers keep their FP32 MLP.
  bool experts_mxfp4 = false;
  // The checkpoint's dtype as config.json names it ("bfloat16", "float32").
  std::string checkpoint_dtype = "bfloat16";
  // On CUDA, the dense projections (attention q/k/v/o and the LM head) are stored in BF16 and
  // multiplied by cuBLAS in BF16 with FP32 accumulation (activations rounded to BF16 before each
  // of them). Set by open_hf_model when every such projection in the checkpoint is BF16: their
  // values then lose nothing. The CPU decoder ignores it (FP32 everywhere: the reference). Off
  // for built-in configs.
  bool dense_bf16 = false;
  // On CUDA, one GEMM for a layer's q, k and v when their weights lie back to back (rope_qk then
  // splits the rows and adds the projection biases). false keeps the checkpoint's three GEMMs:
  // an A/B switch for benchmarks and for telling a numerical difference from a bug.
  bool fuse_qkv = true;
  // On CUDA, MXFP4 routed experts (H and I multiples of 64) run on moe::experts' grouped kernels
  // with BF16 GEMM inputs. false keeps Backend::moe_experts (FP32 activations, one (token, expert)
  // pair at a time, much slower): an A/B switch, like fuse_qkv, for telling the BF16 rounding of
  // the expert inputs from a bug.
  bool grouped_experts = true;
  // How a checkpoint's fused `mlp.experts.gate_up_proj` orders its rows: concatenated
  // (gate rows, then up rows: transformers 5) or interleaved (gate j, up j, ...: gpt-oss).
  bool gate_up_checkpoint_interleaved = false;
  // Benchmarks of weight transports: extra BF16 parameters `synthetic.{i}.weight` of 256 MiB
  // each (the last one smaller), up to this many bytes in all. Not read by the forward pass;
  // their values are unspecified until a weight update writes them.
  int64_t synthetic_param_bytes = 0;
  // ... and this many small BF16 parameters `synthetic_small.{i}.weight` of 1024 elements
  // (per-tensor overhead of a bucket of many small tensors).
  int64_t synthetic_small_params = 0;
  // ... and this many bytes (as the trainer sends them: BF16) of parameters quantized to MXFP4
  // on arrival, `synthetic_mx.{i}.weight` [32768, 4096] (256 MiB of BF16 each), stored as
  // `synthetic_mx.{i}.weight_blocks` / `_scales` (online quantization in the transport path).
  int64_t synthetic_mxfp4_bytes = 0;
  // ... and this many bytes (BF16, as sent) of parameters quantized to blockwise FP8 on arrival,
  // `synthetic_fp8.{i}.weight` [32768, 4096] stored as float8_e4m3fn plus
  // `synthetic_fp8.{i}.weight_scale_inv` [256, 32] FP32 (UE8M0 scales, DeepSeek-V3 layout).
  int64_t synthetic_fp8_bytes = 0;

  // Qwen3MoeDecoderLayer's rule: MoE unless listed in mlp_only_layers, and only every
  // decoder_sparse_step-th layer.
  bool is_moe_layer(int64_t layer) const {
    for (int64_t d : mlp_only_layers)
      if (d == layer) return false;
    return (layer + 1) % decoder_sparse_step == 0;
  }
  int64_t num_moe_layers() const {
    int64_t n = 0;
    for (int64_t l = 0; l < num_hidden_layers; ++l) n += is_moe_layer(l) ? 1 : 0;
    return n;
  }
  // gpt-oss: layers that attend over the last sliding_window positions only.
  bool is_sliding_layer(int64_t layer) const {
    return !layer_types.empty() && layer_types[static_cast<size_t>(layer)] == "sliding_attention";
  }
  int64_t num_sliding_layers() const {
    int64_t n = 0;
    for (int64_t l = 0; l < num_hidden_layers; ++l) n += is_sliding_layer(l) ? 1 : 0;
    return n;
  }
  // Checks internal consistency (positive sizes, heads divisible, top_k <= experts, ...).
  Status validate() const;
};

// How the routed experts are stored, as an operator asks (--quantize-experts).
enum class ExpertQuantization : uint8_t { kNone, kMxfp4 };
// "none" | "mxfp4" (kInvalidArgument otherwise, field "quantize_experts").
Result<ExpertQuantization> parse_expert_quantization(const std::string& name);
const char* expert_quantization_name(ExpertQuantization q);
// Applies a request to `c` (before MoeDecoder::create): kMxfp4 sets experts_mxfp4 for
// output-major experts (qwen3_moe), and is a no-op for input-major ones already MXFP4 (gpt_oss
// as published). Refused, with `c` unchanged: input-major BF16/FP32 experts (transformers' gpt_oss layout, so
// quantizing along the MXFP4 blocks' axis would need a transpose: kUnimplemented, field
// "quantize_experts"); hidden_size or moe_intermediate_size not a multiple of 32 (the MXFP4
// block: kInvalidArgument naming that field).
Status apply_expert_quantization(ModelConfig& c, ExpertQuantization q);

// Rotary frequencies as Hugging Face computes them (modeling_rope_utils): inv_freq [head_dim / 2]
// and the factor cos/sin are multiplied by (1 for "default"; YaRN's attention factor).
struct RopeFrequencies {
  std::vector<float> inv_freq;
  float attention_factor = 1.0f;
};
RopeFrequencies rope_frequencies(const ModelConfig& c);

// The smallest dtype that holds every logical expert id (protocol: uint8 | uint16 | int32).
std::string routed_experts_dtype_for(int64_t num_experts);

}  // namespace rolloutd::core
