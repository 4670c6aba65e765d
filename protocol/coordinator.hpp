#pragma once
// A trainer-side coordinator over many daemons: the C++ twin of rolloutd.Coordinator
// (protocol/python/rolloutd/coordinator.py).
//
// One thread per daemon owns that daemon's Clients (a Client is single-threaded) and does all
// that touches them: commands from callers (submit, abort, weight-update steps), a heartbeat
// (`status` on a second connection with a short deadline), and pumping the daemon's events
// into one fan-in queue that next_event() reads. Every wait has a deadline.
//
// Nothing is lost silently: every request submitted here ends with exactly one final event
// (finished or failed). When a daemon dies (no heartbeat reply for dead_after_ms) or restarts
// (its uptime starts again), each request it held ends with failed{unavailable}, or, with
// resubmit, runs again on another ready daemon under the same rid after a retracted event
// (reason "daemon_lost") that voids what it had produced. Later events of the lost connection
// are dropped and counted.
//
// Health here is the control-plane heartbeat (`status`: state, ready, reason: what /readyz
// reports too); the Python coordinator also polls HTTP /readyz and /v1/status.
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/status.hpp"
#include "protocol/curve.hpp"
#include "protocol/messages.hpp"

namespace rolloutd::protocol {

struct DaemonEndpoint {
  std::string control;  // "tcp://host:7600"
  std::string name;     // in reports; the control endpoint when empty
  const std::string& key() const { return name.empty() ? control : name; }
};

// The daemons in a launch-node.sh endpoints file ({"host", "daemons": [{index, state,
// control, ...}]}, named "host/index"; failed or exited ones left out) or in a daemon's own
// --endpoints-file ({"control", ...}).
Result<std::vector<DaemonEndpoint>> load_endpoints_file(const std::string& path);

struct CoordinatorOptions {
  int request_timeout_ms = 30000;     // each reply (submit, weight steps, ...)
  int heartbeat_interval_ms = 1000;
  int heartbeat_timeout_ms = 2000;    // a status reply slower than this is a missed heartbeat
  int dead_after_ms = 5000;           // no heartbeat reply this long: the daemon's requests are lost
  // A request with no event this long, while its daemon generates nothing (its heartbeats show
  // no new tokens), is aborted and failed (0: never).
  int request_idle_timeout_ms = 600000;
  bool resubmit = false;              // run a lost daemon's requests again elsewhere
  uint32_t max_resubmits = 2;
  bool exclude_stale = true;          // route only to daemons at the fleet's weight version
  int poll_interval_ms = 20;          // how long a worker waits for events between commands
  double restart_slack_s = 0.5;       // start-time jitter tolerated before calling it a restart
  std::string client_name = "rolloutd-cpp-coordinator";
  // CURVE keys for every daemon's control socket (SPEC §1.2): one fleet key pair is the usual
  // setup. A daemon that refuses them is reported with state "unreachable" and an
  // `unauthenticated` reason.
  CurveClientKeys curve;
};

struct DaemonHealth {
  size_t index = 0;
  std::string name;
  std::string control;
  // connecting | ready | updating | not_ready | draining | starting | unreachable | lost
  std::string state = "connecting";
  bool ready = false;
  bool routable = false;  // ready and not stale: submit() may pick it
  bool stale = false;     // weight version below the fleet's
  std::string reason;
  uint64_t weight_version = 0;
  uint64_t outstanding_requests = 0;
  uint64_t outstanding_tokens = 0;  // prompt + max_new_tokens not yet produced
  uint32_t incarnation = 0;         // bumps on each detected loss or restart
  uint32_t num_lost = 0;
};

// One event of any daemon, with the daemon's name (empty for events the coordinator made).
struct FleetEvent {
  std::string daemon;
  Event event;
};

// One bucket of a weight update: a flat buffer and its table (SPEC §11.2), sent inline.
struct WeightBucket {
  std::vector<BucketEntry> entries;
  std::string payload;
  std::optional<uint32_t> checksum;  // crc32 of payload
};

struct FleetWeightUpdate {
  uint64_t weight_version = 0;
  std::map<std::string, EndWeightUpdateReply> completed;
  std::map<std::string, Status> failed;        // began (or tried to) and did not end
  std::map<std::string, std::string> skipped;  // not reachable: never asked
  bool ok() const { return failed.empty() && skipped.empty() && !completed.empty(); }
};

class Coordinator {
 public:
  static Result<std::unique_ptr<Coordinator>> create(std::vector<DaemonEndpoint> endpoints,
                                                     CoordinatorOptions options = {});
  ~Coordinator();  // stops the worker threads (each within its current call's deadline)
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  std::vector<DaemonHealth> daemons() const;
  // Until `n` daemons (0: all) are routable; kDeadlineExceeded after timeout_ms.
  Status wait_ready(size_t n, int timeout_ms);

  // Submits to the routable daemon with the fewest outstanding tokens (or to `daemon`, by
  // name). A daemon refusing for a passing reason (draining, not ready, overloaded,
  // unreachable) is skipped for another. An empty rid gets a random one. Returns the rid.
  Result<std::string> submit(GenerateRequest req, const std::string& daemon = "");
  // The next event of any request submitted here; nullopt after timeout_ms.
  std::optional<FleetEvent> next_event(int timeout_ms);
  // Aborts one request (its finished{abort} follows); ok if it was not in flight.
  Status abort(const std::string& rid);
  size_t num_outstanding() const;
  std::optional<std::string> daemon_of(const std::string& rid) const;
  uint64_t num_dropped_events() const;

  // One weight update on every reachable daemon: (pause,) begin on all, each bucket to all
  // (one buffer, sent to every daemon in parallel), end(weight_version) on all (, continue).
  // A daemon failing a step is dropped from the rest, its session aborted, and reported in
  // .failed; unreachable ones in .skipped. One already serving a version above weight_version
  // is dropped right after begin (invalid_argument, nothing written). Buckets are shared, not
  // copied: a step that gave up on a slow daemon may still be sending from them.
  FleetWeightUpdate push_weights(const std::vector<std::shared_ptr<const WeightBucket>>& buckets,
                                 uint64_t weight_version,
                                 std::optional<PauseMode> pause = std::nullopt, double session_timeout_s = 60.0);
  // The version the last push completed (nullopt before any); daemons below it are stale.
  std::optional<uint64_t> weight_version() const;

  struct Impl;

 private:
  explicit Coordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rolloutd::protocol
