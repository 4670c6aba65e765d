#include "daemon/config.hpp"

#include <filesystem>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <iostream>

#include <CLI/CLI.hpp>

#include "build_info.hpp"
#include "kernels/backend.hpp"

namespace rolloutd::daemon {

ParseOutcome parse_config(int argc, const char* const* argv) {
  ParseOutcome out;
  DaemonConfig& c = out.config;
  CLI::App app{"rolloutd: per-GPU rollout worker daemon for RL on MoE language models"};
  app.set_version_flag("--version", std::string(build::kVersion));
  app.option_defaults()->always_capture_default();

  auto add = [&](const std::string& flag, auto& value, const std::string& env, const std::string& help) {
    return app.add_option(flag, value, help)->envname(env);
  };
  add("--bind", c.bind_address, "ROLLOUTD_BIND",
      "address the control socket binds (loopback by default; any other needs CURVE keys or --insecure-bind-any)");
  add("--control-port", c.control_port, "ROLLOUTD_CONTROL_PORT",
      "control socket port (0: ephemeral); the local index is added to it")
      ->check(CLI::Range(0, 65535));
  add("--http-bind", c.http_bind_address, "ROLLOUTD_HTTP_BIND", "address of the HTTP health/metrics server");
  add("--http-port", c.http_port, "ROLLOUTD_HTTP_PORT", "HTTP port (0: ephemeral); the local index is added to it")
      ->check(CLI::Range(0, 65535));
  add("--endpoints-file", c.endpoints_file, "ROLLOUTD_ENDPOINTS_FILE",
      "write the bound endpoints as JSON to this file once listening");
  add("--curve-key-file", c.curve_key_file, "ROLLOUTD_CURVE_KEY_FILE",
      "the daemon's CURVE secret certificate (rolloutctl keygen's <name>.key_secret); the control socket "
      "then accepts only clients in --curve-allow. Or put the Z85 secret key in ROLLOUTD_CURVE_SECRET_KEY");
  add("--curve-allow", c.curve_allow, "ROLLOUTD_CURVE_ALLOW",
      "client public keys allowed on the control socket: a file (one Z85 key or public-key line each) or a "
      "directory of <name>.key certificates");
  app.add_flag("--insecure-bind-any", c.insecure_bind_any,
               "without CURVE keys, let --bind name a non-loopback address: anyone who reaches the port "
               "controls the daemon")
      ->envname("ROLLOUTD_INSECURE_BIND_ANY");
  add("--model", c.model, "ROLLOUTD_MODEL",
      "model to serve: embedded:tiny-moe, or a Hugging Face checkpoint directory (config.json + "
      "model.safetensors or model.safetensors.index.json; model_type qwen3_moe or gpt_oss)");
  add("--model-seed", c.model_seed, "ROLLOUTD_MODEL_SEED", "seed of the embedded model's weights");
  add("--quantize-experts", c.quantize_experts, "ROLLOUTD_QUANTIZE_EXPERTS",
      "routed experts of a --model checkpoint: none (as stored), or mxfp4 (qwen3_moe: BF16/FP32 experts "
      "quantized to MXFP4 on load and on every weight update; hidden and expert intermediate sizes must be "
      "multiples of 32; a gpt_oss checkpoint must already be MXFP4)")
      ->check(CLI::IsMember({"none", "mxfp4"}));
  add("--dense-dtype", c.dense_dtype, "ROLLOUTD_DENSE_DTYPE",
      "dense projections (attention q/k/v/o, LM head) on CUDA: auto (BF16 when the checkpoint's are BF16: "
      "cuBLAS BF16 GEMMs with FP32 accumulation) or float32 (FP32 GEMMs whatever the checkpoint); the CPU "
      "always computes in FP32")
      ->check(CLI::IsMember({"auto", "float32"}));
  add("--kv-cache-dtype", c.kv_cache_dtype, "ROLLOUTD_KV_CACHE_DTYPE",
      "element type of the K and V caches: auto (bfloat16 on CUDA when the dense projections are BF16, "
      "see --dense-dtype; else float32), float32, or bfloat16 (half the cache's bytes, so twice the blocks "
      "in the same memory, and half the attention's reads; each value rounded to nearest even as stored; "
      "either backend; README: where attention then multiplies in BF16)")
      ->check(CLI::IsMember({"auto", "float32", "bfloat16"}));
  add("--device", c.device, "ROLLOUTD_DEVICE", "compute backend (auto: cuda when a GPU is visible, else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  add("--gpu", c.gpu, "ROLLOUTD_GPU",
      "CUDA device ordinal (-1: 0 if CUDA_VISIBLE_DEVICES names one device, else the local index)")
      ->check(CLI::Range(-1, 1023));
  add("--local-index", c.local_index, "ROLLOUTD_LOCAL_INDEX",
      "this daemon's index on its node, added to the ports (-1: SLURM_LOCALID, else LOCAL_RANK, else 0)")
      ->check(CLI::Range(-1, 1023));
  add("--max-running", c.max_running, "ROLLOUTD_MAX_RUNNING", "requests decoding at once")
      ->check(CLI::Range(1, 4096));
  add("--max-waiting", c.max_waiting, "ROLLOUTD_MAX_WAITING", "queued requests before 'overloaded'")
      ->check(CLI::Range(1, 1 << 20));
  add("--max-step-tokens", c.max_step_tokens, "ROLLOUTD_MAX_STEP_TOKENS",
      "tokens per forward step (chunked-prefill budget)")->check(CLI::Range(1, 1 << 20));
  add("--cuda-graph-max-batch", c.cuda_graph_max_batch, "ROLLOUTD_CUDA_GRAPH_MAX_BATCH",
      "decode steps of up to this many requests replay CUDA graphs, padded to 1, 2, 4, ... this "
      "(0: off; -1: --max-running on CUDA, off on the CPU, where a value > 0 pads without graphs)")
      ->check(CLI::Range(-1, 4096));
  add("--kv-blocks", c.kv_blocks, "ROLLOUTD_KV_BLOCKS", "KV cache blocks")->check(CLI::Range(1, 1 << 24));
  add("--kv-cache-bytes", c.kv_cache_bytes, "ROLLOUTD_KV_CACHE_BYTES",
      "KV cache memory budget in bytes (0: --kv-blocks decides); > 0: the blocks it holds at the model's "
      "shape and --kv-cache-dtype replace --kv-blocks (a bfloat16 cache holds twice as many)")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 50));
  add("--kv-block-size", c.kv_block_size, "ROLLOUTD_KV_BLOCK_SIZE", "tokens per KV block")
      ->check(CLI::Range(1, 1024));
  add("--max-blocks-per-seq", c.max_blocks_per_seq, "ROLLOUTD_MAX_BLOCKS_PER_SEQ",
      "KV blocks one request may hold")->check(CLI::Range(1, 1 << 20));
  CLI::Option* prefix_cache =
      app.add_flag("--prefix-cache,!--no-prefix-cache", c.prefix_cache,
                   "on by default: keep full KV blocks after their request, keyed by their tokens and all "
                   "before them, so that requests starting with the same tokens (a prompt's n samples, a "
                   "conversation's next turn) reuse that KV and its routed-expert records instead of computing "
                   "them; cleared whenever the weights may change, evicted least recently used first when the "
                   "cache needs blocks; off with --sliding-kv-pool for a model with sliding-window layers")
          ->envname("ROLLOUTD_PREFIX_CACHE");
  app.add_flag("--sliding-kv-pool", c.sliding_kv_pool,
               "a model with sliding-window layers (gpt-oss) keeps their KV in a pool of its own, sized to every "
               "running request's window, freeing a request's blocks as it moves past them: the KV blocks (and "
               "--kv-cache-bytes) then hold the full-attention layers' context only; for such a model it turns "
               "the prefix cache off (asking for both is an error)")
      ->envname("ROLLOUTD_SLIDING_KV_POOL");
  add("--max-new-tokens-limit", c.limits.max_new_tokens, "ROLLOUTD_MAX_NEW_TOKENS_LIMIT",
      "largest max_new_tokens accepted")->check(CLI::Range(1u, 1u << 24));
  add("--max-input-tokens", c.limits.max_input_tokens, "ROLLOUTD_MAX_INPUT_TOKENS",
      "longest prompt accepted")->check(CLI::Range(1u, 1u << 24));
  add("--shm-prefix", c.shm_prefix, "ROLLOUTD_SHM_PREFIX",
      "shared-memory buckets must be named with this prefix (e.g. /rolloutd_trainer0)");
  add("--max-shm-bucket-bytes", c.max_shm_bucket_bytes, "ROLLOUTD_MAX_SHM_BUCKET_BYTES",
      "largest shared-memory bucket accepted (the daemon stages it in host memory)")
      ->check(CLI::Range(uint64_t{1} << 20, uint64_t{1} << 40));
  add("--synthetic-params", c.synthetic_param_bytes, "ROLLOUTD_SYNTHETIC_PARAMS",
      "benchmarks: register this many bytes of extra BF16 parameters synthetic.{i}.weight (256 MiB each)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  add("--synthetic-mxfp4-params", c.synthetic_mxfp4_bytes, "ROLLOUTD_SYNTHETIC_MXFP4_PARAMS",
      "benchmarks: register parameters synthetic_mx.{i}.weight [32768, 4096] quantized to MXFP4 on arrival, "
      "this many bytes of BF16 in all")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  add("--synthetic-fp8-params", c.synthetic_fp8_bytes, "ROLLOUTD_SYNTHETIC_FP8_PARAMS",
      "benchmarks: register parameters synthetic_fp8.{i}.weight [32768, 4096] quantized to blockwise FP8 "
      "(UE8M0 scales in synthetic_fp8.{i}.weight_scale_inv) on arrival, this many bytes of BF16 in all")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  add("--synthetic-small-params", c.synthetic_small_params, "ROLLOUTD_SYNTHETIC_SMALL_PARAMS",
      "benchmarks: register this many BF16 parameters synthetic_small.{i}.weight of 1024 elements")
      ->check(CLI::Range(int64_t{0}, int64_t{1000000}));
  add("--checksum-slice-ms", c.checksum_slice_ms, "ROLLOUTD_CHECKSUM_SLICE_MS",
      "weights_checksum reads back and CRCs parameters for at most this long per turn of the engine loop "
      "(at least one parameter a turn; 0: one a turn), so generation, aborts and deadlines go on while a "
      "large model is checksummed; weight commands sent after it wait for its reply")
      ->check(CLI::Range(0.0, 10000.0));
  add("--outbox-limit", c.outbox_limit, "ROLLOUTD_OUTBOX_LIMIT",
      "undelivered messages per client before its requests are aborted")->check(CLI::Range(16, 1 << 24));
  add("--stream-interval", c.stream_interval, "ROLLOUTD_STREAM_INTERVAL",
      "a streamed request's tokens are sent in events of this many (the last one may be shorter; a "
      "retraction or the final event flushes what is held): fewer events for a coordinator to handle")
      ->check(CLI::Range(1, 4096));
  add("--drain-timeout-s", c.drain_timeout_s, "ROLLOUTD_DRAIN_TIMEOUT_S",
      "on SIGTERM, let in-flight requests finish for at most this long")->check(CLI::Range(0.0, 3600.0));
  add("--flush-timeout-s", c.flush_timeout_s, "ROLLOUTD_FLUSH_TIMEOUT_S",
      "then deliver final events for at most this long")->check(CLI::Range(0.0, 600.0));
  add("--stale-heartbeat-s", c.stale_heartbeat_s, "ROLLOUTD_STALE_HEARTBEAT_S",
      "/livez fails when an actor loop has not turned for this long")->check(CLI::Range(0.1, 3600.0));
  add("--log-level", c.log_level, "ROLLOUTD_LOG_LEVEL", "debug | info | warn | error")
      ->check(CLI::IsMember({"debug", "info", "warn", "error"}));

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    out.exit_now = true;
    const int rc = app.exit(e);  // prints help/version (rc 0) or the error (rc != 0)
    out.exit_code = rc == 0 ? 0 : 64;
    return out;
  }
  // The pool frees the window blocks a cached prompt would need: --sliding-kv-pool turns the
  // default prefix cache off. Asked for explicitly (flag or environment), validate() refuses
  // the pair.
  if (c.sliding_kv_pool && c.prefix_cache && prefix_cache->count() == 0) {
    c.prefix_cache = false;
    c.prefix_cache_off_for_pool = true;
  }
  // A secret has no flag: command lines are visible to every user of the host.
  if (const char* key = std::getenv("ROLLOUTD_CURVE_SECRET_KEY"); key != nullptr) c.curve_secret_key = key;
  // Only "auto" asks the CUDA runtime anything: a CPU daemon never initialises it.
  const int visible_gpus = c.device == "auto" ? cuda_device_count() : 0;
  if (Status s = resolve_placement(c, visible_gpus, process_env()); !s.ok()) {
    std::cerr << "rolloutd: " << s.message() << "\n";
    out.exit_now = true;
    out.exit_code = 64;
  }
  return out;
}

EnvLookup process_env() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* v = std::getenv(std::string(name).c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

namespace {

// A non-negative decimal index from the environment; nullopt when unset or empty.
Result<std::optional<int>> env_index(const EnvLookup& env, std::string_view name) {
  auto v = env(name);
  if (!v || v->empty()) return std::optional<int>();
  int out = -1;
  auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), out);
  if (ec != std::errc() || end != v->data() + v->size() || out < 0 || out > 1023)
    return Status(ErrorCode::kInvalidArgument,
                  std::string(name) + "='" + *v + "' is not a local index in [0, 1023]", std::string(name));
  return std::optional<int>(out);
}

// Devices CUDA_VISIBLE_DEVICES names (comma-separated ordinals or UUIDs); nullopt when unset.
std::optional<int> visible_device_entries(const EnvLookup& env) {
  auto v = env("CUDA_VISIBLE_DEVICES");
  if (!v) return std::nullopt;
  int n = 0;
  size_t start = 0;
  while (start <= v->size()) {
    const size_t comma = std::min(v->find(',', start), v->size());
    const std::string item = v->substr(start, comma - start);
    // CUDA stops at the first invalid entry ("-1", "NoDevFiles" from old Slurm).
    if (item.find_first_not_of(" \t") == std::string::npos || item == "NoDevFiles" || item[0] == '-') break;
    ++n;
    start = comma + 1;
  }
  return n;
}

}  // namespace

Status resolve_placement(DaemonConfig& c, int num_visible_gpus, const EnvLookup& env) {
  if (c.local_index < 0) {
    RD_ASSIGN_OR_RETURN(auto slurm, env_index(env, "SLURM_LOCALID"));
    RD_ASSIGN_OR_RETURN(auto rank, env_index(env, "LOCAL_RANK"));
    c.local_index = slurm ? *slurm : rank ? *rank : 0;
  }
  if (c.device == "auto") {
    c.device = num_visible_gpus > 0 ? "cuda" : "cpu";
    if (c.device == "cpu") c.gpu = -1;
  }
  if (c.device == "cuda" && c.gpu < 0) {
    // One visible device is this process's GPU whatever its index (Slurm binds one per task);
    // otherwise the node's daemons share the visible set and take one each, by local index.
    const auto visible = visible_device_entries(env);
    c.gpu = visible && *visible == 1 ? 0 : c.local_index;
  }
  for (auto [port, name] : {std::pair<int*, const char*>{&c.control_port, "control_port"},
                            std::pair<int*, const char*>{&c.http_port, "http_port"}}) {
    if (*port == 0) continue;  // ephemeral stays ephemeral
    if (*port + c.local_index > 65535)
      return Status(ErrorCode::kInvalidArgument,
                    std::string(name) + " " + std::to_string(*port) + " + local index " +
                        std::to_string(c.local_index) + " is past 65535",
                    name);
    *port += c.local_index;
  }
  return Status::Ok();
}

Status validate(const DaemonConfig& c) {
  if (c.device == "auto")
    return Status(ErrorCode::kInvalidArgument, "--device auto is resolved by resolve_placement first", "device");
  if (c.device == "cuda" && c.gpu < 0)
    return Status(ErrorCode::kInvalidArgument, "--device cuda needs --gpu <ordinal>", "gpu");
  if (c.device == "cpu" && c.gpu >= 0)
    return Status(ErrorCode::kInvalidArgument, "--gpu is only meaningful with --device cuda", "gpu");
  if (c.control_port != 0 && c.control_port == c.http_port && c.bind_address == c.http_bind_address)
    return Status(ErrorCode::kInvalidArgument, "control and HTTP ports must differ", "http_port");
  if (c.prefix_cache && c.sliding_kv_pool)
    return Status(ErrorCode::kInvalidArgument,
                  "--prefix-cache (or ROLLOUTD_PREFIX_CACHE=1) and --sliding-kv-pool cannot be combined: a cached "
                  "prompt would need the sliding-window blocks the pool frees; choose one (the pool alone turns "
                  "the default prefix cache off)",
                  "sliding_kv_pool");
  // With a budget the block count is known only once the model is (kv_blocks_for_budget).
  if (c.kv_cache_bytes == 0 && c.max_blocks_per_seq > c.kv_blocks)
    return Status(ErrorCode::kInvalidArgument, "max_blocks_per_seq exceeds kv_blocks",
                  "max_blocks_per_seq");
  const bool has_key = !c.curve_key_file.empty() || !c.curve_secret_key.empty();
  if (!c.curve_key_file.empty() && !c.curve_secret_key.empty())
    return Status(ErrorCode::kInvalidArgument,
                  "give the daemon's CURVE key either as --curve-key-file or in ROLLOUTD_CURVE_SECRET_KEY, not both",
                  "curve_key_file");
  if (has_key && c.curve_allow.empty())
    return Status(ErrorCode::kInvalidArgument,
                  "CURVE keys need --curve-allow: the client public keys allowed to connect", "curve_allow");
  if (!has_key && !c.curve_allow.empty())
    return Status(ErrorCode::kInvalidArgument,
                  "--curve-allow needs the daemon's own key pair (--curve-key-file or ROLLOUTD_CURVE_SECRET_KEY)",
                  "curve_allow");
  if (!has_key && !c.insecure_bind_any && !is_loopback_address(c.bind_address))
    return Status(ErrorCode::kInvalidArgument,
                  "refusing to bind the control socket to '" + c.bind_address +
                      "' without authentication: whoever reaches it can replace the weights or stop the daemon. "
                      "Give the daemon CURVE keys (--curve-key-file and --curve-allow; `rolloutctl keygen` makes "
                      "them), bind loopback, or pass --insecure-bind-any on a network you trust",
                  "bind");
  if (c.shm_prefix.size() < 2 || c.shm_prefix[0] != '/')
    return Status(ErrorCode::kInvalidArgument, "shm prefix must start with '/' and name something", "shm_prefix");
  if (c.quantize_experts != "none" && c.quantize_experts != "mxfp4")
    return Status(ErrorCode::kInvalidArgument, "--quantize-experts must be none or mxfp4", "quantize_experts");
  if (c.dense_dtype != "auto" && c.dense_dtype != "float32")
    return Status(ErrorCode::kInvalidArgument, "--dense-dtype must be auto or float32", "dense_dtype");
  if (c.kv_cache_dtype != "auto" && c.kv_cache_dtype != "float32" && c.kv_cache_dtype != "bfloat16")
    return Status(ErrorCode::kInvalidArgument, "--kv-cache-dtype must be auto, float32 or bfloat16",
                  "kv_cache_dtype");
  if (c.model.rfind("embedded:", 0) == 0) {
    if (c.model != "embedded:tiny-moe")
      return Status(ErrorCode::kInvalidArgument, "the only embedded model is 'embedded:tiny-moe'", "model");
    if (c.quantize_experts != "none")
      return Status(ErrorCode::kInvalidArgument,
                    "--quantize-experts applies to a checkpoint directory (--model DIR): the embedded model's "
                    "weights come from a seed and its goldens are FP32",
                    "quantize_experts");
  } else {
    // A checkpoint directory: its existence is a usage matter (exit 64, found at once); its
    // contents are checked while loading (exit 2, naming the file or tensor).
    std::error_code ec;
    if (c.model.empty() || !std::filesystem::is_directory(c.model, ec))
      return Status(ErrorCode::kInvalidArgument,
                    "--model '" + c.model + "' is neither 'embedded:tiny-moe' nor a checkpoint directory", "model");
    if (!std::filesystem::is_regular_file(std::filesystem::path(c.model) / "config.json", ec))
      return Status(ErrorCode::kInvalidArgument, "--model '" + c.model + "' has no config.json", "model");
  }
  return Status::Ok();
}

DType resolve_kv_cache_dtype(std::string_view flag, bool cuda, bool dense_bf16) {
  if (flag == "float32") return DType::kF32;
  if (flag == "bfloat16") return DType::kBF16;
  // "auto": validate() admits nothing else.
  return cuda && dense_bf16 ? DType::kBF16 : DType::kF32;
}

Result<int64_t> kv_blocks_for_budget(uint64_t budget, int64_t bytes_per_block, int64_t max_blocks_per_seq) {
  if (bytes_per_block <= 0)
    return Status(ErrorCode::kInvalidArgument, "KV block size in bytes must be positive", "kv_cache_bytes");
  const int64_t blocks = static_cast<int64_t>(std::min<uint64_t>(budget / static_cast<uint64_t>(bytes_per_block),
                                                                 uint64_t{1} << 24));
  if (blocks < max_blocks_per_seq)
    return Status(ErrorCode::kInvalidArgument,
                  "--kv-cache-bytes " + std::to_string(budget) + " holds " + std::to_string(blocks) + " KV blocks of " +
                      std::to_string(bytes_per_block) + " bytes, fewer than --max-blocks-per-seq " +
                      std::to_string(max_blocks_per_seq) + ": one request at its longest would not fit",
                  "kv_cache_bytes");
  return blocks;
}

nlohmann::json to_json(const DaemonConfig& c) {
  return {
      {"bind", c.bind_address},
      {"control_port", c.control_port},
      {"http_bind", c.http_bind_address},
      {"http_port", c.http_port},
      {"endpoints_file", c.endpoints_file},
      {"curve_key_file", c.curve_key_file},
      {"curve_secret_key", c.curve_secret_key.empty() ? "" : "(set in ROLLOUTD_CURVE_SECRET_KEY)"},
      {"curve_allow", c.curve_allow},
      {"insecure_bind_any", c.insecure_bind_any},
      {"model", c.model},
      {"model_seed", c.model_seed},
      {"quantize_experts", c.quantize_experts},
      {"dense_dtype", c.dense_dtype},
      {"kv_cache_dtype", c.kv_cache_dtype},
      {"kv_cache_bytes", c.kv_cache_bytes},
      {"device", c.device},
      {"gpu", c.gpu},
      {"local_index", c.local_index},
      {"max_running", c.max_running},
      {"max_waiting", c.max_waiting},
      {"prefix_cache", c.prefix_cache},
      {"prefix_cache_off_for_pool", c.prefix_cache_off_for_pool},
      {"sliding_kv_pool", c.sliding_kv_pool},
      {"max_step_tokens", c.max_step_tokens},
      {"cuda_graph_max_batch", c.cuda_graph_max_batch},
      {"kv_blocks", c.kv_blocks},
      {"kv_block_size", c.kv_block_size},
      {"max_blocks_per_seq", c.max_blocks_per_seq},
      {"max_new_tokens_limit", c.limits.max_new_tokens},
      {"max_input_tokens", c.limits.max_input_tokens},
      {"shm_prefix", c.shm_prefix},
      {"max_shm_bucket_bytes", c.max_shm_bucket_bytes},
      {"synthetic_param_bytes", c.synthetic_param_bytes},
      {"synthetic_small_params", c.synthetic_small_params},
      {"checksum_slice_ms", c.checksum_slice_ms},
      {"synthetic_mxfp4_bytes", c.synthetic_mxfp4_bytes},
      {"synthetic_fp8_bytes", c.synthetic_fp8_bytes},
      {"outbox_limit", c.outbox_limit},
      {"stream_interval", c.stream_interval},
      {"drain_timeout_s", c.drain_timeout_s},
      {"flush_timeout_s", c.flush_timeout_s},
      {"stale_heartbeat_s", c.stale_heartbeat_s},
      {"log_level", c.log_level},
  };
}

std::string bind_host(std::string_view address) {
  if (address == "localhost") return "127.0.0.1";
  if (address.size() >= 2 && address.front() == '[' && address.back() == ']')
    return std::string(address.substr(1, address.size() - 2));
  return std::string(address);
}

bool is_ipv6_literal(std::string_view host) {
  in6_addr v6{};
  return inet_pton(AF_INET6, std::string(host).c_str(), &v6) == 1;
}

std::string endpoint_host(std::string_view host) {
  return is_ipv6_literal(host) ? "[" + std::string(host) + "]" : std::string(host);
}

bool is_loopback_address(std::string_view address) {
  std::string a(address);
  if (a == "localhost") return true;
  if (a.size() >= 2 && a.front() == '[' && a.back() == ']') a = a.substr(1, a.size() - 2);
  in_addr v4{};
  if (inet_pton(AF_INET, a.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, a.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;  // "*", "0.0.0.0", interface names, host names: not provably this host only
}

}  // namespace rolloutd::daemon
