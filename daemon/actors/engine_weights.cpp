// The engine actor's weight commands: sessions, buckets (inline and shm), weight reads,
// checksums, pause and continue. They run on the engine thread between forward steps,
// because the engine is the only writer of parameters; the reply is sent only after the
// work it acknowledges is complete (every byte copied; CUDA IPC copies are polled for
// completion, and the session's mappings are closed right after the end/abort reply).
#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/weights/session.hpp"
#include "daemon/actors/engine_actor.hpp"
#include "daemon/obs/log.hpp"
#include "daemon/weights/shm_source.hpp"
#include "kernels/bf16.hpp"

namespace rolloutd::daemon {
namespace {

using Clock = std::chrono::steady_clock;

// Core statuses name fields relative to the message body ("entries[2].name", "session").
Status in_body(const Status& s) {
  if (s.ok() || s.field().empty() || s.field().rfind("body", 0) == 0) return s;
  return s.with_field_prefix("body");
}

core::Engine::PauseMode to_core(protocol::PauseMode m) {
  switch (m) {
    case protocol::PauseMode::kAbort: return core::Engine::PauseMode::kAbort;
    case protocol::PauseMode::kRetract: return core::Engine::PauseMode::kRetract;
    case protocol::PauseMode::kInPlace: return core::Engine::PauseMode::kInPlace;
  }
  return core::Engine::PauseMode::kAbort;
}

std::vector<int64_t> shape_of(const TensorView& v) { return {v.shape.data(), v.shape.data() + v.rank()}; }

// The request's entries as the core's, their names and shapes moved out (the request is not
// read again): copying them cost two allocations per entry of a 10,000-entry bucket.
std::vector<core::BucketEntry> take_entries(protocol::UpdateWeightsRequest& r) {
  std::vector<core::BucketEntry> out;
  out.reserve(r.entries.size());
  for (auto& e : r.entries) out.push_back({std::move(e.name), e.dtype, std::move(e.shape), e.byte_offset, e.nbytes});
  return out;
}

}  // namespace

void EngineActor::reply(uint64_t client, protocol::WireMessage msg) {
  send(EncodedReply{client, std::move(msg), ""});
}

void EngineActor::reply_error(uint64_t client, uint64_t envelope_id, const Status& s) {
  send(EncodedReply{client, protocol::encode_error(envelope_id, protocol::to_error_info(s)),
                    std::string(error_code_name(s.code()))});
}

void EngineActor::on_model_broken(const Status& why) {
  std::vector<core::EngineEvent> events;
  const size_t n = engine_->fail_all(
      Status(ErrorCode::kNotReady, "the model is not whole: " + engine_->updater().broken_reason()), events);
  obs::log_error("weights", "model is not whole; refusing generation until a session completes",
                 {{"why", why.to_string()}, {"reason", engine_->updater().broken_reason()}, {"failed_requests", n}});
  account(events);
  if (!events.empty()) send(EventBatch{std::move(events)});
}

void EngineActor::check_session_deadline() {
  // A checksum in progress holds the trainer's next commands back (deferred_), so the session
  // is not idle by its fault; an expiry's restore would also change weights mid-checksum. The
  // deadline is checked again once the checksum has replied and the deferred commands ran.
  if (pending_checksum_) return;
  auto expired = engine_->updater().expire_if_idle(Clock::now());
  if (!expired) return;
  metrics_.on_error(error_code_name(expired->code()));
  metrics_.on_weight_session("expired", 0);
  // A broadcast still waiting for a trainer that let its session expire will not be applied:
  // abort its group now rather than at the group's own deadline, so a new group can form.
  if (!pending_buckets_.empty()) {
    auto it = groups_.find(std::get<protocol::NcclSource>(pending_buckets_.front().request.source).group);
    if (it != groups_.end()) it->second->abort("its weight-update session expired");
  }
  finish_session_resources();
  obs::log_error("weights", "weight-update session expired", {{"error", expired->to_string()}});
  if (!engine_->updater().whole() && !engine_->updater().broken_reason().empty()) on_model_broken(*expired);
}

void EngineActor::poll_pending_ipc() {
  while (!pending_ipc_.empty()) {
    Result<bool> done = pending_ipc_.front().copied.done();
    if (done.ok() && !*done) {
      if (Clock::now() - pending_ipc_.front().received < kIpcCopyTimeout) return;
      done = Status(ErrorCode::kCudaError, "a CUDA IPC bucket's copies did not complete within " +
                                               std::to_string(kIpcCopyTimeout.count()) + " s");
    }
    if (!done.ok()) return fail_pending_ipc(done.status(), 0, 0);
    PendingIpc b = std::move(pending_ipc_.front());
    pending_ipc_.pop_front();
    reply_ipc_ok(b);
  }
}

void EngineActor::fail_pending_ipc(const Status& why, uint64_t client, uint64_t envelope_id) {
  // A device fault under a copy: nothing queued can be trusted. Every bucket in flight (and the
  // one being handled, when given) is answered with the error, the session fails closed (the
  // parameters it wrote are marked), and the daemon reports an engine fault: the context is
  // poisoned and only a restart clears it.
  auto& u = engine_->updater();
  settle_pending_ipc(&why);
  if (client != 0 || envelope_id != 0) reply_error(client, envelope_id, why);
  if (u.session_open()) {
    (void)u.abort(u.session_id(), "CUDA IPC copy failed: " + why.message());
    metrics_.on_weight_session("failed", 0);
  }
  finish_session_resources();
  if (!u.broken_reason().empty()) on_model_broken(why);
  on_device_fault(why);
}

void EngineActor::on_device_fault(const Status& why) {
  if (faulted_ || why.code() != ErrorCode::kCudaError) return;
  faulted_ = true;
  fault_reason_ = why.to_string();
  std::vector<core::EngineEvent> rest;
  engine_->abort_all("engine_fault", rest);
  account(rest);
  if (!rest.empty()) send(EventBatch{std::move(rest)});
  send(EngineFault{why});
}

void EngineActor::reply_ipc_ok(const PendingIpc& b) {
  metrics_.add_weight_update_bytes(b.result.num_bytes);
  // duration_s is receipt to reply (SPEC): the handle's opening and the copies included.
  const double dt = std::chrono::duration<double>(Clock::now() - b.received).count();
  reply(b.client, protocol::encode_reply(b.envelope_id, protocol::UpdateWeightsReply{b.session, b.result.num_entries,
                                                                                     b.result.num_bytes, dt}));
}

void EngineActor::settle_pending_ipc(const Status* why) {
  Status fault;
  while (!pending_ipc_.empty()) {
    PendingIpc b = std::move(pending_ipc_.front());
    pending_ipc_.pop_front();
    // Waits on a device-to-device copy only (it depends on no peer), with a deadline: a copy
    // that never completes is a device fault, not a reason to hang the engine loop.
    // After a device fault nothing is waited for: the context is poisoned and the process exits.
    Status s = why && faulted_ ? *why : b.copied.wait(kIpcCopyTimeout);
    if (!s.ok() && why == nullptr) {
      fault = s;
      why = &fault;  // the buckets after it are answered with the same error
      on_device_fault(s);
    }
    if (s.ok() && why) s = *why;
    if (!s.ok()) {
      reply_error(b.client, b.envelope_id, s);
      continue;
    }
    reply_ipc_ok(b);
  }
}

void EngineActor::finish_session_resources() {
  // No mapping is closed under a copy still reading it, and every bucket gets its one reply.
  if (!pending_ipc_.empty()) {
    const Status ended(ErrorCode::kAborted, "the weight-update session ended before this bucket was acknowledged",
                       "body.session");
    settle_pending_ipc(&ended);
  }
  if (ipc_) {
    const size_t n = ipc_->close_all();
    if (n) obs::log_debug("ipc", "closed handles", {{"count", n}});
    metrics_.set_ipc_handles_open(0);
  }
  // The NCCL staging buffer stays allocated for the next session (a cudaMalloc/cudaFree of a
  // GiB per session is milliseconds of the push); release_memory{weights} frees it.
}

void EngineActor::apply_and_reply(uint64_t client, uint64_t envelope_id, protocol::UpdateWeightsRequest& r,
                                  std::span<const uint8_t> bucket, bool on_device, Clock::time_point received) {
  apply_and_reply(client, envelope_id, r, take_entries(r), bucket, on_device, received);
}

void EngineActor::apply_and_reply(uint64_t client, uint64_t envelope_id, protocol::UpdateWeightsRequest& r,
                                  std::vector<core::BucketEntry> entries, std::span<const uint8_t> bucket,
                                  bool on_device, Clock::time_point received) {
  auto& u = engine_->updater();
  std::optional<uint32_t> crc;
  if (r.checksum) crc = r.checksum->value;
  auto a = u.apply_bucket(r.session, entries, bucket, crc, received, on_device);
  // Whatever happened, nothing of the producer's memory is read past this point: inline frames
  // die with the command, the shm object was closed by read_shm, device copies were synchronized.
  if (!a.ok()) {
    if (!u.session_open()) {
      metrics_.on_weight_session("failed", 0);
      finish_session_resources();
    }
    if (!u.broken_reason().empty() && !u.session_open()) on_model_broken(a.status());
    return reply_error(client, envelope_id, in_body(a.status()));
  }
  u.touch(r.session, Clock::now());  // idle from completion: the shm read before it was not idle time
  metrics_.add_weight_update_bytes(a->num_bytes);
  reply(client, protocol::encode_reply(envelope_id, protocol::UpdateWeightsReply{r.session, a->num_entries,
                                                                                 a->num_bytes, a->duration_s}));
}

void EngineActor::apply_ipc_bucket(uint64_t client, uint64_t envelope_id, protocol::UpdateWeightsRequest& r,
                                   std::span<const uint8_t> bucket, Clock::time_point received) {
  // NOTES: the copies are queued and acknowledged from poll_pending_ipc() when their fence
  // completes, not synchronized here: a synchronize per bucket left the device idle for the
  // reply's trip and the next request's handling (~100 us per bucket, issue 7). The trainer
  // keeps several buckets in flight, so the next bucket's copies queue behind this one's.
  if (r.checksum) {
    // Checksummed buckets (tests) take the synchronous path: the CRC reads a host copy anyway.
    settle_pending_ipc(nullptr);
    return apply_and_reply(client, envelope_id, r, bucket, true, received);
  }
  auto& u = engine_->updater();
  const std::vector<core::BucketEntry> entries = take_entries(r);
  auto a = u.apply_bucket(r.session, entries, bucket, std::nullopt, received, true, /*wait_device=*/false);
  if (!a.ok()) {
    // Refused (nothing written: the session stays open) or a write failure (closed). This
    // bucket's entries before the failing one may have queued copies with no fence: wait for the
    // stream before any handle closes.
    settle_pending_ipc(nullptr);
    if (!u.session_open()) {
      if (Status s = engine_->model().backend().synchronize(engine_->model().context()); !s.ok())
        on_device_fault(s);
      metrics_.on_weight_session("failed", 0);
      finish_session_resources();
    }
    if (!u.broken_reason().empty() && !u.session_open()) on_model_broken(a.status());
    return reply_error(client, envelope_id, in_body(a.status()));
  }
  auto fence = DeviceFence::record(engine_->model().context().stream);
  if (!fence.ok()) {
    // No event: fall back to waiting here, as the synchronous path does.
    settle_pending_ipc(nullptr);
    if (Status s = engine_->model().backend().synchronize(engine_->model().context()); !s.ok()) {
      (void)u.abort(r.session, "CUDA IPC copy failed: " + s.message());
      metrics_.on_weight_session("failed", 0);
      finish_session_resources();
      if (!u.broken_reason().empty()) on_model_broken(s);
      reply_error(client, envelope_id, s);
      return on_device_fault(s);
    }
    metrics_.add_weight_update_bytes(a->num_bytes);
    return reply(client, protocol::encode_reply(envelope_id, protocol::UpdateWeightsReply{
                                                                 r.session, a->num_entries, a->num_bytes, a->duration_s}));
  }
  // A producer that ignores its pipeline depth cannot queue without bound: past the cap, the
  // oldest bucket is waited for and answered first.
  while (pending_ipc_.size() >= kMaxIpcInFlight) {
    PendingIpc oldest = std::move(pending_ipc_.front());
    pending_ipc_.pop_front();
    if (Status s = oldest.copied.wait(kIpcCopyTimeout); !s.ok()) {
      pending_ipc_.push_front(std::move(oldest));
      return fail_pending_ipc(s, client, envelope_id);
    }
    reply_ipc_ok(oldest);
  }
  pending_ipc_.push_back(PendingIpc{client, envelope_id, r.session, *a, std::move(*fence), received});
}

void EngineActor::start_nccl_bucket(WeightCommand& cmd) {
  auto& r = std::get<protocol::UpdateWeightsRequest>(cmd.request);
  const auto& src = std::get<protocol::NcclSource>(r.source);
  auto it = groups_.find(src.group);
  if (it == groups_.end() || it->second->aborted() || (pending_join_ && pending_join_->group == src.group))
    return reply_error(cmd.client, cmd.envelope_id,
                       Status(ErrorCode::kNotFound, "no joined group '" + src.group + "'", "body.source.group"));
  if (static_cast<int>(src.root) != it->second->root())
    return reply_error(cmd.client, cmd.envelope_id,
                       Status(ErrorCode::kInvalidArgument,
                              "root " + std::to_string(src.root) + " is not the group's root " +
                                  std::to_string(it->second->root()),
                              "body.source.root"));
  if (!it->second->can_start_broadcast())
    return reply_error(cmd.client, cmd.envelope_id,
                       Status(ErrorCode::kInternal, "group '" + src.group + "' cannot take another broadcast now",
                              "body.source.group"));
  // The staging buffer no bucket in flight uses (at most kMaxInFlight are).
  int slot = 0;
  while (std::any_of(pending_buckets_.begin(), pending_buckets_.end(),
                     [&](const PendingBucket& b) { return b.slot == slot; }))
    ++slot;
  Staging& st = staging_[slot];
  const auto& ctx = engine_->model().context();
  const auto& backend = engine_->model().backend();
  if (src.size > st.bytes) {
    if (st.ptr) (void)backend.free(ctx, st.ptr);
    st.ptr = nullptr;
    st.bytes = 0;
    if (Status s = backend.alloc(ctx, src.size, &st.ptr); !s.ok())
      return reply_error(cmd.client, cmd.envelope_id,
                         Status(ErrorCode::kResourceExhausted, "cannot allocate a " + std::to_string(src.size) +
                                                                   "-byte staging buffer: " + s.message(),
                                "body.source.size"));
    st.bytes = src.size;
  }
  // The broadcast must match the trainer's: post it even if the table will be refused, then
  // refuse after it completes (otherwise the trainer's collective would wait forever).
  if (Status s = it->second->start_broadcast(st.ptr, src.size); !s.ok())
    return reply_error(cmd.client, cmd.envelope_id, s);
  pending_buckets_.push_back(PendingBucket{cmd.client, cmd.envelope_id, std::move(r), slot, Clock::now()});
}

bool EngineActor::can_pipeline(const WeightCommand& cmd) const {
  using namespace protocol;
  const auto* r = std::get_if<UpdateWeightsRequest>(&cmd.request);
  // The next CUDA IPC bucket is queued behind the copies of the previous ones (same stream), so
  // the device never idles between buckets; anything else (end, abort, other sources) waits.
  if (!pending_ipc_.empty())
    return !pending_join_ && pending_buckets_.empty() && r && std::holds_alternative<CudaIpcSource>(r->source);
  if (pending_join_ || pending_buckets_.empty()) return false;
  if (!r) return false;
  const auto* src = std::get_if<NcclSource>(&r->source);
  if (!src || src->group != std::get<NcclSource>(pending_buckets_.front().request.source).group) return false;
  auto it = groups_.find(src->group);
  return it != groups_.end() && it->second->can_start_broadcast();
}

void EngineActor::fail_pending_buckets(const Status& why) {
  const std::string group = std::get<protocol::NcclSource>(pending_buckets_.front().request.source).group;
  std::deque<PendingBucket> lost;
  lost.swap(pending_buckets_);
  // The trainer is gone or too slow: the communicator is aborted and the session fails
  // closed; the group must be re-initialised.
  groups_.erase(group);
  auto& u = engine_->updater();
  if (u.session_open()) {
    auto a = u.abort(u.session_id(), "NCCL broadcast failed: " + why.message());
    metrics_.on_weight_session("failed", 0);
    finish_session_resources();
    if (a.ok() && !*a) on_model_broken(why);
  }
  for (const auto& b : lost) reply_error(b.client, b.envelope_id, why);
}

void EngineActor::poll_device_work() {
  using namespace protocol;
  advance_checksum();
  if (pending_join_) {
    auto it = groups_.find(pending_join_->group);
    Result<bool> done = it == groups_.end()
                            ? Result<bool>(Status(ErrorCode::kInternal, "group vanished", "body.group"))
                            : it->second->poll_join();
    if (!done.ok() || *done) {
      PendingJoin j = *pending_join_;
      pending_join_.reset();
      if (!done.ok()) {
        groups_.erase(j.group);
        reply_error(j.client, j.envelope_id, done.status());
      } else {
        const double dt = std::chrono::duration<double>(Clock::now() - j.started).count();
        obs::log_info("nccl", "joined group", {{"group", j.group}, {"duration_s", dt}});
        InitWeightGroupReply rep;
        rep.group = j.group;
        rep.nccl_version = static_cast<uint32_t>(NcclGroup::loaded_version());
        rep.rank = j.rank;
        rep.world_size = j.world_size;
        rep.duration_s = dt;
        reply(j.client, encode_reply(j.envelope_id, rep));
      }
    }
  }
  // Buckets complete in the order they were posted; each is applied as soon as its bytes are
  // in, while the next one is still being received into the other staging buffer.
  while (!pending_buckets_.empty()) {
    const std::string group = std::get<NcclSource>(pending_buckets_.front().request.source).group;
    auto it = groups_.find(group);
    Result<bool> done = it == groups_.end()
                            ? Result<bool>(Status(ErrorCode::kUnavailable, "group vanished", "body.source.group"))
                            : it->second->poll_broadcast();
    if (!done.ok()) {
      fail_pending_buckets(done.status());
      break;
    }
    if (!*done) break;
    PendingBucket b = std::move(pending_buckets_.front());
    pending_buckets_.pop_front();
    metrics_.set_ipc_handles_open(ipc_ ? ipc_->num_open() : 0);
    const uint64_t size = std::get<NcclSource>(b.request.source).size;
    apply_and_reply(b.client, b.envelope_id, b.request, {static_cast<const uint8_t*>(staging_[b.slot].ptr), size},
                    true, b.received);
  }
  poll_pending_ipc();
  while (!deferred_.empty() && (!has_pending_device_work() || can_pipeline(deferred_.front()))) {
    WeightCommand next = std::move(deferred_.front());
    deferred_.pop_front();
    handle_weights(next);
  }
}

void EngineActor::start_checksum(uint64_t client, uint64_t envelope_id, const protocol::WeightsChecksumRequest& r) {
  using namespace protocol;
  const auto& reg = engine_->model().weights();
  PendingChecksum job;
  job.client = client;
  job.envelope_id = envelope_id;
  if (r.names) {
    for (size_t k = 0; k < r.names->size(); ++k) {
      const size_t i = reg.index_of((*r.names)[k]);
      if (i == SIZE_MAX)
        return reply_error(client, envelope_id,
                           Status(ErrorCode::kNotFound, "unknown parameter '" + (*r.names)[k] + "'",
                                  "body.names[" + std::to_string(k) + "]"));
      job.which.push_back(i);
    }
  } else {
    for (size_t i = 0; i < reg.size(); ++i) job.which.push_back(i);
  }
  // Nothing can change the weights before the reply: weight commands wait behind it
  // (has_pending_device_work) and check_session_deadline holds an expiry's restore back.
  job.out.weight_version = engine_->weight_version();
  job.started = Clock::now();
  job.steps_before = steps_;
  pending_checksum_ = std::move(job);
  advance_checksum();
}

void EngineActor::advance_checksum() {
  using namespace protocol;
  if (!pending_checksum_) return;
  PendingChecksum& job = *pending_checksum_;
  const auto& reg = engine_->model().weights();
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double, std::milli>(config_.checksum_slice_ms));
  ++job.turns;
  // A whole large model is tens of seconds of read-back and CRC (~2 GB/s): a slice per loop turn,
  // so that steps, aborts, deadlines and /v1/status go on meanwhile.
  while (job.next < job.which.size()) {
    heartbeat_.beat();
    const size_t i = job.which[job.next++];
    if (Status st = reg.read_checkpoint(i, checksum_bytes_); !st.ok()) {
      const PendingChecksum failed = std::move(job);
      pending_checksum_.reset();
      return reply_error(failed.client, failed.envelope_id, st);
    }
    const auto& p = reg.parameters()[i];
    protocol::ParameterChecksum c{p.name, std::string(dtype_name(p.storage.dtype)), shape_of(p.storage),
                                  core::crc32_of(checksum_bytes_)};
    job.bytes += checksum_bytes_.size();
    job.sums.emplace_back(c.name, c.checksum);
    job.out.parameters.push_back(std::move(c));
    if (Clock::now() >= until) break;
  }
  if (job.next < job.which.size()) return;
  PendingChecksum done = std::move(job);
  pending_checksum_.reset();
  std::sort(done.out.parameters.begin(), done.out.parameters.end(),
            [](const protocol::ParameterChecksum& a, const protocol::ParameterChecksum& b) { return a.name < b.name; });
  done.out.model_checksum = model_checksum(std::move(done.sums));
  const double dt = std::chrono::duration<double>(Clock::now() - done.started).count();
  obs::log_info("weights", "weights checksummed",
                {{"parameters", done.which.size()}, {"size_bytes", done.bytes}, {"turns", done.turns},
                 {"engine_steps", steps_ - done.steps_before},
                 {"weight_version", done.out.weight_version}, {"duration_s", dt}});
  reply(done.client, protocol::encode_reply(done.envelope_id, done.out));
}

void EngineActor::handle_weights(WeightCommand& cmd) {
  using namespace protocol;
  auto& u = engine_->updater();
  const uint64_t id = cmd.envelope_id;
  const auto now = Clock::now();

  if (std::holds_alternative<ReleaseMemoryRequest>(cmd.request) ||
      std::holds_alternative<ResumeMemoryRequest>(cmd.request))
    return handle_memory(cmd);
  if (auto* r = std::get_if<BeginWeightUpdateRequest>(&cmd.request)) {
    auto b = u.begin(r->selector.value_or(std::vector<std::string>{}), r->timeout_s, now);
    if (!b.ok()) return reply_error(cmd.client, id, in_body(b.status()));
    obs::log_info("weights", "session begun",
                  {{"session", b->session}, {"restored", b->num_parameters_restored}, {"timeout_s", r->timeout_s}});
    return reply(cmd.client, encode_reply(id, BeginWeightUpdateReply{b->session, engine_->weight_version(),
                                                                     b->num_parameters_restored}));
  }
  if (auto* r = std::get_if<UpdateWeightsRequest>(&cmd.request)) {
    if (auto* in = std::get_if<InlineSource>(&r->source)) {
      if (in->frame >= cmd.payload.size())
        return reply_error(cmd.client, id, Status(ErrorCode::kOutOfRange, "no such payload frame", "body.source.frame"));
      const zmq::message_t& f = cmd.payload[in->frame];
      return apply_and_reply(cmd.client, id, *r, {static_cast<const uint8_t*>(f.data()), f.size()}, false, now);
    }
    // NCCL: the trainer's broadcast is already posted, so the daemon always takes part in it
    // (a refusal before receiving would leave the trainer's collective waiting until its own
    // timeout); the session and the table are checked when the bytes are in.
    if (std::holds_alternative<NcclSource>(r->source)) {
      if (config_.device != "cuda" || NcclGroup::loaded_version() == 0)
        return reply_error(cmd.client, id, Status(ErrorCode::kUnimplemented,
                                                  "nccl buckets need a daemon on a GPU with NCCL loaded",
                                                  "body.source.kind"));
      return start_nccl_bucket(cmd);
    }
    // Check the session before touching the producer's memory at all (buckets in flight are
    // answered first: replies keep the order of the requests).
    if (Status s = u.check_session(r->session); !s.ok()) {
      settle_pending_ipc(nullptr);
      return reply_error(cmd.client, id, in_body(s));
    }
    if (auto* shm = std::get_if<ShmSource>(&r->source)) {
      // The table against the parameters first (SPEC 11.2's order), then the object: a misnamed
      // or mis-shaped entry is reported as itself and costs no read of a bucket of gigabytes.
      std::vector<core::BucketEntry> entries = take_entries(*r);
      Status s = u.check_bucket(r->session, entries, shm->size);
      if (!s.ok()) s = in_body(s);
      if (s.ok()) s = check_shm_name(shm->name, config_.shm_prefix);
      if (s.ok()) s = read_shm(shm->name, shm->offset, shm->size, shm_staging_, config_.max_shm_bucket_bytes);
      if (!s.ok()) {
        u.touch(r->session, Clock::now());
        return reply_error(cmd.client, id, s);
      }
      return apply_and_reply(cmd.client, id, *r, std::move(entries), shm_staging_, false, now);
    }
    if (config_.device != "cuda")
      return reply_error(cmd.client, id, Status(ErrorCode::kUnimplemented,
                                                "cuda_ipc buckets need a daemon on a GPU (--device cuda)",
                                                "body.source.kind"));
    if (auto* ipc = std::get_if<CudaIpcSource>(&r->source)) {
      if (!ipc_) ipc_ = std::make_unique<CudaIpcImporter>(config_.gpu);
      auto p = ipc_->map(ipc->handle, ipc->offset, ipc->size, ipc->device_uuid);
      metrics_.set_ipc_handles_open(ipc_->num_open());
      if (!p.ok()) {
        settle_pending_ipc(nullptr);  // earlier buckets are answered first, in order
        return reply_error(cmd.client, id, p.status());
      }
      return apply_ipc_bucket(cmd.client, id, *r, {*p, ipc->size}, now);
    }
    return reply_error(cmd.client, id, Status(ErrorCode::kInternal, "unknown bucket source", "body.source"));
  }
  if (auto* r = std::get_if<InitWeightGroupRequest>(&cmd.request)) {
    const int mine = NcclGroup::loaded_version();
    if (config_.device != "cuda" || mine == 0)
      return reply_error(cmd.client, id,
                         Status(ErrorCode::kUnimplemented,
                                config_.device != "cuda" ? "weight groups need a daemon on a GPU (--device cuda)"
                                                         : "this daemon could not load libnccl.so.2: put the trainer's "
                                                           "NCCL on LD_LIBRARY_PATH",
                                ""));
    if (groups_.count(r->group))
      return reply_error(cmd.client, id, Status(ErrorCode::kFailedPrecondition,
                                                "group '" + r->group + "' exists; destroy it first", "body.group"));
    if (static_cast<int>(r->nccl_version) != mine)
      return reply_error(
          cmd.client, id,
          Status(ErrorCode::kFailedPrecondition,
                 "the trainer runs NCCL " + std::to_string(r->nccl_version) + " but this daemon loaded NCCL " +
                     std::to_string(mine) + "; start the daemon with LD_LIBRARY_PATH pointing at the trainer's "
                     "library (PyTorch: <site-packages>/nvidia/nccl/lib)",
                 "body.nccl_version"));
    auto g = NcclGroup::start_join(r->group, r->unique_id, static_cast<int>(r->world_size), static_cast<int>(r->rank),
                                   static_cast<int>(r->root), config_.gpu, r->timeout_s);
    if (!g.ok()) return reply_error(cmd.client, id, g.status());
    groups_.emplace(r->group, std::move(*g));
    pending_join_ = PendingJoin{cmd.client, id, r->group, r->rank, r->world_size, now};
    obs::log_info("nccl", "joining group", {{"group", r->group}, {"rank", r->rank}, {"world_size", r->world_size},
                                             {"nccl_version", mine}});
    return;  // replied from poll_device_work()
  }
  if (auto* r = std::get_if<DestroyWeightGroupRequest>(&cmd.request)) {
    auto it = groups_.find(r->group);
    if (it == groups_.end())
      return reply_error(cmd.client, id, Status(ErrorCode::kNotFound, "no group '" + r->group + "'", "body.group"));
    // Tearing down aborts the communicator (never blocks on a peer that may be gone). A join in
    // progress is answered `aborted`; a broadcast in progress fails as for a lost peer.
    if (pending_join_ && pending_join_->group == r->group) {
      reply_error(pending_join_->client, pending_join_->envelope_id,
                  Status(ErrorCode::kAborted, "group '" + r->group + "' was destroyed while joining", "body.group"));
      pending_join_.reset();
    }
    if (!pending_buckets_.empty() && std::get<NcclSource>(pending_buckets_.front().request.source).group == r->group)
      it->second->abort("destroy_weight_group during a broadcast");  // poll_device_work() fails it
    else
      groups_.erase(it);
    obs::log_info("nccl", "group destroyed", {{"group", r->group}});
    return reply(cmd.client, encode_reply(id, DestroyWeightGroupReply{r->group}));
  }
  if (auto* r = std::get_if<EndWeightUpdateRequest>(&cmd.request)) {
    // Versions never decrease (SPEC 6): a trainer that restarted from an older step says so
    // by bumping, not by going back. The session stays open.
    if (r->weight_version < engine_->weight_version() && u.session_open() && u.session_id() == r->session)
      return reply_error(cmd.client, id,
                         Status(ErrorCode::kInvalidArgument,
                                "weight_version " + std::to_string(r->weight_version) + " is below the serving version " +
                                    std::to_string(engine_->weight_version()),
                                "body.weight_version"));
    auto e = u.end(r->session, r->weight_version, now);
    if (!e.ok()) {
      if (!u.broken_reason().empty()) on_model_broken(e.status());
      return reply_error(cmd.client, id, in_body(e.status()));
    }
    engine_->set_weight_version(r->weight_version);
    metrics_.on_weight_session("completed", e->duration_s);
    obs::log_info("weights", "session ended",
                  {{"session", e->session}, {"weight_version", e->weight_version}, {"buckets", e->num_buckets},
                   {"entries", e->num_entries}, {"size_bytes", e->num_bytes},
                   {"parameters_updated", e->num_parameters_updated}, {"duration_s", e->duration_s},
                   {"postprocess_s", e->postprocess_s}, {"whole", e->whole}});
    if (!e->whole) obs::log_warn("weights", "model still not whole", {{"reason", u.broken_reason()}});
    // NOTES: the mappings are closed before the reply. CUDA leaves freeing an exported allocation
    // while an importer still has it open undefined, and the trainer frees its staging (or calls
    // empty_cache) as soon as the session ends; unmapping costs ~0.1-0.5 ms per large handle.
    finish_session_resources();
    reply(cmd.client, encode_reply(id, EndWeightUpdateReply{e->session, e->weight_version, e->num_buckets,
                                                            e->num_entries, e->num_bytes, e->num_parameters_updated,
                                                            e->duration_s, e->postprocess_s}));
    return;
  }
  if (auto* r = std::get_if<AbortWeightUpdateRequest>(&cmd.request)) {
    auto a = u.abort(r->session, "abort_weight_update");
    if (!a.ok()) return reply_error(cmd.client, id, in_body(a.status()));
    metrics_.on_weight_session("aborted", 0);
    if (!*a) on_model_broken(Status(ErrorCode::kAborted, "session aborted after writing buckets"));
    finish_session_resources();  // before the reply, as for end_weight_update
    reply(cmd.client, encode_reply(id, AbortWeightUpdateReply{r->session, *a ? "ready" : "not_ready"}));
    return;
  }
  if (auto* r = std::get_if<GetWeightsByNameRequest>(&cmd.request)) {
    const auto& reg = engine_->model().weights();
    const size_t i = reg.index_of(r->name);
    if (i == SIZE_MAX)
      return reply_error(cmd.client, id, Status(ErrorCode::kNotFound, "unknown parameter '" + r->name + "'", "body.name"));
    // Each value costs 9 bytes on the wire: refuse a reply that could not fit an envelope.
    if (static_cast<uint64_t>(r->truncate) * 9 + 4096 > config_.limits.max_envelope_bytes)
      return reply_error(cmd.client, id,
                         Status(ErrorCode::kTooLarge, "truncate would make the reply exceed max_envelope_bytes",
                                "body.truncate"));
    std::vector<uint8_t> bytes;
    if (Status s = reg.read_checkpoint(i, bytes); !s.ok()) return reply_error(cmd.client, id, s);
    const auto& p = reg.parameters()[i];
    GetWeightsByNameReply out;
    out.name = p.name;
    out.dtype = std::string(dtype_name(p.storage.dtype));
    out.shape = shape_of(p.storage);
    const size_t elem = dtype_size(p.storage.dtype);
    const size_t n = std::min<size_t>(r->truncate, bytes.size() / elem);
    out.values.reserve(n);
    for (size_t k = 0; k < n; ++k) out.values.push_back(element_value(bytes.data() + k * elem, p.storage.dtype));
    return reply(cmd.client, encode_reply(id, out));
  }
  if (auto* r = std::get_if<WeightsChecksumRequest>(&cmd.request)) return start_checksum(cmd.client, id, *r);
  if (auto* r = std::get_if<PauseGenerationRequest>(&cmd.request)) {
    std::vector<core::EngineEvent> events;
    const auto c = engine_->pause(to_core(r->mode), events);
    account(events);
    if (!events.empty()) send(EventBatch{std::move(events)});
    obs::log_info("engine", "generation paused",
                  {{"mode", std::string(pause_mode_name(r->mode))}, {"aborted", c.aborted},
                   {"retracted", c.retracted}, {"paused", c.paused}});
    return reply(cmd.client, encode_reply(id, PauseGenerationReply{c.aborted, c.retracted, c.paused}));
  }
  if (std::holds_alternative<ContinueGenerationRequest>(cmd.request)) {
    const uint32_t n = engine_->resume();
    obs::log_info("engine", "generation continued", {{"requests", n}});
    return reply(cmd.client, encode_reply(id, ContinueGenerationReply{n}));
  }
  reply_error(cmd.client, id, Status(ErrorCode::kInternal, "engine got a request it does not handle"));
}

}  // namespace rolloutd::daemon
