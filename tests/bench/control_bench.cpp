// Control-plane and CPU decode benchmark (a benchmark, not a test: it reports numbers).
//
//   control_bench --daemon build/ci/daemon/rolloutd [--seconds 3] [--json out.json]
//
// 1. Starts a daemon on ephemeral loopback ports.
// 2. Round-trip latency of `status` (p50, p99) with one request in flight.
// 3. Messages per second: a window of pipelined `status` requests.
// 4. CPU decode tokens/s of the embedded model through the daemon (batch 1 and 32, greedy)
//    and in-process through core::Engine (no sockets), so the protocol's share is visible.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/engine/engine.hpp"
#include "core/model/embedded_model.hpp"
#include "protocol/client.hpp"

extern char** environ;

namespace {
using Clock = std::chrono::steady_clock;
using rolloutd::protocol::Client;

double pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

struct Daemon {
  pid_t pid = -1;
  std::string control;
  ~Daemon() {
    if (pid > 0) {
      kill(pid, SIGTERM);
      int st = 0;
      waitpid(pid, &st, 0);
    }
  }
};

bool start_daemon(const std::string& bin, const std::string& dir, Daemon& d) {
  const std::string ep = dir + "/bench-endpoints.json";
  std::remove(ep.c_str());
  std::vector<std::string> args = {bin, "--control-port", "0", "--http-port", "0", "--endpoints-file", ep,
                                   "--log-level", "warn", "--max-running", "64"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  if (posix_spawn(&d.pid, bin.c_str(), nullptr, nullptr, argv.data(), environ) != 0) return false;
  for (int i = 0; i < 300; ++i) {
    std::ifstream f(ep);
    if (f) {
      try {
        d.control = nlohmann::json::parse(f)["control"];
        return true;
      } catch (...) {
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

double engine_tokens_per_s(int batch, int new_tokens) {
  using namespace rolloutd;
  core::StepLimits l;
  l.max_tokens = 512;
  l.max_seqs = 64;
  l.num_kv_blocks = 2048;
  l.kv_block_size = 16;
  l.max_blocks_per_seq = 256;
  auto m = core::MoeDecoder::create(core::embedded_model_config(), l, cpu_backend(), ExecContext{});
  if (!m.ok() || !core::init_random_weights(**m, core::kEmbeddedModelSeed).ok()) return 0;
  core::EngineOptions o;
  o.step = l;
  o.max_running = 64;
  auto e = core::Engine::create(std::move(*m), o);
  for (int i = 0; i < batch; ++i) {
    core::RequestSpec s;
    s.rid = "b" + std::to_string(i);
    s.input_ids = {1 + i % 200, 2, 3, 4};
    s.max_new_tokens = static_cast<uint32_t>(new_tokens);
    s.sampling.temperature = 0;
    (void)(*e)->submit(s);
  }
  std::vector<core::EngineEvent> ev;
  (void)(*e)->step(ev);  // prefill
  const auto t0 = Clock::now();
  while ((*e)->has_work()) (void)(*e)->step(ev);
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  return batch * (new_tokens - 1) / dt;
}
}  // namespace

int main(int argc, char** argv) {
  std::string bin, json_out;
  double seconds = 3.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--daemon") bin = argv[i + 1];
    else if (k == "--seconds") seconds = std::stod(argv[i + 1]);
    else if (k == "--json") json_out = argv[i + 1];
  }
  if (bin.empty()) {
    std::cerr << "usage: control_bench --daemon PATH [--seconds S] [--json FILE]\n";
    return 64;
  }
  Daemon d;
  if (!start_daemon(bin, "/tmp", d)) {
    std::cerr << "daemon did not start\n";
    return 1;
  }
  rolloutd::protocol::ClientOptions opts;
  opts.endpoint = d.control;
  auto c = Client::connect(opts);
  if (!c.ok() || !(*c)->hello().ok()) {
    std::cerr << "cannot reach the daemon\n";
    return 1;
  }
  nlohmann::json out;
  out["host_cpus"] = std::thread::hardware_concurrency();

  // Round trip, one in flight.
  for (int i = 0; i < 200; ++i) (void)(*c)->status();
  std::vector<double> rtt;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    const auto t0 = Clock::now();
    if (!(*c)->status().ok()) return 1;
    rtt.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  out["status_rtt_us"] = {{"p50", pct(rtt, 0.5)}, {"p99", pct(rtt, 0.99)}, {"samples", rtt.size()}};

  // Pipelined: a window of 64 requests in flight over the raw transport.
  {
    const auto msg = rolloutd::protocol::encode_request(1, rolloutd::protocol::Request{rolloutd::protocol::StatusRequest{}});
    std::vector<std::string> frames = {msg.envelope};
    uint64_t sent = 0, received = 0;
    const auto t0 = Clock::now();
    const auto stop = t0 + std::chrono::duration<double>(seconds);
    while (Clock::now() < stop) {
      while (sent - received < 64) {
        if (!(*c)->send_raw(frames).ok()) return 1;
        ++sent;
      }
      auto r = (*c)->recv_raw(1000);
      if (!r.ok() || !*r) return 1;
      ++received;
    }
    while (received < sent) {
      auto r = (*c)->recv_raw(1000);
      if (!r.ok() || !*r) break;
      ++received;
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    out["status_pipelined_msgs_per_s"] = static_cast<double>(received) / dt;
  }

  // Decode through the daemon.
  for (int batch : {1, 32}) {
    const int new_tokens = 64;
    std::vector<std::string> rids;
    const auto t0 = Clock::now();
    for (int i = 0; i < batch; ++i) {
      rolloutd::protocol::GenerateRequest g;
      g.rid = "bench-" + std::to_string(batch) + "-" + std::to_string(i);
      g.input_ids = {1 + i % 200, 2, 3, 4};
      g.max_new_tokens = new_tokens;
      g.temperature = 0;
      if (!(*c)->submit(g).ok()) return 1;
      rids.push_back(g.rid);
    }
    size_t finals = 0, tokens = 0;
    while (finals < rids.size()) {
      auto ev = (*c)->next_event(30000);
      if (!ev.ok() || !*ev) return 1;
      if (auto* t = std::get_if<rolloutd::protocol::TokensEvent>(&**ev)) tokens += t->token_ids.size();
      else ++finals;
    }
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    out["daemon_decode_tokens_per_s"]["batch_" + std::to_string(batch)] = static_cast<double>(tokens) / dt;
    out["engine_decode_tokens_per_s"]["batch_" + std::to_string(batch)] = engine_tokens_per_s(batch, new_tokens);
  }
  std::cout << out.dump(2) << std::endl;
  if (!json_out.empty()) std::ofstream(json_out) << out.dump(2) << "\n";
  return 0;
}
