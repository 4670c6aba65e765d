// Randomized schedules of the engine's public API: seeded sequences of submit, abort, abort_all,
// pause (abort, retract, in_place), resume, step and expire on a virtual clock, under KV pools of
// a few blocks (preemptions), checked against the contracts of engine.hpp and protocol/SPEC.md
// (§4.3 events, §5 routed-expert rows and preemption, §11.6 pausing) from the events and stats()
// alone. The seeds are fixed; a failure names its seed, the configuration and the last ops, and
// ROLLOUTD_SCHEDULE_SEED=<seed> runs that seed alone.
#include "core/engine/engine.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../test_util.hpp"

namespace rolloutd::core {
namespace {

using Clock = std::chrono::steady_clock;
using Kind = EngineEvent::Kind;
using test::embedded_engine;
using test::run_to_idle;
using test::small_limits;

// The same draws on every standard library (std::uniform_int_distribution's are not specified).
class Rng {
 public:
  explicit Rng(uint64_t seed) : g_(seed) {}
  int64_t uniform(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(g_() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool one_in(int64_t n) { return uniform(1, n) == 1; }

 private:
  std::mt19937_64 g_;
};

struct Config {
  uint64_t seed = 0;
  int64_t kv_blocks = 0, max_tokens = 0, max_running = 0, max_waiting = 0, max_blocks_per_seq = 0;
  int ops = 0;
};

std::string describe(const Config& c) {
  std::ostringstream os;
  os << "seed " << c.seed << ": kv_blocks " << c.kv_blocks << ", max_tokens " << c.max_tokens << ", max_running "
     << c.max_running << ", max_waiting " << c.max_waiting << ", max_blocks_per_seq " << c.max_blocks_per_seq
     << ", " << c.ops << " ops (ROLLOUTD_SCHEDULE_SEED=" << c.seed << " runs it alone)";
  return os.str();
}

Config config_for(uint64_t seed, int ops) {
  Rng r(seed);
  Config c;
  c.seed = seed;
  c.ops = ops;
  c.kv_blocks = r.uniform(3, 24);  // blocks of 4 positions; the longest request needs 14
  c.max_tokens = r.uniform(1, 16);
  c.max_running = r.uniform(1, 8);
  c.max_waiting = r.uniform(1, 12);
  c.max_blocks_per_seq = r.one_in(3) ? r.uniform(2, 12) : 64;  // sometimes the per-request bound binds
  return c;
}

StepLimits limits_for(const Config& c) {
  StepLimits l = small_limits(c.max_tokens, /*max_seqs=*/8, c.kv_blocks);
  l.max_blocks_per_seq = c.max_blocks_per_seq;
  return l;
}

// Summed over the seeds: each contract must have been exercised, not only never broken.
struct Coverage {
  uint64_t preemptions = 0, retracted = 0, tokens_discarded = 0, deadline_aborts = 0, overloaded = 0,
           out_of_range = 0, duplicates = 0, held_compared = 0, routed_rows = 0, stops = 0, lengths = 0,
           aborts = 0;
};

// What may come out of one call.
struct Allowed {
  bool tokens = false;          // tokens events, and finished{stop | length} (step)
  bool retracted = false;       // retracted events (pause retract)
  const char* abort = nullptr;  // finished{abort, this reason}
};

class Schedule {
 public:
  Schedule(const Config& cfg, Coverage& cov)
      : cfg_(cfg),
        cov_(cov),
        rng_(cfg.seed * 0x9E3779B97F4A7C15ull + 1),
        e_(embedded_engine(limits_for(cfg), cfg.max_running, cfg.max_waiting)) {
    const ModelConfig& m = e_->model_config();
    row_size_ = m.num_moe_layers() * m.num_experts_per_tok;
    num_experts_ = m.num_experts;
    vocab_ = m.vocab_size;
    block_size_ = limits_for(cfg).kv_block_size;
    free0_ = e_->stats().kv_blocks_free;
  }

  void run() {
    EXPECT_EQ(free0_, cfg_.kv_blocks);
    for (op_ = 0; op_ < cfg_.ops; ++op_) {
      now_ += std::chrono::milliseconds(1);
      const uint64_t preemptions = e_->stats().num_preemptions_total;
      int64_t dice = rng_.uniform(0, 99);
      // A request preempted after it began is in flight without KV until readmitted (soon): pause
      // often right after a step that preempted, or the schedules rarely meet that state.
      if (preempted_ && rng_.one_in(2)) dice = 31;
      preempted_ = false;
      bool stepped = false;
      if (dice < 25) {
        submit();
      } else if (dice < 30) {
        abort_one();
      } else if (dice < 31) {
        abort_all();
      } else if (dice < 33) {
        pause();
      } else if (dice < 40) {
        resume();
      } else {
        step();
        stepped = true;
        preempted_ = e_->stats().num_preemptions_total > preemptions;
      }
      if (!stepped) {
        EXPECT_EQ(e_->stats().num_preemptions_total, preemptions) << at() << ": only a step preempts";
      }
      expire();
      check_state();
      if (::testing::Test::HasFailure()) return report();
    }
    // Drain: continue if paused, then run to idle (the clock stands still: no more deadlines).
    op_ = cfg_.ops;
    if (e_->paused()) resume();
    note("run_to_idle");
    for (auto& [rid, r] : requests_) r.maybe_begun = r.ever_maybe_begun = true;
    consume(run_to_idle(*e_, 20000), Allowed{.tokens = true});
    check_state();
    for (const auto& [rid, r] : requests_) EXPECT_TRUE(r.ended) << at() << ": " << rid << " never ended";
    const EngineStats s = e_->stats();
    EXPECT_EQ(s.kv_blocks_free, free0_) << at() << ": KV blocks leaked";
    EXPECT_EQ(s.num_running, 0u) << at();
    EXPECT_EQ(s.num_waiting, 0u) << at();
    EXPECT_FALSE(e_->has_requests()) << at();
    EXPECT_EQ(s.num_deadline_aborts_total, deadline_finals_) << at();
    cov_.preemptions += s.num_preemptions_total;
    if (::testing::Test::HasFailure()) report();
  }

 private:
  struct Request {
    RequestSpec spec;
    bool ended = false;
    std::vector<int32_t> tokens;  // received since the last retracted event
    int64_t routed_next = -1;     // where the next row must start; -1: no row since the last retraction
    // In flight (SPEC 11.6: prefill begun, until a retraction) is not visible, but bounded: a request
    // that received tokens or rows since its last retraction has begun; one that no step ran for
    // since its submission or its last retraction has not.
    bool surely_begun = false;
    bool maybe_begun = false;
    // --max-waiting counts the requests queued that have not begun (preempted and retracted ones
    // had). Surely counted: no step ran since its submission. Surely not: it received output since
    // its last retraction, or before it and no step ran since (a step may admit it and send it back
    // before it begins again: then it is new again).
    bool surely_new = true;
    bool surely_old = false;
    bool ever_received = false, ever_maybe_begun = false;  // for the prompt-token counter's bounds
  };

  // Where a check failed: the last op noted (the schedule's ops are numbered from 0; op `ops` is
  // the drain after them).
  std::string at() const { return log_.empty() ? "op " + std::to_string(op_) : log_.back(); }
  void note(std::string what) {
    log_.push_back("op " + std::to_string(op_) + " at " + std::to_string(ms(now_)) + " ms: " + std::move(what));
    if (log_.size() > 12) log_.pop_front();
  }
  int64_t ms(Clock::time_point t) const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(t - kEpoch).count();
  }
  void report() const {
    std::ostringstream os;
    for (const auto& l : log_) os << "\n  " << l;
    ADD_FAILURE() << describe(cfg_) << "\nthe last ops:" << os.str();
  }

  bool live(const std::string& rid) const {
    auto it = requests_.find(rid);
    return it != requests_.end() && !it->second.ended;
  }
  std::vector<std::string> live_rids() const {
    std::vector<std::string> v;
    for (const auto& [rid, r] : requests_)
      if (!r.ended) v.push_back(rid);
    return v;
  }
  size_t count_live(bool Request::*flag) const {
    size_t n = 0;
    for (const auto& [rid, r] : requests_) n += !r.ended && r.*flag;
    return n;
  }

  RequestSpec random_spec() {
    RequestSpec s;
    const int64_t plen = rng_.uniform(1, 24);
    for (int64_t i = 0; i < plen; ++i) s.input_ids.push_back(static_cast<int32_t>(rng_.uniform(0, vocab_ - 1)));
    s.max_new_tokens = static_cast<uint32_t>(rng_.uniform(1, 30));
    s.sampling.temperature = rng_.one_in(2) ? 0.0f : 0.9f;
    s.sampling.seed = static_cast<uint64_t>(rng_.uniform(1, 1000));
    if (rng_.one_in(4))
      for (int k = 0; k < 20; ++k) s.stop_token_ids.push_back(static_cast<int32_t>(rng_.uniform(0, vocab_ - 1)));
    s.return_logprob = rng_.one_in(2);
    s.top_logprobs_num = rng_.one_in(4) ? static_cast<uint32_t>(rng_.uniform(1, 3)) : 0;
    s.return_routed_experts = rng_.one_in(3);
    s.routed_experts_start_len = static_cast<uint32_t>(
        rng_.one_in(4) ? rng_.uniform(0, plen + s.max_new_tokens) : rng_.uniform(0, plen + 3));
    s.tag = static_cast<uint64_t>(rng_.uniform(1, 3));
    if (rng_.one_in(4)) s.deadline = now_ + std::chrono::milliseconds(rng_.uniform(-2, 120));
    return s;
  }

  void submit() {
    RequestSpec s = random_spec();
    const auto alive = live_rids();
    const bool duplicate = !alive.empty() && rng_.one_in(12);
    if (duplicate) {
      s.rid = alive[static_cast<size_t>(rng_.uniform(0, static_cast<int64_t>(alive.size()) - 1))];
      s.tag = 1000;  // the request in flight keeps its own: events carrying 1000 would be this one's
    } else {
      s.rid = "r" + std::to_string(next_id_++);
    }
    // As submit() counts: the last sampled token is never fed back, so total - 1 positions need KV.
    const int64_t total = static_cast<int64_t>(s.input_ids.size()) + s.max_new_tokens;
    const int64_t blocks = (total - 1 + block_size_ - 1) / block_size_;
    const bool fits = blocks <= std::min(cfg_.kv_blocks, cfg_.max_blocks_per_seq);
    const EngineStats before = e_->stats();
    const size_t surely_new = count_live(&Request::surely_new);
    const size_t maybe_new =
        std::min<size_t>(before.num_waiting, live_rids().size() - count_live(&Request::surely_old));
    const Status st = e_->submit(s);
    note("submit " + s.rid + " (prompt " + std::to_string(s.input_ids.size()) + ", max_new " +
         std::to_string(s.max_new_tokens) + ", " + std::to_string(blocks) + " blocks" +
         (s.return_routed_experts ? ", routed from " + std::to_string(s.routed_experts_start_len) : "") +
         (s.deadline ? ", deadline at " + std::to_string(ms(*s.deadline)) + " ms" : "") +
         ") -> " + (st.ok() ? "ok" : st.to_string()));
    if (duplicate) {
      ++cov_.duplicates;
      EXPECT_EQ(st.code(), ErrorCode::kDuplicateRid) << at();
      EXPECT_EQ(e_->stats().num_requests_total, before.num_requests_total) << at();
      return;
    }
    if (!fits) {
      ++cov_.out_of_range;
      EXPECT_EQ(st.code(), ErrorCode::kOutOfRange) << at() << ": needs " << blocks << " blocks";
      EXPECT_EQ(st.field(), "max_new_tokens") << at();
    } else {
      EXPECT_TRUE(st.ok() || st.code() == ErrorCode::kOverloaded) << at() << ": fits, yet " << st.to_string();
      if (st.code() == ErrorCode::kOverloaded) {
        ++cov_.overloaded;
        // Only requests not yet begun count against the bound; every one of them is queued.
        EXPECT_GE(before.num_waiting, static_cast<uint64_t>(cfg_.max_waiting)) << at() << ": overloaded";
      }
      // Those submitted since the last step are queued and never begun: at the bound, refuse.
      if (static_cast<int64_t>(surely_new) >= cfg_.max_waiting) {
        EXPECT_EQ(st.code(), ErrorCode::kOverloaded) << at() << ": " << surely_new << " new requests queued";
      }
      if (static_cast<int64_t>(maybe_new) < cfg_.max_waiting) {
        EXPECT_TRUE(st.ok()) << at() << ": at most " << maybe_new << " new requests queued";
      }
    }
    if (!st.ok()) {
      EXPECT_FALSE(e_->contains(s.rid)) << at() << ": a refused request left a trace";
      EXPECT_EQ(e_->stats().num_requests_total, before.num_requests_total) << at();
      EXPECT_EQ(e_->stats().num_waiting, before.num_waiting) << at();
      return;
    }
    ++accepted_;
    Request& r = requests_[s.rid];
    r.spec = std::move(s);
  }

  void abort_one() {
    // Any rid submitted so far (in flight, ended or refused), or one never seen.
    const std::string rid = next_id_ > 0 && !rng_.one_in(8) ? "r" + std::to_string(rng_.uniform(0, next_id_ - 1)) : "x";
    const bool in = live(rid);
    std::vector<EngineEvent> out;
    const bool got = e_->abort(rid, "client", out);
    note("abort " + rid + " -> " + (got ? "true" : "false"));
    EXPECT_EQ(got, in) << at();
    EXPECT_EQ(out.size(), in ? 1u : 0u) << at();
    if (!out.empty()) {
      EXPECT_EQ(out[0].rid, rid) << at();
    }
    consume(out, Allowed{.abort = "client"});
  }

  void abort_all() {
    std::optional<uint64_t> tag;
    if (rng_.one_in(2)) tag = static_cast<uint64_t>(rng_.uniform(1, 3));
    size_t expected = 0;
    for (const auto& [rid, r] : requests_) expected += !r.ended && (!tag || r.spec.tag == *tag);
    std::vector<EngineEvent> out;
    const size_t n = e_->abort_all(tag ? "client_gone" : "shutdown", out, tag);
    note("abort_all" + (tag ? " tag " + std::to_string(*tag) : std::string()) + " -> " + std::to_string(n));
    EXPECT_EQ(n, expected) << at();
    EXPECT_EQ(out.size(), n) << at();
    for (const auto& ev : out) {
      if (tag) {
        EXPECT_EQ(ev.tag, *tag) << at() << ": " << ev.rid;
      }
    }
    consume(out, Allowed{.abort = tag ? "client_gone" : "shutdown"});
  }

  void pause() {
    const auto mode = static_cast<Engine::PauseMode>(rng_.uniform(0, 2));
    const bool was_paused = e_->paused();
    const size_t in_flight_min = count_live(&Request::surely_begun), in_flight_max = count_live(&Request::maybe_begun);
    const size_t alive = live_rids().size();
    std::set<std::string> must_retract, may_retract;
    for (const auto& [rid, r] : requests_) {
      if (!r.ended && r.surely_begun) must_retract.insert(rid);
      if (!r.ended && r.maybe_begun) may_retract.insert(rid);
    }
    const std::optional<uint32_t> held = held_;
    std::vector<EngineEvent> out;
    const Engine::PauseCounts c = e_->pause(mode, out);
    static const char* const kNames[] = {"abort", "retract", "in_place"};
    note(std::string("pause ") + kNames[static_cast<int>(mode)] + (was_paused ? " (paused)" : "") + " -> aborted " +
         std::to_string(c.aborted) + " retracted " + std::to_string(c.retracted) + " paused " +
         std::to_string(c.paused) + (held ? ", " + std::to_string(*held) + " held" : ""));
    EXPECT_TRUE(e_->paused()) << at();
    switch (mode) {
      case Engine::PauseMode::kAbort:
        EXPECT_EQ(c.aborted, alive) << at() << ": every request accepted and not ended";
        EXPECT_EQ(c.retracted + c.paused, 0u) << at();
        EXPECT_EQ(out.size(), alive) << at();
        consume(out, Allowed{.abort = "weight_update"});
        EXPECT_TRUE(live_rids().empty()) << at();
        held_ = 0;
        break;
      case Engine::PauseMode::kRetract: {
        EXPECT_EQ(c.aborted + c.paused, 0u) << at();
        EXPECT_EQ(c.retracted, out.size()) << at() << ": one retracted event per request counted";
        std::set<std::string> got;
        for (const auto& ev : out) {
          EXPECT_TRUE(got.insert(ev.rid).second) << at() << ": " << ev.rid << " retracted twice";
          EXPECT_TRUE(may_retract.count(ev.rid)) << at() << ": " << ev.rid << " retracted before any step ran for it";
        }
        for (const auto& rid : must_retract)
          EXPECT_TRUE(got.count(rid)) << at() << ": " << rid << " received output, yet was not retracted";
        // Only a held count known exactly can be compared: a pause while paused retracts those held.
        if (was_paused && held) {
          ++cov_.held_compared;
          EXPECT_EQ(c.retracted, *held) << at() << ": the requests held";
        }
        consume(out, Allowed{.retracted = true});
        for (auto& [rid, r] : requests_) r.maybe_begun = r.surely_begun = false;  // all restart from the prompt
        held_ = 0;
        break;
      }
      case Engine::PauseMode::kInPlace:
        EXPECT_EQ(c.aborted + c.retracted, 0u) << at();
        EXPECT_TRUE(out.empty()) << at();
        EXPECT_GE(c.paused, in_flight_min) << at() << ": requests that received output are in flight";
        EXPECT_LE(c.paused, in_flight_max) << at() << ": no step ran for the others";
        if (was_paused && held) {
          ++cov_.held_compared;
          EXPECT_EQ(c.paused, *held) << at() << ": a pause while paused holds the same requests";
        }
        held_ = c.paused;
        break;
    }
  }

  void resume() {
    const bool was_paused = e_->paused();
    const size_t in_flight_min = count_live(&Request::surely_begun), in_flight_max = count_live(&Request::maybe_begun);
    const std::optional<uint32_t> held = held_;
    const uint32_t n = e_->resume();
    note(std::string("resume") + (was_paused ? "" : " (not paused)") + " -> " + std::to_string(n) +
         (held ? ", " + std::to_string(*held) + " held" : ""));
    EXPECT_FALSE(e_->paused()) << at();
    if (!was_paused) {
      EXPECT_EQ(n, 0u) << at() << ": not paused, nothing resumed";
    } else {
      EXPECT_GE(n, in_flight_min) << at();
      EXPECT_LE(n, in_flight_max) << at();
      if (held) {
        // No step runs while paused: the requests the pause counted (less those ended since) resume.
        ++cov_.held_compared;
        EXPECT_EQ(n, *held) << at() << ": the pause's count";
      }
    }
    held_.reset();
  }

  void step() {
    const bool runs = !e_->paused();
    EXPECT_EQ(e_->has_work(), runs && e_->has_requests()) << at();
    std::vector<EngineEvent> out;
    const Status st = e_->step(out);
    note("step" + std::string(runs ? "" : " (paused)") + " -> " + std::to_string(out.size()) + " events, " +
         std::to_string(e_->stats().num_running) + " running, " + std::to_string(e_->stats().num_waiting) +
         " waiting, " + std::to_string(e_->stats().kv_blocks_free) + " blocks free");
    EXPECT_TRUE(st.ok()) << at() << ": " << st.to_string();
    if (!runs) {
      EXPECT_TRUE(out.empty()) << at() << ": a step while paused";
    } else {
      for (auto& [rid, r] : requests_) {
        if (r.ended) continue;
        r.maybe_begun = r.ever_maybe_begun = true;
        r.surely_new = false;
        r.surely_old = r.surely_begun;
      }
    }
    consume(out, Allowed{.tokens = true});
  }

  void expire() {
    std::vector<EngineEvent> out;
    const size_t n = e_->expire(now_, out);
    if (n > 0) note("expire -> " + std::to_string(n));
    EXPECT_EQ(n, out.size()) << at();
    consume(out, Allowed{.abort = "deadline"});
    for (const auto& [rid, r] : requests_) {
      if (!r.ended && r.spec.deadline) {
        EXPECT_GT(ms(*r.spec.deadline), ms(now_)) << at() << ": " << rid << " is past its deadline, not expired";
      }
    }
  }

  // One call's events, in order.
  void consume(const std::vector<EngineEvent>& out, const Allowed& allowed) {
    for (const EngineEvent& ev : out) {
      auto it = requests_.find(ev.rid);
      if (it == requests_.end()) {
        ADD_FAILURE() << at() << ": an event of " << ev.rid << ", never accepted";
        continue;
      }
      Request& r = it->second;
      const RequestSpec& s = r.spec;
      EXPECT_FALSE(r.ended) << at() << ": an event of " << ev.rid << " after its final one";
      EXPECT_EQ(ev.tag, s.tag) << at() << ": " << ev.rid;
      switch (ev.kind) {
        case Kind::kTokens: on_tokens(r, ev, allowed); break;
        case Kind::kRetracted:
          EXPECT_TRUE(allowed.retracted) << at() << ": a retracted event of " << ev.rid;
          EXPECT_EQ(ev.num_tokens_discarded, r.tokens.size()) << at() << ": " << ev.rid;
          ++cov_.retracted;
          cov_.tokens_discarded += ev.num_tokens_discarded;
          r.tokens.clear();
          r.routed_next = -1;
          r.surely_begun = r.maybe_begun = false;
          break;
        case Kind::kFinished:
        case Kind::kFailed: on_final(r, ev, allowed); break;
      }
    }
  }

  void on_tokens(Request& r, const EngineEvent& ev, const Allowed& allowed) {
    const RequestSpec& s = r.spec;
    EXPECT_TRUE(allowed.tokens) << at() << ": a tokens event of " << ev.rid;
    const size_t n = ev.token_ids.size();
    r.tokens.insert(r.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
    generated_ += n;
    EXPECT_LE(r.tokens.size(), s.max_new_tokens) << at() << ": " << ev.rid << " received more than max_new_tokens";
    EXPECT_EQ(ev.weight_versions.size(), n) << at();
    EXPECT_EQ(ev.logprobs.size(), s.return_logprob ? n : 0u) << at();
    EXPECT_EQ(ev.top_ids.size(), n * s.top_logprobs_num) << at();
    EXPECT_EQ(ev.top_logprobs.size(), n * s.top_logprobs_num) << at();
    for (int32_t t : ev.token_ids) EXPECT_TRUE(t >= 0 && t < vocab_) << at() << ": token " << t;
    if (ev.routed_num_tokens > 0) {
      EXPECT_TRUE(s.return_routed_experts) << at() << ": rows for " << ev.rid << ", which did not ask";
      // Rows start at routed_experts_start_len and continue where the last event ended (a
      // preemption's recomputation sends none twice), once per position.
      const int64_t expect = r.routed_next < 0 ? s.routed_experts_start_len : r.routed_next;
      EXPECT_EQ(ev.routed_start_pos, expect) << at() << ": rows of " << ev.rid << " with a gap or repeated";
      r.routed_next = ev.routed_start_pos + ev.routed_num_tokens;
      // A position's row comes from the pass that processed its token: never past the last token received.
      EXPECT_LE(r.routed_next, static_cast<int64_t>(s.input_ids.size() + r.tokens.size()) - 1)
          << at() << ": rows of " << ev.rid << " ahead of its tokens";
      EXPECT_EQ(ev.routed_rows.size(), static_cast<size_t>(ev.routed_num_tokens * row_size_)) << at();
      for (int32_t id : ev.routed_rows) EXPECT_TRUE(id >= 0 && id < num_experts_) << at() << ": expert " << id;
      cov_.routed_rows += static_cast<uint64_t>(ev.routed_num_tokens);
    } else {
      EXPECT_EQ(ev.routed_num_tokens, 0) << at();
      EXPECT_TRUE(ev.routed_rows.empty()) << at();
    }
    if (n > 0 || ev.routed_num_tokens > 0) r.surely_begun = r.surely_old = r.ever_received = true;
  }

  void on_final(Request& r, const EngineEvent& ev, const Allowed& allowed) {
    const RequestSpec& s = r.spec;
    EXPECT_EQ(ev.kind, Kind::kFinished) << at() << ": " << ev.rid << " failed: " << ev.error.to_string();
    EXPECT_EQ(ev.completion_tokens, r.tokens.size()) << at() << ": " << ev.rid << ", tokens since the last retraction";
    EXPECT_EQ(ev.prompt_tokens, s.input_ids.size()) << at();
    const auto is_stop = [&](int32_t t) {
      return std::find(s.stop_token_ids.begin(), s.stop_token_ids.end(), t) != s.stop_token_ids.end();
    };
    // A stop token ends the request: it can only be the last one.
    for (size_t i = 0; i + 1 < r.tokens.size(); ++i) EXPECT_FALSE(is_stop(r.tokens[i])) << at() << ": " << ev.rid;
    if (ev.finish_reason == "stop" || ev.finish_reason == "length") {
      EXPECT_TRUE(allowed.tokens) << at() << ": " << ev.rid << " finished " << ev.finish_reason;
      if (ev.finish_reason == "stop") {
        ++cov_.stops;
        EXPECT_TRUE(!r.tokens.empty() && is_stop(r.tokens.back())) << at() << ": " << ev.rid;
      } else {
        ++cov_.lengths;
        EXPECT_EQ(r.tokens.size(), s.max_new_tokens) << at() << ": " << ev.rid << " finished length";
        EXPECT_FALSE(!r.tokens.empty() && is_stop(r.tokens.back()))
            << at() << ": " << ev.rid << " sampled a stop token, finished length";
      }
      if (s.return_routed_experts) {
        // SPEC 5: exactly max(0, prompt + completion - 1 - routed_experts_start_len) rows.
        const int64_t end = std::max<int64_t>(static_cast<int64_t>(s.input_ids.size() + r.tokens.size()) - 1,
                                              s.routed_experts_start_len);
        EXPECT_EQ(r.routed_next < 0 ? int64_t{s.routed_experts_start_len} : r.routed_next, end)
            << at() << ": rows of " << ev.rid << " incomplete";
      }
    } else {
      ++cov_.aborts;
      EXPECT_EQ(ev.finish_reason, "abort") << at() << ": " << ev.rid;
      EXPECT_TRUE(allowed.abort && ev.abort_reason == allowed.abort)
          << at() << ": " << ev.rid << " aborted (" << ev.abort_reason << ") by "
          << (allowed.abort ? allowed.abort : "a call that does not abort");
      if (!r.tokens.empty()) {
        EXPECT_FALSE(is_stop(r.tokens.back())) << at() << ": " << ev.rid << " sampled a stop token";
      }
      if (ev.abort_reason == "deadline") {
        ++deadline_finals_;
        ++cov_.deadline_aborts;
        EXPECT_TRUE(s.deadline && *s.deadline <= now_)
            << at() << ": " << ev.rid << " expired at " << ms(now_) << " ms, its deadline "
            << (s.deadline ? std::to_string(ms(*s.deadline)) + " ms" : std::string("none"));
      }
    }
    r.ended = true;
    // A held count stays known while the requests that end were surely in flight or surely not.
    if (held_) {
      if (r.surely_begun) {
        EXPECT_GT(*held_, 0u) << at() << ": " << ev.rid << " was in flight, not counted";
        if (*held_ > 0) --*held_;
      } else if (r.maybe_begun) {
        held_.reset();
      }
    }
  }

  void check_state() {
    const EngineStats s = e_->stats();
    const auto alive = live_rids();
    EXPECT_EQ(s.num_waiting + s.num_running, alive.size()) << at();
    EXPECT_LE(s.num_running, static_cast<uint64_t>(cfg_.max_running)) << at();
    EXPECT_EQ(s.kv_blocks_total, cfg_.kv_blocks) << at();
    EXPECT_TRUE(s.kv_blocks_free >= 0 && s.kv_blocks_free <= cfg_.kv_blocks) << at();
    if (alive.empty()) {
      EXPECT_EQ(s.kv_blocks_free, free0_) << at() << ": idle, yet blocks are taken";
    }
    EXPECT_EQ(e_->has_requests(), !alive.empty()) << at();
    EXPECT_EQ(e_->has_work(), !alive.empty() && !e_->paused()) << at();
    EXPECT_EQ(s.num_requests_total, accepted_) << at();
    EXPECT_EQ(s.num_generated_tokens_total, generated_) << at() << ": every token sampled was delivered";
    EXPECT_EQ(s.num_deadline_aborts_total, deadline_finals_) << at();
    EXPECT_GE(s.num_preemptions_total, last_.num_preemptions_total) << at();
    EXPECT_GE(s.num_recomputed_tokens_total, last_.num_recomputed_tokens_total) << at();
    EXPECT_GE(s.num_recomputed_tokens_total, s.num_preemptions_total) << at() << ": a preemption drops some KV";
    uint64_t prompt_min = 0, prompt_max = 0;
    std::optional<Clock::time_point> earliest;
    for (const auto& [rid, r] : requests_) {
      EXPECT_EQ(e_->contains(rid), !r.ended) << at() << ": " << rid;
      if (r.ever_received) prompt_min += r.spec.input_ids.size();
      if (r.ever_maybe_begun) prompt_max += r.spec.input_ids.size();
      if (!r.ended && r.spec.deadline && (!earliest || *r.spec.deadline < *earliest)) earliest = r.spec.deadline;
    }
    EXPECT_GE(s.num_prompt_tokens_total, prompt_min) << at();
    EXPECT_LE(s.num_prompt_tokens_total, prompt_max) << at();
    if (earliest) {
      // It may name a request gone since (then earlier than any in flight), never a later one.
      EXPECT_TRUE(e_->next_deadline() && *e_->next_deadline() <= *earliest) << at();
    }
    last_ = s;
  }

  const Config cfg_;
  Coverage& cov_;
  Rng rng_;
  std::unique_ptr<Engine> e_;
  int64_t row_size_ = 0, num_experts_ = 0, vocab_ = 0, block_size_ = 0, free0_ = 0;
  static constexpr Clock::time_point kEpoch{std::chrono::hours(1)};
  Clock::time_point now_ = kEpoch;  // virtual: one millisecond per op
  int op_ = 0;
  int next_id_ = 0;
  std::map<std::string, Request> requests_;  // every one accepted
  uint64_t accepted_ = 0, generated_ = 0, deadline_finals_ = 0;
  // While paused: how many requests are held in flight, when that is known exactly (a pause's count,
  // less those that ended since; unknown once one that may or may not have begun ends).
  std::optional<uint32_t> held_;
  EngineStats last_;
  std::deque<std::string> log_;
  bool preempted_ = false;  // the last op was a step that preempted
};

constexpr int kSeeds = 32;
constexpr int kOps = 300;

TEST(EngineSchedule, RandomSchedulesKeepTheContracts) {
  Coverage cov;
  uint64_t first = 1, last = kSeeds;
  if (const char* one = std::getenv("ROLLOUTD_SCHEDULE_SEED")) first = last = std::strtoull(one, nullptr, 10);
  for (uint64_t seed = first; seed <= last; ++seed) {
    Schedule(config_for(seed, kOps), cov).run();
    if (HasFailure()) return;  // the first failing seed is the one to look at
  }
  if (first != last) {
    // The schedules must reach what they check.
    EXPECT_GT(cov.preemptions, 0u);
    EXPECT_GT(cov.retracted, 0u);
    EXPECT_GT(cov.tokens_discarded, 0u);
    EXPECT_GT(cov.deadline_aborts, 0u);
    EXPECT_GT(cov.overloaded, 0u);
    EXPECT_GT(cov.out_of_range, 0u);
    EXPECT_GT(cov.duplicates, 0u);
    EXPECT_GT(cov.held_compared, 0u);
    EXPECT_GT(cov.routed_rows, 0u);
    EXPECT_GT(cov.stops, 0u);
    EXPECT_GT(cov.lengths, 0u);
    EXPECT_GT(cov.aborts, 0u);
  }
}

// Everything one request received, by rid.
struct Output {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::map<int64_t, std::vector<int32_t>> rows;  // by position
  int finals = 0;
  std::string reason;
  uint32_t completion_tokens = 0;
};

TEST(EngineSchedule, PreemptionKeepsTokens) {
  // The same requests (greedy and seeded sampling, no pause, abort or deadline) in a pool that holds
  // them all and in one that holds about one at its end: the youngest running requests are
  // preempted and computed again, and every request gets the same tokens, log-probs and rows.
  uint64_t preemptions = 0;
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    Rng rng(seed * 7919);
    std::vector<RequestSpec> reqs;
    const int64_t n = rng.uniform(3, 12);
    for (int64_t i = 0; i < n; ++i) {
      RequestSpec s;
      s.rid = "q" + std::to_string(i);
      const int64_t plen = rng.uniform(1, 20);
      for (int64_t k = 0; k < plen; ++k) s.input_ids.push_back(static_cast<int32_t>(rng.uniform(0, 255)));
      s.max_new_tokens = static_cast<uint32_t>(rng.uniform(1, 24));
      s.sampling.temperature = rng.one_in(2) ? 0.0f : 0.9f;
      s.sampling.seed = static_cast<uint64_t>(rng.uniform(1, 1000));
      s.return_logprob = true;
      s.return_routed_experts = rng.one_in(2);
      s.routed_experts_start_len = static_cast<uint32_t>(rng.uniform(0, plen));
      reqs.push_back(s);
    }
    auto run = [&](int64_t kv_blocks, int64_t max_tokens, EngineStats* stats) {
      auto e = embedded_engine(small_limits(max_tokens, 8, kv_blocks), 8, 64);
      for (const auto& r : reqs) EXPECT_TRUE(e->submit(r).ok()) << r.rid;
      std::map<std::string, Output> m;
      for (const EngineEvent& ev : run_to_idle(*e, 20000)) {
        Output& o = m[ev.rid];
        if (ev.kind != Kind::kTokens) {
          ++o.finals;
          o.reason = ev.finish_reason;
          o.completion_tokens = ev.completion_tokens;
          continue;
        }
        o.tokens.insert(o.tokens.end(), ev.token_ids.begin(), ev.token_ids.end());
        o.logprobs.insert(o.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
        const int64_t row = static_cast<int64_t>(ev.routed_rows.size()) / std::max<int64_t>(1, ev.routed_num_tokens);
        for (int64_t t = 0; t < ev.routed_num_tokens; ++t) {
          EXPECT_EQ(o.rows.count(ev.routed_start_pos + t), 0u) << ev.rid << " position " << ev.routed_start_pos + t;
          o.rows[ev.routed_start_pos + t].assign(ev.routed_rows.begin() + t * row,
                                                 ev.routed_rows.begin() + (t + 1) * row);
        }
      }
      EXPECT_EQ(e->stats().kv_blocks_free, kv_blocks);
      *stats = e->stats();
      return m;
    };
    EngineStats roomy_stats;
    auto roomy = run(256, 16, &roomy_stats);
    EXPECT_EQ(roomy_stats.num_preemptions_total, 0u);
    // 11 blocks, 44 positions: the longest request (20 + 24 - 1) fits alone.
    for (int64_t max_tokens : {3, 16}) {
      SCOPED_TRACE("11 blocks, max_tokens " + std::to_string(max_tokens));
      EngineStats tiny_stats;
      auto tiny = run(11, max_tokens, &tiny_stats);
      preemptions += tiny_stats.num_preemptions_total;
      for (const auto& r : reqs) {
        const Output& a = tiny[r.rid];
        const Output& b = roomy[r.rid];
        EXPECT_EQ(a.finals, 1) << r.rid;
        EXPECT_EQ(a.reason, "length") << r.rid;
        EXPECT_EQ(a.completion_tokens, r.max_new_tokens) << r.rid;
        EXPECT_EQ(a.tokens, b.tokens) << r.rid;
        ASSERT_EQ(a.logprobs.size(), b.logprobs.size()) << r.rid;
        for (size_t i = 0; i < a.logprobs.size(); ++i) EXPECT_NEAR(a.logprobs[i], b.logprobs[i], 1e-4) << r.rid;
        EXPECT_EQ(a.rows, b.rows) << r.rid;
        if (r.return_routed_experts) {
          EXPECT_EQ(a.rows.size(), r.input_ids.size() + r.max_new_tokens - 1 - r.routed_experts_start_len) << r.rid;
        }
      }
      if (HasFailure()) return;
    }
  }
  EXPECT_GT(preemptions, 0u) << "the tiny pools must preempt for this test to mean anything";
}

}  // namespace
}  // namespace rolloutd::core
