// The engine actor's weight commands: sessions, buckets (inline and shm), weight reads,
// checksums, pause and continue. They run on the engine thread between forward steps,
// because the engine is the only writer of parameters; the reply is sent only after the
// work it acknowledges is complete (every byte copied, every mapping closed).
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

double element_as_double(const uint8_t* p, DType t) {
  switch (t) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return bf16_bits_to_f32(b);
    }
    case DType::kI32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::kU8: return *p;
    default: return 0.0;
  }
}

std::vector<int64_t> shape_of(const TensorView& v) { return {v.shape.data(), v.shape.data() + v.rank()}; }

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
  auto expired = engine_->updater().expire_if_idle(Clock::now());
  if (!expired) return;
  metrics_.on_error(error_code_name(expired->code()));
  metrics_.on_weight_session("expired", 0);
  obs::log_error("weights", "weight-update session expired", {{"error", expired->to_string()}});
  if (!engine_->updater().whole() && !engine_->updater().broken_reason().empty()) on_model_broken(*expired);
}

void EngineActor::handle_weights(WeightCommand& cmd) {
  using namespace protocol;
  auto& u = engine_->updater();
  const uint64_t id = cmd.envelope_id;
  const auto now = Clock::now();

  if (auto* r = std::get_if<BeginWeightUpdateRequest>(&cmd.request)) {
    auto b = u.begin(r->selector.value_or(std::vector<std::string>{}), r->timeout_s, now);
    if (!b.ok()) return reply_error(cmd.client, id, in_body(b.status()));
    obs::log_info("weights", "session begun",
                  {{"session", b->session}, {"restored", b->num_parameters_restored}, {"timeout_s", r->timeout_s}});
    return reply(cmd.client, encode_reply(id, BeginWeightUpdateReply{b->session, engine_->weight_version(),
                                                                     b->num_parameters_restored}));
  }
  if (auto* r = std::get_if<UpdateWeightsRequest>(&cmd.request)) {
    std::span<const uint8_t> bucket;
    if (auto* in = std::get_if<InlineSource>(&r->source)) {
      if (in->frame >= cmd.payload.size())
        return reply_error(cmd.client, id, Status(ErrorCode::kOutOfRange, "no such payload frame", "body.source.frame"));
      const zmq::message_t& f = cmd.payload[in->frame];
      bucket = {static_cast<const uint8_t*>(f.data()), f.size()};
    } else {
      const auto& shm = std::get<ShmSource>(r->source);
      // Check the session before touching the producer's memory at all.
      if (!u.session_open() || u.session_id() != r->session)
        return reply_error(cmd.client, id,
                           Status(ErrorCode::kFailedPrecondition, "weight-update session is not open", "body.session"));
      Status s = check_shm_name(shm.name, config_.shm_prefix);
      if (s.ok()) s = read_shm(shm.name, shm.offset, shm.size, shm_staging_);
      if (!s.ok()) return reply_error(cmd.client, id, s);
      bucket = shm_staging_;
    }
    std::vector<core::BucketEntry> entries;
    entries.reserve(r->entries.size());
    for (const auto& e : r->entries) entries.push_back({e.name, e.dtype, e.shape, e.byte_offset, e.nbytes});
    std::optional<uint32_t> crc;
    if (r->checksum) crc = r->checksum->value;
    auto a = u.apply_bucket(r->session, entries, bucket, crc, now);
    // Whatever happened, nothing of the producer's memory is held past this point: the
    // inline frames die with `cmd`, the shm object was closed by read_shm.
    if (!a.ok()) {
      if (!u.session_open()) metrics_.on_weight_session("failed", 0);
      if (!u.broken_reason().empty() && !u.session_open()) on_model_broken(a.status());
      return reply_error(cmd.client, id, in_body(a.status()));
    }
    metrics_.add_weight_update_bytes(a->num_bytes);
    return reply(cmd.client, encode_reply(id, UpdateWeightsReply{r->session, a->num_entries, a->num_bytes, a->duration_s}));
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
    return reply(cmd.client, encode_reply(id, EndWeightUpdateReply{e->session, e->weight_version, e->num_buckets,
                                                                   e->num_entries, e->num_bytes,
                                                                   e->num_parameters_updated, e->duration_s,
                                                                   e->postprocess_s}));
  }
  if (auto* r = std::get_if<AbortWeightUpdateRequest>(&cmd.request)) {
    auto a = u.abort(r->session, "abort_weight_update");
    if (!a.ok()) return reply_error(cmd.client, id, in_body(a.status()));
    metrics_.on_weight_session("aborted", 0);
    if (!*a) on_model_broken(Status(ErrorCode::kAborted, "session aborted after writing buckets"));
    return reply(cmd.client, encode_reply(id, AbortWeightUpdateReply{r->session, *a ? "ready" : "not_ready"}));
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
    for (size_t k = 0; k < n; ++k) out.values.push_back(element_as_double(bytes.data() + k * elem, p.storage.dtype));
    return reply(cmd.client, encode_reply(id, out));
  }
  if (auto* r = std::get_if<WeightsChecksumRequest>(&cmd.request)) {
    const auto& reg = engine_->model().weights();
    std::vector<size_t> which;
    if (r->names) {
      for (size_t k = 0; k < r->names->size(); ++k) {
        const size_t i = reg.index_of((*r->names)[k]);
        if (i == SIZE_MAX)
          return reply_error(cmd.client, id,
                             Status(ErrorCode::kNotFound, "unknown parameter '" + (*r->names)[k] + "'",
                                    "body.names[" + std::to_string(k) + "]"));
        which.push_back(i);
      }
    } else {
      for (size_t i = 0; i < reg.size(); ++i) which.push_back(i);
    }
    WeightsChecksumReply out;
    out.weight_version = engine_->weight_version();
    std::vector<uint8_t> bytes;
    std::vector<std::pair<std::string, uint32_t>> sums;
    for (size_t i : which) {
      if (Status s = reg.read_checkpoint(i, bytes); !s.ok()) return reply_error(cmd.client, id, s);
      const auto& p = reg.parameters()[i];
      ParameterChecksum c{p.name, std::string(dtype_name(p.storage.dtype)), shape_of(p.storage), core::crc32_of(bytes)};
      sums.emplace_back(c.name, c.checksum);
      out.parameters.push_back(std::move(c));
    }
    std::sort(out.parameters.begin(), out.parameters.end(),
              [](const ParameterChecksum& a, const ParameterChecksum& b) { return a.name < b.name; });
    out.model_checksum = model_checksum(std::move(sums));
    return reply(cmd.client, encode_reply(id, out));
  }
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
