#include "daemon/obs/metrics.hpp"

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "kernels/status.hpp"

namespace rolloutd::obs {
namespace {

constexpr std::string_view kOtherLabel = "other";

// A labelled counter family with a bounded number of series. The hot unlabelled
// counters bypass this; labelled ones are bumped once per request, where a mutex
// and a map lookup cost nothing next to the request itself.
class CappedCounterFamily {
 public:
  CappedCounterFamily(prometheus::Family<prometheus::Counter>& family, std::string label, size_t max_values)
      : family_(family), label_(std::move(label)), max_values_(max_values < 1 ? 1 : max_values) {}

  prometheus::Counter& get(std::string_view value) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = series_.find(value); it != series_.end()) return *it->second;
    // One slot is kept for "other", so the family never exceeds max_values_ series.
    const bool fits = !value.empty() && num_named_ + 1 < max_values_;
    if (!fits) value = kOtherLabel;
    if (auto it = series_.find(value); it != series_.end()) return *it->second;
    prometheus::Counter& c = family_.Add({{label_, std::string(value)}});
    series_.emplace(std::string(value), &c);
    if (value != kOtherLabel) ++num_named_;
    return c;
  }

 private:
  prometheus::Family<prometheus::Counter>& family_;
  const std::string label_;
  const size_t max_values_;
  std::mutex mu_;
  std::map<std::string, prometheus::Counter*, std::less<>> series_;
  size_t num_named_ = 0;
};

// Engine steps: a decode step of a tiny CPU model is ~100 us, a long prefill or a
// step stalled behind a weight update reaches seconds.
prometheus::Histogram::BucketBoundaries step_buckets() {
  return {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
}

// Control messages: decode-and-route is tens of microseconds; the tail is a reply
// that waits for device work.
prometheus::Histogram::BucketBoundaries control_buckets() {
  return {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
          2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
}

}  // namespace

struct Metrics::Impl {
  // Families are owned by the registry; the pointers below stay valid for its life.
  prometheus::Registry registry;

  explicit Impl(size_t max_label_values)
      : requests(prometheus::BuildCounter()
                     .Name("rolloutd_requests_total")
                     .Help("Control requests received, by message type.")
                     .Register(registry),
                 "type", max_label_values),
        errors(prometheus::BuildCounter()
                   .Name("rolloutd_errors_total")
                   .Help("Errors answered or reported, by error code.")
                   .Register(registry),
               "code", max_label_values),
        finished(prometheus::BuildCounter()
                     .Name("rolloutd_requests_finished_total")
                     .Help("Generate requests that reached their final event, by reason.")
                     .Register(registry),
                 "reason", max_label_values),
        stream_aborts(prometheus::BuildCounter()
                          .Name("rolloutd_stream_aborts_total")
                          .Help("Event streams the daemon could not deliver, by reason.")
                          .Register(registry),
                      "reason", max_label_values),
        weight_sessions(prometheus::BuildCounter()
                            .Name("rolloutd_weight_update_sessions_total")
                            .Help("Weight-update sessions that ended, by result.")
                            .Register(registry),
                        "result", max_label_values) {
    weight_update_seconds = &prometheus::BuildHistogram()
                                 .Name("rolloutd_weight_update_duration_seconds")
                                 .Help("Wall time of completed weight-update sessions, begin to end.")
                                 .Register(registry)
                                 .Add({}, step_buckets());
    ipc_handles_open = &prometheus::BuildGauge()
                            .Name("rolloutd_weight_ipc_handles_open")
                            .Help("CUDA IPC handles held open by the weight-update session.")
                            .Register(registry)
                            .Add({});
    weight_update_bytes = &prometheus::BuildCounter()
                               .Name("rolloutd_weight_update_bytes_total")
                               .Help("Bucket bytes applied to parameters.")
                               .Register(registry)
                               .Add({});
    replies_dropped = &prometheus::BuildCounter()
                           .Name("rolloutd_replies_dropped_total")
                           .Help("Replies not queued for a client whose outbox was over its bound "
                                 "(it sent requests without reading).")
                           .Register(registry)
                           .Add({});
    prompt_tokens = &prometheus::BuildCounter()
                         .Name("rolloutd_prompt_tokens_total")
                         .Help("Prompt tokens accepted for prefill.")
                         .Register(registry)
                         .Add({});
    generated_tokens = &prometheus::BuildCounter()
                            .Name("rolloutd_tokens_generated_total")
                            .Help("Tokens sampled and emitted.")
                            .Register(registry)
                            .Add({});
    preemptions = &prometheus::BuildCounter()
                       .Name("rolloutd_preemptions_total")
                       .Help("Running requests whose cached KV was dropped and that went back to the queue because "
                             "the KV cache ran out of blocks (their KV is computed again when they are readmitted).")
                       .Register(registry)
                       .Add({});
    recomputed_tokens = &prometheus::BuildCounter()
                             .Name("rolloutd_recomputed_tokens_total")
                             .Help("Tokens whose KV a preemption dropped (prefilled again on readmission unless the request ends "
                                   "first or, with the prefix cache, its full blocks are still cached then).")
                             .Register(registry)
                             .Add({});
    prefix_queried = &prometheus::BuildCounter()
                          .Name("rolloutd_prefix_cache_queried_tokens_total")
                          .Help("Tokens looked up in the prefix cache at each admission (all of the request's tokens but its "
                                "last: a readmitted one's generated tokens too), counted when the request first "
                                "computes after that admission.")
                          .Register(registry)
                          .Add({});
    prefix_hit = &prometheus::BuildCounter()
                      .Name("rolloutd_prefix_cache_hit_tokens_total")
                      .Help("Prompt tokens whose KV came from the prefix cache instead of being computed, counted when "
                            "the request first computes after its admission (one sent back before that, by a weight "
                            "change, counts once, when it runs).")
                      .Register(registry)
                      .Add({});
    auto& cached = prometheus::BuildGauge()
                       .Name("rolloutd_kv_blocks_cached")
                       .Help("KV blocks the prefix cache holds: read by running requests, or evictable (no request "
                             "reads them; evicted, oldest first, when requests need blocks).")
                       .Register(registry);
    kv_blocks_cached_read = &cached.Add({{"state", "read"}});
    kv_blocks_cached_evictable = &cached.Add({{"state", "evictable"}});
    kv_blocks_family = &prometheus::BuildGauge()
                            .Name("rolloutd_kv_blocks")
                            .Help("KV cache blocks by pool (full: every layer, or the full-attention layers with "
                                  "--sliding-kv-pool; sliding: the sliding-window layers' own pool) and state "
                                  "(free, or used: held by requests or the prefix cache).")
                            .Register(registry);
    kv_blocks_full_free = &kv_blocks_family->Add({{"pool", "full"}, {"state", "free"}});
    kv_blocks_full_used = &kv_blocks_family->Add({{"pool", "full"}, {"state", "used"}});
    auto& steps = prometheus::BuildCounter()
                      .Name("rolloutd_forward_steps_total")
                      .Help("Forward steps by how they ran: graph (a decode step padded to its bucket and "
                            "replayed from a CUDA graph; padded eagerly on the CPU) or eager.")
                      .Register(registry);
    graph_steps = &steps.Add({{"mode", "graph"}});
    eager_steps = &steps.Add({{"mode", "eager"}});
    auto& queue = prometheus::BuildGauge()
                      .Name("rolloutd_queue_depth")
                      .Help("Generate requests in the scheduler, by state.")
                      .Register(registry);
    queue_waiting = &queue.Add({{"state", "waiting"}});
    queue_running = &queue.Add({{"state", "running"}});
    step_seconds = &prometheus::BuildHistogram()
                        .Name("rolloutd_engine_step_duration_seconds")
                        .Help("Wall time of one engine step (schedule, forward, sample).")
                        .Register(registry)
                        .Add({}, step_buckets());
    control_seconds = &prometheus::BuildHistogram()
                           .Name("rolloutd_control_handle_duration_seconds")
                           .Help("Wall time from receiving a control message to sending its reply.")
                           .Register(registry)
                           .Add({}, control_buckets());
    ready = &prometheus::BuildGauge()
                 .Name("rolloutd_ready")
                 .Help("1 when the daemon serves generation (weights loaded, not draining).")
                 .Register(registry)
                 .Add({});
    weight_version = &prometheus::BuildGauge()
                          .Name("rolloutd_weight_version")
                          .Help("Weight version of the loaded parameters.")
                          .Register(registry)
                          .Add({});
    uptime = &prometheus::BuildGauge()
                  .Name("rolloutd_uptime_seconds")
                  .Help("Seconds since the daemon started.")
                  .Register(registry)
                  .Add({});
    build_info_family = &prometheus::BuildGauge()
                             .Name("rolloutd_build_info")
                             .Help("Always 1; the labels describe the build.")
                             .Register(registry);

    auto& resident_family = prometheus::BuildGauge()
                                .Name("rolloutd_memory_resident_bytes")
                                .Help("Physical memory the daemon's arenas hold now, by memory tag.")
                                .Register(registry);
    auto& released_family = prometheus::BuildGauge()
                                .Name("rolloutd_memory_released_bytes")
                                .Help("Physical memory given back by release_memory and not yet resumed, by memory tag.")
                                .Register(registry);
    auto& release_family = prometheus::BuildHistogram()
                               .Name("rolloutd_memory_release_duration_seconds")
                               .Help("Wall time of releasing one memory tag (static-state backup, unmap).")
                               .Register(registry);
    auto& resume_family = prometheus::BuildHistogram()
                              .Name("rolloutd_memory_resume_duration_seconds")
                              .Help("Wall time of resuming one memory tag (map, static-state restore).")
                              .Register(registry);
    for (const char* tag : {"weights", "kv_cache", "cuda_graph", "scratch"}) {
      memory_resident[tag] = &resident_family.Add({{"tag", tag}});
      memory_released[tag] = &released_family.Add({{"tag", tag}});
      memory_release_seconds[tag] = &release_family.Add({{"tag", tag}}, step_buckets());
      memory_resume_seconds[tag] = &resume_family.Add({{"tag", tag}}, step_buckets());
    }

    // Series that exist from the start read 0 rather than absent, so rate() and
    // alerts see the first event. Only the closed sets are declared here; request
    // types belong to the protocol and appear on first use.
    for (std::string_view r : {"stop", "length", "abort", "failed"}) finished.get(r);
    for (std::string_view r : {"client_gone", "backpressure"}) stream_aborts.get(r);
    for (std::string_view r : {"completed", "aborted", "expired", "failed"}) weight_sessions.get(r);
    for (int c = static_cast<int>(ErrorCode::kOk) + 1; c <= static_cast<int>(ErrorCode::kInternal); ++c) {
      errors.get(error_code_name(static_cast<ErrorCode>(c)));
    }
  }

  CappedCounterFamily requests;
  CappedCounterFamily errors;
  CappedCounterFamily finished;
  CappedCounterFamily stream_aborts;
  CappedCounterFamily weight_sessions;
  prometheus::Histogram* weight_update_seconds = nullptr;
  prometheus::Counter* weight_update_bytes = nullptr;
  prometheus::Gauge* ipc_handles_open = nullptr;
  prometheus::Counter* replies_dropped = nullptr;
  prometheus::Counter* prompt_tokens = nullptr;
  prometheus::Counter* generated_tokens = nullptr;
  prometheus::Counter* preemptions = nullptr;
  prometheus::Counter* recomputed_tokens = nullptr;
  prometheus::Counter* prefix_queried = nullptr;
  prometheus::Counter* prefix_hit = nullptr;
  prometheus::Gauge* kv_blocks_cached_read = nullptr;
  prometheus::Gauge* kv_blocks_cached_evictable = nullptr;
  prometheus::Family<prometheus::Gauge>* kv_blocks_family = nullptr;
  prometheus::Gauge* kv_blocks_full_free = nullptr;
  prometheus::Gauge* kv_blocks_full_used = nullptr;
  prometheus::Gauge* kv_blocks_sliding_free = nullptr;  // added with the first sliding pool seen
  prometheus::Gauge* kv_blocks_sliding_used = nullptr;
  prometheus::Counter* graph_steps = nullptr;
  prometheus::Counter* eager_steps = nullptr;
  prometheus::Gauge* queue_waiting = nullptr;
  prometheus::Gauge* queue_running = nullptr;
  prometheus::Histogram* step_seconds = nullptr;
  prometheus::Histogram* control_seconds = nullptr;
  prometheus::Gauge* ready = nullptr;
  prometheus::Gauge* weight_version = nullptr;
  prometheus::Gauge* uptime = nullptr;
  // Fixed label sets, made at start: lookups need no lock.
  std::map<std::string, prometheus::Gauge*, std::less<>> memory_resident, memory_released;
  std::map<std::string, prometheus::Histogram*, std::less<>> memory_release_seconds, memory_resume_seconds;

  std::mutex build_info_mu;
  prometheus::Family<prometheus::Gauge>* build_info_family = nullptr;
  prometheus::Gauge* build_info = nullptr;
};

Metrics::Metrics() : Metrics(kDefaultMaxLabelValues) {}
Metrics::Metrics(size_t max_label_values) : impl_(std::make_unique<Impl>(max_label_values)) {}
Metrics::~Metrics() = default;

std::string Metrics::serialize() const {
  return prometheus::TextSerializer().Serialize(impl_->registry.Collect());
}

void Metrics::on_request(std::string_view type) { impl_->requests.get(type).Increment(); }
void Metrics::on_error(std::string_view code) { impl_->errors.get(code).Increment(); }
void Metrics::add_prompt_tokens(uint64_t n) { impl_->prompt_tokens->Increment(static_cast<double>(n)); }
void Metrics::add_generated_tokens(uint64_t n) { impl_->generated_tokens->Increment(static_cast<double>(n)); }
void Metrics::add_preemptions(uint64_t preemptions, uint64_t recomputed_tokens) {
  impl_->preemptions->Increment(static_cast<double>(preemptions));
  impl_->recomputed_tokens->Increment(static_cast<double>(recomputed_tokens));
}
void Metrics::add_prefix_cache_tokens(uint64_t queried, uint64_t hit) {
  impl_->prefix_queried->Increment(static_cast<double>(queried));
  impl_->prefix_hit->Increment(static_cast<double>(hit));
}
void Metrics::set_kv_blocks_cached(int64_t cached, int64_t evictable) {
  impl_->kv_blocks_cached_read->Set(static_cast<double>(cached - evictable));
  impl_->kv_blocks_cached_evictable->Set(static_cast<double>(evictable));
}
void Metrics::set_kv_blocks(int64_t free, int64_t total, int64_t sliding_free, int64_t sliding_total) {
  impl_->kv_blocks_full_free->Set(static_cast<double>(free));
  impl_->kv_blocks_full_used->Set(static_cast<double>(total - free));
  if (sliding_total == 0) return;  // no sliding pool: no series that would read as an empty one
  if (!impl_->kv_blocks_sliding_free) {
    impl_->kv_blocks_sliding_free = &impl_->kv_blocks_family->Add({{"pool", "sliding"}, {"state", "free"}});
    impl_->kv_blocks_sliding_used = &impl_->kv_blocks_family->Add({{"pool", "sliding"}, {"state", "used"}});
  }
  impl_->kv_blocks_sliding_free->Set(static_cast<double>(sliding_free));
  impl_->kv_blocks_sliding_used->Set(static_cast<double>(sliding_total - sliding_free));
}
void Metrics::on_finished(std::string_view reason) { impl_->finished.get(reason).Increment(); }
void Metrics::on_stream_abort(std::string_view reason) { impl_->stream_aborts.get(reason).Increment(); }
void Metrics::on_reply_dropped() { impl_->replies_dropped->Increment(); }
void Metrics::add_forward_steps(uint64_t graph, uint64_t eager) {
  impl_->graph_steps->Increment(static_cast<double>(graph));
  impl_->eager_steps->Increment(static_cast<double>(eager));
}

void Metrics::set_queue_depth(uint64_t waiting, uint64_t running) {
  impl_->queue_waiting->Set(static_cast<double>(waiting));
  impl_->queue_running->Set(static_cast<double>(running));
}

void Metrics::observe_step_seconds(double s) { impl_->step_seconds->Observe(s); }
void Metrics::on_weight_session(std::string_view result, double seconds) {
  impl_->weight_sessions.get(result).Increment();
  if (result == "completed") impl_->weight_update_seconds->Observe(seconds);
}
void Metrics::set_ipc_handles_open(uint64_t n) { impl_->ipc_handles_open->Set(static_cast<double>(n)); }
void Metrics::add_weight_update_bytes(uint64_t n) {
  impl_->weight_update_bytes->Increment(static_cast<double>(n));
}
void Metrics::observe_control_seconds(double s) { impl_->control_seconds->Observe(s); }
void Metrics::set_memory_bytes(std::string_view tag, uint64_t resident, uint64_t released) {
  auto r = impl_->memory_resident.find(tag);
  auto g = impl_->memory_released.find(tag);
  if (r == impl_->memory_resident.end() || g == impl_->memory_released.end()) return;
  r->second->Set(static_cast<double>(resident));
  g->second->Set(static_cast<double>(released));
}
void Metrics::observe_memory_op(std::string_view op, std::string_view tag, double seconds) {
  auto& m = op == "release" ? impl_->memory_release_seconds : impl_->memory_resume_seconds;
  if (auto it = m.find(tag); it != m.end()) it->second->Observe(seconds);
}
void Metrics::set_ready(bool ready) { impl_->ready->Set(ready ? 1.0 : 0.0); }
void Metrics::set_weight_version(uint64_t version) {
  impl_->weight_version->Set(static_cast<double>(version));
}
void Metrics::set_uptime_seconds(double s) { impl_->uptime->Set(s); }

void Metrics::set_build_info(std::string_view version, bool cuda) {
  std::lock_guard<std::mutex> lock(impl_->build_info_mu);
  // One series at a time: a second call replaces the labels instead of adding a
  // second "1" that would double every join on build_info.
  if (impl_->build_info != nullptr) impl_->build_info_family->Remove(impl_->build_info);
  impl_->build_info =
      &impl_->build_info_family->Add({{"version", std::string(version)}, {"cuda", cuda ? "true" : "false"}});
  impl_->build_info->Set(1.0);
}

prometheus::Registry& Metrics::registry() { return impl_->registry; }

}  // namespace rolloutd::obs
