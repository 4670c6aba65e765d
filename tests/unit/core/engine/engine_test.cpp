#include "core/engine/engine.hpp"

#include <algorithm>
#include <cmath>
#include <map>

#include "../model/hf_test_util.hpp"
#include "../test_util.hpp"

namespace rolloutd::core {
namespace {

using test::embedded_engine;
using test::run_to_idle;
using test::small_limits;

RequestSpec spec(const std::string& rid, std::vector<int32_t> prompt, uint32_t max_new, float temperature = 0.0f,
                 uint64_t seed = 1) {
  RequestSpec s;
  s.rid = rid;
  s.input_ids = std::move(prompt);
  s.max_new_tokens = max_new;
  s.sampling.temperature = temperature;
  s.sampling.seed = seed;
  s.return_logprob = true;
  return s;
}

struct Collected {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<uint64_t> versions;
  int finals = 0;
  std::string reason, abort_reason;
  uint32_t completion_tokens = 0;
};

std::map<std::string, Collected> collect(const std::vector<EngineEvent>& events) {
  std::map<std::string, Collected> m;
  for (const auto& e : events) {
    auto& c = m[e.rid];
    if (e.kind == EngineEvent::Kind::kTokens) {
      EXPECT_EQ(c.finals, 0) << "tokens after the final event of " << e.rid;
      c.tokens.insert(c.tokens.end(), e.token_ids.begin(), e.token_ids.end());
      c.logprobs.insert(c.logprobs.end(), e.logprobs.begin(), e.logprobs.end());
      c.versions.insert(c.versions.end(), e.weight_versions.begin(), e.weight_versions.end());
    } else {
      ++c.finals;
      c.reason = e.kind == EngineEvent::Kind::kFinished ? e.finish_reason : "failed";
      c.abort_reason = e.abort_reason;
      c.completion_tokens = e.completion_tokens;
    }
  }
  return m;
}

TEST(Engine, RejectsBadRequestsWithTypedErrorsAndNoTrace) {
  auto e = embedded_engine(small_limits(), 4, 2);
  Status s = e->submit(spec("a", {1, 256}, 4));
  EXPECT_EQ(s.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(s.field(), "input_ids[1]");
  s = e->submit(spec("a", {-1}, 4));
  EXPECT_EQ(s.field(), "input_ids[0]");
  s = e->submit(spec("a", {}, 4));
  EXPECT_EQ(s.field(), "input_ids");
  s = e->submit(spec("a", {1}, 0));
  EXPECT_EQ(s.field(), "max_new_tokens");
  s = e->submit(spec("a", {1}, 5000));  // beyond the 4096 context
  EXPECT_EQ(s.code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(s.field(), "max_new_tokens");
  auto bad_stop = spec("a", {1}, 4);
  bad_stop.stop_token_ids = {3, 999};
  EXPECT_EQ(e->submit(bad_stop).field(), "stop_token_ids[1]");
  auto bad_temp = spec("a", {1}, 4, -0.5f);
  EXPECT_EQ(e->submit(bad_temp).field(), "temperature");
  EXPECT_FALSE(e->has_work());
  EXPECT_EQ(e->stats().num_requests_total, 0u);

  ASSERT_TRUE(e->submit(spec("a", {1}, 4)).ok());
  EXPECT_EQ(e->submit(spec("a", {2}, 4)).code(), ErrorCode::kDuplicateRid);
  ASSERT_TRUE(e->submit(spec("b", {1}, 4)).ok());
  EXPECT_EQ(e->submit(spec("c", {1}, 4)).code(), ErrorCode::kOverloaded) << "max_waiting = 2";
}

TEST(Engine, EveryRequestEndsWithExactlyOneFinalEventAndNoBlockLeaks) {
  auto e = embedded_engine(small_limits(16, 4, 40), 4, 64);
  const int64_t free0 = e->stats().kv_blocks_free;
  for (int i = 0; i < 12; ++i)
    ASSERT_TRUE(e->submit(spec("r" + std::to_string(i), {i, i + 1, i + 2, 3, 4, 5, 6}, 10 + i, 0.7f, i)).ok());
  auto events = run_to_idle(*e);
  auto m = collect(events);
  ASSERT_EQ(m.size(), 12u);
  for (int i = 0; i < 12; ++i) {
    const auto& c = m["r" + std::to_string(i)];
    EXPECT_EQ(c.finals, 1);
    EXPECT_EQ(c.reason, "length");
    EXPECT_EQ(c.tokens.size(), static_cast<size_t>(10 + i));
    EXPECT_EQ(c.completion_tokens, static_cast<uint32_t>(10 + i));
    EXPECT_EQ(c.logprobs.size(), c.tokens.size());
    for (float lp : c.logprobs) EXPECT_LE(lp, 0.0f);
    for (uint64_t v : c.versions) EXPECT_EQ(v, 0u);
  }
  EXPECT_EQ(e->stats().kv_blocks_free, free0);
}

TEST(Engine, BatchingDoesNotChangeResults) {
  // The same requests alone, and mixed into a busy batch with chunked prefill, give the
  // same tokens (greedy and seeded sampling) and log-probs within FP32 noise.
  std::vector<RequestSpec> probes = {spec("g", {5, 6, 7, 8, 9, 10, 11}, 12, 0.0f),
                                     spec("s", {100, 3, 250}, 12, 0.9f, 4242)};
  std::map<std::string, Collected> alone;
  for (const auto& p : probes) {
    auto e = embedded_engine(small_limits(64, 8, 128));
    ASSERT_TRUE(e->submit(p).ok());
    auto m = collect(run_to_idle(*e));
    alone[p.rid] = m[p.rid];
  }
  auto e = embedded_engine(small_limits(/*max_tokens=*/5, 8, 128));
  ASSERT_TRUE(e->submit(spec("x1", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, 20, 1.0f, 1)).ok());
  std::vector<EngineEvent> events;
  ASSERT_TRUE(e->step(events).ok());  // x1 is mid-prefill when the probes arrive
  for (const auto& p : probes) ASSERT_TRUE(e->submit(p).ok());
  ASSERT_TRUE(e->submit(spec("x2", {42}, 30, 1.0f, 2)).ok());
  auto rest = run_to_idle(*e);
  events.insert(events.end(), rest.begin(), rest.end());
  auto m = collect(events);
  for (const auto& p : probes) {
    EXPECT_EQ(m[p.rid].tokens, alone[p.rid].tokens) << p.rid;
    ASSERT_EQ(m[p.rid].logprobs.size(), alone[p.rid].logprobs.size());
    for (size_t i = 0; i < m[p.rid].logprobs.size(); ++i)
      EXPECT_NEAR(m[p.rid].logprobs[i], alone[p.rid].logprobs[i], 1e-4);
  }
}

TEST(Engine, TopLogprobsAreTheModelsMostLikelyTokens) {
  // Checked against the same model's logits from one prefill of each finished sequence, with a
  // double log-softmax and a full sort here (not the sampling op's code).
  const auto limits = small_limits();
  auto e = embedded_engine(limits);
  std::map<std::string, RequestSpec> specs;
  specs["t"] = spec("t", {17, 42, 99}, 8);  // greedy
  specs["t"].top_logprobs_num = 5;
  specs["u"] = spec("u", {3, 1, 4, 1, 5}, 8, 1.0f, 7);  // sampled
  specs["u"].top_logprobs_num = 20;
  specs["plain"] = spec("plain", {9, 8}, 4);
  auto too_many = spec("x", {1}, 2);
  too_many.top_logprobs_num = 21;
  EXPECT_EQ(e->submit(too_many).code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(e->submit(too_many).field(), "top_logprobs_num");
  for (const auto& [rid, sp] : specs) ASSERT_TRUE(e->submit(sp).ok()) << rid;
  std::map<std::string, std::vector<int32_t>> ids;
  std::map<std::string, std::vector<float>> lps;
  for (const EngineEvent& ev : run_to_idle(*e)) {
    if (ev.kind != EngineEvent::Kind::kTokens) continue;
    const size_t n = specs[ev.rid].top_logprobs_num;
    if (!ev.token_ids.empty()) {
      EXPECT_EQ(ev.top_logprobs_num, n) << ev.rid;
    }
    EXPECT_EQ(ev.top_ids.size(), ev.token_ids.size() * n) << ev.rid;
    EXPECT_EQ(ev.top_logprobs.size(), ev.token_ids.size() * n) << ev.rid;
    ids[ev.rid].insert(ids[ev.rid].end(), ev.top_ids.begin(), ev.top_ids.end());
    lps[ev.rid].insert(lps[ev.rid].end(), ev.top_logprobs.begin(), ev.top_logprobs.end());
  }
  EXPECT_TRUE(ids["plain"].empty());
  // The events again, for the tokens and their log-probs.
  auto e2 = embedded_engine(limits);
  for (const auto& [rid, sp] : specs) ASSERT_TRUE(e2->submit(sp).ok());
  auto got = collect(run_to_idle(*e2));
  auto model = test::embedded_model(limits);
  const int64_t V = model->config().vocab_size;
  for (const std::string rid : {"t", "u"}) {
    SCOPED_TRACE(rid);
    const RequestSpec& sp = specs[rid];
    const auto n = static_cast<size_t>(sp.top_logprobs_num);
    const Collected& c = got[rid];
    ASSERT_EQ(c.tokens.size(), sp.max_new_tokens);
    ASSERT_EQ(ids[rid].size(), c.tokens.size() * n);
    std::vector<int32_t> seq = sp.input_ids;
    seq.insert(seq.end(), c.tokens.begin(), c.tokens.end() - 1);  // the last token is never fed
    StepBatch b = test::single_sequence_prefill(seq, limits.kv_block_size);
    for (size_t j = 0; j < c.tokens.size(); ++j)
      b.logits_rows.push_back(static_cast<int32_t>(sp.input_ids.size() - 1 + j));
    std::vector<float> logits;
    ASSERT_TRUE(model->forward(b, logits, nullptr).ok());
    for (size_t j = 0; j < c.tokens.size(); ++j) {
      const float* l = logits.data() + j * static_cast<size_t>(V);
      double m = l[0], z = 0;
      for (int64_t i = 0; i < V; ++i) m = std::max(m, static_cast<double>(l[i]));
      for (int64_t i = 0; i < V; ++i) z += std::exp(static_cast<double>(l[i]) - m);
      std::vector<int32_t> order(static_cast<size_t>(V));
      for (int64_t i = 0; i < V; ++i) order[static_cast<size_t>(i)] = static_cast<int32_t>(i);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t x) { return l[a] > l[x]; });
      for (size_t k = 0; k < n; ++k) {
        EXPECT_EQ(ids[rid][j * n + k], order[k]) << "token " << j << " entry " << k;
        EXPECT_NEAR(lps[rid][j * n + k], l[order[k]] - m - std::log(z), 1e-4) << "token " << j << " entry " << k;
        if (ids[rid][j * n + k] == c.tokens[j]) {  // the sampled token's entry is its log-prob exactly
          EXPECT_EQ(lps[rid][j * n + k], c.logprobs[j]) << "token " << j;
        }
      }
      if (rid == "t") {
        EXPECT_EQ(ids[rid][j * n], c.tokens[j]) << "greedy: the first entry is the token";
      }
    }
  }
}

TEST(Engine, StopTokenEndsWithReasonStop) {
  auto e = embedded_engine(small_limits());
  // Greedy continuation of [17, 42, 99] starts 127, 157, 244 (tests/reference golden).
  auto s = spec("a", {17, 42, 99}, 16);
  s.stop_token_ids = {244};
  ASSERT_TRUE(e->submit(s).ok());
  auto m = collect(run_to_idle(*e));
  EXPECT_EQ(m["a"].reason, "stop");
  EXPECT_EQ(m["a"].tokens, (std::vector<int32_t>{127, 157, 244}));
}

TEST(Engine, AbortOneAndAll) {
  auto e = embedded_engine(small_limits(8, 4, 64), 2, 16);
  const int64_t free0 = e->stats().kv_blocks_free;
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(e->submit(spec("r" + std::to_string(i), {1, 2, 3}, 50)).ok());
  std::vector<EngineEvent> events;
  ASSERT_TRUE(e->step(events).ok());
  ASSERT_TRUE(e->step(events).ok());
  EXPECT_TRUE(e->abort("r0", "client", events));   // running
  EXPECT_TRUE(e->abort("r4", "client", events));   // waiting
  EXPECT_FALSE(e->abort("r4", "client", events));  // already gone
  EXPECT_FALSE(e->abort("nope", "client", events));
  ASSERT_TRUE(e->step(events).ok());
  EXPECT_EQ(e->abort_all("shutdown", events), 3u);
  EXPECT_FALSE(e->has_work());
  auto m = collect(events);
  for (int i = 0; i < 5; ++i) {
    const auto& c = m["r" + std::to_string(i)];
    EXPECT_EQ(c.finals, 1) << i;
    EXPECT_EQ(c.reason, "abort");
    EXPECT_EQ(c.abort_reason, (i == 0 || i == 4) ? "client" : "shutdown");
  }
  EXPECT_EQ(e->stats().kv_blocks_free, free0);
}

TEST(Engine, AbortAllByTagOnlyTouchesThatClient) {
  auto e = embedded_engine(small_limits());
  auto a = spec("a", {1}, 8);
  a.tag = 1;
  auto b = spec("b", {1}, 8);
  b.tag = 2;
  ASSERT_TRUE(e->submit(a).ok());
  ASSERT_TRUE(e->submit(b).ok());
  std::vector<EngineEvent> ev;
  EXPECT_EQ(e->abort_all("client_gone", ev, 1), 1u);
  EXPECT_TRUE(e->contains("b"));
  EXPECT_FALSE(e->contains("a"));
}

TEST(Engine, RoutedRecordsStartAtTheRequestedPositionAndCountForwardedTokens) {
  auto e = embedded_engine(small_limits(4, 4, 64), 4);
  auto s = spec("a", {1, 2, 3, 4, 5, 6}, 5);
  s.return_routed_experts = true;
  s.routed_experts_start_len = 2;
  ASSERT_TRUE(e->submit(s).ok());
  auto events = run_to_idle(*e);
  const auto& c = e->model_config();
  int64_t rows = 0, next = 2;
  for (const auto& ev : events) {
    if (ev.kind != EngineEvent::Kind::kTokens || ev.routed_num_tokens == 0) continue;
    EXPECT_EQ(ev.routed_start_pos, next);
    next += ev.routed_num_tokens;
    rows += ev.routed_num_tokens;
    ASSERT_EQ(ev.routed_rows.size(),
              static_cast<size_t>(ev.routed_num_tokens * c.num_moe_layers() * c.num_experts_per_tok));
    for (int32_t id : ev.routed_rows) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, c.num_experts);
    }
  }
  // prompt 6 + generated 5 - 1 (the last sampled token is never forwarded) - start 2.
  EXPECT_EQ(rows, 6 + 5 - 1 - 2);
}

TEST(Engine, WeightVersionIsStampedOnEveryToken) {
  auto e = embedded_engine(small_limits());
  e->set_weight_version(7);
  ASSERT_TRUE(e->submit(spec("a", {9, 9}, 3)).ok());
  auto m = collect(run_to_idle(*e));
  EXPECT_EQ(m["a"].versions, (std::vector<uint64_t>{7, 7, 7}));
}

// Expert records of one request, by position; each position must arrive once.
std::map<int64_t, std::vector<int32_t>> routed_by_position(const std::vector<EngineEvent>& events,
                                                          const std::string& rid, int64_t row_size) {
  std::map<int64_t, std::vector<int32_t>> m;
  for (const auto& ev : events) {
    if (ev.rid != rid || ev.kind != EngineEvent::Kind::kTokens) continue;
    for (int64_t t = 0; t < ev.routed_num_tokens; ++t) {
      const int64_t pos = ev.routed_start_pos + t;
      EXPECT_EQ(m.count(pos), 0u) << rid << ": position " << pos << " recorded twice";
      m[pos].assign(ev.routed_rows.begin() + t * row_size, ev.routed_rows.begin() + (t + 1) * row_size);
    }
  }
  return m;
}

TEST(Engine, AdmissionTakesOnlyThePromptsBlocksSoLongGenerationsRunTogether) {
  // 40 blocks of 4 tokens. Four requests of 8 + 60 tokens need 17 blocks each at their end:
  // reserved up front only two would run at once; admitted by their prompts (2 blocks) all do.
  auto e = embedded_engine(small_limits(64, 8, 40), 8);
  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE(e->submit(spec("r" + std::to_string(i), {1, 2, 3, 4, 5, 6, 7, i}, 60)).ok());
  std::vector<EngineEvent> events;
  ASSERT_TRUE(e->step(events).ok());
  EXPECT_EQ(e->stats().num_running, 4u);
  EXPECT_EQ(e->stats().num_waiting, 0u);
  EXPECT_EQ(e->stats().kv_blocks_free, 40 - 4 * 2);
}

TEST(Engine, ARunningRequestIsPreemptedWhenBlocksRunOutAndFinishesWithTheSameResults) {
  // The same requests with a pool that holds them all, and with one that holds ~1.5 of them
  // at their full length: the youngest running requests go back to the queue (their KV is
  // computed again when readmitted) and every request ends with the tokens, log-probs and
  // expert records it gets with the large pool, each record sent once, no block leaked.
  std::vector<RequestSpec> reqs;
  for (int i = 0; i < 5; ++i) {
    auto r = spec("r" + std::to_string(i), {3 + i, 40, 41, 42, 43, 7 * i}, 40, i % 2 ? 0.8f : 0.0f, 100 + i);
    r.return_routed_experts = true;
    r.routed_experts_start_len = static_cast<uint32_t>(i);
    reqs.push_back(r);
  }
  auto run = [&](int64_t kv_blocks, EngineStats* stats) {
    auto e = embedded_engine(small_limits(16, 8, kv_blocks), 8);
    const int64_t free0 = e->stats().kv_blocks_free;
    for (const auto& r : reqs) EXPECT_TRUE(e->submit(r).ok());
    auto events = run_to_idle(*e);
    EXPECT_EQ(e->stats().kv_blocks_free, free0);
    *stats = e->stats();
    return events;
  };
  EngineStats big_stats, small_stats;
  const auto big = run(128, &big_stats);
  const auto small = run(18, &small_stats);  // one request at its end: 46 positions, 12 blocks
  EXPECT_EQ(big_stats.num_preemptions_total, 0u);
  EXPECT_GT(small_stats.num_preemptions_total, 0u);
  EXPECT_GT(small_stats.num_recomputed_tokens_total, 0u);
  EXPECT_EQ(small_stats.num_prompt_tokens_total, big_stats.num_prompt_tokens_total);
  EXPECT_EQ(small_stats.num_generated_tokens_total, 5u * 40u);
  auto mb = collect(big), ms = collect(small);
  const ModelConfig c = embedded_engine(small_limits())->model_config();  // a copy: the engine is a temporary
  const int64_t row = c.num_moe_layers() * c.num_experts_per_tok;
  for (const auto& r : reqs) {
    const auto& a = ms[r.rid];
    const auto& b = mb[r.rid];
    EXPECT_EQ(a.finals, 1) << r.rid;
    EXPECT_EQ(a.reason, "length") << r.rid;
    EXPECT_EQ(a.completion_tokens, 40u) << r.rid;
    EXPECT_EQ(a.tokens, b.tokens) << r.rid;
    ASSERT_EQ(a.logprobs.size(), b.logprobs.size()) << r.rid;
    for (size_t i = 0; i < a.logprobs.size(); ++i) EXPECT_NEAR(a.logprobs[i], b.logprobs[i], 1e-4) << r.rid;
    const auto ra = routed_by_position(small, r.rid, row), rb = routed_by_position(big, r.rid, row);
    // Every position from routed_experts_start_len to the last one forwarded, once.
    ASSERT_EQ(ra.size(), static_cast<size_t>(6 + 40 - 1 - r.routed_experts_start_len)) << r.rid;
    EXPECT_EQ(ra.begin()->first, r.routed_experts_start_len) << r.rid;
    EXPECT_EQ(ra, rb) << r.rid;
  }
}

TEST(Engine, APreemptedRequestIsInFlightForPausesAndTheQueueBound) {
  // a decodes and grows; b's long prompt is prefilled 1 token a step (budget 2, decode first), its
  // expert records streaming, until a's growth takes b's blocks: b goes back to the queue having
  // sent records but holding no KV. A retract must then void those records (a retracted event,
  // rows again from routed_experts_start_len); pauses count b as in flight; b does not take a
  // place in the waiting queue's bound.
  auto e = embedded_engine(small_limits(/*max_tokens=*/2, 8, /*kv_blocks=*/10), 8, /*max_waiting=*/2);
  ASSERT_TRUE(e->submit(spec("a", {1, 2, 3, 4}, 30)).ok());
  std::vector<int32_t> long_prompt(24);
  for (int i = 0; i < 24; ++i) long_prompt[static_cast<size_t>(i)] = 5 + i;
  auto b = spec("b", long_prompt, 2);
  b.return_routed_experts = true;
  ASSERT_TRUE(e->submit(b).ok());
  std::vector<EngineEvent> events;
  for (int i = 0; i < 200 && e->stats().num_preemptions_total == 0; ++i) ASSERT_TRUE(e->step(events).ok());
  ASSERT_EQ(e->stats().num_preemptions_total, 1u);
  int64_t rows_before = 0;
  for (const auto& ev : events)
    if (ev.rid == "b") rows_before += ev.routed_num_tokens;
  ASSERT_GT(rows_before, 0);
  ASSERT_LT(rows_before, 24) << "b must be preempted mid-prefill";
  EXPECT_EQ(e->stats().num_running, 1u);
  EXPECT_EQ(e->stats().num_waiting, 1u);
  // Two new requests fit the bound of 2 beside the preempted b; a third does not.
  ASSERT_TRUE(e->submit(spec("c", {1}, 2)).ok());
  ASSERT_TRUE(e->submit(spec("d", {1}, 2)).ok());
  EXPECT_EQ(e->submit(spec("x", {1}, 2)).code(), ErrorCode::kOverloaded);
  EXPECT_TRUE(e->abort("c", "client", events));
  EXPECT_TRUE(e->abort("d", "client", events));
  std::vector<EngineEvent> after;
  EXPECT_EQ(e->pause(Engine::PauseMode::kInPlace, after).paused, 2u);
  EXPECT_EQ(e->pause(Engine::PauseMode::kRetract, after).retracted, 2u);
  e->resume();
  auto rest = run_to_idle(*e);
  after.insert(after.end(), rest.begin(), rest.end());
  int retracted_b = 0;
  int64_t next = 0;
  for (const auto& ev : after) {
    if (ev.rid != "b") continue;
    if (ev.kind == EngineEvent::Kind::kRetracted) {
      ++retracted_b;
      EXPECT_EQ(next, 0) << "records before the retracted event";
    } else if (ev.kind == EngineEvent::Kind::kTokens && ev.routed_num_tokens > 0) {
      EXPECT_EQ(ev.routed_start_pos, next);
      next += ev.routed_num_tokens;
    }
  }
  EXPECT_EQ(retracted_b, 1);
  EXPECT_EQ(next, 24 + 2 - 1) << "every position recorded once after the retraction";
  int finals = 0;
  for (const auto& ev : after)
    if (ev.kind == EngineEvent::Kind::kFinished) {
      ++finals;
      EXPECT_EQ(ev.finish_reason, "length") << ev.rid;
    }
  EXPECT_EQ(finals, 2);
  EXPECT_EQ(e->stats().kv_blocks_free, 10);
}

int count_kind(const std::vector<EngineEvent>& events, const std::string& rid, EngineEvent::Kind kind) {
  int n = 0;
  for (const auto& ev : events) n += ev.rid == rid && ev.kind == kind;
  return n;
}

TEST(Engine, InFlightIsOneRuleForInPlaceRetractAndContinue) {
  // SPEC 11.6: in flight = prefill begun, or preempted after it began. (1) b, preempted
  // mid-prefill without asking for expert records, is in flight: in_place and retract count
  // it and it gets its retracted event. (2) A request admitted while the step's token budget
  // ran out before its prefill has not begun: no count, no event.
  {
    auto e = embedded_engine(small_limits(/*max_tokens=*/2, 8, /*kv_blocks=*/10), 8, 8);
    ASSERT_TRUE(e->submit(spec("a", {1, 2, 3, 4}, 30)).ok());
    std::vector<int32_t> long_prompt(24);
    for (int i = 0; i < 24; ++i) long_prompt[static_cast<size_t>(i)] = 5 + i;
    ASSERT_TRUE(e->submit(spec("b", long_prompt, 2)).ok());
    std::vector<EngineEvent> events;
    for (int i = 0; i < 200 && e->stats().num_preemptions_total == 0; ++i) ASSERT_TRUE(e->step(events).ok());
    ASSERT_EQ(e->stats().num_preemptions_total, 1u);
    std::vector<EngineEvent> p;
    EXPECT_EQ(e->pause(Engine::PauseMode::kInPlace, p).paused, 2u);
    EXPECT_EQ(e->resume(), 2u);
    EXPECT_EQ(e->pause(Engine::PauseMode::kRetract, p).retracted, 2u);
    EXPECT_EQ(count_kind(p, "b", EngineEvent::Kind::kRetracted), 1);
    EXPECT_EQ(count_kind(p, "a", EngineEvent::Kind::kRetracted), 1);
    EXPECT_EQ(e->resume(), 0u) << "retracted requests are not held";
    auto rest = run_to_idle(*e);
    auto got = collect(rest);
    EXPECT_EQ(got["a"].finals, 1);
    EXPECT_EQ(got["b"].finals, 1);
    EXPECT_EQ(e->stats().kv_blocks_free, 10);
  }
  {
    auto e = embedded_engine(small_limits(/*max_tokens=*/2, 8, 64), 8, 8);
    ASSERT_TRUE(e->submit(spec("a", {1, 2, 3, 4}, 5)).ok());
    ASSERT_TRUE(e->submit(spec("b", {5, 6, 7, 8}, 5)).ok());
    std::vector<EngineEvent> events;
    ASSERT_TRUE(e->step(events).ok());  // both admitted, the budget of 2 spent on a's prompt
    ASSERT_EQ(e->stats().num_running, 2u);
    std::vector<EngineEvent> p;
    EXPECT_EQ(e->pause(Engine::PauseMode::kInPlace, p).paused, 1u);
    EXPECT_EQ(e->resume(), 1u);
    e->pause(Engine::PauseMode::kInPlace, p);
    EXPECT_EQ(e->pause(Engine::PauseMode::kRetract, p).retracted, 1u);
    EXPECT_EQ(count_kind(p, "b", EngineEvent::Kind::kRetracted), 0);
    e->resume();
    auto got = collect(run_to_idle(*e));
    EXPECT_EQ(got["a"].finals, 1);
    EXPECT_EQ(got["b"].finals, 1);
  }
}

TEST(Engine, ARequestSentBackBeforeItBeganIsNoPreemptionAndWaitsAsANewOne) {
  // c is admitted with the pool's last free blocks, and the same step a and b's growth takes
  // them back before c computed anything: nothing was lost (no preemption counted), c is not
  // in flight, and it takes a place in --max-waiting (2) like any request not yet begun.
  auto e = embedded_engine(small_limits(16, 8, /*kv_blocks=*/8), 8, /*max_waiting=*/2);
  ASSERT_TRUE(e->submit(spec("a", {1, 2, 3, 4}, 28)).ok());
  ASSERT_TRUE(e->submit(spec("b", {5, 6, 7, 8}, 28)).ok());
  std::vector<EngineEvent> events;
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(e->step(events).ok());
  ASSERT_EQ(e->stats().kv_blocks_free, 4);
  ASSERT_TRUE(e->submit(spec("c", std::vector<int32_t>(12, 9), 2)).ok());
  ASSERT_TRUE(e->step(events).ok());
  ASSERT_EQ(e->stats().num_waiting, 1u) << "c must have been sent back for this test to mean anything";
  EXPECT_EQ(e->stats().num_preemptions_total, 0u);
  EXPECT_EQ(e->stats().num_recomputed_tokens_total, 0u);
  EXPECT_EQ(count_kind(events, "c", EngineEvent::Kind::kTokens), 0);
  ASSERT_TRUE(e->submit(spec("d", {1}, 2)).ok());
  EXPECT_EQ(e->submit(spec("x", {1}, 2)).code(), ErrorCode::kOverloaded) << "c and d fill the bound";
  std::vector<EngineEvent> p;
  EXPECT_EQ(e->pause(Engine::PauseMode::kInPlace, p).paused, 2u);
  EXPECT_EQ(e->pause(Engine::PauseMode::kRetract, p).retracted, 2u);
  EXPECT_EQ(count_kind(p, "c", EngineEvent::Kind::kRetracted), 0);
  e->resume();
  auto rest = run_to_idle(*e);
  events.insert(events.end(), rest.begin(), rest.end());
  auto got = collect(events);
  for (const char* rid : {"a", "b", "c", "d"}) EXPECT_EQ(got[rid].finals, 1) << rid;
  EXPECT_EQ(e->stats().kv_blocks_free, 8);
}

TEST(Engine, RetractedRequestsDoNotTakePlacesInTheQueueBound) {
  // Like preempted ones, retracted requests had begun: a pause{retract} must not make new
  // requests overloaded (--max-waiting 2, two retracted).
  auto e = embedded_engine(small_limits(16, 8, 64), 8, /*max_waiting=*/2);
  ASSERT_TRUE(e->submit(spec("a", {1, 2, 3, 4}, 20)).ok());
  ASSERT_TRUE(e->submit(spec("b", {5, 6, 7, 8}, 20)).ok());
  std::vector<EngineEvent> events;
  ASSERT_TRUE(e->step(events).ok());
  std::vector<EngineEvent> retracted;
  ASSERT_EQ(e->pause(Engine::PauseMode::kRetract, retracted).retracted, 2u);
  EXPECT_TRUE(e->submit(spec("c", {1}, 2)).ok());
  EXPECT_TRUE(e->submit(spec("d", {1}, 2)).ok());
  EXPECT_EQ(e->submit(spec("x", {1}, 2)).code(), ErrorCode::kOverloaded);
  e->resume();
  auto got = collect(run_to_idle(*e));  // after the retraction: each from its start
  for (const char* rid : {"a", "b", "c", "d"}) EXPECT_EQ(got[rid].finals, 1) << rid;
  EXPECT_EQ(e->stats().kv_blocks_free, 64);
}

TEST(Engine, DeadlineEndsQueuedRunningAndPausedRequestsWithReasonDeadline) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto e = embedded_engine(small_limits(8, 4, 64), 1, 16);  // one running at a time
  const int64_t free0 = e->stats().kv_blocks_free;
  auto a = spec("a", {1, 2, 3}, 50);
  a.deadline = t0 + std::chrono::seconds(10);
  auto b = spec("b", {1, 2, 3}, 50);  // queued behind a
  b.deadline = t0 + std::chrono::seconds(5);
  auto c = spec("c", {1, 2, 3}, 4);  // no deadline
  ASSERT_TRUE(e->submit(a).ok());
  ASSERT_TRUE(e->submit(b).ok());
  ASSERT_TRUE(e->submit(c).ok());
  EXPECT_EQ(e->next_deadline(), b.deadline);
  std::vector<EngineEvent> events;
  ASSERT_TRUE(e->step(events).ok());
  ASSERT_TRUE(e->step(events).ok());
  EXPECT_EQ(e->expire(t0 + std::chrono::seconds(4), events), 0u);
  EXPECT_EQ(e->expire(t0 + std::chrono::seconds(5), events), 1u);  // b, still queued
  EXPECT_FALSE(e->contains("b"));
  EXPECT_EQ(e->next_deadline(), a.deadline);
  std::vector<EngineEvent> ignored;
  e->pause(Engine::PauseMode::kInPlace, ignored);
  EXPECT_EQ(e->expire(t0 + std::chrono::seconds(11), events), 1u);  // a, running but paused
  EXPECT_FALSE(e->next_deadline().has_value());
  e->resume();
  auto rest = run_to_idle(*e);
  events.insert(events.end(), rest.begin(), rest.end());
  auto m = collect(events);
  EXPECT_EQ(m["a"].finals, 1);
  EXPECT_EQ(m["a"].reason, "abort");
  EXPECT_EQ(m["a"].abort_reason, "deadline");
  EXPECT_EQ(m["a"].completion_tokens, static_cast<uint32_t>(m["a"].tokens.size()));
  EXPECT_GT(m["a"].tokens.size(), 0u);
  EXPECT_EQ(m["b"].abort_reason, "deadline");
  EXPECT_TRUE(m["b"].tokens.empty());
  EXPECT_EQ(m["c"].reason, "length");
  EXPECT_EQ(e->stats().num_deadline_aborts_total, 2u);
  EXPECT_EQ(e->stats().kv_blocks_free, free0);
}

}  // namespace
}  // namespace rolloutd::core
