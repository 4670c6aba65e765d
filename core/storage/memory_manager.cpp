#include "core/storage/memory_manager.hpp"

#include <chrono>

#include <zlib.h>

namespace rolloutd::core {
namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

void MemoryManager::add_arena(StableArena* arena) { arenas_.push_back(arena); }
void MemoryManager::add_static_state(StaticState* state) { static_.push_back(state); }
void MemoryManager::add_release_hook(MemoryTag tag, std::function<Result<size_t>()> hook) {
  hooks_.emplace_back(tag, std::move(hook));
}

Result<MemoryOpResult> MemoryManager::release(MemoryTag tag) {
  TagState& st = state_[index(tag)];
  MemoryOpResult r;
  if (st.released) return r;
  const auto t0 = Clock::now();
  // Static state first: once an arena is unmapped its values are gone.
  for (StaticState* s : static_) RD_RETURN_IF_ERROR(s->backup(tag));
  for (auto& [t, hook] : hooks_) {
    if (t != tag) continue;
    RD_ASSIGN_OR_RETURN(size_t n, hook());
    r.bytes += n;
  }
  for (StableArena* a : arenas_) {
    if (a->tag() != tag) continue;
    RD_ASSIGN_OR_RETURN(size_t n, a->release());
    r.bytes += n;
  }
  st.released = true;
  r.changed = true;
  r.duration_s = since(t0);
  ++st.num_releases;
  st.last_release_bytes = r.bytes;
  st.last_release_s = r.duration_s;
  return r;
}

Result<MemoryOpResult> MemoryManager::resume(MemoryTag tag) {
  TagState& st = state_[index(tag)];
  MemoryOpResult r;
  if (!st.released) return r;
  const auto t0 = Clock::now();
  // An arena that cannot map (the trainer still holds the device) stays released, with the
  // pieces mapped so far kept; the tag stays released and a retry maps the rest.
  for (StableArena* a : arenas_) {
    if (a->tag() != tag) continue;
    RD_ASSIGN_OR_RETURN(size_t n, a->resume());
    r.bytes += n;
  }
  for (StaticState* s : static_) RD_RETURN_IF_ERROR(s->restore(tag));
  st.released = false;
  r.changed = true;
  r.duration_s = since(t0);
  ++st.num_resumes;
  st.last_resume_bytes = r.bytes;
  st.last_resume_s = r.duration_s;
  return r;
}

MemoryTagStats MemoryManager::stats(MemoryTag tag) const {
  const TagState& st = state_[index(tag)];
  MemoryTagStats s;
  s.released = st.released;
  for (const StableArena* a : arenas_) {
    if (a->tag() != tag) continue;
    s.resident_bytes += a->bytes_resident();
    s.backed_bytes += a->bytes_backed();
    s.reserved_bytes += a->bytes_reserved();
    s.used_bytes += a->bytes_used();
  }
  for (const StaticState* ss : static_) {
    s.static_state_bytes += ss->bytes(tag);
    s.static_state_entries += ss->count(tag);
  }
  s.num_releases = st.num_releases;
  s.num_resumes = st.num_resumes;
  s.last_release_bytes = st.last_release_bytes;
  s.last_resume_bytes = st.last_resume_bytes;
  s.last_release_s = st.last_release_s;
  s.last_resume_s = st.last_resume_s;
  return s;
}

std::vector<const StableArena*> MemoryManager::arenas(MemoryTag tag) const {
  std::vector<const StableArena*> out;
  for (const StableArena* a : arenas_)
    if (a->tag() == tag) out.push_back(a);
  return out;
}

Result<uint32_t> MemoryManager::static_state_digest(MemoryTag tag) const {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (const StaticState* s : static_) {
    RD_ASSIGN_OR_RETURN(uint32_t d, s->digest(tag));
    const Bytef b[4] = {static_cast<Bytef>(d), static_cast<Bytef>(d >> 8), static_cast<Bytef>(d >> 16),
                        static_cast<Bytef>(d >> 24)};
    crc = crc32(crc, b, 4);
  }
  return static_cast<uint32_t>(crc);
}

}  // namespace rolloutd::core
