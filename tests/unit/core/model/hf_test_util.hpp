#pragma once
// Helpers shared by the Hugging Face model tests (tests/unit/core/model/hf_*_test.cpp).
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "core/model/moe_decoder.hpp"
#include "core/model/safetensors.hpp"
#include "core/weights/session.hpp"

namespace rolloutd::test {

// Every tensor of a checkpoint as one bucket, under its own names and dtypes: what a trainer
// pushing that checkpoint sends.
struct CheckpointBucket {
  std::vector<core::BucketEntry> entries;
  std::vector<uint8_t> bytes;
};
inline CheckpointBucket checkpoint_bucket(const core::SafetensorsCheckpoint& ckpt) {
  CheckpointBucket b;
  for (const auto& [name, t] : ckpt.tensors()) {
    const auto data = ckpt.data(t);
    b.entries.push_back({name, t.entry->dtype, t.entry->shape, b.bytes.size(), data.size()});
    b.bytes.insert(b.bytes.end(), data.begin(), data.end());
  }
  return b;
}

// Appends one FP32 tensor to a bucket (what a trainer exporting FP32 sends).
inline void add_f32_entry(CheckpointBucket& b, const std::string& name, std::vector<int64_t> shape,
                          std::span<const float> values) {
  core::BucketEntry e;
  e.name = name;
  e.dtype = DType::kF32;
  e.shape = std::move(shape);
  e.byte_offset = b.bytes.size();
  e.nbytes = values.size() * sizeof(float);
  b.bytes.resize(b.bytes.size() + e.nbytes);
  std::memcpy(b.bytes.data() + e.byte_offset, values.data(), e.nbytes);
  b.entries.push_back(std::move(e));
}

// One sequence's prefill step: token t at position t, KV slot t, blocks 0.. of `block_size`
// (no logits rows: the caller says which it wants).
inline core::StepBatch single_sequence_prefill(const std::vector<int32_t>& tokens, int64_t block_size) {
  core::StepBatch b;
  const int32_t T = static_cast<int32_t>(tokens.size());
  b.max_blocks_per_seq = static_cast<int32_t>((T + block_size - 1) / block_size);
  for (int32_t i = 0; i < b.max_blocks_per_seq; ++i) b.block_tables.push_back(i);
  for (int32_t t = 0; t < T; ++t) {
    b.token_ids.push_back(tokens[static_cast<size_t>(t)]);
    b.positions.push_back(t);
    b.seq_of.push_back(0);
    b.slot_mapping.push_back(t);
    b.ctx_len.push_back(t + 1);
  }
  return b;
}

}  // namespace rolloutd::test
