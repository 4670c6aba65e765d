#pragma once
// Shared helpers for core/ tests.
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/engine/engine.hpp"
#include "core/model/embedded_model.hpp"

namespace rolloutd::test {

inline std::string source_root() {
  const char* r = std::getenv("ROLLOUTD_SOURCE_ROOT");
  return r ? r : ".";
}

inline nlohmann::json load_json(const std::string& rel) {
  std::ifstream f(source_root() + "/" + rel);
  if (!f) throw std::runtime_error("cannot open " + rel + " (set ROLLOUTD_SOURCE_ROOT)");
  return nlohmann::json::parse(f);
}

inline core::StepLimits small_limits(int64_t max_tokens = 64, int64_t max_seqs = 8, int64_t kv_blocks = 128) {
  core::StepLimits l;
  l.max_tokens = max_tokens;
  l.max_seqs = max_seqs;
  l.num_kv_blocks = kv_blocks;
  l.kv_block_size = 4;  // small blocks: every sequence spans several
  l.max_blocks_per_seq = 64;
  return l;
}

inline std::unique_ptr<core::MoeDecoder> embedded_model(const core::StepLimits& limits) {
  auto m = core::MoeDecoder::create(core::embedded_model_config(), limits, cpu_backend(), ExecContext{});
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_TRUE(core::init_random_weights(**m, core::kEmbeddedModelSeed).ok());
  return std::move(*m);
}

inline std::unique_ptr<core::Engine> embedded_engine(const core::StepLimits& limits, int64_t max_running = 8,
                                                     int64_t max_waiting = 64, bool prefix_cache = false) {
  core::EngineOptions o;
  o.max_running = max_running;
  o.max_waiting = max_waiting;
  o.prefix_cache = prefix_cache;
  o.step = limits;
  auto e = core::Engine::create(embedded_model(limits), o);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return std::move(*e);
}

// Random finite bf16 bit patterns (normal values in roughly [-4, 4]), deterministic.
inline void fill_bf16_values(std::vector<uint16_t>& out, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const uint16_t sign = static_cast<uint16_t>((x >> 63) << 15);
    const uint16_t exp = static_cast<uint16_t>(120 + (x >> 40) % 9);  // 2^-7 .. 2^1
    const uint16_t man = static_cast<uint16_t>(x & 0x7f);
    v = static_cast<uint16_t>(sign | (exp << 7) | man);
  }
}

// Runs the engine until idle (bounded), collecting every event.
inline std::vector<core::EngineEvent> run_to_idle(core::Engine& e, int max_steps = 10000) {
  std::vector<core::EngineEvent> out;
  for (int i = 0; i < max_steps && e.has_work(); ++i) {
    Status s = e.step(out);
    EXPECT_TRUE(s.ok()) << s.to_string();
  }
  EXPECT_FALSE(e.has_work()) << "engine did not go idle";
  return out;
}

// What requests received, by rid: their tokens, log-probs and routed-expert rows in arrival
// order, and their final events (a failed one is a test failure).
struct RequestLog {
  std::map<std::string, std::vector<int32_t>> tokens, routed;
  std::map<std::string, std::vector<float>> logprobs;
  std::map<std::string, int> finals;
  void add(const core::EngineEvent& ev) {
    if (ev.kind != core::EngineEvent::Kind::kTokens) {
      EXPECT_NE(ev.kind, core::EngineEvent::Kind::kFailed) << ev.rid << ": " << ev.error.to_string();
      ++finals[ev.rid];
      return;
    }
    tokens[ev.rid].insert(tokens[ev.rid].end(), ev.token_ids.begin(), ev.token_ids.end());
    logprobs[ev.rid].insert(logprobs[ev.rid].end(), ev.logprobs.begin(), ev.logprobs.end());
    routed[ev.rid].insert(routed[ev.rid].end(), ev.routed_rows.begin(), ev.routed_rows.end());
  }
};

// Steps the engine until idle (bounded), logging every event; `after_step(i)` runs after step i.
inline RequestLog step_to_idle(core::Engine& e, const std::function<void(int)>& after_step = {}) {
  RequestLog log;
  for (int i = 0; i < 10000 && e.has_work(); ++i) {
    std::vector<core::EngineEvent> evs;
    const Status st = e.step(evs);
    EXPECT_TRUE(st.ok()) << st.to_string();
    if (!st.ok()) break;
    if (after_step) after_step(i);
    for (const auto& ev : evs) log.add(ev);
  }
  EXPECT_FALSE(e.has_work()) << "engine did not go idle";
  return log;
}

// Parameters of `src` in checkpoint layout, as one bucket (what a trainer pushes): every one, or
// every `every`-th from `phase` (a partial update). `names` is the selector of that update.
struct RegistryBucket {
  std::vector<std::string> names;
  std::vector<core::BucketEntry> entries;
  std::vector<uint8_t> bytes;
};
inline RegistryBucket registry_bucket(const core::WeightRegistry& src, size_t every = 1, size_t phase = 0) {
  RegistryBucket b;
  std::vector<uint8_t> one;
  for (size_t i = phase; i < src.size(); i += every) {
    EXPECT_TRUE(src.read_checkpoint(i, one).ok());
    const auto& p = src.parameters()[i];
    b.names.push_back(p.name);
    b.entries.push_back({p.name, p.storage.dtype, {p.storage.shape.data(), p.storage.shape.data() + p.storage.rank()},
                         b.bytes.size(), one.size()});
    b.bytes.insert(b.bytes.end(), one.begin(), one.end());
  }
  return b;
}

// One whole weight-update session applying `b` (selector: its names when `partial`, else every
// parameter), ending at `version`.
inline Status push_bucket(core::Engine& e, const RegistryBucket& b, bool partial, uint64_t version) {
  const auto now = core::SteadyClock::now();
  auto& u = e.updater();
  RD_ASSIGN_OR_RETURN(core::BeginResult s, u.begin(partial ? b.names : std::vector<std::string>{}, 60, now));
  RD_RETURN_IF_ERROR(u.apply_bucket(s.session, b.entries, b.bytes, std::nullopt, now).status());
  RD_RETURN_IF_ERROR(u.end(s.session, version, now).status());
  e.set_weight_version(version);
  return Status::Ok();
}

}  // namespace rolloutd::test
