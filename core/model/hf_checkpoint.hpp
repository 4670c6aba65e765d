#pragma once
// Loading a Hugging Face checkpoint directory (config.json + safetensors) into a MoeDecoder.
//
// Every tensor goes through the weight registry by its checkpoint name -- the same path and
// the same names `update_weights` takes -- so a weight update with the checkpoint's own
// tensors leaves bit-identical parameters. The whole checkpoint is checked before the first
// byte is written: a tensor the model does not have (extra), a dtype or shape it cannot take
// (mis-shaped), two tensors writing the same rows, and a parameter no tensor writes
// (missing) are each refused with a message and a field naming the tensor.
#include <memory>
#include <string>

#include "core/model/config.hpp"
#include "core/model/moe_decoder.hpp"
#include "core/model/safetensors.hpp"
#include "kernels/status.hpp"

namespace rolloutd::core {

struct HfModel {
  std::string dir;
  ModelConfig config;
  std::unique_ptr<SafetensorsCheckpoint> checkpoint;
};

// Parses DIR/config.json (refusing a family or setting the decoder cannot run, with
// kUnimplemented) and maps the safetensors files (validated headers). `quantize_experts`
// (the daemon's --quantize-experts) goes through apply_expert_quantization once the checkpoint
// says what its experts are (config.hpp: what is refused, and why).
Result<HfModel> open_hf_model(const std::string& dir,
                              ExpertQuantization quantize_experts = ExpertQuantization::kNone);

// Checks the checkpoint against `model`'s registered parameters, writes every tensor (quantizing
// those the model stores quantized, MXFP4 experts of a qwen3_moe model with experts_mxfp4, on
// the model's backend: the same path and bytes as a weight update), then moves every parameter
// to kernel layout. Parameters must be freshly built (checkpoint
// layout). Benchmark-only `synthetic*` parameters are not expected in a checkpoint.
Status load_checkpoint(MoeDecoder& model, const SafetensorsCheckpoint& checkpoint);

}  // namespace rolloutd::core
