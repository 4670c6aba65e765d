#include "daemon/actors/control_actor.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "build_info.hpp"
#include "core/model/config.hpp"
#include "daemon/obs/log.hpp"
#include "daemon/actors/connection_flush.hpp"
#include "daemon/security/control_auth.hpp"

namespace rolloutd::daemon {

using Clock = std::chrono::steady_clock;

namespace {

// Appends one engine step's tokens of a request to what is held for it (routed rows are
// consecutive positions of the same request, so their bytes concatenate).
void append_tokens(protocol::TokensEvent& into, protocol::TokensEvent&& t) {
  into.token_ids.insert(into.token_ids.end(), t.token_ids.begin(), t.token_ids.end());
  into.logprobs.insert(into.logprobs.end(), t.logprobs.begin(), t.logprobs.end());
  into.weight_versions.insert(into.weight_versions.end(), t.weight_versions.begin(), t.weight_versions.end());
  // n is the request's: an event without tokens (a prefill chunk's rows) carries 0.
  into.top_logprobs_num = std::max(into.top_logprobs_num, t.top_logprobs_num);
  into.top_token_ids.insert(into.top_token_ids.end(), t.top_token_ids.begin(), t.top_token_ids.end());
  into.top_logprobs.insert(into.top_logprobs.end(), t.top_logprobs.begin(), t.top_logprobs.end());
  if (!t.routed_experts) return;
  if (!into.routed_experts) {
    into.routed_experts = std::move(t.routed_experts);
  } else {
    into.routed_experts->num_tokens += t.routed_experts->num_tokens;
    into.routed_experts->data += t.routed_experts->data;
  }
}
// An upper bound on the msgpack bytes of a tokens event holding `tokens` tokens with `top_n` top
// log-probs each (ids up to 5 bytes, float64 9, weight versions up to 9; routed rows travel in
// frames), so an event is never built that a client's max_envelope_bytes would refuse.
uint64_t tokens_event_bound(uint64_t tokens, uint64_t top_n, size_t rid_bytes) {
  return 1024 + rid_bytes + tokens * (23 + 14 * top_n);
}

// How many requests to take off the socket per loop turn before looking at the mailbox
// again: keeps engine output flowing under a request flood.
constexpr int kMaxRequestsPerTurn = 256;

std::string build_string() {
  return std::string(build::kVersion) + " (" + build::kBuildType + ", " + build::kCompiler +
         (build::kCudaEnabled ? ", cuda" : ", cpu-only") + ")";
}

// Routed-expert rows (int32 logical ids) in the record dtype, little-endian.
void append_packed(std::string& out, const std::vector<int32_t>& rows, const std::string& dtype) {
  const size_t n = rows.size();
  if (dtype == "uint8") {
    const size_t at = out.size();
    out.resize(at + n);
    for (size_t i = 0; i < n; ++i) out[at + i] = static_cast<char>(static_cast<uint8_t>(rows[i]));
  } else if (dtype == "uint16") {
    const size_t at = out.size();
    out.resize(at + 2 * n);
    for (size_t i = 0; i < n; ++i) {
      const auto v = static_cast<uint16_t>(rows[i]);
      out[at + 2 * i] = static_cast<char>(v & 0xff);
      out[at + 2 * i + 1] = static_cast<char>(v >> 8);
    }
  } else {
    const size_t at = out.size();
    out.resize(at + 4 * n);
    for (size_t i = 0; i < n; ++i) {
      const auto v = static_cast<uint32_t>(rows[i]);
      for (int b = 0; b < 4; ++b) out[at + 4 * i + static_cast<size_t>(b)] = static_cast<char>((v >> (8 * b)) & 0xff);
    }
  }
}
}  // namespace

ControlActor::ControlActor(zmq::context_t& ctx, const DaemonConfig& config,
                           std::unique_ptr<MailboxEnd> engine, obs::Metrics& metrics,
                           SnapshotCell<EngineSnapshot>& snapshot, Heartbeat& heartbeat,
                           protocol::ModelInfo model, int32_t gpu, std::atomic<int>& drain_signals)
    : ctx_(ctx),
      config_(config),
      engine_(std::move(engine)),
      metrics_(metrics),
      snapshot_(snapshot),
      heartbeat_(heartbeat),
      model_(std::move(model)),
      gpu_(gpu),
      drain_signals_(drain_signals),
      router_(ctx, zmq::socket_type::router),
      seed_rng_(std::random_device{}()),
      started_(Clock::now()) {}

ControlActor::~ControlActor() = default;

Result<std::string> ControlActor::bind() {
  try {
    // Detect, never drop: an unroutable reply raises EHOSTUNREACH instead of vanishing.
    router_.set(zmq::sockopt::router_mandatory, 1);
    router_.set(zmq::sockopt::sndhwm, 10000);
    router_.set(zmq::sockopt::rcvhwm, 10000);
    router_.set(zmq::sockopt::linger, 0);
    // A peer that vanished without closing (host down, cable pulled) is detected within
    // ~10 s, its pipe is dropped, and the next send to it fails with EHOSTUNREACH.
    router_.set(zmq::sockopt::heartbeat_ivl, 2000);
    router_.set(zmq::sockopt::heartbeat_timeout, 10000);
    router_.set(zmq::sockopt::heartbeat_ttl, 10000);
    // Hard cap on one frame; anything larger makes ZeroMQ drop the connection. Soft limits
    // (typed too_large replies) are below it, in protocol::Limits.
    router_.set(zmq::sockopt::maxmsgsize,
                static_cast<int64_t>(std::max(config_.limits.max_frame_bytes,
                                              config_.limits.max_envelope_bytes) + 1024));
    // Before the bind: no connection may be accepted on a socket that is not yet a CURVE server.
    if (auth_ != nullptr)
      if (Status s = auth_->secure(router_); !s.ok()) return s;
    const std::string port = config_.control_port == 0 ? "*" : std::to_string(config_.control_port);
    const std::string host = bind_host(config_.bind_address);
    if (is_ipv6_literal(host)) router_.set(zmq::sockopt::ipv6, 1);
    router_.bind("tcp://" + endpoint_host(host) + ":" + port);
    const std::string endpoint = router_.get(zmq::sockopt::last_endpoint);
    const size_t colon = endpoint.rfind(':');
    try {
      bound_port_ = static_cast<uint16_t>(std::stoul(endpoint.substr(colon + 1)));
    } catch (const std::exception&) {
      return Status(ErrorCode::kInternal, "no port in the bound endpoint " + endpoint, "control_port");
    }
    return endpoint;
  } catch (const zmq::error_t& e) {
    return Status(ErrorCode::kUnavailable,
                  std::string("cannot bind the control socket: ") + e.what(), "control_port");
  }
}

void ControlActor::send_engine(EngineCommand cmd) {
  auto mail = std::make_unique<EngineCommandMail>();
  mail->cmd = std::move(cmd);
  Status s = engine_->send(std::move(mail));
  if (!s.ok()) obs::log_error("control", "engine mailbox send failed", {{"error", s.to_string()}});
}

uint64_t ControlActor::client_for(const std::string& identity) {
  auto it = client_ids_.find(identity);
  if (it != client_ids_.end()) return it->second;
  const uint64_t id = next_client_++;
  client_ids_.emplace(identity, id);
  ClientState c;
  c.identity = identity;
  clients_.emplace(id, std::move(c));
  return id;
}

void ControlActor::gc_clients() {
  // A client with nothing in flight and nothing to deliver needs no state: it is
  // recreated from its identity on its next message. Keeps a hello flood from growing maps.
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (it->second.num_routes == 0 && it->second.num_pending_replies == 0 && it->second.outbox.empty()) {
      client_ids_.erase(it->second.identity);
      it = clients_.erase(it);
    } else {
      ++it;
    }
  }
}

bool ControlActor::enqueue(uint64_t client, protocol::WireMessage msg, Delivery kind) {
  auto it = clients_.find(client);
  if (it == clients_.end()) {
    // Every path that can produce a message for a client keeps its state alive (routes,
    // pending replies), so this is a bug: report it rather than lose the message quietly.
    obs::log_error("control", "message for a client without state", {{"client", client}});
    metrics_.on_error("internal");
    return false;
  }
  ClientState& c = it->second;
  if (c.gone) return false;  // its requests were aborted with reason client_gone; nothing to deliver to
  if (c.over_limit && kind == Delivery::kEvent) return false;  // withheld past the bound (SPEC 1.1)
  if (c.over_limit && kind == Delivery::kReply && static_cast<int64_t>(c.outbox.size()) >= config_.outbox_limit) {
    // A client that sends requests but does not read would otherwise grow this outbox
    // without limit (replies are not events: nothing to abort). Counted, never silent.
    ++c.num_replies_dropped;
    metrics_.on_reply_dropped();
    return false;
  }
  c.outbox.push_back(std::move(msg));
  // The bound counts what the socket refused, not what one engine step produced (a step
  // can emit more events than the bound for a client that reads promptly): with nothing
  // queued ahead, offer the message now; it stays only if the socket says EAGAIN.
  if (c.outbox.size() == 1) flush_client(client, c);
  if (!c.gone && !c.over_limit && static_cast<int64_t>(c.outbox.size()) > config_.outbox_limit) {
    c.over_limit = true;
    obs::log_warn("control", "client outbox over its bound; aborting its requests",
                  {{"client", client}, {"outbox_messages", c.outbox.size()}});
    send_engine(AbortClientCommand{client, "backpressure"});
  }
  return true;
}

void ControlActor::reply_error(uint64_t client, uint64_t id, const Status& s) {
  metrics_.on_error(error_code_name(s.code()));
  enqueue(client, protocol::encode_error(id, protocol::to_error_info(s)), Delivery::kReply);
}

protocol::StatusReply ControlActor::status_reply() const {
  protocol::StatusReply r;
  auto snap = snapshot_.load();
  if (snap) {
    r.state = snap->state;
    r.reason = snap->reason;
    r.weight_version = snap->weight_version;
    r.num_waiting = static_cast<uint32_t>(snap->num_waiting);
    r.num_running = static_cast<uint32_t>(snap->num_running);
    r.num_requests_total = snap->num_requests_total;
    r.num_tokens_generated_total = snap->num_generated_tokens_total;
    r.paused = snap->paused;
    r.update_session = snap->update_session;
  } else {
    r.state = "starting";
    r.reason = "engine not started";
  }
  if (draining_ && r.state == "ready") {
    r.state = "draining";
    r.reason = "draining";
  }
  r.ready = r.state == "ready";
  r.uptime_s = std::chrono::duration<double>(Clock::now() - started_).count();
  r.build = build_string();
  r.model = model_;
  return r;
}

void ControlActor::on_request(const std::string& identity, std::vector<zmq::message_t>& parts) {
  const auto t0 = Clock::now();
  const uint64_t client = client_for(identity);
  // /readyz reads the signal flag directly; start the drain before judging this request so
  // nothing is accepted after a probe has seen "draining".
  check_signals();
  if (parts.size() < 2) {
    metrics_.on_request("invalid");
    reply_error(client, 0, Status(ErrorCode::kBadMessage, "empty message: expected an envelope frame"));
    return;
  }
  std::vector<protocol::Frame> frames;
  frames.reserve(parts.size() - 2);
  for (size_t i = 2; i < parts.size(); ++i)
    frames.emplace_back(static_cast<const uint8_t*>(parts[i].data()), parts[i].size());
  const protocol::Frame envelope(static_cast<const uint8_t*>(parts[1].data()), parts[1].size());
  protocol::RequestDecodeResult dec = protocol::decode_request(envelope, frames, config_.limits);
  if (!dec.status.ok()) {
    metrics_.on_request("invalid");
    obs::log_debug("control", "rejected request",
                   {{"error", dec.status.to_string()}, {"client", client}});
    reply_error(client, dec.env.id, dec.status);
    return;
  }
  const uint64_t id = dec.env.id;
  protocol::Request& req = *dec.request;
  metrics_.on_request(protocol::request_type_name(req));

  if (auto* hello = std::get_if<protocol::HelloRequest>(&req)) {
    uint32_t best = 0;
    for (uint32_t v : hello->versions)
      if (v == protocol::kProtocolVersion) best = v;
    if (best == 0) {
      reply_error(client, id, Status(ErrorCode::kUnsupportedVersion,
                                     "this daemon speaks protocol version " +
                                         std::to_string(protocol::kProtocolVersion),
                                     "body.versions"));
    } else {
      protocol::HelloReply r;
      r.version = best;
      r.build = build_string();
      r.gpu = gpu_;
      r.model = model_;
      auto snap = snapshot_.load();
      r.weight_version = snap ? snap->weight_version : 0;
      r.limits = config_.limits;
      r.nccl_version = nccl_version_;
      r.device_uuid = device_uuid_;
      enqueue(client, protocol::encode_reply(id, r), Delivery::kReply);
    }
  } else if (std::holds_alternative<protocol::StatusRequest>(req)) {
    enqueue(client, protocol::encode_reply(id, status_reply()), Delivery::kReply);
  } else if (auto* gen = std::get_if<protocol::GenerateRequest>(&req)) {
    auto snap = snapshot_.load();
    if (draining_) {
      reply_error(client, id, Status(ErrorCode::kDraining, "daemon is draining; no new requests"));
    } else if (!snap || (snap->state != "ready" && snap->state != "updating")) {
      // "updating" (a weight session is open) queues the request; a failed session or a
      // faulted engine refuses it.
      reply_error(client, id, Status(ErrorCode::kNotReady,
                                     "daemon is not ready: " + (snap ? snap->reason : std::string("starting"))));
    } else if (clients_[client].over_limit) {
      // Its earlier requests were aborted for backpressure and it has not caught up: a new
      // request's events would be withheld too (SPEC 1.1).
      reply_error(client, id, Status(ErrorCode::kOverloaded,
                                     "this connection is over its outbox bound (backpressure): read its "
                                     "pending events, then resubmit"));
    } else if (routes_.count(gen->rid)) {
      reply_error(client, id, Status(ErrorCode::kDuplicateRid,
                                     "request id '" + gen->rid + "' is already in flight", "body.rid"));
    } else if (gen->max_new_tokens > config_.limits.max_new_tokens) {
      reply_error(client, id, Status(ErrorCode::kOutOfRange, "max_new_tokens above this daemon's limit",
                                     "body.max_new_tokens"));
    } else if (!gen->stream && gen->top_logprobs_num > 0 &&
               tokens_event_bound(gen->max_new_tokens, gen->top_logprobs_num, gen->rid.size()) >
                   config_.limits.max_envelope_bytes) {
      // stream=false sends one tokens event: with top log-probs it could outgrow the envelope limit
      // that clients apply, and the result would be lost. Streamed events are cut to fit instead.
      reply_error(client, id,
                  Status(ErrorCode::kTooLarge,
                         "top_logprobs_num " + std::to_string(gen->top_logprobs_num) + " with max_new_tokens " +
                             std::to_string(gen->max_new_tokens) + " and stream=false would exceed the " +
                             std::to_string(config_.limits.max_envelope_bytes) +
                             "-byte envelope limit in one event: stream the request or ask for fewer tokens",
                         "body.top_logprobs_num"));
    } else {
      core::RequestSpec spec;
      spec.rid = gen->rid;
      spec.input_ids = std::move(gen->input_ids);
      spec.max_new_tokens = gen->max_new_tokens;
      spec.sampling.temperature = static_cast<float>(gen->temperature);
      // Any top_p in (0, 1] is valid (SPEC 3); one below float's range must not round to 0.
      spec.sampling.top_p = std::max(static_cast<float>(gen->top_p), std::numeric_limits<float>::min());
      spec.sampling.top_k = gen->top_k;
      spec.sampling.min_p = static_cast<float>(gen->min_p);
      spec.sampling.seed = gen->seed ? *gen->seed : seed_rng_();
      spec.stop_token_ids = std::move(gen->stop_token_ids);
      spec.return_logprob = gen->return_logprob;
      spec.return_routed_experts = gen->return_routed_experts;
      spec.routed_experts_start_len = gen->routed_experts_start_len;
      spec.top_logprobs_num = gen->top_logprobs_num;
      if (gen->deadline_s > 0)  // counted from receipt (SPEC 4.1)
        spec.deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(gen->deadline_s));
      spec.tag = client;
      Route route;
      route.client = client;
      route.envelope_id = id;
      route.stream = gen->stream;
      route.pending.rid = gen->rid;
      route.routed = gen->return_routed_experts;
      route.routed_start_len = route.routed_next_pos = static_cast<uint32_t>(gen->routed_experts_start_len);
      routes_.emplace(gen->rid, std::move(route));
      ++clients_[client].num_routes;
      send_engine(SubmitCommand{std::move(spec)});
    }
  } else if (auto* abort = std::get_if<protocol::AbortRequest>(&req)) {
    AbortCommand cmd;
    cmd.rid = abort->all ? std::nullopt : abort->rid;
    cmd.reason = "client";
    cmd.client = client;
    cmd.envelope_id = id;
    ++clients_[client].num_pending_replies;
    send_engine(std::move(cmd));
  } else if (std::holds_alternative<protocol::BeginWeightUpdateRequest>(req) ||
             std::holds_alternative<protocol::UpdateWeightsRequest>(req) ||
             std::holds_alternative<protocol::EndWeightUpdateRequest>(req) ||
             std::holds_alternative<protocol::AbortWeightUpdateRequest>(req) ||
             std::holds_alternative<protocol::GetWeightsByNameRequest>(req) ||
             std::holds_alternative<protocol::WeightsChecksumRequest>(req) ||
             std::holds_alternative<protocol::PauseGenerationRequest>(req) ||
             std::holds_alternative<protocol::ContinueGenerationRequest>(req) ||
             std::holds_alternative<protocol::InitWeightGroupRequest>(req) ||
             std::holds_alternative<protocol::DestroyWeightGroupRequest>(req) ||
             std::holds_alternative<protocol::ReleaseMemoryRequest>(req) ||
             std::holds_alternative<protocol::ResumeMemoryRequest>(req)) {
    WeightCommand cmd;
    cmd.client = client;
    cmd.envelope_id = id;
    cmd.request = std::move(req);
    // The payload frames (an inline bucket) move to the engine without a copy.
    for (size_t i = 2; i < parts.size(); ++i) cmd.payload.push_back(std::move(parts[i]));
    ++clients_[client].num_pending_replies;
    send_engine(std::move(cmd));
  } else if (auto* shut = std::get_if<protocol::ShutdownRequest>(&req)) {
    // accepted=false tells the caller a shutdown (or SIGTERM drain) was already under way.
    enqueue(client, protocol::encode_reply(id, protocol::ShutdownReply{!draining_}), Delivery::kReply);
    begin_drain(shut->drain ? shut->deadline_s : 0.0, "shutdown request");
  }
  metrics_.observe_control_seconds(std::chrono::duration<double>(Clock::now() - t0).count());
}

protocol::TokensEvent ControlActor::to_tokens(const core::EngineEvent& ev) const {
  protocol::TokensEvent t;
  t.rid = ev.rid;
  t.token_ids = ev.token_ids;
  t.logprobs.assign(ev.logprobs.begin(), ev.logprobs.end());
  t.weight_versions = ev.weight_versions;
  if (!ev.token_ids.empty()) {
    t.top_logprobs_num = ev.top_logprobs_num;
    t.top_token_ids = ev.top_ids;
    t.top_logprobs.assign(ev.top_logprobs.begin(), ev.top_logprobs.end());
  }
  if (ev.routed_num_tokens > 0) {
    protocol::RoutedExperts r;
    r.dtype = model_.routed_experts_dtype;
    r.num_tokens = static_cast<uint32_t>(ev.routed_num_tokens);
    r.num_layers = model_.num_moe_layers;
    r.top_k = model_.top_k;
    r.start_pos = static_cast<uint32_t>(ev.routed_start_pos);
    append_packed(r.data, ev.routed_rows, r.dtype);
    t.routed_experts = std::move(r);
  }
  return t;
}

void ControlActor::drop_route(const std::string& rid) {
  auto it = routes_.find(rid);
  if (it == routes_.end()) return;
  auto c = clients_.find(it->second.client);
  if (c != clients_.end() && c->second.num_routes > 0) --c->second.num_routes;
  routes_.erase(it);
}

void ControlActor::stamp_routed(Route& route) {
  if (!route.routed) return;
  auto& map = route.pending.routed_experts;
  if (!map) {
    protocol::RoutedExperts r;
    r.dtype = model_.routed_experts_dtype;
    r.num_tokens = 0;
    r.num_layers = model_.num_moe_layers;
    r.top_k = model_.top_k;
    r.start_pos = route.routed_next_pos;
    map = std::move(r);
  }
  route.routed_next_pos = map->start_pos + map->num_tokens;
}

void ControlActor::flush_pending_tokens(Route& route) {
  if (route.pending.token_ids.empty() && !route.pending.routed_experts) return;
  stamp_routed(route);
  const std::string rid = route.pending.rid;
  const auto n = static_cast<uint32_t>(route.pending.token_ids.size());
  if (!enqueue(route.client, protocol::encode_event(route.envelope_id, protocol::Event{std::move(route.pending)}),
               Delivery::kEvent))
    route.num_tokens_withheld += n;
  route.pending = protocol::TokensEvent{};
  route.pending.rid = rid;
}

void ControlActor::on_event(core::EngineEvent& ev) {
  auto it = routes_.find(ev.rid);
  if (it == routes_.end()) {
    obs::log_error("control", "event for an unknown request", {{"rid", ev.rid}});
    metrics_.on_error("internal");
    return;
  }
  Route& route = it->second;
  auto client_it = clients_.find(route.client);
  const bool client_gone = client_it == clients_.end() || client_it->second.gone;
  switch (ev.kind) {
    case core::EngineEvent::Kind::kTokens: {
      // Held until --stream-interval tokens are there (--stream-interval 1: every engine event
      // as it comes, routed rows of a prompt chunk without a token included); stream=false
      // holds everything for one tokens event right before the final event.
      // A streamed event is also sent before the next engine step's tokens could take it past the
      // envelope limit (top log-probs make tokens large).
      if (route.stream && !route.pending.token_ids.empty() &&
          tokens_event_bound(route.pending.token_ids.size() + ev.token_ids.size(), ev.top_logprobs_num,
                             ev.rid.size()) > config_.limits.max_envelope_bytes)
        flush_pending_tokens(route);
      append_tokens(route.pending, to_tokens(ev));
      if (route.stream && (config_.stream_interval == 1 ||
                           route.pending.token_ids.size() >= static_cast<size_t>(config_.stream_interval)))
        flush_pending_tokens(route);
      return;
    }
    case core::EngineEvent::Kind::kRetracted: {
      // A streamed request's held tokens go out first, so the client discards exactly
      // num_tokens_discarded of what it received; a stream=false request has delivered
      // nothing yet: just forget what was gathered.
      if (route.stream) flush_pending_tokens(route);
      route.pending = protocol::TokensEvent{};
      route.pending.rid = ev.rid;
      route.num_tokens_withheld = 0;
      route.routed_next_pos = route.routed_start_len;  // rows start again (SPEC 4.4)
      // Sent with stream=false too (SPEC 11.6): the client learns the request restarted; it
      // had received no tokens, so none are discarded.
      protocol::RetractedEvent r{ev.rid, route.stream ? ev.num_tokens_discarded : 0, "weight_update"};
      enqueue(route.client, protocol::encode_event(route.envelope_id, protocol::Event{std::move(r)}), Delivery::kEvent);
      return;
    }
    case core::EngineEvent::Kind::kFinished:
    case core::EngineEvent::Kind::kFailed: {
      if (ev.kind == core::EngineEvent::Kind::kFinished && ev.finish_reason == "abort" &&
          (ev.abort_reason == "client_gone" || ev.abort_reason == "backpressure"))
        metrics_.on_stream_abort(ev.abort_reason);
      if (client_gone) {
        // Counted above (client_gone) and logged when the peer vanished; nobody to tell.
        drop_route(ev.rid);
        return;
      }
      // stream=false: exactly one tokens event precedes the final one, even when empty.
      if (route.stream) {
        flush_pending_tokens(route);
      } else {
        stamp_routed(route);
        enqueue(route.client,
                protocol::encode_event(route.envelope_id, protocol::Event{std::move(route.pending)}),
                Delivery::kRequestEnd);
      }
      protocol::Event final_ev;
      if (ev.kind == core::EngineEvent::Kind::kFinished) {
        protocol::FinishedEvent f;
        f.rid = ev.rid;
        f.reason = ev.finish_reason;
        f.abort_reason = ev.abort_reason;
        f.prompt_tokens = ev.prompt_tokens;
        f.completion_tokens = ev.completion_tokens - std::min(ev.completion_tokens, route.num_tokens_withheld);
        final_ev = std::move(f);
      } else {
        protocol::FailedEvent f;
        f.rid = ev.rid;
        f.error = protocol::to_error_info(ev.error);
        final_ev = std::move(f);
      }
      enqueue(route.client, protocol::encode_event(route.envelope_id, final_ev), Delivery::kRequestEnd);
      drop_route(ev.rid);
      return;
    }
  }
}

void ControlActor::on_engine_output(EngineOutput& out) {
  if (auto* r = std::get_if<SubmitResult>(&out)) {
    auto it = routes_.find(r->rid);
    if (it == routes_.end()) return;
    if (r->status.ok()) {
      it->second.accepted = true;
      enqueue(r->client, protocol::encode_reply(it->second.envelope_id, protocol::GenerateReply{r->rid}), Delivery::kRequestEnd);
    } else {
      // The engine's field names are relative to the generate body.
      const uint64_t env_id = it->second.envelope_id;
      drop_route(r->rid);
      reply_error(r->client, env_id, r->status.with_field_prefix(r->status.field().empty() ? "" : "body"));
    }
  } else if (auto* a = std::get_if<AbortResult>(&out)) {
    if (auto c = clients_.find(a->client); c != clients_.end() && c->second.num_pending_replies > 0)
      --c->second.num_pending_replies;
    if (a->status.ok()) {
      enqueue(a->client, protocol::encode_reply(a->envelope_id, protocol::AbortReply{a->num_aborted}), Delivery::kReply);
    } else {
      reply_error(a->client, a->envelope_id, a->status);
    }
  } else if (auto* b = std::get_if<EventBatch>(&out)) {
    for (auto& ev : b->events) on_event(ev);
  } else if (auto* e = std::get_if<EncodedReply>(&out)) {
    if (auto c = clients_.find(e->client); c != clients_.end() && c->second.num_pending_replies > 0)
      --c->second.num_pending_replies;
    if (!e->error_code.empty()) metrics_.on_error(e->error_code);
    enqueue(e->client, std::move(e->message), Delivery::kReply);
  } else if (std::holds_alternative<DrainDone>(out)) {
    drain_done_ = true;
    flush_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(config_.flush_timeout_s));
  } else if (auto* f = std::get_if<EngineFault>(&out)) {
    obs::log_error("control", "engine fault; shutting down for a restart", {{"error", f->status.to_string()}});
    exit_code_ = 3;
    begin_drain(0.0, "engine fault");
  }
}

void ControlActor::flush_client(uint64_t id, ClientState& c) {
  while (!c.outbox.empty()) {
    protocol::WireMessage& m = c.outbox.front();
    try {
      zmq::message_t ident(c.identity.data(), c.identity.size());
      if (!router_.send(ident, zmq::send_flags::sndmore | zmq::send_flags::dontwait)) return;  // HWM: later
      // Once the routing frame is accepted the rest of the message goes through.
      const bool has_frames = !m.frames.empty();
      router_.send(zmq::buffer(m.envelope), has_frames ? zmq::send_flags::sndmore : zmq::send_flags::none);
      for (size_t i = 0; i < m.frames.size(); ++i)
        router_.send(zmq::buffer(m.frames[i]),
                     i + 1 < m.frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
      c.outbox.pop_front();
    } catch (const zmq::error_t& e) {
      if (e.num() == EHOSTUNREACH) {
        c.gone = true;
        const size_t dropped = c.outbox.size();
        c.outbox.clear();
        obs::log_warn("control", "client disconnected; aborting its requests",
                      {{"client", id}, {"undelivered_messages", dropped}, {"requests", c.num_routes}});
        if (c.num_routes > 0) send_engine(AbortClientCommand{id, "client_gone"});
      } else {
        obs::log_error("control", "send failed", {{"client", id}, {"error", e.what()}});
        metrics_.on_error("unavailable");
      }
      return;
    }
  }
}

void ControlActor::flush() {
  for (auto& [id, c] : clients_) {
    if (!c.gone && !c.outbox.empty()) flush_client(id, c);
    // Caught up, and every request the backpressure abort ended has had its final event:
    // the client may submit again.
    if (c.over_limit && c.outbox.empty() && c.num_routes == 0) {
      c.over_limit = false;
      obs::log_info("control", "client caught up with its outbox; accepting its requests again",
                    {{"client", id}, {"replies_dropped", c.num_replies_dropped}});
      c.num_replies_dropped = 0;
    }
  }
}

void ControlActor::check_signals() {
  const int n = drain_signals_.load();
  if (n >= 1 && !draining_) begin_drain(config_.drain_timeout_s, "signal");
  if (n >= 2 && !drain_cut_) {
    // An operator who signals twice wants out now: requests still running end with
    // finished{abort, shutdown} (their final events are still delivered), whatever started the drain.
    drain_cut_ = true;
    obs::log_info("control", "second signal; drain deadline cut to zero");
    send_engine(DrainCommand{0.0});
  }
}

void ControlActor::begin_drain(double deadline_s, const std::string& why) {
  if (draining_) return;
  draining_ = true;
  obs::log_info("control", "drain started", {{"why", why}, {"deadline_s", deadline_s}});
  if (on_drain_start_) on_drain_start_();
  send_engine(DrainCommand{deadline_s});
}

int ControlActor::run() {
  obs::log_info("control", "control loop started");
  while (true) {
    heartbeat_.beat();
    check_signals();

    bool pending_out = false;
    for (auto& [id, c] : clients_) pending_out |= !c.gone && !c.outbox.empty();
    zmq::pollitem_t items[] = {
        {router_.handle(), 0, static_cast<short>(ZMQ_POLLIN | (pending_out ? ZMQ_POLLOUT : 0)), 0},
        {engine_->socket().handle(), 0, ZMQ_POLLIN, 0},
    };
    try {
      // POLLOUT on a ROUTER means "some peer can take a message"; cap the wait anyway so a
      // peer stuck at its HWM does not turn this into a busy loop or a stall.
      zmq::poll(items, 2, std::chrono::milliseconds(pending_out ? 5 : 50));
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) obs::log_error("control", "poll failed", {{"error", e.what()}});
    }

    if (items[0].revents & ZMQ_POLLIN) {
      for (int n = 0; n < kMaxRequestsPerTurn; ++n) {
        std::vector<zmq::message_t> parts;
        std::optional<size_t> got;
        try {
          got = zmq::recv_multipart(router_, std::back_inserter(parts), zmq::recv_flags::dontwait);
        } catch (const zmq::error_t& e) {
          obs::log_error("control", "receive failed", {{"error", e.what()}});
          break;
        }
        if (!got) break;
        if (parts.empty()) continue;
        const std::string identity(static_cast<const char*>(parts[0].data()), parts[0].size());
        on_request(identity, parts);
      }
    }
    while (auto mail = engine_->try_recv<EngineOutputMail>()) on_engine_output(mail->out);
    flush();
    gc_clients();

    if (draining_ && drain_done_ && !stop_sent_) {
      bool undelivered = false;
      for (auto& [id, c] : clients_) undelivered |= !c.gone && !c.outbox.empty();
      if (!undelivered || Clock::now() >= flush_deadline_) {
        size_t left = 0;
        for (auto& [id, c] : clients_) left += c.gone ? 0 : c.outbox.size();
        if (left) obs::log_warn("control", "flush deadline reached with undelivered messages", {{"count", left}});
        send_engine(StopCommand{});
        stop_sent_ = true;
        break;
      }
    }
  }
  obs::log_info("control", "control loop stopped", {{"exit_code", exit_code_}});
  await_delivery();
  // The socket has taken the last messages but may not have written them yet: linger 0 (set at
  // bind, so a restart never waits on a dead peer) would discard them when the context closes,
  // final events included. Let it deliver for what is left of the flush deadline.
  const auto flush_left = std::chrono::duration_cast<std::chrono::milliseconds>(flush_deadline_ - Clock::now());
  try {
    router_.set(zmq::sockopt::linger, static_cast<int>(std::clamp<int64_t>(flush_left.count(), 0, 600'000)));
  } catch (const zmq::error_t& e) {
    obs::log_warn("control", "could not set the control socket's linger", {{"error", e.what()}});
  }
  return exit_code_;
}

void ControlActor::await_delivery() {
  // Every message is in ZeroMQ's hands, but for a client slow to read much of it may sit in
  // our kernel send buffer; closing now would let a byte from the client (its PONG to our
  // heartbeat) reset the connection and drop it (connection_flush.hpp). So the socket stays
  // open, ZeroMQ reading and answering heartbeats, until each connection at the control port
  // has been acknowledged in full, or the flush deadline, or another signal.
  const auto start = Clock::now();
  constexpr auto kCheckEvery = std::chrono::milliseconds(10);
  constexpr auto kSettle = std::chrono::milliseconds(50);
  ConnectionFlushWatch watch(kSettle);
  const int signals_at_start = drain_signals_.load();
  uint64_t num_refused = 0;
  const char* outcome = "received";
  while (true) {
    auto conns = tcp_connections_at_port(bound_port_);
    if (!conns.ok()) {
      obs::log_warn("control", "cannot see the control connections' send queues; closing without waiting",
                    {{"error", conns.status().to_string()}});
      return;
    }
    watch.observe(*conns, Clock::now());
    if (watch.all_flushed()) break;
    if (Clock::now() >= flush_deadline_) {
      outcome = "flush_deadline";
      break;
    }
    if (drain_signals_.load() > signals_at_start) {
      outcome = "signal";
      break;
    }
    heartbeat_.beat();
    zmq::pollitem_t item{router_.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, kCheckEvery);
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) obs::log_error("control", "poll failed", {{"error", e.what()}});
    }
    // Read, so no byte stays unread at the close (that too makes the close a reset), and
    // refused: nothing serves requests any more. A reconnecting client is accepted until the
    // socket closes, and learns from the reply that this daemon is going.
    for (int n = 0; n < kMaxRequestsPerTurn && (item.revents & ZMQ_POLLIN); ++n) {
      std::vector<zmq::message_t> parts;
      try {
        if (!zmq::recv_multipart(router_, std::back_inserter(parts), zmq::recv_flags::dontwait)) break;
      } catch (const zmq::error_t&) {
        break;
      }
      if (parts.size() < 2) continue;
      const protocol::Frame envelope(static_cast<const uint8_t*>(parts[1].data()), parts[1].size());
      const protocol::RequestDecodeResult dec = protocol::decode_request(envelope, {}, config_.limits);
      const std::string identity(static_cast<const char*>(parts[0].data()), parts[0].size());
      reply_error(client_for(identity), dec.env.id, Status(ErrorCode::kDraining, "the daemon is exiting"));
      ++num_refused;
    }
    flush();
  }
  const double waited_s = std::chrono::duration<double>(Clock::now() - start).count();
  nlohmann::json fields{{"outcome", outcome},
                        {"waited_s", waited_s},
                        {"connections_received", watch.num_flushed()},
                        {"connections_waiting", watch.num_waiting()},
                        {"unacked_bytes", watch.unacked_bytes()},
                        {"connections_closed", watch.num_closed()},
                        {"connections_closed_unacked", watch.num_closed_unacked()},
                        {"closed_unacked_bytes", watch.closed_unacked_bytes()},
                        {"connections_lost", watch.num_lost()},
                        {"lost_bytes", watch.lost_bytes()},
                        {"requests_refused", num_refused}};
  if (std::string_view(outcome) == "received" && watch.num_lost() == 0) {
    obs::log_info("control", "clients have received the last messages", fields);
  } else {
    obs::log_warn("control", "control socket closed before every client had received its messages", fields);
  }
}

}  // namespace rolloutd::daemon
