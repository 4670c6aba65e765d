#include "protocol/client.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <unordered_set>
#include <utility>
#include <zmq.hpp>

namespace rolloutd::protocol {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// NOTES: one ZeroMQ context per process, made on first use and deliberately never
// destroyed. A context's destructor blocks until every socket in it is closed; a
// Client still alive at exit (a Python object collected after interpreter
// teardown, a static) would then hang the process. Sockets linger at most
// kLingerMs, so nothing is held back long. A context must not cross fork(): a
// child (multiprocessing's fork start method) gets a fresh one; the parent's is
// left untouched, as its I/O threads do not exist in the child.
zmq::context_t& process_context() {
  static std::mutex mu;
  static zmq::context_t* context = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (context == nullptr || owner != ::getpid()) {
    context = new zmq::context_t(1);
    owner = ::getpid();
  }
  return *context;
}

// Bounded so that closing never stalls, long enough that a request sent just
// before close (shutdown, abort) still leaves the host.
constexpr int kLingerMs = 100;

milliseconds remaining(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
  return std::max(left, milliseconds(0));
}

Clock::time_point deadline_after(int timeout_ms) {
  return Clock::now() + milliseconds(std::max(timeout_ms, 0));
}

Frame as_frame(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

const std::string& event_rid(const Event& e) {
  return std::visit([](const auto& ev) -> const std::string& { return ev.rid; }, e);
}

// finished and failed end a request; tokens and retracted do not.
bool is_final(const Event& e) {
  return std::holds_alternative<FinishedEvent>(e) || std::holds_alternative<FailedEvent>(e);
}

// The event in a received message, or nullopt for a reply.
std::optional<Event> take_event(Incoming& msg) {
  if (auto* e = std::get_if<TokensEvent>(&msg)) return Event(std::move(*e));
  if (auto* e = std::get_if<FinishedEvent>(&msg)) return Event(std::move(*e));
  if (auto* e = std::get_if<FailedEvent>(&msg)) return Event(std::move(*e));
  if (auto* e = std::get_if<RetractedEvent>(&msg)) return Event(std::move(*e));
  return std::nullopt;
}

// The daemon's error object as a Status. A code this build does not know (a newer
// daemon) keeps its name in the message rather than being silently remapped.
Status status_from_error(const ErrorInfo& e) {
  if (auto code = error_code_from_name(e.code); code && *code != ErrorCode::kOk)
    return Status(*code, e.message, e.field);
  return Status(ErrorCode::kInternal, "daemon sent unknown error code '" + e.code + "': " + e.message,
                e.field);
}

// Appends one tokens event's routed-expert rows to what generate() collected.
// Rows must share dtype, layers and top_k and follow on from the previous rows,
// or the record would silently misalign tokens and experts.
Status append_routed_rows(std::optional<RoutedExperts>& acc, const RoutedExperts& rows) {
  const std::string field = "body.routed_experts";
  const size_t elem = routed_experts_dtype_size(rows.dtype);
  if (elem == 0)
    return Status(ErrorCode::kBadMessage, "unknown routed-experts dtype '" + rows.dtype + "'",
                  field + ".dtype");
  const uint64_t expected = uint64_t{rows.num_tokens} * rows.num_layers * rows.top_k * elem;
  if (rows.data.size() != expected)
    return Status(ErrorCode::kBadMessage,
                  "routed-experts frame has " + std::to_string(rows.data.size()) +
                      " bytes, shape and dtype say " + std::to_string(expected),
                  field + ".frame");
  if (!acc) {
    acc = rows;
    return Status::Ok();
  }
  if (rows.dtype != acc->dtype || rows.num_layers != acc->num_layers || rows.top_k != acc->top_k)
    return Status(ErrorCode::kBadMessage,
                  "routed-experts rows changed layout within one request: " + rows.dtype + " [" +
                      std::to_string(rows.num_layers) + ", " + std::to_string(rows.top_k) +
                      "] after " + acc->dtype + " [" + std::to_string(acc->num_layers) + ", " +
                      std::to_string(acc->top_k) + "]",
                  field);
  const uint64_t next_pos = uint64_t{acc->start_pos} + acc->num_tokens;
  if (rows.start_pos != next_pos)
    return Status(ErrorCode::kBadMessage,
                  "routed-experts rows start at position " + std::to_string(rows.start_pos) +
                      ", expected " + std::to_string(next_pos),
                  field + ".start_pos");
  acc->data += rows.data;
  acc->num_tokens += rows.num_tokens;
  return Status::Ok();
}

}  // namespace

// Drawn from the OS each time: a seeded generator would repeat its sequence in a forked child.
std::string random_rid() {
  std::random_device rd;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string rid;
  for (int word = 0; word < 4; ++word) {
    uint32_t v = rd();
    for (int i = 0; i < 8; ++i, v >>= 4) rid.push_back(kHex[v & 0xF]);
  }
  return rid;
}

// Tracks whether the DEALER has a live connection (ZeroMQ's socket monitor), so that a call to
// a daemon that is down fails fast with `unavailable` without ZMQ_IMMEDIATE (which would drop
// messages already received when the daemon disconnects). It also sees the security
// handshake: a daemon that refuses it (a key not in its allowlist, CURVE on one side only) is
// reported at once as `unauthenticated`, instead of every call waiting out its deadline while
// ZeroMQ reconnects and is refused again in the background.
class ConnectionMonitor : public zmq::monitor_t {
 public:
  explicit ConnectionMonitor(bool curve) : curve_(curve) {}

  bool connected = false;
  // Connections dropped so far, and when the last drop was seen (see Client::Impl::lost).
  uint64_t disconnects = 0;
  std::chrono::steady_clock::time_point disconnected_at{};
  // Why the last handshake failed; cleared by a handshake that succeeds.
  std::optional<std::string> handshake_error;

  // With CURVE a connection is usable once its handshake succeeded, not when TCP connects.
  void on_event_connected(const zmq_event_t&, const char*) override {
    if (!curve_) connected = true;
  }
  void on_event_disconnected(const zmq_event_t&, const char*) override {
    connected = false;
    ++disconnects;
    disconnected_at = std::chrono::steady_clock::now();
  }
  void on_event_handshake_succeeded(const zmq_event_t&, const char*) override {
    connected = true;
    handshake_error.reset();
    aborted_in_a_row_ = 0;
  }
  void on_event_handshake_failed_auth(const zmq_event_t& e, const char*) override {
    connected = false;
    handshake_error = "the daemon refused this client's CURVE key (ZAP status " + std::to_string(e.value) +
                      "): its public key is not in the daemon's --curve-allow list";
  }
  void on_event_handshake_failed_protocol(const zmq_event_t& e, const char*) override {
    connected = false;
    if (e.value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
      handshake_error = curve_ ? "the daemon does not use CURVE (it runs without keys) but this client was "
                                 "given a server key"
                               : "the daemon requires CURVE: give this client the daemon's public key and a "
                                 "client key pair whose public key the daemon allows";
    } else {
      char code[16];
      std::snprintf(code, sizeof code, "0x%08x", static_cast<unsigned>(e.value));
      handshake_error = std::string("the CURVE handshake failed (ZMTP protocol error ") + code +
                        "): is the server key this daemon's public key?";
    }
  }
  void on_event_handshake_failed_no_detail(const zmq_event_t& e, const char*) override {
    connected = false;
    ++aborted_in_a_row_;
    // One connection dropped mid-greeting is a daemon going away (killed during a
    // handshake). Several in a row, each reconnection dropped again, are a refusal: a daemon
    // that cannot decrypt our CURVE hello (another server key), or a CURVE daemon resetting a
    // plain connection before this client read the mechanism it asks for (libzmq reports that
    // mismatch only sometimes). A more precise reason already recorded is kept.
    if (handshake_error || aborted_in_a_row_ < kAbortedHandshakesToRefusal) return;
    handshake_error = "the daemon closed " + std::to_string(aborted_in_a_row_) +
                      " connections in a row during the handshake (" + std::string(std::strerror(e.value)) + "): " +
                      (curve_ ? "it does not use CURVE, or the server key is not its public key"
                              : "it requires CURVE (give this client the daemon's public key and a client key pair), "
                                "or the port is not a rolloutd control socket");
  }
  void pump() {
    while (check_event(0)) {
    }
  }
  static constexpr int kAbortedHandshakesToRefusal = 3;
  // kUnauthenticated when the last handshake failed and none has succeeded since.
  Status refusal(const std::string& endpoint) const {
    if (connected || !handshake_error) return Status::Ok();
    return Status(ErrorCode::kUnauthenticated, endpoint + ": " + *handshake_error);
  }

 private:
  const bool curve_;
  int aborted_in_a_row_ = 0;  // handshakes dropped mid-greeting since the last one that succeeded
};

// How long a send waits for the first connection before calling the daemon unreachable.
constexpr auto kConnectGrace = std::chrono::milliseconds(2000);
// How often a receive that waits looks at the monitor for a refused handshake.
constexpr auto kHandshakeCheckInterval = std::chrono::milliseconds(100);

// A DEALER connected to options.endpoint, with its monitor. The monitor must watch before the
// socket connects: a CONNECTED event raised before it exists is never delivered, and the client
// would think the daemon is down.
struct OpenConnection {
  zmq::socket_t socket;
  std::unique_ptr<ConnectionMonitor> monitor;
};

Result<OpenConnection> open_connection(const ClientOptions& options) {
  try {
    OpenConnection c{zmq::socket_t(process_context(), zmq::socket_type::dealer),
                     std::make_unique<ConnectionMonitor>(options.curve.enabled())};
    zmq::socket_t& socket = c.socket;
    socket.set(zmq::sockopt::linger, kLingerMs);
    socket.set(zmq::sockopt::sndhwm, options.send_hwm);
    socket.set(zmq::sockopt::rcvhwm, options.recv_hwm);
    // Not ZMQ_IMMEDIATE: with it, libzmq discards messages already received but not yet read
    // when the peer disconnects -- the final events of a daemon that drained and exited could
    // vanish (seen: 3 of 8 runs). Without it a request to a daemon that is down waits in the
    // local queue; the call's deadline still bounds the wait.
    // A peer that sends a frame beyond any limit is disconnected by ZeroMQ before
    // the frame is buffered (the pending call then times out).
    socket.set(zmq::sockopt::maxmsgsize,
               static_cast<int64_t>(std::max(options.limits.max_envelope_bytes,
                                             options.limits.max_frame_bytes)));
    if (options.curve.enabled()) {
      // The client side of CURVE: it knows the daemon's public key, so it talks only to the
      // daemon holding the matching secret, and proves its own key pair to the daemon's ZAP
      // handler. Keys go in as raw bytes (checked above), never as text libzmq reinterprets.
      auto server = z85_key_bytes(options.curve.server_public_key, "server public key");
      auto pub = z85_key_bytes(options.curve.client.public_key, "client public key");
      auto sec = z85_key_bytes(options.curve.client.secret_key, "client secret key");
      socket.set(zmq::sockopt::curve_serverkey, zmq::buffer(server->data(), server->size()));
      socket.set(zmq::sockopt::curve_publickey, zmq::buffer(pub->data(), pub->size()));
      socket.set(zmq::sockopt::curve_secretkey, zmq::buffer(sec->data(), sec->size()));
    }
    // One inproc monitor endpoint per socket (the address must be unique in the context).
    static std::atomic<uint64_t> monitors{0};
    c.monitor->init(socket, "inproc://rolloutd-client-monitor-" + std::to_string(::getpid()) + "-" +
                                std::to_string(monitors.fetch_add(1)),
                    ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                        ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                        ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL);
    try {
      // An IPv6 literal ("tcp://[::1]:PORT", as a daemon bound to ::1 reports) needs the option.
      if (options.endpoint.find("://[") != std::string::npos) socket.set(zmq::sockopt::ipv6, 1);
      socket.connect(options.endpoint);
    } catch (const zmq::error_t& e) {
      return Status(ErrorCode::kInvalidArgument,
                    "cannot connect to '" + options.endpoint + "': " + e.what(), "endpoint");
    }
    return c;
  } catch (const zmq::error_t& e) {
    return Status(ErrorCode::kUnavailable, std::string("ZeroMQ socket setup failed: ") + e.what());
  }
}

struct Client::Impl {
  ClientOptions options;
  // Declared before the monitor, which is destroyed first: it watches the socket's handle.
  zmq::socket_t socket;
  std::unique_ptr<ConnectionMonitor> monitor;
  Clock::time_point connected_at = Clock::now();
  uint64_t next_id = 1;           // envelope ids: replies are matched by it
  std::deque<Event> events;       // events received while waiting for something else
  // Requests whose caller gave up (generate() timed out): their remaining events
  // are dropped until the final one, so they never surface in next_event().
  std::unordered_set<std::string> abandoned;

  explicit Impl(ClientOptions opts) : options(std::move(opts)) {}

  // One slice of a wait for `events` (ZMQ_POLLIN or ZMQ_POLLOUT) on the socket: at most
  // kHandshakeCheckInterval, because TCP may connect (which counts as connected without CURVE)
  // before the daemon refuses the handshake, and then nothing ever arrives and no queue slot
  // opens: the refusal must end the wait, not the deadline (seen under ASan on a loaded 2-core
  // host, where the refusal came after the connect event had been read). True when the events
  // are ready; otherwise the monitor has been pumped and a refusal returns as an error.
  Result<bool> poll_slice(short events, Clock::time_point deadline);
  Status send_frames(const std::vector<std::string_view>& parts, Clock::time_point deadline);
  // `lost_since`: a snapshot of monitor->disconnects taken before the awaited request was sent;
  // the wait then ends with kUnavailable once that connection is lost (see lost()).
  Result<std::optional<std::vector<std::string>>> recv_frames(Clock::time_point deadline,
                                                               std::optional<uint64_t> lost_since = {});
  // Requests sent before drop_unsent() replaced the socket (their snapshot is below this) can
  // never be answered, even once the new socket connects to a daemon back on the endpoint.
  uint64_t replaced_through = 0;
  bool lost(uint64_t since) const {
    return monitor->disconnects > since && !monitor->connected &&
           Clock::now() >= monitor->disconnected_at + std::chrono::milliseconds(Client::kReconnectWaitMs);
  }
  // Messages still queued for a connection that dropped would go to whatever daemon next
  // answers on the endpoint (one restarted there, or this one after a long network outage),
  // after their callers were told `unavailable` and a coordinator placed them elsewhere: one
  // request would run twice. A new socket replaces this one, closed with linger 0, so
  // unavailable means not delivered, or delivered over the dropped connection (whose requests
  // the daemon ends as client_gone). Not zmq_disconnect + zmq_connect on the same socket: the
  // old connection's session, terminated asynchronously, was seen on a loaded host to connect
  // again and attach a fresh pipe first, so a later request could go down it and vanish.
  void drop_unsent() {
    replaced_through = monitor->disconnects;
    auto opened = open_connection(options);
    if (!opened.ok()) {
      // No new socket (out of sockets?): the same-socket way, racy under load (see above) but
      // better than leaving the queue to the next daemon.
      try {
        socket.set(zmq::sockopt::linger, 0);
        socket.disconnect(options.endpoint);
        socket.connect(options.endpoint);
        socket.set(zmq::sockopt::linger, kLingerMs);
      } catch (const zmq::error_t&) {
      }
      return;
    }
    opened->monitor->disconnects = monitor->disconnects;
    opened->monitor->disconnected_at = monitor->disconnected_at;
    monitor.reset();  // stops watching the old socket before it closes
    try {
      socket.set(zmq::sockopt::linger, 0);
    } catch (const zmq::error_t&) {
    }
    socket = std::move(opened->socket);  // closes the old one
    monitor = std::move(opened->monitor);
  }
  Status lost_status() const {
    return Status(ErrorCode::kUnavailable,
                  "the connection to " + options.endpoint + " dropped after the request was sent and did not "
                      "come back within " + std::to_string(Client::kReconnectWaitMs) + " ms: the daemon is down");
  }
  // Next decoded message, or nullopt at the deadline.
  Result<std::optional<DecodedIncoming>> receive(Clock::time_point deadline, std::optional<uint64_t> lost_since = {});
  // `payload`: frames sent after the envelope (an inline bucket).
  Status send_request(uint64_t id, const Request& req, Clock::time_point deadline,
                      const std::vector<std::string_view>& payload = {});
  // Queues an event for next_event(), unless its request was abandoned.
  void enqueue(Event event);
  // Sends an abort for `rid` without waiting (its reply is dropped as stale) and
  // drops the request's remaining events.
  void abandon(const std::string& rid);

  // Sends `req` and waits for its reply. `*unanswered` is set when the request was
  // sent but no reply came (timeout, undecodable message): it may be running.
  template <class Reply>
  Result<Reply> call(const Request& req, Clock::time_point deadline, bool* unanswered = nullptr,
                     const std::vector<std::string_view>& payload = {});
  template <class Reply>
  Result<Reply> call(const Request& req) {
    return call<Reply>(req, deadline_after(options.request_timeout_ms));
  }
};

Result<bool> Client::Impl::poll_slice(short events, Clock::time_point deadline) {
  zmq::pollitem_t item{socket.handle(), 0, events, 0};
  try {
    zmq::poll(&item, 1, std::min(remaining(deadline), kHandshakeCheckInterval));
  } catch (const zmq::error_t& e) {
    if (e.num() != EINTR) return Status(ErrorCode::kUnavailable, std::string("poll: ") + e.what());
  }
  if (item.revents & events) return true;
  monitor->pump();
  RD_RETURN_IF_ERROR(monitor->refusal(options.endpoint));
  return false;
}

Status Client::Impl::send_frames(const std::vector<std::string_view>& parts,
                                 Clock::time_point deadline) {
  if (parts.empty()) return Status(ErrorCode::kInvalidArgument, "a message needs at least one frame");
  // NOTES: POLLOUT means room in the socket's queue (the socket does not set
  // `immediate`: see connect()). Once the first part is accepted ZeroMQ accepts the
  // rest (multipart is atomic).
  // No live connection: wait for one (a fresh socket needs a moment, a restarted daemon one
  // reconnect interval), but not past the grace period or the deadline; a daemon that is
  // down is then reported as such.
  monitor->pump();
  if (!monitor->connected) {
    // A daemon that restarted on the same endpoint is reconnected to within one reconnect
    // interval, so a short wait is enough to tell "down" from "coming back".
    const auto give_up =
        std::min(deadline, std::max(Clock::now() + std::chrono::milliseconds(kReconnectWaitMs),
                                    connected_at + kConnectGrace));
    while (!monitor->connected && Clock::now() < give_up) {
      RD_RETURN_IF_ERROR(monitor->refusal(options.endpoint));
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - Clock::now()).count();
      monitor->check_event(static_cast<int>(std::clamp<int64_t>(left, 1, 50)));
    }
    RD_RETURN_IF_ERROR(monitor->refusal(options.endpoint));
    if (!monitor->connected)
      return Status(ErrorCode::kUnavailable, "no daemon at " + options.endpoint +
                                                 " is connected (not running or not reachable)");
  }
  for (;;) {
    RD_ASSIGN_OR_RETURN(const bool writable, poll_slice(ZMQ_POLLOUT, deadline));
    if (writable) {
      try {
        for (size_t i = 0; i < parts.size(); ++i) {
          auto flags = zmq::send_flags::dontwait;
          if (i + 1 < parts.size()) flags = flags | zmq::send_flags::sndmore;
          if (!socket.send(zmq::buffer(parts[i].data(), parts[i].size()), flags)) {
            if (i == 0) break;  // lost a race for the queue slot: poll again
            return Status(ErrorCode::kInternal, "ZeroMQ refused part of a multipart message");
          }
          if (i + 1 == parts.size()) return Status::Ok();
        }
      } catch (const zmq::error_t& e) {
        return Status(ErrorCode::kUnavailable, std::string("send: ") + e.what());
      }
    }
    if (Clock::now() >= deadline)
      return Status(ErrorCode::kUnavailable, "no daemon at " + options.endpoint +
                                                 " accepted the message in time (not running, "
                                                 "not reachable, or its queue is full)");
  }
}

Result<std::optional<std::vector<std::string>>> Client::Impl::recv_frames(
    Clock::time_point deadline, std::optional<uint64_t> lost_since) {
  for (;;) {
    RD_ASSIGN_OR_RETURN(const bool readable, poll_slice(ZMQ_POLLIN, deadline));
    if (!readable) {
      // Nothing queued and the daemon gone: no reply can come over this connection (a
      // daemon's replies go to the connection that carried the request). Without this a
      // request queued just before the drop was noticed waited out its whole deadline.
      if (lost_since && *lost_since < replaced_through) return lost_status();
      if (lost_since && lost(*lost_since)) {
        drop_unsent();
        return lost_status();
      }
    }
    if (readable) {
      std::vector<std::string> frames;
      try {
        zmq::message_t part;
        // All parts of a message are present once the first is.
        while (socket.recv(part, zmq::recv_flags::dontwait)) {
          frames.emplace_back(part.data<char>(), part.size());
          if (!part.more()) return std::optional<std::vector<std::string>>(std::move(frames));
        }
      } catch (const zmq::error_t& e) {
        return Status(ErrorCode::kUnavailable, std::string("recv: ") + e.what());
      }
      if (!frames.empty())
        return Status(ErrorCode::kInternal, "ZeroMQ delivered a truncated multipart message");
    }
    if (Clock::now() >= deadline) return std::optional<std::vector<std::string>>();
  }
}

Result<std::optional<DecodedIncoming>> Client::Impl::receive(Clock::time_point deadline,
                                                             std::optional<uint64_t> lost_since) {
  RD_ASSIGN_OR_RETURN(auto frames, recv_frames(deadline, lost_since));
  if (!frames) return std::optional<DecodedIncoming>();
  std::vector<Frame> payload;
  payload.reserve(frames->size() - 1);
  for (size_t i = 1; i < frames->size(); ++i) payload.push_back(as_frame((*frames)[i]));
  RD_ASSIGN_OR_RETURN(auto decoded, decode_incoming(as_frame(frames->front()), payload,
                                                    options.limits));
  return std::optional<DecodedIncoming>(std::move(decoded));
}

Status Client::Impl::send_request(uint64_t id, const Request& req, Clock::time_point deadline,
                                  const std::vector<std::string_view>& payload) {
  WireMessage msg = encode_request(id, req);
  std::vector<std::string_view> parts{msg.envelope};
  for (const auto& f : msg.frames) parts.emplace_back(f);
  parts.insert(parts.end(), payload.begin(), payload.end());
  return send_frames(parts, deadline);
}

void Client::Impl::enqueue(Event event) {
  if (auto it = abandoned.find(event_rid(event)); it != abandoned.end()) {
    if (is_final(event)) abandoned.erase(it);
    return;
  }
  events.push_back(std::move(event));
}

void Client::Impl::abandon(const std::string& rid) {
  // Events already queued for the request go; later ones are dropped on arrival.
  std::erase_if(events, [&](const Event& e) { return event_rid(e) == rid; });
  abandoned.insert(rid);
  AbortRequest abort;
  abort.rid = rid;
  // Best effort: if even this cannot be sent the daemon is gone with the request.
  (void)send_request(next_id++, abort, deadline_after(kLingerMs));
}

template <class Reply>
Result<Reply> Client::Impl::call(const Request& req, Clock::time_point deadline,
                                 bool* unanswered, const std::vector<std::string_view>& payload) {
  const uint64_t id = next_id++;
  if (unanswered) *unanswered = false;
  monitor->pump();
  const uint64_t since = monitor->disconnects;
  RD_RETURN_IF_ERROR(send_request(id, req, deadline, payload));
  if (unanswered) *unanswered = true;
  for (;;) {
    RD_ASSIGN_OR_RETURN(auto incoming, receive(deadline, since));
    if (!incoming)
      return Status(ErrorCode::kDeadlineExceeded,
                    "no reply to '" + std::string(request_type_name(req)) + "' (id " +
                        std::to_string(id) + ") from " + options.endpoint + " in time");
    auto& msg = incoming->msg;
    if (auto event = take_event(msg)) {
      enqueue(std::move(*event));
      continue;
    }
    // A reply with another id answers a call that already gave up waiting.
    if (incoming->env.id != id) continue;
    if (unanswered) *unanswered = false;
    if (auto* err = std::get_if<ErrorInfo>(&msg)) return status_from_error(*err);
    if (auto* reply = std::get_if<Reply>(&msg)) return std::move(*reply);
    return Status(ErrorCode::kBadMessage,
                  "reply of type '" + incoming->env.type + "' does not answer '" +
                      std::string(request_type_name(req)) + "'",
                  "type");
  }
}

// ------------------------------------------------------------------ Client --

Result<std::unique_ptr<Client>> Client::connect(const ClientOptions& options) {
  if (options.request_timeout_ms <= 0)
    return Status(ErrorCode::kInvalidArgument, "request_timeout_ms must be positive",
                  "request_timeout_ms");
  RD_RETURN_IF_ERROR(validate_curve_client_keys(options.curve));
  auto impl = std::make_unique<Impl>(options);
  RD_ASSIGN_OR_RETURN(auto opened, open_connection(options));
  impl->socket = std::move(opened.socket);
  impl->monitor = std::move(opened.monitor);
  impl->connected_at = Clock::now();
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

bool Client::unreachable() {
  impl_->monitor->pump();
  return !impl_->monitor->connected && Clock::now() >= impl_->connected_at + kConnectGrace;
}
Client::~Client() = default;

Result<HelloReply> Client::hello(const std::string& client_name) {
  HelloRequest req{client_name, {kProtocolVersion}};
  RD_ASSIGN_OR_RETURN(HelloReply reply,
                      impl_->call<HelloReply>(req, deadline_after(impl_->options.request_timeout_ms)));
  if (reply.version != kProtocolVersion)
    return Status(ErrorCode::kUnsupportedVersion,
                  "daemon chose protocol version " + std::to_string(reply.version) +
                      ", this client speaks " + std::to_string(kProtocolVersion),
                  "body.version");
  return reply;
}

Result<StatusReply> Client::status() {
  return impl_->call<StatusReply>(StatusRequest{},
                                  deadline_after(impl_->options.request_timeout_ms));
}

Result<GenerateReply> Client::submit(const GenerateRequest& req) {
  if (!req.rid.empty())
    return impl_->call<GenerateReply>(req, deadline_after(impl_->options.request_timeout_ms));
  GenerateRequest named = req;
  named.rid = random_rid();
  return impl_->call<GenerateReply>(named, deadline_after(impl_->options.request_timeout_ms));
}

Result<AbortReply> Client::abort(const std::string& rid) {
  AbortRequest req;
  req.rid = rid;
  return impl_->call<AbortReply>(req, deadline_after(impl_->options.request_timeout_ms));
}

Result<AbortReply> Client::abort_all() {
  AbortRequest req;
  req.all = true;
  return impl_->call<AbortReply>(req, deadline_after(impl_->options.request_timeout_ms));
}

Result<ShutdownReply> Client::shutdown(bool drain, double deadline_s) {
  return impl_->call<ShutdownReply>(ShutdownRequest{drain, deadline_s},
                                    deadline_after(impl_->options.request_timeout_ms));
}

Result<BeginWeightUpdateReply> Client::begin_weight_update(
    std::optional<std::vector<std::string>> selector, double timeout_s) {
  return impl_->call<BeginWeightUpdateReply>(
      BeginWeightUpdateRequest{std::move(selector), timeout_s});
}

Result<UpdateWeightsReply> Client::update_weights_inline(uint64_t session,
                                                         std::vector<BucketEntry> entries,
                                                         std::string_view payload,
                                                         std::optional<uint32_t> checksum) {
  UpdateWeightsRequest req;
  req.session = session;
  req.entries = std::move(entries);
  req.source = InlineSource{0};
  if (checksum) req.checksum = BucketChecksum{"crc32", *checksum};
  return impl_->call<UpdateWeightsReply>(
      req, deadline_after(impl_->options.request_timeout_ms), nullptr, {payload});
}

Result<UpdateWeightsReply> Client::update_weights_shm(uint64_t session,
                                                      std::vector<BucketEntry> entries,
                                                      const std::string& shm_name, uint64_t offset,
                                                      uint64_t size,
                                                      std::optional<uint32_t> checksum) {
  UpdateWeightsRequest req;
  req.session = session;
  req.entries = std::move(entries);
  req.source = ShmSource{shm_name, offset, size};
  if (checksum) req.checksum = BucketChecksum{"crc32", *checksum};
  return impl_->call<UpdateWeightsReply>(req);
}

Result<EndWeightUpdateReply> Client::end_weight_update(uint64_t session, uint64_t weight_version) {
  return impl_->call<EndWeightUpdateReply>(EndWeightUpdateRequest{session, weight_version});
}

Result<AbortWeightUpdateReply> Client::abort_weight_update(uint64_t session) {
  return impl_->call<AbortWeightUpdateReply>(AbortWeightUpdateRequest{session});
}

Result<GetWeightsByNameReply> Client::get_weights_by_name(const std::string& name,
                                                          uint32_t truncate) {
  return impl_->call<GetWeightsByNameReply>(GetWeightsByNameRequest{name, truncate});
}

Result<WeightsChecksumReply> Client::weights_checksum(
    std::optional<std::vector<std::string>> names) {
  return impl_->call<WeightsChecksumReply>(WeightsChecksumRequest{std::move(names)});
}

Result<PauseGenerationReply> Client::pause_generation(PauseMode mode) {
  return impl_->call<PauseGenerationReply>(PauseGenerationRequest{mode});
}

Result<ContinueGenerationReply> Client::continue_generation() {
  return impl_->call<ContinueGenerationReply>(ContinueGenerationRequest{});
}

Result<ReleaseMemoryReply> Client::release_memory(std::optional<std::vector<std::string>> tags) {
  return impl_->call<ReleaseMemoryReply>(ReleaseMemoryRequest{std::move(tags)});
}

Result<ResumeMemoryReply> Client::resume_memory(std::optional<std::vector<std::string>> tags) {
  return impl_->call<ResumeMemoryReply>(ResumeMemoryRequest{std::move(tags)});
}

Result<InitWeightGroupReply> Client::init_weight_group(const std::string& group,
                                                       const std::string& unique_id,
                                                       uint32_t world_size, uint32_t rank,
                                                       uint32_t root, uint32_t nccl_version,
                                                       double timeout_s) {
  InitWeightGroupRequest req{group, unique_id, world_size, rank, root, nccl_version, timeout_s};
  // The daemon answers when it has joined or given up (after timeout_s): wait past that,
  // with slack for the reply itself, so a slow join is reported by the daemon, not guessed.
  const double join_ms = std::isfinite(timeout_s) ? std::clamp(timeout_s, 0.0, 3600.0) * 1000.0 : 0.0;
  const int wait_ms = std::max(impl_->options.request_timeout_ms, static_cast<int>(join_ms) + 5000);
  return impl_->call<InitWeightGroupReply>(req, deadline_after(wait_ms));
}

Result<DestroyWeightGroupReply> Client::destroy_weight_group(const std::string& group) {
  return impl_->call<DestroyWeightGroupReply>(DestroyWeightGroupRequest{group});
}

Result<UpdateWeightsReply> Client::update_weights_nccl(uint64_t session,
                                                       std::vector<BucketEntry> entries,
                                                       const std::string& group, uint32_t root,
                                                       uint64_t size,
                                                       std::optional<uint32_t> checksum) {
  UpdateWeightsRequest req;
  req.session = session;
  req.entries = std::move(entries);
  req.source = NcclSource{group, root, size};
  if (checksum) req.checksum = BucketChecksum{"crc32", *checksum};
  return impl_->call<UpdateWeightsReply>(req);
}

Result<UpdateWeightsReply> Client::update_weights_cuda_ipc(
    uint64_t session, std::vector<BucketEntry> entries, const std::string& handle,
    uint64_t offset, uint64_t size, const std::string& device_uuid,
    std::optional<uint32_t> checksum) {
  UpdateWeightsRequest req;
  req.session = session;
  req.entries = std::move(entries);
  req.source = CudaIpcSource{handle, offset, size, device_uuid};
  if (checksum) req.checksum = BucketChecksum{"crc32", *checksum};
  return impl_->call<UpdateWeightsReply>(req);
}

Result<std::optional<Event>> Client::next_event(int timeout_ms) {
  const auto deadline = deadline_after(timeout_ms);
  while (impl_->events.empty()) {
    RD_ASSIGN_OR_RETURN(auto incoming, impl_->receive(deadline));
    if (!incoming) return std::optional<Event>();
    // Anything but an event is a reply to a call that gave up waiting.
    if (auto event = take_event(incoming->msg)) impl_->enqueue(std::move(*event));
  }
  Event event = std::move(impl_->events.front());
  impl_->events.pop_front();
  return std::optional<Event>(std::move(event));
}

Result<GenerateResult> Client::generate(const GenerateRequest& req, int timeout_ms) {
  const auto deadline = deadline_after(timeout_ms);
  GenerateRequest named = req;
  if (named.rid.empty()) named.rid = random_rid();
  const auto reply_deadline =
      std::min(deadline, deadline_after(impl_->options.request_timeout_ms));
  bool unanswered = false;
  // Events come over the connection that carried the request: if it is lost, so are they.
  impl_->monitor->pump();
  const uint64_t since = impl_->monitor->disconnects;
  auto accepted = impl_->call<GenerateReply>(named, reply_deadline, &unanswered);
  if (!accepted.ok()) {
    // An unanswered request may still run on the daemon: abort it. A rejected one
    // must not be aborted: its rid may belong to another request in flight.
    if (unanswered) impl_->abandon(named.rid);
    return accepted.status();
  }

  GenerateResult result;
  result.rid = named.rid;
  // Folds one event into the result; true once the request has ended.
  auto apply = [&](Event& event) -> Result<bool> {
    if (auto* t = std::get_if<TokensEvent>(&event)) {
      result.token_ids.insert(result.token_ids.end(), t->token_ids.begin(), t->token_ids.end());
      result.logprobs.insert(result.logprobs.end(), t->logprobs.begin(), t->logprobs.end());
      result.weight_versions.insert(result.weight_versions.end(), t->weight_versions.begin(),
                                    t->weight_versions.end());
      // Every event with tokens carries the request's n (a daemon that predates top log-probs
      // sends none): a mismatch would misalign the per-token lists.
      if (!t->token_ids.empty() && t->top_logprobs_num != named.top_logprobs_num)
        return Status(ErrorCode::kBadMessage,
                      "tokens event with top_logprobs_num " + std::to_string(t->top_logprobs_num) + ", asked " +
                          std::to_string(named.top_logprobs_num) +
                          (t->top_logprobs_num == 0 ? " (does this daemon support top_logprobs_num?)" : ""),
                      "body.top_logprobs_num");
      result.top_logprobs_num = named.top_logprobs_num;
      result.top_token_ids.insert(result.top_token_ids.end(), t->top_token_ids.begin(), t->top_token_ids.end());
      result.top_logprobs.insert(result.top_logprobs.end(), t->top_logprobs.begin(), t->top_logprobs.end());
      if (t->routed_experts) RD_RETURN_IF_ERROR(append_routed_rows(result.routed_experts, *t->routed_experts));
      return false;
    }
    if (std::holds_alternative<RetractedEvent>(event)) {
      // The request restarts from its prompt under new weights: nothing received so
      // far stands, and its routed rows start again at routed_experts_start_len.
      result.token_ids.clear();
      result.logprobs.clear();
      result.weight_versions.clear();
      result.top_token_ids.clear();
      result.top_logprobs.clear();
      result.routed_experts.reset();
      ++result.num_retractions;
      return false;
    }
    if (auto* f = std::get_if<FinishedEvent>(&event)) result.finished = std::move(*f);
    else result.failed = std::move(std::get<FailedEvent>(event));
    return true;
  };
  auto give_up = [&](Status s) {
    impl_->abandon(named.rid);
    return s;
  };

  // Events that arrived while waiting for the reply, in order; others stay queued.
  auto& queue = impl_->events;
  for (auto it = queue.begin(); it != queue.end();) {
    if (event_rid(*it) != named.rid) { ++it; continue; }
    Event event = std::move(*it);
    it = queue.erase(it);
    auto done = apply(event);
    if (!done.ok()) return give_up(done.status());
    if (*done) return result;
  }
  for (;;) {
    auto incoming = impl_->receive(deadline, since);
    if (!incoming.ok()) return give_up(incoming.status());
    if (!*incoming)
      return give_up(Status(ErrorCode::kDeadlineExceeded,
                            "request '" + named.rid + "' did not finish within " +
                                std::to_string(timeout_ms) + " ms; aborted it",
                            "rid"));
    std::optional<Event> received = take_event((*incoming)->msg);
    if (!received) continue;  // a late reply to a call that gave up
    Event& event = *received;
    if (event_rid(event) != named.rid) {
      impl_->enqueue(std::move(event));
      continue;
    }
    auto done = apply(event);
    if (!done.ok()) return give_up(done.status());
    if (*done) return result;
  }
}

Status Client::send_raw(const std::vector<std::string>& frames) {
  return send_raw(frames, impl_->options.request_timeout_ms);
}

Status Client::send_raw(const std::vector<std::string>& frames, int timeout_ms) {
  std::vector<std::string_view> parts(frames.begin(), frames.end());
  return impl_->send_frames(parts, deadline_after(timeout_ms));
}

Status Client::send_raw_views(const std::vector<std::string_view>& frames, int timeout_ms) {
  return impl_->send_frames(frames, deadline_after(timeout_ms));
}

Result<std::optional<std::vector<std::string>>> Client::recv_raw(int timeout_ms,
                                                                 std::optional<uint64_t> lost_since) {
  return impl_->recv_frames(deadline_after(timeout_ms), lost_since);
}

uint64_t Client::disconnects() {
  impl_->monitor->pump();
  return impl_->monitor->disconnects;
}

}  // namespace rolloutd::protocol
