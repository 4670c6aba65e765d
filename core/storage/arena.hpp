#pragma once
// A stable arena: memory handed out once and never moved. Parameters, KV cache
// and step workspaces come from arenas so their addresses survive weight
// updates (and, later, CUDA graph capture and memory release/resume).
//
// The arena grows by whole chunks (one backend allocation each); a tensor never
// spans chunks, and nothing is freed until the arena dies.
#include <cstddef>
#include <memory>
#include <string_view>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/status.hpp"
#include "kernels/tensor_view.hpp"

namespace rolloutd::core {

enum class MemoryTag : uint8_t { kWeights, kKvCache, kCudaGraph, kScratch };
std::string_view memory_tag_name(MemoryTag tag);

class StableArena {
 public:
  StableArena(const Backend& backend, ExecContext ctx, MemoryTag tag,
              size_t chunk_bytes = size_t{64} << 20);
  ~StableArena();
  StableArena(const StableArena&) = delete;
  StableArena& operator=(const StableArena&) = delete;

  // A contiguous tensor of `dtype` and `shape`, `alignment`-aligned (power of two).
  Result<TensorView> allocate(DType dtype, const Shape& shape, size_t alignment = 256);

  MemoryTag tag() const { return tag_; }
  size_t bytes_used() const { return used_; }
  size_t bytes_reserved() const { return reserved_; }
  const Backend& backend() const { return backend_; }
  const ExecContext& context() const { return ctx_; }

 private:
  struct Chunk {
    void* base = nullptr;
    size_t size = 0;
    size_t offset = 0;
  };
  const Backend& backend_;
  ExecContext ctx_;
  MemoryTag tag_;
  size_t chunk_bytes_;
  std::vector<Chunk> chunks_;
  size_t used_ = 0;
  size_t reserved_ = 0;
};

}  // namespace rolloutd::core
