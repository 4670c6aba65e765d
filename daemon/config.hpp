#pragma once
// The daemon's settings: one registry, read once at start-up and printed as one
// log line. Precedence: command-line flag, then ROLLOUTD_* environment variable,
// then the default (NCCL_PARAM's habit).
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/dtype.hpp"
#include "kernels/status.hpp"
#include "protocol/messages.hpp"

namespace rolloutd::daemon {

struct DaemonConfig {
  // Network. Loopback by default: a daemon is reachable from other hosts only when the
  // operator says so.
  std::string bind_address = "127.0.0.1";
  int control_port = 7600;            // 0: ephemeral (see endpoints_file); else base + local_index
  std::string http_bind_address = "127.0.0.1";
  int http_port = 7700;               // 0: ephemeral; else base + local_index
  std::string endpoints_file;         // JSON {control, http, pid, gpu} written once bound

  // Control-plane security (SPEC §1.2, daemon/security/control_auth.hpp). With a key pair the
  // control socket is a CURVE server that accepts only the client keys in curve_allow; without
  // one it binds loopback only, unless insecure_bind_any.
  std::string curve_key_file;         // the daemon's secret certificate (rolloutctl keygen)
  std::string curve_secret_key;       // or the Z85 secret itself, from ROLLOUTD_CURVE_SECRET_KEY only; never logged
  std::string curve_allow;            // client public keys: a file, or a directory of *.key certificates
  bool insecure_bind_any = false;     // without keys, allow a non-loopback --bind

  // Model and device.
  std::string model = "embedded:tiny-moe";
  uint64_t model_seed = 20261130;
  // Routed experts of a checkpoint: "none" (as the checkpoint has them) or "mxfp4" (qwen3_moe:
  // quantized on load and on every weight update; gpt_oss published as MXFP4: already so).
  std::string quantize_experts = "none";
  // Dense projections (attention q/k/v/o, LM head) on CUDA: auto = BF16 when the checkpoint's are
  // BF16 (ModelConfig::dense_bf16), float32 = FP32 whatever the checkpoint. The CPU is FP32.
  std::string dense_dtype = "auto";
  // K and V caches: auto = bfloat16 on CUDA when the dense projections are BF16 (after
  // dense_dtype), else float32; float32 or bfloat16 as asked on either backend.
  std::string kv_cache_dtype = "auto";
  std::string device = "cpu";         // "cpu" | "cuda" | "auto" (resolve_placement picks one)
  int gpu = -1;                       // CUDA ordinal; -1 with --device cpu, or "pick" before resolve_placement
  // This daemon's index among the daemons of its node: added to non-zero ports and, with
  // --device cuda and no --gpu, the CUDA ordinal. -1: SLURM_LOCALID, else LOCAL_RANK, else 0.
  int local_index = -1;

  // Engine.
  int max_running = 64;
  int max_waiting = 4096;
  int max_step_tokens = 512;
  // Decode steps of up to this many requests replay CUDA graphs (padded to 1, 2, 4, ... this);
  // 0: off; -1: max_running on CUDA, off on the CPU.
  int cuda_graph_max_batch = -1;
  int kv_blocks = 2048;
  // KV cache memory budget in bytes; > 0: the blocks it holds at the model's shape and the cache
  // dtype (kv_blocks_for_budget) replace kv_blocks.
  uint64_t kv_cache_bytes = 0;
  int kv_block_size = 16;
  int max_blocks_per_seq = 256;
  // Keep full KV blocks for requests that start with the same tokens (core::PrefixCache). On
  // by default (--no-prefix-cache turns it off); parse_config turns it off for --sliding-kv-pool
  // unless it was asked for, which validate() then refuses.
  bool prefix_cache = true;
  // Set by parse_config where --sliding-kv-pool turned the default cache off: a model without
  // sliding-window layers (no pool) keeps the cache after all.
  bool prefix_cache_off_for_pool = false;
  // A model with sliding-window layers keeps their KV in a pool of its own, sized to every
  // running request's window (StepLimits::num_sliding_kv_blocks): the KV budget then holds the
  // full-attention layers' context only. Turns the default prefix cache off (parse_config);
  // validate() refuses it with a prefix cache asked for.
  bool sliding_kv_pool = false;

  // Protocol bounds (the hello reply reports them).
  protocol::Limits limits;

  // Weight updates.
  std::string shm_prefix = "/rolloutd";  // update_weights reads only shm objects named so
  uint64_t max_shm_bucket_bytes = uint64_t{8} << 30;  // largest shm bucket staged (bounded before allocating)
  int64_t synthetic_param_bytes = 0;      // benchmarks: extra BF16 `synthetic.{i}.weight` parameters
  int64_t synthetic_small_params = 0;     // benchmarks: BF16 `synthetic_small.{i}.weight` of 1024 elements
  int64_t synthetic_mxfp4_bytes = 0;      // benchmarks: BF16 bytes of `synthetic_mx.{i}.weight`, quantized to MXFP4
  int64_t synthetic_fp8_bytes = 0;        // benchmarks: BF16 bytes of `synthetic_fp8.{i}.weight`, quantized to FP8
  // weights_checksum reads back and CRCs parameters for at most this long per turn of the engine
  // loop (at least one parameter a turn), so steps, aborts and deadlines go on between turns.
  double checksum_slice_ms = 10.0;

  // Streams and lifecycle.
  int outbox_limit = 65536;           // undelivered messages per client before its requests abort
  int stream_interval = 1;            // tokens per streamed `tokens` event (fewer events for the client)
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

// Parses argv and the environment, then resolve_placement (getenv, and the visible CUDA
// devices when --device auto). Usage errors print a message and set exit_code 64.
ParseOutcome parse_config(int argc, const char* const* argv);

// How resolve_placement reads the environment: getenv in the daemon, a map in tests.
using EnvLookup = std::function<std::optional<std::string>(std::string_view name)>;
EnvLookup process_env();

// Where a daemon runs on its node, resolved once after parsing:
// - local_index (if -1): SLURM_LOCALID, else LOCAL_RANK, else 0;
// - device "auto": "cuda" when num_visible_gpus > 0, else "cpu" (and gpu -1);
// - with "cuda" and gpu -1: 0 if CUDA_VISIBLE_DEVICES names exactly one device (Slurm's
//   --gpus-per-task=1, a Kubernetes GPU container), else local_index;
// - non-zero ports become base + local_index.
// Errors (a malformed SLURM_LOCALID, a port past 65535) are usage errors.
Status resolve_placement(DaemonConfig& c, int num_visible_gpus, const EnvLookup& env);
// Semantic checks beyond what the parser enforces (port ranges, device/gpu agreement, ...).
Status validate(const DaemonConfig& c);
// The K/V cache element type for --kv-cache-dtype (one validate() admits): float32 -> kF32,
// bfloat16 -> kBF16, auto -> kBF16 when the daemon runs on CUDA and the model's dense projections
// are BF16 (ModelConfig::dense_bf16 after --dense-dtype), else kF32: a model computed in FP32
// (the CPU, the embedded model, --dense-dtype float32) keeps FP32 K/V unless asked otherwise.
DType resolve_kv_cache_dtype(std::string_view flag, bool cuda, bool dense_bf16);
// The KV blocks a --kv-cache-bytes budget holds: budget / bytes_per_block (every layer's K and V
// of one block), at most 2^24; kInvalidArgument (field kv_cache_bytes, with the figures) when that
// is fewer than max_blocks_per_seq (one request at its longest would not fit).
Result<int64_t> kv_blocks_for_budget(uint64_t budget, int64_t bytes_per_block, int64_t max_blocks_per_seq);
nlohmann::json to_json(const DaemonConfig& c);
// 127.0.0.0/8, ::1 (bracketed or not) and "localhost": addresses only this host can reach.
bool is_loopback_address(std::string_view address);
// The literal a listening socket binds for an accepted --bind / --http-bind value: "localhost"
// is 127.0.0.1 (ZeroMQ and Boost.Asio take literals, and the daemon binds one address), "[::1]"
// loses its brackets; anything else is returned as it is.
std::string bind_host(std::string_view address);
// An IPv6 literal (after bind_host): ZeroMQ needs its ipv6 option, and endpoints need brackets.
bool is_ipv6_literal(std::string_view host);
// `host` as it goes into a tcp:// or http:// endpoint: IPv6 literals in brackets.
std::string endpoint_host(std::string_view host);

}  // namespace rolloutd::daemon
