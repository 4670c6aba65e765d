#pragma once
// The control actor: owns the ROUTER socket. It decodes and validates every
// request, answers what it can from published snapshots, hands generation work
// to the engine through the mailbox, and delivers replies and events back to the
// client that asked -- the stream role lives here because a ZeroMQ socket
// belongs to one thread and events travel on the client's own connection
// (protocol/SPEC.md argues the choice).
//
// Delivery: per-client outbox, non-blocking sends with ZMQ_ROUTER_MANDATORY. A
// peer that is gone (EHOSTUNREACH) or an outbox past its bound makes the engine
// abort that client's requests, with the reason in their final events and in
// rolloutd_stream_aborts_total: a stream is never dropped silently.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "daemon/actors/mail.hpp"
#include "daemon/actors/mailbox.hpp"
#include "daemon/config.hpp"
#include "daemon/obs/metrics.hpp"
#include "daemon/state.hpp"
#include "protocol/codec.hpp"

namespace rolloutd::daemon {

class CurveAuthenticator;

class ControlActor {
 public:
  ControlActor(zmq::context_t& ctx, const DaemonConfig& config, std::unique_ptr<MailboxEnd> engine,
               obs::Metrics& metrics, SnapshotCell<EngineSnapshot>& snapshot, Heartbeat& heartbeat,
               protocol::ModelInfo model, int32_t gpu, std::atomic<int>& drain_signals);
  ~ControlActor();

  void set_device_facts(uint32_t nccl_version, std::string device_uuid) {
    nccl_version_ = nccl_version;
    device_uuid_ = std::move(device_uuid);
  }
  // With CURVE keys configured: bind() makes the ROUTER a CURVE server checked by `auth`,
  // which must outlive this actor (daemon/security/control_auth.hpp).
  void set_authenticator(CurveAuthenticator* auth) { auth_ = auth; }
  // Called once, on this actor's thread, when a drain starts (whatever started it): systemd's
  // STOPPING=1.
  void set_on_drain_start(std::function<void()> f) { on_drain_start_ = std::move(f); }
  // Binds the ROUTER; returns the bound endpoint ("tcp://127.0.0.1:7600").
  Result<std::string> bind();
  // Thread body. Returns the process exit code: 0 after a clean drain, 3 after an engine fault.
  int run();

 private:
  struct ClientState {
    std::string identity;
    // Messages the socket refused (EAGAIN at its high-water mark) and those queued behind
    // them, in order. A message with nothing ahead of it is offered to the socket at once,
    // so only a client that does not read can fill this (SPEC 1.1).
    std::deque<protocol::WireMessage> outbox;
    uint32_t num_routes = 0;
    uint32_t num_pending_replies = 0;  // commands sent to the engine whose reply goes here
    bool gone = false;
    // Set when the outbox passes --outbox-limit: its requests are aborted (backpressure),
    // their non-final events withheld, and new generate requests refused (overloaded) until
    // the outbox is empty and every aborted request has had its final event.
    bool over_limit = false;
    uint64_t num_replies_dropped = 0;  // since over_limit was last set (logged when it clears)
  };
  struct Route {
    uint64_t client = 0;
    uint64_t envelope_id = 0;
    bool stream = true;
    bool accepted = false;
    // Tokens not yet sent: stream=false, everything so far; stream=true, fewer than
    // --stream-interval (flushed when it reaches it, before a retraction and before the end).
    protocol::TokensEvent pending;
    // Tokens of this attempt withheld because the client was over its bound: the final
    // event's completion_tokens counts only what was delivered (SPEC 4.3).
    uint32_t num_tokens_withheld = 0;
    // return_routed_experts: every tokens event carries the map, rows or not (SPEC 4.4); one
    // without rows states where the next row will be.
    bool routed = false;
    uint32_t routed_start_len = 0;
    uint32_t routed_next_pos = 0;
  };

  void on_request(const std::string& identity, std::vector<zmq::message_t>& parts);
  void on_engine_output(EngineOutput& out);
  void on_event(core::EngineEvent& ev);
  // Sends a streamed route's held tokens as one event (nothing when none are held).
  void flush_pending_tokens(Route& route);
  // Gives a routed request's held event its routed_experts map (empty when it has no rows) and
  // moves the route's next row position past it; call right before the event is sent.
  void stamp_routed(Route& route);
  // What a message is to the per-client bound (SPEC 1.1).
  enum class Delivery {
    kEvent,       // tokens, retracted: withheld while the client is over its bound
    kRequestEnd,  // generate.ok, a stream=false request's tokens, final events: never dropped
                  // (a few per request in flight, so bounded by the scheduler's queues)
    kReply,       // every other reply: dropped and counted once an over-bound outbox is full
  };
  // Queues (and, with nothing queued ahead, sends) one message; false when it was withheld
  // or dropped (the client is gone, or over its bound).
  bool enqueue(uint64_t client, protocol::WireMessage msg, Delivery kind);
  void reply_error(uint64_t client, uint64_t id, const Status& s);
  void flush();
  void flush_client(uint64_t id, ClientState& c);
  void begin_drain(double deadline_s, const std::string& why);
  void check_signals();
  void send_engine(EngineCommand cmd);
  void drop_route(const std::string& rid);
  void gc_clients();
  // After the loop: keeps the socket open until the clients have what it took (connection_flush.hpp).
  void await_delivery();
  uint64_t client_for(const std::string& identity);
  protocol::StatusReply status_reply() const;
  protocol::TokensEvent to_tokens(const core::EngineEvent& ev) const;

  zmq::context_t& ctx_;
  const DaemonConfig& config_;
  std::unique_ptr<MailboxEnd> engine_;
  obs::Metrics& metrics_;
  SnapshotCell<EngineSnapshot>& snapshot_;
  Heartbeat& heartbeat_;
  protocol::ModelInfo model_;
  int32_t gpu_;
  uint32_t nccl_version_ = 0;   // reported in hello so a trainer can check before joining
  std::string device_uuid_;     // 16 bytes on a GPU: a trainer on the same device may use IPC
  std::atomic<int>& drain_signals_;  // SIGTERM/SIGINTs taken: 1 starts a drain, 2 cuts its deadline
  std::function<void()> on_drain_start_;
  bool drain_cut_ = false;           // the second signal's zero deadline was sent
  zmq::socket_t router_;
  CurveAuthenticator* auth_ = nullptr;  // null: a plain socket (loopback unless --insecure-bind-any)

  std::unordered_map<std::string, uint64_t> client_ids_;
  std::unordered_map<uint64_t, ClientState> clients_;
  std::unordered_map<std::string, Route> routes_;
  uint64_t next_client_ = 1;
  std::mt19937_64 seed_rng_;
  std::chrono::steady_clock::time_point started_;

  bool draining_ = false;
  bool drain_done_ = false;
  bool stop_sent_ = false;
  int exit_code_ = 0;
  std::chrono::steady_clock::time_point flush_deadline_;
  uint16_t bound_port_ = 0;  // the control socket's TCP port, once bound
};

}  // namespace rolloutd::daemon
