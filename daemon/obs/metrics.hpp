#pragma once
// The daemon's Prometheus metrics, exposed as text by the http actor's /metrics.
//
// Names follow one scheme: prefix `rolloutd_`, base units (`_seconds`), `_total` on
// counters. Every method is safe to call from any thread (engine, control, http).
//
// Label values must come from small fixed sets: request types, ErrorCode wire
// names, finish reasons. Never pass a request id, a peer address or free text: each
// distinct value is a time series kept for the life of the process. As a backstop,
// each labelled family keeps at most `max_label_values` values (64 by default,
// "other" included); anything beyond is counted under "other".
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace prometheus {
class Registry;
}

namespace rolloutd::obs {

class Metrics {
 public:
  static constexpr size_t kDefaultMaxLabelValues = 64;

  Metrics();
  explicit Metrics(size_t max_label_values);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Prometheus text exposition (format 0.0.4) of every family in the registry.
  std::string serialize() const;

  void on_request(std::string_view type);          // rolloutd_requests_total{type}
  void on_error(std::string_view code);            // rolloutd_errors_total{code}
  void add_prompt_tokens(uint64_t n);              // rolloutd_prompt_tokens_total
  void add_generated_tokens(uint64_t n);           // rolloutd_tokens_generated_total
  // rolloutd_preemptions_total, rolloutd_recomputed_tokens_total
  void add_preemptions(uint64_t preemptions, uint64_t recomputed_tokens);
  // rolloutd_prefix_cache_queried_tokens_total, rolloutd_prefix_cache_hit_tokens_total,
  // rolloutd_kv_blocks_cached{state="read"|"evictable"}
  void add_prefix_cache_tokens(uint64_t queried, uint64_t hit);
  void set_kv_blocks_cached(int64_t cached, int64_t evictable);
  // rolloutd_kv_blocks{pool="full"|"sliding", state="free"|"used"} (the sliding pool's only
  // with --sliding-kv-pool; blocks the prefix cache holds count as used)
  void set_kv_blocks(int64_t free, int64_t total, int64_t sliding_free, int64_t sliding_total);
  void on_finished(std::string_view reason);       // rolloutd_requests_finished_total{reason}
  void on_stream_abort(std::string_view reason);   // rolloutd_stream_aborts_total{reason}
  void on_reply_dropped();                         // rolloutd_replies_dropped_total
  void add_forward_steps(uint64_t graph, uint64_t eager);  // rolloutd_forward_steps_total{mode}
  void set_queue_depth(uint64_t waiting, uint64_t running);  // rolloutd_queue_depth{state}
  void observe_step_seconds(double s);             // rolloutd_engine_step_duration_seconds
  void observe_control_seconds(double s);          // rolloutd_control_handle_duration_seconds
  // rolloutd_weight_update_sessions_total{result="completed"|"aborted"|"expired"|"failed"};
  // completed ones also observe rolloutd_weight_update_duration_seconds.
  void on_weight_session(std::string_view result, double seconds);
  void add_weight_update_bytes(uint64_t n);        // rolloutd_weight_update_bytes_total
  void set_ipc_handles_open(uint64_t n);           // rolloutd_weight_ipc_handles_open
  // Memory by tag ("weights" | "kv_cache" | "cuda_graph" | "scratch"; others are ignored):
  // rolloutd_memory_resident_bytes{tag} (physical memory mapped now) and
  // rolloutd_memory_released_bytes{tag} (physical memory given back by release_memory).
  void set_memory_bytes(std::string_view tag, uint64_t resident, uint64_t released);
  // rolloutd_memory_release_duration_seconds{tag} / rolloutd_memory_resume_duration_seconds{tag}
  // (op "release" | "resume"), one observation per tag whose state changed.
  void observe_memory_op(std::string_view op, std::string_view tag, double seconds);
  void set_ready(bool ready);                      // rolloutd_ready
  void set_weight_version(uint64_t version);       // rolloutd_weight_version
  void set_uptime_seconds(double s);               // rolloutd_uptime_seconds
  void set_build_info(std::string_view version, bool cuda);  // rolloutd_build_info{version,cuda} 1

  // For modules that own metrics of their own (e.g. weight-update durations): register
  // families here so that one serialize() exposes everything. Same naming rules.
  prometheus::Registry& registry();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rolloutd::obs
