#pragma once
// State the actors publish for readers on other threads (HTTP, status replies):
// immutable snapshots swapped under a mutex, and heartbeats as atomics. Readers
// never wait on an actor.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "protocol/messages.hpp"

namespace rolloutd::daemon {

template <class T>
class SnapshotCell {
 public:
  void publish(std::shared_ptr<const T> v) {
    std::lock_guard<std::mutex> lock(mu_);
    v_ = std::move(v);
  }
  std::shared_ptr<const T> load() const {
    std::lock_guard<std::mutex> lock(mu_);
    return v_;
  }

 private:
  mutable std::mutex mu_;
  std::shared_ptr<const T> v_;
};

class Heartbeat {
 public:
  void beat() { ns_.store(now_ns(), std::memory_order_relaxed); }
  // Seconds since the last beat (infinity-like if never).
  double age_s() const {
    const int64_t last = ns_.load(std::memory_order_relaxed);
    if (last == 0) return 1e9;
    return static_cast<double>(now_ns() - last) * 1e-9;
  }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  std::atomic<int64_t> ns_{0};
};

// One memory tag as /v1/status shows it (memory release/resume).
struct MemoryTagSnapshot {
  std::string tag;                    // weights | kv_cache | cuda_graph | scratch
  std::string state;                  // resident | released
  uint64_t resident_bytes = 0;        // physical memory mapped now
  uint64_t backed_bytes = 0;          // physical memory when resident
  uint64_t reserved_bytes = 0;        // virtual address space held (never given back)
  uint64_t used_bytes = 0;            // handed out to tensors
  uint64_t static_state_bytes = 0;
  uint64_t static_state_entries = 0;
  uint32_t static_state_crc32 = 0;    // equal across a release/resume: the state came back bit for bit
  uint64_t num_releases = 0, num_resumes = 0;
  uint64_t last_release_bytes = 0, last_resume_bytes = 0;
  double last_release_s = 0, last_resume_s = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // reserved virtual ranges {base, size}
};

// What /v1/status, /readyz and the status reply show.
struct EngineSnapshot {
  std::string state = "starting";    // starting | ready | updating | not_ready | draining
  std::string reason;
  uint64_t weight_version = 0;
  uint64_t num_waiting = 0;
  uint64_t num_running = 0;
  uint64_t num_requests_total = 0;
  uint64_t num_prompt_tokens_total = 0;
  uint64_t num_generated_tokens_total = 0;
  int64_t kv_blocks_free = 0;
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_cached = 0;     // held by the prefix cache
  int64_t kv_blocks_evictable = 0;  // of those, the ones no request reads (evicted when needed)
  int64_t sliding_kv_blocks_free = 0;   // the sliding-window layers' pool (--sliding-kv-pool)
  int64_t sliding_kv_blocks_total = 0;  // 0 without it
  bool prefix_cache_enabled = false;
  uint64_t num_prefix_cache_queried_tokens_total = 0, num_prefix_cache_hit_tokens_total = 0;
  std::string kv_cache_dtype;        // "float32" | "bfloat16": the K/V caches' element type
  uint64_t num_steps_total = 0;
  // Decode graphs: buckets up to graph_max_batch (0: off), executable graphs held, steps run
  // from a graph (padded) or eagerly, capture wall time at start.
  int64_t graph_max_batch = 0, graph_buckets = 0, num_graphs = 0;
  uint64_t graph_steps = 0, eager_steps = 0;
  double graph_capture_s = 0;
  bool paused = false;
  uint64_t update_session = 0;
  std::vector<MemoryTagSnapshot> memory;
  // FNV-1a over every parameter's (name, address): equal values mean no parameter moved.
  uint64_t parameters_address_digest = 0;
};

}  // namespace rolloutd::daemon
