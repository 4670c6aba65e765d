#pragma once
// Memory release and resume by tag, for a colocated trainer that wants the GPU between
// rollouts. One manager per model: the arenas of each tag, the static state that must survive
// a release, and hooks that give back transient buffers of a tag (layout-permutation staging,
// NCCL receive buffers) that are re-made on demand.
//
// release(tag): back static state of the tag up to host memory, run the tag's hooks, unmap
// every arena of the tag (addresses stay reserved). resume(tag): map fresh memory under every
// arena of the tag, write the static state back. Both are idempotent: releasing a released tag
// or resuming a resident one does nothing and reports zero bytes. The caller (the engine)
// makes sure nothing runs on the memory meanwhile.
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/storage/arena.hpp"
#include "core/storage/static_state.hpp"
#include "kernels/status.hpp"

namespace rolloutd::core {

struct MemoryTagStats {
  bool released = false;
  size_t resident_bytes = 0;   // physical memory mapped now (arenas)
  size_t backed_bytes = 0;     // physical memory when resident (arenas)
  size_t reserved_bytes = 0;   // virtual address space held (arenas)
  size_t used_bytes = 0;       // handed out by the arenas
  size_t static_state_bytes = 0;
  size_t static_state_entries = 0;
  uint64_t num_releases = 0, num_resumes = 0;
  size_t last_release_bytes = 0, last_resume_bytes = 0;
  double last_release_s = 0, last_resume_s = 0;
};

struct MemoryOpResult {
  bool changed = false;        // false: the tag was already in the requested state
  size_t bytes = 0;            // physical bytes given back (release) or mapped (resume)
  double duration_s = 0;
};

class MemoryManager {
 public:
  void add_arena(StableArena* arena);            // not owned; outlives the manager's use
  void add_static_state(StaticState* state);     // not owned
  // Called on release of `tag`, after the static state is backed up and before the arenas are
  // unmapped; returns the bytes it gave back.
  void add_release_hook(MemoryTag tag, std::function<Result<size_t>()> hook);

  Result<MemoryOpResult> release(MemoryTag tag);
  Result<MemoryOpResult> resume(MemoryTag tag);
  bool released(MemoryTag tag) const { return state_[index(tag)].released; }
  MemoryTagStats stats(MemoryTag tag) const;
  std::vector<const StableArena*> arenas(MemoryTag tag) const;
  // CRC-32 of the tag's static state (StaticState::digest over every registered set).
  Result<uint32_t> static_state_digest(MemoryTag tag) const;

 private:
  static size_t index(MemoryTag t) { return static_cast<size_t>(t); }
  struct TagState {
    bool released = false;
    uint64_t num_releases = 0, num_resumes = 0;
    size_t last_release_bytes = 0, last_resume_bytes = 0;
    double last_release_s = 0, last_resume_s = 0;
  };
  std::vector<StableArena*> arenas_;
  std::vector<StaticState*> static_;
  std::vector<std::pair<MemoryTag, std::function<Result<size_t>()>>> hooks_;
  std::array<TagState, 4> state_{};
};

}  // namespace rolloutd::core
