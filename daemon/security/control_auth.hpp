#pragma once
// Who may use the control socket (SPEC §1.2). Anyone who can send to it can push weights,
// abort every request or shut the daemon down, so:
//
// - with a key pair (--curve-key-file, or ROLLOUTD_CURVE_SECRET_KEY) the socket is a CURVE
//   server: traffic is encrypted, and a ZAP handler (ZeroMQ RFC 27) accepts a connection only
//   when the client proves a public key listed in --curve-allow. A plain client, or one whose
//   key is not listed, never gets a message through; each refusal is counted in
//   rolloutd_auth_denied_total{reason} and logged (rate-limited);
// - without keys the socket binds loopback only, unless the operator says
//   --insecure-bind-any (validate() in config.cpp refuses the rest with exit 64).
//
// NOTES: a CURVE server whose context has no ZAP handler accepts *every* client key (libzmq
// skips authentication when inproc://zeromq.zap.01 is not bound). So the handler binds before
// the control socket does, and stays bound until after it is closed; if its thread ever
// stopped answering, handshakes would time out (fail closed), never pass unchecked.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "daemon/config.hpp"
#include "kernels/status.hpp"
#include "protocol/curve.hpp"

namespace prometheus {
class Counter;
}

namespace rolloutd::obs {
class Metrics;
}

namespace rolloutd::daemon {

inline constexpr size_t kMaxAllowedClients = 65536;
// The ZAP domain the control socket asks about; the handler answers for no other.
inline constexpr std::string_view kControlZapDomain = "rolloutd-control";

struct AllowedClient {
  std::string key;   // 32 raw bytes
  std::string name;  // where it came from, for logs: "trainer.key", "clients.txt:3"
};

// Client public keys from a file (one per line: a bare Z85 key or `public-key = "..."`;
// `#` starts a comment) or from a directory of public certificates (every `*.key` in it:
// what `rolloutctl keygen` and pyzmq's zmq.auth.create_certificates write, and what
// zmq.auth.load_certificates reads). A secret key found there is an error: it belongs
// with its owner only. Duplicates are allowed (the same key under two names).
Result<std::vector<AllowedClient>> load_client_allowlist(const std::string& path);

// The control socket's security, decided once at start-up.
struct ControlSecurity {
  bool curve = false;
  protocol::CurveKeyPair server;        // with curve: the daemon's key pair
  std::vector<AllowedClient> allowed;   // with curve: who may connect
  bool insecure_bind_any = false;
  // For the start-up log, /v1/status and the endpoints file; never the secret key.
  nlohmann::json describe() const;
};

// Loads the daemon's key pair and the allowlist named by the configuration (after
// validate()). Errors are usage errors: a missing or malformed key file, an empty allowlist,
// a libzmq without CURVE.
Result<ControlSecurity> load_control_security(const DaemonConfig& config);

// The ZAP handler and handshake watcher of the control socket, on a thread of its own. Every
// wait in it is bounded (it polls in 100 ms slices and checks for stop).
class CurveAuthenticator {
 public:
  // Binds inproc://zeromq.zap.01 in `ctx` (refused if another handler holds it). The
  // handler thread starts in secure().
  static Result<std::unique_ptr<CurveAuthenticator>> create(zmq::context_t& ctx, const ControlSecurity& security,
                                                            obs::Metrics& metrics);
  // Stops the thread (within one poll slice) and closes the handler's sockets. Destroy it
  // only after the socket it secures is closed.
  ~CurveAuthenticator();
  CurveAuthenticator(const CurveAuthenticator&) = delete;
  CurveAuthenticator& operator=(const CurveAuthenticator&) = delete;

  // Makes `router` a CURVE server with the daemon's key pair and this handler's domain,
  // watches its handshakes, and starts the handler thread. Call before `router` binds.
  Status secure(zmq::socket_t& router);

  size_t num_allowed() const { return num_allowed_; }
  uint64_t num_accepted() const { return accepted_.load(); }
  uint64_t num_denied() const { return denied_.load(); }

 private:
  CurveAuthenticator(zmq::context_t& ctx, const ControlSecurity& security, obs::Metrics& metrics);
  void run();
  void handle_zap_request();
  void handle_monitor_event();
  void deny(std::string_view reason, const nlohmann::json& fields);

  zmq::context_t& ctx_;
  const protocol::CurveKeyPair server_;
  std::unordered_map<std::string, std::string> allowed_;  // raw key -> name
  const size_t num_allowed_;
  zmq::socket_t zap_;      // REP on inproc://zeromq.zap.01
  zmq::socket_t monitor_;  // PAIR: the control socket's handshake events
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> denied_{0};
  // Series of rolloutd_auth_denied_total{reason} and rolloutd_auth_accepted_total.
  std::unordered_map<std::string, prometheus::Counter*> denied_counters_;
  prometheus::Counter* accepted_counter_ = nullptr;
  // Refusals are logged at most once per kLogInterval (a client retrying in a loop would
  // otherwise flood the log); the next line says how many were not logged.
  std::chrono::steady_clock::time_point last_denial_log_{};
  uint64_t denials_not_logged_ = 0;
};

}  // namespace rolloutd::daemon
