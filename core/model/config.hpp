#pragma once
// Architecture of a MoE decoder as the engine needs it. Field names follow the
// Hugging Face config.json keys where one exists.
#include <cstdint>
#include <string>

#include "kernels/status.hpp"

namespace rolloutd::core {

struct ModelConfig {
  std::string name = "tiny-moe";
  std::string family = "qwen3_moe";   // router/activation conventions
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

  int64_t num_moe_layers() const { return num_hidden_layers; }
  // Checks internal consistency (positive sizes, heads divisible, top_k <= experts, ...).
  Status validate() const;
};

// The smallest dtype that holds every logical expert id (protocol: uint8 | uint16 | int32).
std::string routed_experts_dtype_for(int64_t num_experts);

}  // namespace rolloutd::core
