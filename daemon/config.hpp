#pragma once
// The daemon's settings: one registry, read once at start-up and printed as one
// log line. Precedence: command-line flag, then ROLLOUTD_* environment variable,
// then the default (NCCL_PARAM's habit).
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/status.hpp"
#include "protocol/messages.hpp"

namespace rolloutd::daemon {

struct DaemonConfig {
  // Network. Loopback by default: a daemon is reachable from other hosts only when the
  // operator says so.
  std::string bind_address = "127.0.0.1";
  int control_port = 7600;            // 0: ephemeral (see endpoints_file)
  std::string http_bind_address = "127.0.0.1";
  int http_port = 7700;               // 0: ephemeral
  std::string endpoints_file;         // JSON {control, http, pid, gpu} written once bound

  // Model and device.
  std::string model = "embedded:tiny-moe";
  uint64_t model_seed = 20261130;
  std::string device = "cpu";         // "cpu" | "cuda"
  int gpu = -1;                       // CUDA ordinal; -1 with --device cpu

  // Engine.
  int max_running = 64;
  int max_waiting = 4096;
  int max_step_tokens = 512;
  int kv_blocks = 2048;
  int kv_block_size = 16;
  int max_blocks_per_seq = 256;

  // Protocol bounds (the hello reply reports them).
  protocol::Limits limits;

  // Weight updates.
  std::string shm_prefix = "/rolloutd";  // update_weights reads only shm objects named so

  // Streams and lifecycle.
  int outbox_limit = 65536;           // undelivered messages per client before its requests abort
  double drain_timeout_s = 30.0;      // SIGTERM: finish in-flight requests for at most this long
  double flush_timeout_s = 5.0;       // then deliver their final events for at most this long
  double stale_heartbeat_s = 10.0;    // /livez fails when an actor loop stalls this long
  std::string log_level = "info";
};

struct ParseOutcome {
  DaemonConfig config;
  bool exit_now = false;  // --help / --version were printed (exit_code 0) or parsing failed
  int exit_code = 0;
};

// Parses argv and the environment. Usage errors print CLI11's message and set exit_code 64.
ParseOutcome parse_config(int argc, const char* const* argv);
// Semantic checks beyond what the parser enforces (port ranges, device/gpu agreement, ...).
Status validate(const DaemonConfig& c);
nlohmann::json to_json(const DaemonConfig& c);

}  // namespace rolloutd::daemon
