#pragma once
// Small random checkpoints in exactly the Hugging Face format (config.json +
// model.safetensors with the tensor names transformers saves), deterministic for a seed:
// `rolloutctl make-test-model` writes them, so tests and demos never need a download.
//
// Values: each tensor from its own stream (random_init.hpp: seed and the tensor's name), the
// embedded model's scheme -- norms 1 + U(-0.1, 0.1), embeddings U(-1, 1), matrices
// U(-g, g)/sqrt(fan_in) with gain 2 for routers and 4 for the LM head, biases and sinks
// U(-0.1, 0.1) -- then rounded to the checkpoint dtype (BF16: to nearest even).
#include <cstdint>
#include <string>
#include <vector>

#include "core/model/config.hpp"
#include "kernels/dtype.hpp"
#include "kernels/status.hpp"

namespace rolloutd::core {

struct TestModelSpec {
  std::string family = "qwen3_moe";   // a model_type of core/model/families/ (qwen3_moe, gpt_oss)
  int64_t layers = 2;
  int64_t hidden = 64;
  int64_t experts = 8;
  int64_t top_k = 2;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 16;
  int64_t intermediate = 32;          // per expert
  int64_t vocab = 256;
  std::string dtype = "bfloat16";     // bfloat16 | float32
  // qwen3_moe dense layers: these indices, and all but every decoder_sparse_step-th layer.
  std::vector<int64_t> mlp_only_layers;
  int64_t decoder_sparse_step = 1;
  // gpt_oss: the window of the sliding-attention (even) layers.
  int64_t sliding_window = 128;
  // gpt_oss: experts written as MXFP4 `*_blocks` / `*_scales` (as OpenAI publishes gpt-oss),
  // quantized from the same random values (transposed to [E, out, in]) instead of BF16/FP32.
  bool experts_mxfp4 = false;
  uint64_t seed = 0;
};

// The ModelConfig a spec describes (validated; the family's conventions filled in).
Result<ModelConfig> test_model_config(const TestModelSpec& spec);

struct TestTensor {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype;
  std::vector<uint8_t> bytes;
};
// Every tensor of the checkpoint, in the order transformers lists them.
Result<std::vector<TestTensor>> make_test_tensors(const ModelConfig& c, uint64_t seed);

// Writes DIR/config.json and DIR/model.safetensors (DIR is created if missing).
Status write_test_model(const TestModelSpec& spec, const std::string& dir);

}  // namespace rolloutd::core
