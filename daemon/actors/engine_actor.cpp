#include "daemon/actors/engine_actor.hpp"

#include <algorithm>

#include "daemon/obs/log.hpp"

namespace rolloutd::daemon {

using Clock = std::chrono::steady_clock;

EngineActor::EngineActor(std::unique_ptr<core::Engine> engine, std::unique_ptr<MailboxEnd> mailbox,
                         obs::Metrics& metrics, SnapshotCell<EngineSnapshot>& snapshot,
                         Heartbeat& heartbeat, const DaemonConfig& config)
    : engine_(std::move(engine)),
      mailbox_(std::move(mailbox)),
      metrics_(metrics),
      snapshot_(snapshot),
      heartbeat_(heartbeat),
      config_(config) {
  refresh_memory_digests();
}

void EngineActor::send(EngineOutput out) {
  // A client that got a reply, or a request's final event, and then asks for status must see
  // the state it acknowledged (the request gone from num_running): publish before it leaves
  // (status is answered from the snapshot). Batches of tokens alone need not wait for it.
  const auto* batch = std::get_if<EventBatch>(&out);
  if (batch == nullptr || std::any_of(batch->events.begin(), batch->events.end(), [](const core::EngineEvent& e) {
        return e.kind == core::EngineEvent::Kind::kFinished || e.kind == core::EngineEvent::Kind::kFailed;
      }))
    publish();
  auto mail = std::make_unique<EngineOutputMail>();
  mail->out = std::move(out);
  Status s = mailbox_->send(std::move(mail));
  // The control actor outlives the engine loop; a failed hand-off is a bug.
  if (!s.ok()) obs::log_error("engine", "mailbox send failed", {{"error", s.to_string()}});
}

void EngineActor::account(const std::vector<core::EngineEvent>& events) {
  uint64_t generated = 0;
  for (const auto& e : events) {
    switch (e.kind) {
      case core::EngineEvent::Kind::kTokens: generated += e.token_ids.size(); break;
      case core::EngineEvent::Kind::kFinished: metrics_.on_finished(e.finish_reason); break;
      case core::EngineEvent::Kind::kFailed: metrics_.on_finished("failed"); break;
      case core::EngineEvent::Kind::kRetracted: break;
    }
  }
  if (generated) metrics_.add_generated_tokens(generated);
}

void EngineActor::handle(EngineCommand& cmd) {
  std::vector<core::EngineEvent> events;
  if (auto* submit = std::get_if<SubmitCommand>(&cmd)) {
    SubmitResult r;
    r.rid = submit->spec.rid;
    r.client = submit->spec.tag;
    if (draining_) {
      r.status = Status(ErrorCode::kDraining, "daemon is draining; no new requests");
    } else if (faulted_) {
      r.status = Status(ErrorCode::kNotReady, "engine faulted: " + fault_reason_);
    } else {
      r.status = engine_->submit(std::move(submit->spec));
    }
    send(std::move(r));
  } else if (auto* abort = std::get_if<AbortCommand>(&cmd)) {
    AbortResult r;
    r.client = abort->client;
    r.envelope_id = abort->envelope_id;
    if (abort->rid) {
      // Idempotent (SPEC 4.4): an abort racing with the request's own end is normal for a
      // coordinator, so an rid not in flight answers num_aborted 0, not an error.
      r.num_aborted = engine_->abort(*abort->rid, abort->reason, events) ? 1 : 0;
    } else {
      r.num_aborted = static_cast<uint32_t>(engine_->abort_all(abort->reason, events));
    }
    // Final events first, then the reply: a client that sees abort.ok has its events queued.
    account(events);
    if (!events.empty()) send(EventBatch{std::move(events)});
    send(std::move(r));
  } else if (auto* gone = std::get_if<AbortClientCommand>(&cmd)) {
    const size_t n = engine_->abort_all(gone->reason, events, gone->client);
    if (n) obs::log_warn("engine", "aborted requests of a client",
                         {{"client", gone->client}, {"reason", gone->reason}, {"count", n}});
    account(events);
    if (!events.empty()) send(EventBatch{std::move(events)});
  } else if (auto* drain = std::get_if<DrainCommand>(&cmd)) {
    if (!draining_) {
      draining_ = true;
      drain_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(drain->deadline_s));
      const auto st = engine_->stats();
      obs::log_info("engine", "draining",
                    {{"deadline_s", drain->deadline_s}, {"running", st.num_running}, {"waiting", st.num_waiting}});
    } else {
      // A later drain (a second signal) can only bring the deadline nearer.
      const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(drain->deadline_s));
      if (deadline < drain_deadline_) {
        drain_deadline_ = deadline;
        obs::log_info("engine", "drain deadline shortened", {{"deadline_s", drain->deadline_s}});
      }
    }
  } else if (auto* w = std::get_if<WeightCommand>(&cmd)) {
    // Weight commands are ordered: while a join or an NCCL bucket is in flight, later ones wait,
    // except the group's next NCCL bucket, which may start while the previous one is received.
    if (deferred_.empty() && (!has_pending_device_work() || can_pipeline(*w))) handle_weights(*w);
    else deferred_.push_back(std::move(*w));
  } else if (std::holds_alternative<StopCommand>(cmd)) {
    // Anything still in flight gets its final event (or reply) before the loop ends, and no
    // mapping is closed under a queued copy.
    const Status shutdown(ErrorCode::kAborted, "the daemon is shutting down");
    settle_pending_ipc(&shutdown);
    if (pending_checksum_) {
      reply_error(pending_checksum_->client, pending_checksum_->envelope_id, shutdown);
      pending_checksum_.reset();
    }
    finish_session_resources();
    engine_->abort_all("shutdown", events);
    account(events);
    if (!events.empty()) send(EventBatch{std::move(events)});
    stop_ = true;
  }
}

void EngineActor::publish() {
  const auto st = engine_->stats();
  auto s = std::make_shared<EngineSnapshot>();
  const auto& u = engine_->updater();
  if (faulted_) {
    s->state = "not_ready";
    s->reason = "engine fault: " + fault_reason_;
  } else if (draining_) {
    s->state = "draining";
    s->reason = "draining";
  } else if (!u.broken_reason().empty()) {
    s->state = "not_ready";
    s->reason = u.broken_reason();
  } else if (const std::string why = engine_->memory_blocked_reason(); !why.empty()) {
    s->state = "not_ready";
    s->reason = why;
  } else if (u.session_open()) {
    // Not servable (layouts restored, buckets arriving) but healthy: generate requests queue.
    s->state = "updating";
    s->reason = "weight-update session " + std::to_string(u.session_id()) + " is open";
  } else {
    s->state = "ready";
  }
  s->paused = engine_->paused();
  s->update_session = u.session_id();
  s->weight_version = engine_->weight_version();
  s->num_waiting = st.num_waiting;
  s->num_running = st.num_running;
  s->num_requests_total = st.num_requests_total;
  s->num_prompt_tokens_total = st.num_prompt_tokens_total;
  s->num_generated_tokens_total = st.num_generated_tokens_total;
  s->kv_blocks_free = st.kv_blocks_free;
  s->kv_blocks_total = st.kv_blocks_total;
  s->kv_blocks_cached = st.kv_blocks_cached;
  s->kv_blocks_evictable = st.kv_blocks_evictable;
  s->sliding_kv_blocks_free = st.sliding_kv_blocks_free;
  s->sliding_kv_blocks_total = st.sliding_kv_blocks_total;
  s->prefix_cache_enabled = st.prefix_cache_enabled;
  s->num_prefix_cache_queried_tokens_total = st.num_prefix_cache_queried_tokens_total;
  s->num_prefix_cache_hit_tokens_total = st.num_prefix_cache_hit_tokens_total;
  s->kv_cache_dtype = dtype_name(engine_->model().limits().kv_dtype);
  s->num_steps_total = steps_;
  s->graph_max_batch = st.graph_max_batch;
  s->graph_buckets = st.graph_buckets;
  s->num_graphs = st.num_graphs;
  s->graph_steps = st.graph_steps;
  s->eager_steps = st.eager_steps;
  s->graph_capture_s = st.graph_capture_s;
  metrics_.add_forward_steps(st.graph_steps - graph_steps_seen_, st.eager_steps - eager_steps_seen_);
  graph_steps_seen_ = st.graph_steps;
  eager_steps_seen_ = st.eager_steps;
  fill_memory_snapshot(*s);
  metrics_.set_queue_depth(st.num_waiting, st.num_running);
  metrics_.set_ready(s->state == "ready");
  metrics_.set_weight_version(s->weight_version);
  if (st.num_preemptions_total > preemptions_seen_ || st.num_recomputed_tokens_total > recomputed_seen_) {
    metrics_.add_preemptions(st.num_preemptions_total - preemptions_seen_,
                             st.num_recomputed_tokens_total - recomputed_seen_);
    preemptions_seen_ = st.num_preemptions_total;
    recomputed_seen_ = st.num_recomputed_tokens_total;
  }
  if (st.num_prefix_cache_queried_tokens_total > prefix_queried_seen_ ||
      st.num_prefix_cache_hit_tokens_total > prefix_hit_seen_) {
    metrics_.add_prefix_cache_tokens(st.num_prefix_cache_queried_tokens_total - prefix_queried_seen_,
                                     st.num_prefix_cache_hit_tokens_total - prefix_hit_seen_);
    prefix_queried_seen_ = st.num_prefix_cache_queried_tokens_total;
    prefix_hit_seen_ = st.num_prefix_cache_hit_tokens_total;
  }
  metrics_.set_kv_blocks_cached(st.kv_blocks_cached, st.kv_blocks_evictable);
  metrics_.set_kv_blocks(st.kv_blocks_free, st.kv_blocks_total, st.sliding_kv_blocks_free, st.sliding_kv_blocks_total);
  if (st.num_prompt_tokens_total > prompt_tokens_seen_) {
    metrics_.add_prompt_tokens(st.num_prompt_tokens_total - prompt_tokens_seen_);
    prompt_tokens_seen_ = st.num_prompt_tokens_total;
  }
  snapshot_.publish(std::move(s));
}

void EngineActor::run() {
  publish();
  obs::log_info("engine", "engine loop started");
  while (!stop_) {
    heartbeat_.beat();
    // Busy: only look at the mailbox between steps. Idle: sleep on it (bounded, so the
    // heartbeat keeps beating and drain deadlines are checked).
    // A join or broadcast in flight is polled without sleeping: a millisecond of latency per
    // bucket is a measurable share of a 512 MiB broadcast (1.4 ms at link speed).
    const auto timeout = engine_->has_work() || has_pending_device_work() ? std::chrono::milliseconds(0)
                                                                          : std::chrono::milliseconds(50);
    zmq::pollitem_t items[] = {{mailbox_->socket().handle(), 0, ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, 1, timeout);
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) obs::log_error("engine", "poll failed", {{"error", e.what()}});
    }
    while (auto mail = mailbox_->try_recv<EngineCommandMail>()) {
      handle(mail->cmd);
      if (stop_) break;
    }
    if (stop_) break;

    check_session_deadline();
    poll_device_work();
    {
      // Requests past their deadline_s end here, running or not (the idle poll above is 50 ms,
      // so a deadline is met within ~50 ms plus one step).
      std::vector<core::EngineEvent> events;
      if (const size_t n = engine_->expire(Clock::now(), events)) {
        obs::log_info("engine", "requests reached their deadline", {{"count", n}});
        account(events);
        send(EventBatch{std::move(events)});
      }
    }
    if (draining_ && engine_->has_requests() && Clock::now() >= drain_deadline_) {
      std::vector<core::EngineEvent> events;
      const size_t n = engine_->abort_all("shutdown", events);
      obs::log_warn("engine", "drain deadline reached; aborted in-flight requests", {{"count", n}});
      account(events);
      if (!events.empty()) send(EventBatch{std::move(events)});
    }
    if (engine_->has_work()) {
      std::vector<core::EngineEvent> events;
      const auto t0 = Clock::now();
      Status st = engine_->step(events);
      const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
      ++steps_;
      metrics_.observe_step_seconds(dt);
      account(events);
      if (!events.empty()) send(EventBatch{std::move(events)});
      if (!st.ok()) {
        obs::log_error("engine", "step failed", {{"error", st.to_string()}});
        metrics_.on_error(error_code_name(st.code()));
        on_device_fault(st);  // a CUDA error poisons the context: the launcher must restart the process
      }
    }
    if (draining_ && !drain_done_sent_ && !engine_->has_requests()) {
      drain_done_sent_ = true;
      send(DrainDone{});
    }
    publish();
  }
  publish();
  obs::log_info("engine", "engine loop stopped", {{"steps", steps_}});
}

}  // namespace rolloutd::daemon
