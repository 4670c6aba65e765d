#pragma once
// A stable arena: memory handed out once and never moved. Parameters, KV cache
// and step workspaces come from arenas so their addresses survive weight
// updates, CUDA graph capture and memory release/resume.
//
// Built on virtual memory (Backend::vm_*): the arena reserves a virtual range and maps
// physical memory into it as it grows, in pieces of `chunk_bytes` (rounded to the backend's
// granularity). A tensor never spans two ranges; when a range is full the arena reserves
// another, so earlier tensors never move. release() unmaps every piece -- the physical memory
// goes back to the device (or the host) while the addresses stay reserved; resume() maps
// fresh physical memory at the same addresses. What a resumed arena holds:
//   CPU   zero bytes (fresh anonymous pages);
//   CUDA  undefined bytes (fresh device memory).
// While released, the memory is inaccessible: a CPU access faults (SIGSEGV), a CUDA kernel
// access is an illegal-address error. Callers that need values across a release back them up
// (core/storage/static_state.hpp) or rewrite them (a weight session).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/status.hpp"
#include "kernels/tensor_view.hpp"

namespace rolloutd::core {

enum class MemoryTag : uint8_t { kWeights, kKvCache, kCudaGraph, kScratch };
inline constexpr MemoryTag kAllMemoryTags[] = {MemoryTag::kWeights, MemoryTag::kKvCache, MemoryTag::kCudaGraph,
                                               MemoryTag::kScratch};
std::string_view memory_tag_name(MemoryTag tag);
// "weights" | "kv_cache" | "cuda_graph" | "scratch" -> the tag; false for anything else.
bool memory_tag_from_name(std::string_view name, MemoryTag& out);

class StableArena {
 public:
  // `chunk_bytes`: physical memory is mapped in pieces of at least this size. `reserve_bytes`:
  // the size of each virtual range (0: a default of 8 GiB on CUDA, 1 GiB on the host; a
  // tensor larger than that gets a range of its own). Virtual space is cheap but not free on
  // the device (unified addressing shares it with the host): many small arenas must not
  // each reserve a model's worth.
  StableArena(const Backend& backend, ExecContext ctx, MemoryTag tag, size_t chunk_bytes = size_t{64} << 20,
              size_t reserve_bytes = 0);
  ~StableArena();
  StableArena(const StableArena&) = delete;
  StableArena& operator=(const StableArena&) = delete;

  // A contiguous tensor of `dtype` and `shape`, `alignment`-aligned (power of two).
  // kFailedPrecondition while released.
  Result<TensorView> allocate(DType dtype, const Shape& shape, size_t alignment = 256);

  // Unmaps every piece; the addresses stay reserved. A no-op when already released.
  // Returns the physical bytes given back by this call.
  Result<size_t> release();
  // Maps fresh physical memory under every piece, at the same addresses. A no-op when
  // resident. Returns the bytes mapped by this call. On failure (kResourceExhausted: the
  // device is still full) the pieces mapped so far stay mapped, the arena stays released, and
  // a later resume() maps the rest.
  Result<size_t> resume();
  bool released() const { return released_; }

  MemoryTag tag() const { return tag_; }
  size_t bytes_used() const { return used_; }           // handed out by allocate()
  size_t bytes_reserved() const { return reserved_; }   // virtual address space held
  size_t bytes_backed() const { return backed_; }       // physical memory when resident
  size_t bytes_resident() const { return resident_; }   // physical memory mapped now
  // The reserved virtual ranges [base, base + size), in order: fixed for the arena's life.
  struct Range {
    uintptr_t base = 0;
    size_t size = 0;
  };
  std::vector<Range> ranges() const;
  bool contains(const void* p, size_t bytes) const;
  const Backend& backend() const { return backend_; }
  const ExecContext& context() const { return ctx_; }

 private:
  struct Piece {
    char* addr = nullptr;
    size_t bytes = 0;
    bool mapped = false;
  };
  struct Segment {
    char* base = nullptr;
    size_t reserved = 0;
    size_t mapped = 0;   // prefix of the range with pieces
    size_t offset = 0;   // bump pointer
  };
  Status new_segment(size_t min_bytes);
  Status grow(Segment& s, size_t end);

  const Backend& backend_;
  ExecContext ctx_;
  MemoryTag tag_;
  size_t chunk_bytes_;
  size_t reserve_bytes_;
  size_t granularity_ = 0;
  std::vector<Segment> segments_;
  std::vector<Piece> pieces_;
  bool released_ = false;
  size_t used_ = 0, reserved_ = 0, backed_ = 0, resident_ = 0;
};

}  // namespace rolloutd::core
