#include "daemon/daemon.hpp"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <thread>

#if defined(ROLLOUTD_WITH_SYSTEMD)
#include <systemd/sd-daemon.h>
#endif

#include "build_info.hpp"
#include "core/engine/engine.hpp"
#include "core/model/embedded_model.hpp"
#include "core/model/hf_checkpoint.hpp"
#include "daemon/actors/control_actor.hpp"
#include "daemon/actors/engine_actor.hpp"
#include "daemon/http/http_server.hpp"
#include "daemon/obs/log.hpp"
#include "daemon/obs/metrics.hpp"
#include "daemon/state.hpp"
#include "daemon/weights/cuda_ipc.hpp"
#include "daemon/security/control_auth.hpp"
#include "daemon/weights/nccl_group.hpp"

namespace rolloutd::daemon {
namespace {

void notify_systemd(const char* state) {
#if defined(ROLLOUTD_WITH_SYSTEMD)
  sd_notify(0, state);
#else
  (void)state;
#endif
}

// systemd's watchdog (WatchdogSec= in the unit sets WATCHDOG_USEC): WATCHDOG=1 every half
// interval from a thread of its own, so no actor ever waits on the notify socket. Until
// serving() it pings unconditionally (model loading has no heartbeat; TimeoutStartSec bounds
// it); after, only while both actor loops have turned within the interval, so a wedged engine
// gets the unit restarted instead of being kept alive by this thread.
class SystemdWatchdog {
 public:
  SystemdWatchdog(const Heartbeat& control, const Heartbeat& engine, double stale_s)
      : control_(control), engine_(engine) {
#if defined(ROLLOUTD_WITH_SYSTEMD)
    uint64_t usec = 0;
    if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0) return;
    const double interval_s = static_cast<double>(usec) * 1e-6;
    limit_s_ = std::min(stale_s, interval_s);
    period_ = std::chrono::microseconds(std::max<uint64_t>(usec / 2, 20000));
    obs::log_info("daemon", "systemd watchdog enabled", {{"interval_s", interval_s}});
    thread_ = std::thread([this] { loop(); });
#else
    (void)stale_s;
#endif
  }
  ~SystemdWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void serving() { serving_.store(true); }

 private:
  void loop() {
    bool warned = false;
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, period_, [this] { return stop_; })) {
      const double c = control_.age_s(), e = engine_.age_s();
      if (!serving_.load() || (c < limit_s_ && e < limit_s_)) {
        notify_systemd("WATCHDOG=1");
        warned = false;
      } else if (!warned) {
        obs::log_warn("daemon", "actor loop stalled; withholding the systemd watchdog ping",
                      {{"control_heartbeat_age_s", c}, {"engine_heartbeat_age_s", e}});
        warned = true;
      }
    }
  }

  const Heartbeat& control_;
  const Heartbeat& engine_;
  double limit_s_ = 0;
  std::chrono::microseconds period_{0};
  std::atomic<bool> serving_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// Written atomically (temp file + rename) so a launcher polling for it never reads half a file.
Status write_endpoints_file(const std::string& path, const nlohmann::json& j) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) return Status(ErrorCode::kUnavailable, "cannot write " + tmp, "endpoints_file");
    f << j.dump() << "\n";
    if (!f.good()) return Status(ErrorCode::kUnavailable, "cannot write " + tmp, "endpoints_file");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return Status(ErrorCode::kUnavailable, "cannot rename to " + path + ": " + ec.message(), "endpoints_file");
  return Status::Ok();
}

std::string hex_address(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

nlohmann::json memory_json(const EngineSnapshot& s) {
  nlohmann::json tags = nlohmann::json::object();
  for (const MemoryTagSnapshot& m : s.memory) {
    nlohmann::json ranges = nlohmann::json::array();
    for (const auto& [base, size] : m.ranges) ranges.push_back({{"base", hex_address(base)}, {"size_bytes", size}});
    tags[m.tag] = {{"state", m.state},
                   {"resident_bytes", m.resident_bytes},
                   {"backed_bytes", m.backed_bytes},
                   {"reserved_bytes", m.reserved_bytes},
                   {"used_bytes", m.used_bytes},
                   {"static_state", {{"entries", m.static_state_entries},
                                     {"bytes", m.static_state_bytes},
                                     {"crc32", m.static_state_crc32}}},
                   {"releases", m.num_releases},
                   {"resumes", m.num_resumes},
                   {"last_release", {{"size_bytes", m.last_release_bytes}, {"duration_s", m.last_release_s}}},
                   {"last_resume", {{"size_bytes", m.last_resume_bytes}, {"duration_s", m.last_resume_s}}},
                   {"ranges", ranges}};
  }
  tags["parameters_address_digest"] = hex_address(s.parameters_address_digest);
  return tags;
}

nlohmann::json snapshot_json(const EngineSnapshot* s) {
  if (!s) return {{"state", "starting"}};
  return {{"memory", memory_json(*s)},
          {"state", s->state},
          {"reason", s->reason},
          {"weight_version", s->weight_version},
          {"queue", {{"waiting", s->num_waiting}, {"running", s->num_running}}},
          {"kv_blocks", {{"free", s->kv_blocks_free}, {"total", s->kv_blocks_total}, {"cached", s->kv_blocks_cached},
                         {"evictable", s->kv_blocks_evictable},
                         {"sliding", {{"free", s->sliding_kv_blocks_free}, {"total", s->sliding_kv_blocks_total}}}}},
          {"prefix_cache",
           {{"enabled", s->prefix_cache_enabled},
            {"queried_tokens_total", s->num_prefix_cache_queried_tokens_total},
            {"hit_tokens_total", s->num_prefix_cache_hit_tokens_total}}},
          {"kv_cache_dtype", s->kv_cache_dtype},
          {"requests_total", s->num_requests_total},
          {"prompt_tokens_total", s->num_prompt_tokens_total},
          {"generated_tokens_total", s->num_generated_tokens_total},
          {"steps_total", s->num_steps_total},
          {"cuda_graphs",
           {{"max_batch", s->graph_max_batch},
            {"buckets", s->graph_buckets},
            {"graphs", s->num_graphs},
            {"graph_steps_total", s->graph_steps},
            {"eager_steps_total", s->eager_steps},
            {"capture_duration_s", s->graph_capture_s}}},
          {"paused", s->paused},
          {"update_session", s->update_session}};
}

}  // namespace

int run_daemon(const DaemonConfig& config, std::atomic<int>& drain_signals) {
  const auto started = std::chrono::steady_clock::now();
  obs::log_info("daemon", "configuration", to_json(config));
  if (Status s = validate(config); !s.ok()) {
    obs::log_error("daemon", "invalid configuration", {{"error", s.to_string()}});
    std::cerr << "rolloutd: " << s.message() << "\n";
    return kExitUsage;
  }
  // Keys and allowlist before anything slow: a bad key file is a usage error, found at once.
  auto security = load_control_security(config);
  if (!security.ok()) {
    obs::log_error("daemon", "invalid security configuration", {{"error", security.status().to_string()}});
    std::cerr << "rolloutd: " << security.status().message() << "\n";
    return kExitUsage;
  }
  Heartbeat control_hb, engine_hb;
  SystemdWatchdog watchdog(control_hb, engine_hb, config.stale_heartbeat_s);

  // ---- device and model ----
  const Backend* backend = &cpu_backend();
  ExecContext ctx;
  if (config.device == "cuda") {
    backend = cuda_backend();
    if (!backend || cuda_device_count() <= config.gpu) {
      obs::log_error("daemon", "CUDA device not available",
                     {{"gpu", config.gpu}, {"visible_devices", cuda_device_count()},
                      {"cuda_built", cuda_backend() != nullptr}});
      return kExitStartupFailure;
    }
    ctx.device = Device::cuda(config.gpu);
  }
  // The embedded model (weights from a seed), or a Hugging Face checkpoint directory: its
  // config.json is parsed and its safetensors headers validated before anything is built.
  const auto load_started = std::chrono::steady_clock::now();
  const bool embedded = config.model.rfind("embedded:", 0) == 0;
  core::ModelConfig mc = core::embedded_model_config();
  core::HfModel hf;
  if (!embedded) {
    // validate() admits only the names parse_expert_quantization knows.
    const auto quantize = core::parse_expert_quantization(config.quantize_experts);
    auto opened = quantize.ok() ? core::open_hf_model(config.model, *quantize)
                                : Result<core::HfModel>(quantize.status());
    if (!opened.ok()) {
      obs::log_error("daemon", "model load failed",
                     {{"model", config.model}, {"error", opened.status().to_string()},
                      {"tensor", opened.status().field()}});
      return kExitStartupFailure;
    }
    hf = std::move(*opened);
    mc = hf.config;
    mc.name = config.model;
    if (config.dense_dtype == "float32") mc.dense_bf16 = false;
  }
  mc.synthetic_param_bytes = config.synthetic_param_bytes;
  mc.synthetic_small_params = config.synthetic_small_params;
  mc.synthetic_mxfp4_bytes = config.synthetic_mxfp4_bytes;
  mc.synthetic_fp8_bytes = config.synthetic_fp8_bytes;
  core::StepLimits limits;
  limits.max_tokens = config.max_step_tokens;
  limits.max_seqs = config.max_running;
  limits.num_kv_blocks = config.kv_blocks;
  limits.kv_block_size = config.kv_block_size;
  limits.max_blocks_per_seq = config.max_blocks_per_seq;
  limits.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, config.device == "cuda", mc.dense_bf16);
  // The sliding-window layers' own pool, sized to every running request's window; the budget
  // pays for it first, and the rest holds the full-attention layers' context.
  const bool sliding_pool = config.sliding_kv_pool && mc.num_sliding_layers() > 0;
  // Whether the main pool holds any layer's KV (not when every layer is in the sliding pool).
  const bool full_layers = !sliding_pool || mc.num_sliding_layers() < mc.num_hidden_layers;
  uint64_t sliding_bytes = 0;
  // The default prefix cache, turned off for the pool, stays on where there is no pool.
  const bool prefix_cache = config.prefix_cache || (config.prefix_cache_off_for_pool && !sliding_pool);
  if (config.sliding_kv_pool && !sliding_pool)
    obs::log_info("daemon", "--sliding-kv-pool: the model has no sliding-window layers, one KV pool",
                  {{"prefix_cache", prefix_cache}});
  else if (config.prefix_cache_off_for_pool)
    obs::log_info("daemon", "--sliding-kv-pool: the prefix cache is off (the pool frees the window blocks it "
                  "would reuse)", {});
  if (sliding_pool) {
    limits.num_sliding_kv_blocks = core::sliding_kv_blocks_needed(mc, limits);
    sliding_bytes = static_cast<uint64_t>(limits.num_sliding_kv_blocks) *
                    static_cast<uint64_t>(core::kv_cache_bytes_per_block(mc, config.kv_block_size, limits.kv_dtype,
                                                                         /*sliding=*/true));
    obs::log_info("daemon", "sliding-window layers in a KV pool of their own",
                  {{"sliding_kv_blocks", limits.num_sliding_kv_blocks},
                   {"sliding_layers", mc.num_sliding_layers()},
                   {"window", mc.sliding_window},
                   {"size_bytes", sliding_bytes}});
  }
  if (config.kv_cache_bytes > 0) {  // the budget's blocks replace --kv-blocks
    const int64_t per_block =
        sliding_pool ? core::kv_cache_bytes_per_block(mc, config.kv_block_size, limits.kv_dtype, /*sliding=*/false)
                     : core::kv_cache_bytes_per_block(mc, config.kv_block_size, limits.kv_dtype);
    if (sliding_bytes > config.kv_cache_bytes || (full_layers && sliding_bytes == config.kv_cache_bytes)) {
      obs::log_error("daemon", "KV cache budget too small",
                     {{"error", "--kv-cache-bytes " + std::to_string(config.kv_cache_bytes) +
                                    " does not cover the sliding-window pool's " + std::to_string(sliding_bytes) +
                                    " bytes (--sliding-kv-pool; it grows with --max-running and --max-step-tokens)"}});
      return kExitStartupFailure;
    }
    // Every layer sliding: the main pool holds no memory, only each request's positions; one
    // request at its longest is all it must admit.
    const auto blocks =
        full_layers ? kv_blocks_for_budget(config.kv_cache_bytes - sliding_bytes, per_block, config.max_blocks_per_seq)
                    : Result<int64_t>(std::max<int64_t>(config.kv_blocks, config.max_blocks_per_seq));
    if (!blocks.ok()) {
      obs::log_error("daemon", "KV cache budget too small", {{"error", blocks.status().to_string()}});
      return kExitStartupFailure;
    }
    limits.num_kv_blocks = *blocks;
    obs::log_info("daemon", "KV cache from its budget",
                  {{"kv_cache_bytes", config.kv_cache_bytes}, {"block_size_bytes", per_block}, {"kv_blocks", *blocks}});
  }
  // -1 (default): decode graphs up to max_running on CUDA, none on the CPU (padding buys
  // nothing without graphs there); an explicit value applies to either backend.
  limits.graph_max_batch = config.cuda_graph_max_batch >= 0 ? config.cuda_graph_max_batch
                           : config.device == "cuda"        ? config.max_running
                                                            : 0;
  auto model = core::MoeDecoder::create(mc, limits, *backend, ctx);
  if (!model.ok()) {
    obs::log_error("daemon", "model build failed", {{"error", model.status().to_string()}});
    return kExitStartupFailure;
  }
  if (embedded) {
    if (Status s = core::init_random_weights(**model, config.model_seed); !s.ok()) {
      obs::log_error("daemon", "model init failed", {{"error", s.to_string()}});
      return kExitStartupFailure;
    }
  } else if (Status s = core::load_checkpoint(**model, *hf.checkpoint); !s.ok()) {
    obs::log_error("daemon", "model load failed",
                   {{"model", config.model}, {"error", s.to_string()}, {"tensor", s.field()}});
    return kExitStartupFailure;
  }
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_started).count();
  const uint64_t checkpoint_bytes = hf.checkpoint ? hf.checkpoint->total_bytes() : 0;
  const size_t checkpoint_files = hf.checkpoint ? hf.checkpoint->num_files() : 0;
  hf.checkpoint.reset();  // unmap the files: every byte now lives in parameter storage
  core::EngineOptions eo;
  eo.max_running = config.max_running;
  eo.max_waiting = config.max_waiting;
  eo.prefix_cache = prefix_cache;
  eo.step = limits;
  auto engine = core::Engine::create(std::move(*model), eo);
  if (!engine.ok()) {
    obs::log_error("daemon", "engine build failed", {{"error", engine.status().to_string()}});
    return kExitStartupFailure;
  }
  protocol::ModelInfo info;
  info.name = mc.name;
  info.family = mc.family;
  info.vocab_size = static_cast<uint32_t>(mc.vocab_size);
  info.num_layers = static_cast<uint32_t>(mc.num_hidden_layers);
  info.num_moe_layers = static_cast<uint32_t>(mc.num_moe_layers());
  info.num_experts = static_cast<uint32_t>(mc.num_experts);
  info.top_k = static_cast<uint32_t>(mc.num_experts_per_tok);
  info.routed_experts_dtype = core::routed_experts_dtype_for(mc.num_experts);
  obs::log_info("daemon", "model ready",
                {{"model", mc.name}, {"family", mc.family}, {"device", ctx.device.to_string()},
                 {"experts", mc.experts_mxfp4 ? "mxfp4" : "fp32"},
                 {"dense", (*engine)->model().uses_bf16_dense() ? "bf16" : "fp32"},
                 {"kv_cache_dtype", dtype_name((*engine)->model().limits().kv_dtype)},
                 {"prefix_cache", prefix_cache}, {"sliding_kv_pool", sliding_pool},
                 {"qkv_fused_layers", (*engine)->model().qkv_fused_layers()},
                 {"seed", embedded ? nlohmann::json(config.model_seed) : nlohmann::json(nullptr)},
                 {"parameters", (*engine)->model().weights().size()}, {"checkpoint_files", checkpoint_files},
                 {"checkpoint_size_bytes", checkpoint_bytes}, {"load_duration_s", load_s}});

  // ---- actors ----
  obs::Metrics metrics;
  metrics.set_build_info(build::kVersion, build::kCudaEnabled);
  SnapshotCell<EngineSnapshot> snapshot;
  zmq::context_t zctx(1);
  // Declared before the control actor, so it is destroyed after the socket it authenticates.
  std::unique_ptr<CurveAuthenticator> auth;
  if (security->curve) {
    auto a = CurveAuthenticator::create(zctx, *security, metrics);
    if (!a.ok()) {
      obs::log_error("daemon", "authentication setup failed", {{"error", a.status().to_string()}});
      return kExitStartupFailure;
    }
    auth = std::move(*a);
  }

  auto control_box = MailboxEnd::bind(zctx, "engine");
  auto engine_box = control_box.ok() ? MailboxEnd::connect(zctx, "engine") : control_box.status();
  if (!control_box.ok() || !engine_box.ok()) {
    obs::log_error("daemon", "mailbox setup failed");
    return kExitStartupFailure;
  }
  const int32_t gpu = config.device == "cuda" ? config.gpu : -1;
  ControlActor control(zctx, config, std::move(*control_box), metrics, snapshot, control_hb, info, gpu,
                       drain_signals);
  control.set_authenticator(auth.get());
  if (config.device == "cuda")
    control.set_device_facts(static_cast<uint32_t>(NcclGroup::loaded_version()), cuda_device_uuid(config.gpu));
  auto control_ep = control.bind();
  if (!control_ep.ok()) {
    obs::log_error("daemon", "bind failed", {{"error", control_ep.status().to_string()}});
    return kExitStartupFailure;
  }

  // HTTP: GET only, reads published snapshots and heartbeats, never waits on an actor.
  const double stale_s = config.stale_heartbeat_s;
  std::map<std::string, http::HttpHandler> routes;
  routes["/livez"] = [&]() {
    const double c = control_hb.age_s(), e = engine_hb.age_s();
    if (c > stale_s || e > stale_s)
      return http::HttpResponse{503, "application/json",
                                nlohmann::json{{"alive", false}, {"control_heartbeat_age_s", c},
                                               {"engine_heartbeat_age_s", e}}.dump()};
    return http::HttpResponse{200, "application/json", nlohmann::json{{"alive", true}}.dump()};
  };
  routes["/readyz"] = [&]() {
    auto s = snapshot.load();
    const bool draining = drain_signals.load() > 0;
    const bool ready = s && s->state == "ready" && !draining;
    nlohmann::json j{{"ready", ready},
                     {"state", s ? (draining && s->state == "ready" ? "draining" : s->state) : "starting"},
                     {"reason", s ? s->reason : "starting"}};
    return http::HttpResponse{ready ? 200 : 503, "application/json", j.dump()};
  };
  routes["/metrics"] = [&]() {
    metrics.set_uptime_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    return http::HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8", metrics.serialize()};
  };
  routes["/v1/status"] = [&]() {
    auto s = snapshot.load();
    nlohmann::json j = snapshot_json(s.get());
    j["uptime_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    j["build"] = {{"version", build::kVersion}, {"type", build::kBuildType}, {"cuda", build::kCudaEnabled}};
    j["model"] = {{"name", info.name}, {"family", info.family}, {"vocab_size", info.vocab_size},
                  {"num_layers", info.num_layers}, {"num_experts", info.num_experts}, {"top_k", info.top_k},
                  {"routed_experts_dtype", info.routed_experts_dtype}};
    j["device"] = ctx.device.to_string();
    j["draining"] = drain_signals.load() > 0 || (s && s->state == "draining");
    j["pid"] = ::getpid();
    j["security"] = security->describe();
    j["security"]["auth_accepted_total"] = auth ? auth->num_accepted() : 0;
    j["security"]["auth_denied_total"] = auth ? auth->num_denied() : 0;
    return http::HttpResponse{200, "application/json", j.dump()};
  };
  http::HttpServerOptions hopts;
  hopts.bind_address = bind_host(config.http_bind_address);
  hopts.port = static_cast<uint16_t>(config.http_port);
  hopts.on_error = [](std::string_view what) { obs::log_warn("http", std::string(what)); };
  auto http_server = http::HttpServer::start(hopts, std::move(routes));
  if (!http_server.ok()) {
    obs::log_error("daemon", "HTTP bind failed", {{"error", http_server.status().to_string()}});
    return kExitStartupFailure;
  }
  const std::string http_ep =
      "http://" + endpoint_host(bind_host(config.http_bind_address)) + ":" + std::to_string((*http_server)->port());

  EngineActor engine_actor(std::move(*engine), std::move(*engine_box), metrics, snapshot, engine_hb, config);
  std::thread engine_thread([&] { engine_actor.run(); });
  // Announce only once the engine has published its first snapshot: a request sent the moment
  // the endpoints file appears must not meet "not_ready: starting". Bounded: a wedged engine
  // shows on /livez.
  for (int i = 0; i < 1000 && !snapshot.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));

  nlohmann::json endpoints{{"control", *control_ep}, {"http", http_ep}, {"pid", ::getpid()}, {"gpu", gpu}};
  // A client needs the daemon's public key to connect; it is no secret.
  if (security->curve) endpoints["curve_public_key"] = security->server.public_key;
  {
    // The log line carries the endpoints; its own `gpu` field already names the device.
    nlohmann::json line = endpoints;
    line.erase("gpu");
    line["security"] = security->describe();
    obs::log_info("daemon", "listening", line);
    if (!security->curve)
      obs::log(is_loopback_address(config.bind_address) ? obs::LogLevel::kInfo : obs::LogLevel::kWarn, "daemon",
               is_loopback_address(config.bind_address)
                   ? "control socket without authentication, on loopback only (give CURVE keys to bind others)"
                   : "control socket WITHOUT AUTHENTICATION on a non-loopback address (--insecure-bind-any): "
                     "whoever reaches it controls this daemon",
               {{"bind", config.bind_address}});
  }
  if (!config.endpoints_file.empty()) {
    if (Status s = write_endpoints_file(config.endpoints_file, endpoints); !s.ok())
      obs::log_warn("daemon", "could not write the endpoints file", {{"error", s.to_string()}});
  }
  notify_systemd("READY=1");
  watchdog.serving();

  control.set_on_drain_start([] { notify_systemd("STOPPING=1"); });  // when the drain starts
  const int rc = control.run();  // returns after the drain completes
  engine_thread.join();
  (*http_server)->stop();
  obs::log_info("daemon", "stopped", {{"exit_code", rc}});
  obs::flush_logs();
  return rc;
}

}  // namespace rolloutd::daemon
