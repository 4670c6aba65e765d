#pragma once
// The C++ client of one daemon: a ZeroMQ DEALER on the daemon's control socket.
// Replies and events share the connection; events that arrive while a call
// waits for its reply are queued and handed out by next_event(). Every call has
// a deadline. The pybind11 module (protocol/python/native.cpp) exposes the raw
// transport to the Python package, which speaks msgpack itself.
//
// Not thread-safe: one thread per Client (as ZeroMQ sockets require).
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/status.hpp"
#include "protocol/codec.hpp"
#include "protocol/messages.hpp"

namespace rolloutd::protocol {

struct ClientOptions {
  std::string endpoint;             // "tcp://127.0.0.1:7600"
  int request_timeout_ms = 30000;   // deadline for each reply
  int send_hwm = 1000;
  int recv_hwm = 100000;
  Limits limits;                    // applied to what the daemon sends
};

// Everything one generate produced, collected by Client::generate().
struct GenerateResult {
  std::string rid;
  std::vector<int32_t> token_ids;
  std::vector<double> logprobs;
  std::vector<uint64_t> weight_versions;
  // Concatenated routed-expert rows [num_tokens, num_layers, top_k] (raw little-endian).
  std::optional<RoutedExperts> routed_experts;
  std::optional<FinishedEvent> finished;  // exactly one of finished / failed
  std::optional<FailedEvent> failed;
};

class Client {
 public:
  static Result<std::unique_ptr<Client>> connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // ---- typed calls (each waits for its reply, bounded by request_timeout_ms) ----
  Result<HelloReply> hello(const std::string& client_name = "rolloutd-cpp");
  Result<StatusReply> status();
  // Accepted; events follow. An empty req.rid is replaced by a random one (the reply carries it).
  Result<GenerateReply> submit(const GenerateRequest& req);
  Result<AbortReply> abort(const std::string& rid);
  Result<AbortReply> abort_all();
  Result<ShutdownReply> shutdown(bool drain = true, double deadline_s = 30.0);

  // Next event for any submitted request; nullopt when none arrived within timeout_ms.
  Result<std::optional<Event>> next_event(int timeout_ms);
  // submit + collect events until the final one (bounded by timeout_ms overall).
  // Events of other requests stay queued for next_event(). On a timeout the
  // request is aborted and its later events are dropped.
  Result<GenerateResult> generate(const GenerateRequest& req, int timeout_ms = 120000);

  // ---- raw transport (used by the Python package and the bad-input tests) ----
  // Waits up to request_timeout_ms (or timeout_ms) for a connected daemon to take
  // the message; kUnavailable when none does.
  Status send_raw(const std::vector<std::string>& frames);
  Status send_raw(const std::vector<std::string>& frames, int timeout_ms);
  // nullopt on timeout. Returns every frame of one message.
  Result<std::optional<std::vector<std::string>>> recv_raw(int timeout_ms);

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rolloutd::protocol
