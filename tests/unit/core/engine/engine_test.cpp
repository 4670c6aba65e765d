#include "core/engine/engine.hpp"

#include <map>

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

}  // namespace
}  // namespace rolloutd::core
