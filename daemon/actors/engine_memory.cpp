// The engine actor's memory commands: release_memory and resume_memory (SPEC §12). They run
// on the engine thread between steps, only while the engine is idle, and reply after the
// work is done on the device: released memory is unmapped, resumed memory is mapped again and
// its static state written back.
#include <algorithm>
#include <chrono>

#include "daemon/actors/engine_actor.hpp"
#include "daemon/obs/log.hpp"

namespace rolloutd::daemon {
namespace {

using Clock = std::chrono::steady_clock;

// The request's tags as core tags, in canonical order (nil: every client-visible tag).
std::vector<core::MemoryTag> core_tags(const std::optional<std::vector<std::string>>& tags) {
  std::vector<core::MemoryTag> out;
  for (std::string_view name : protocol::kMemoryTags) {
    if (tags && std::find(tags->begin(), tags->end(), name) == tags->end()) continue;
    core::MemoryTag t;
    if (core::memory_tag_from_name(name, t)) out.push_back(t);
  }
  return out;
}

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace

size_t EngineActor::free_nccl_staging() {
  size_t freed = 0;
  const auto& ctx = engine_->model().context();
  const auto& backend = engine_->model().backend();
  for (Staging& st : staging_) {
    if (!st.ptr) continue;
    (void)backend.free(ctx, st.ptr);
    freed += st.bytes;
    st = Staging{};
  }
  return freed;
}

void EngineActor::refresh_memory_digests() {
  const auto& mem = engine_->memory();
  for (core::MemoryTag t : core::kAllMemoryTags) {
    auto d = mem.static_state_digest(t);
    static_state_crc_[static_cast<size_t>(t)] = d.ok() ? *d : 0;
  }
  uint64_t h = 1469598103934665603ull;
  for (const auto& p : engine_->model().weights().parameters()) {
    h = fnv1a(h, p.name.data(), p.name.size());
    const auto addr = reinterpret_cast<uintptr_t>(p.storage.data);
    h = fnv1a(h, &addr, sizeof(addr));
  }
  parameters_address_digest_ = h;
}

void EngineActor::fill_memory_snapshot(EngineSnapshot& s) {
  const auto& mem = engine_->memory();
  for (core::MemoryTag t : core::kAllMemoryTags) {
    const core::MemoryTagStats st =
        t == core::MemoryTag::kScratch ? core::MemoryTagStats{} : mem.stats(t);
    MemoryTagSnapshot m;
    m.tag = std::string(core::memory_tag_name(t));
    m.state = st.released ? "released" : "resident";
    if (t == core::MemoryTag::kScratch) {
      // Step workspaces: never released (a few MiB), shown so the resident total is complete.
      const core::StableArena& a = engine_->model().arena(core::MemoryTag::kScratch);
      m.resident_bytes = a.bytes_resident();
      m.backed_bytes = a.bytes_backed();
      m.reserved_bytes = a.bytes_reserved();
      m.used_bytes = a.bytes_used();
      for (const auto& r : a.ranges()) m.ranges.emplace_back(r.base, r.size);
    } else {
      m.resident_bytes = st.resident_bytes;
      m.backed_bytes = st.backed_bytes;
      m.reserved_bytes = st.reserved_bytes;
      m.used_bytes = st.used_bytes;
      for (const core::StableArena* a : mem.arenas(t))
        for (const auto& r : a->ranges()) m.ranges.emplace_back(r.base, r.size);
    }
    m.static_state_bytes = st.static_state_bytes;
    m.static_state_entries = st.static_state_entries;
    m.static_state_crc32 = static_state_crc_[static_cast<size_t>(t)];
    m.num_releases = st.num_releases;
    m.num_resumes = st.num_resumes;
    m.last_release_bytes = st.last_release_bytes;
    m.last_resume_bytes = st.last_resume_bytes;
    m.last_release_s = st.last_release_s;
    m.last_resume_s = st.last_resume_s;
    metrics_.set_memory_bytes(m.tag, m.resident_bytes, st.released ? m.backed_bytes : 0);
    s.memory.push_back(std::move(m));
  }
  s.parameters_address_digest = parameters_address_digest_;
}

void EngineActor::handle_memory(WeightCommand& cmd) {
  using namespace protocol;
  const uint64_t id = cmd.envelope_id;
  const bool release = std::holds_alternative<ReleaseMemoryRequest>(cmd.request);
  const auto& wanted = release ? std::get<ReleaseMemoryRequest>(cmd.request).tags
                               : std::get<ResumeMemoryRequest>(cmd.request).tags;
  const std::vector<core::MemoryTag> tags = core_tags(wanted);
  if (faulted_) return reply_error(cmd.client, id, Status(ErrorCode::kNotReady, "engine faulted: " + fault_reason_));
  // A join or a broadcast in flight writes into device memory the daemon owns: wait for it.
  if (has_pending_device_work())
    return reply_error(cmd.client, id,
                       Status(ErrorCode::kFailedPrecondition,
                              "an NCCL join or broadcast is in flight: wait for its reply before " +
                                  std::string(release ? "release_memory" : "resume_memory")));
  const auto t0 = Clock::now();
  auto r = release ? engine_->release_memory(tags) : engine_->resume_memory(tags);
  if (!r.ok()) {
    Status s = r.status();
    obs::log_warn("memory", release ? "release_memory refused or failed" : "resume_memory refused or failed",
                  {{"error", s.to_string()}});
    if (s.code() == ErrorCode::kCudaError && !faulted_) {
      // An unmap or map the driver refused leaves the device in an unknown state: restart.
      reply_error(cmd.client, id, s);
      return on_device_fault(s);
    }
    refresh_memory_digests();
    return reply_error(cmd.client, id, s.field().empty() ? s : s.with_field_prefix("body"));
  }
  uint64_t bytes = 0;
  std::vector<std::string> changed;
  for (const auto& t : *r) {
    if (!t.op.changed) continue;
    size_t extra = 0;
    // The NCCL receive buffers belong with the weights: they exist only to fill parameters.
    if (release && t.tag == core::MemoryTag::kWeights) extra = free_nccl_staging();
    bytes += t.op.bytes + extra;
    changed.emplace_back(core::memory_tag_name(t.tag));
    metrics_.observe_memory_op(release ? "release" : "resume", core::memory_tag_name(t.tag), t.op.duration_s);
    obs::log_info("memory", release ? "memory released" : "memory resumed",
                  {{"tag", std::string(core::memory_tag_name(t.tag))}, {"size_bytes", t.op.bytes + extra},
                   {"duration_s", t.op.duration_s}});
  }
  refresh_memory_digests();
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  if (release) return reply(cmd.client, encode_reply(id, ReleaseMemoryReply{changed, bytes, dt}));
  reply(cmd.client, encode_reply(id, ResumeMemoryReply{changed, bytes, dt}));
}

}  // namespace rolloutd::daemon
