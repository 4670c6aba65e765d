#pragma once
// Static state: small device-resident values that are not checkpoint tensors -- expert maps'
// device copies, restore permutations, clamp limits, activation constants, layout tables --
// yet live in memory that release_memory gives back. A weight push rewrites every checkpoint
// tensor but none of these (the seed bug: constants lost across a release because nobody
// registered them), so each is registered here once, at model build, with the tag of the
// memory it lives in. Releasing the tag copies each region to host memory first; resuming it
// writes the copies back at the same addresses, bit for bit.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/storage/arena.hpp"
#include "kernels/backend.hpp"
#include "kernels/status.hpp"
#include "kernels/tensor_view.hpp"

namespace rolloutd::core {

class StaticState {
 public:
  struct Entry {
    std::string name;
    MemoryTag tag = MemoryTag::kWeights;
    TensorView region;               // contiguous, on the context's device
    std::vector<uint8_t> backup;     // host copy while the tag is released
    bool backed_up = false;
  };

  StaticState(const Backend& backend, ExecContext ctx) : backend_(backend), ctx_(ctx) {}

  // Registers `region` under `name` (unique). The region's bytes at release time are what
  // resume writes back.
  Status add(std::string name, MemoryTag tag, TensorView region);
  // Copies every region of `tag` to host memory; call before the tag's memory is unmapped.
  Status backup(MemoryTag tag);
  // Writes every backup of `tag` back to its region (the memory is mapped again) and frees it.
  Status restore(MemoryTag tag);

  // The bytes of entry `i` now: read from the device when resident, the backup when released.
  Status read(size_t i, std::vector<uint8_t>& out) const;
  // CRC-32 over the entries of `tag` in registration order (name, 0 byte, bytes): equal
  // digests before a release and after the resume mean the state came back bit for bit.
  Result<uint32_t> digest(MemoryTag tag) const;
  size_t bytes(MemoryTag tag) const;
  size_t count(MemoryTag tag) const;
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  CopyKind to_host() const;
  CopyKind to_device() const;

  const Backend& backend_;
  ExecContext ctx_;
  std::vector<Entry> entries_;
};

}  // namespace rolloutd::core
