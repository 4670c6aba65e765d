// release_memory / resume_memory on a whole engine (CPU backend): refused unless idle; after
// release(weights, kv_cache) the engine refuses generation and sessions; after resume and a
// full weight push it generates exactly what a fresh engine does, with every parameter at its
// old address and the static state bit-identical.
#include <map>

#include "../test_util.hpp"

namespace rolloutd::core {
namespace {

using test::embedded_engine;
using test::run_to_idle;
using test::small_limits;

const auto kNow = SteadyClock::now();

std::vector<int32_t> greedy(Engine& e, const std::string& rid, std::vector<int32_t> prompt, uint32_t n) {
  RequestSpec s;
  s.rid = rid;
  s.input_ids = std::move(prompt);
  s.max_new_tokens = n;
  s.sampling.temperature = 0.0f;
  EXPECT_TRUE(e.submit(s).ok());
  std::vector<int32_t> out;
  for (const auto& ev : run_to_idle(e))
    if (ev.kind == EngineEvent::Kind::kTokens) out.insert(out.end(), ev.token_ids.begin(), ev.token_ids.end());
  return out;
}

struct Snapshot {
  std::map<std::string, const void*> addresses;
  std::map<std::string, std::vector<int32_t>> method_state;
  std::map<std::string, Layout> layouts;
  std::vector<std::vector<uint8_t>> static_bytes;
  uint32_t digest = 0;
};

Snapshot snapshot(Engine& e) {
  Snapshot s;
  const auto& reg = e.model().weights();
  for (const auto& p : reg.parameters()) {
    s.addresses[p.name] = p.storage.data;
    s.method_state[p.name] = p.method->static_state();
    s.layouts[p.name] = p.layout;
  }
  for (size_t i = 0; i < reg.static_state().entries().size(); ++i) {
    s.static_bytes.emplace_back();
    EXPECT_TRUE(reg.static_state().read(i, s.static_bytes.back()).ok());
  }
  s.digest = *e.memory().static_state_digest(MemoryTag::kWeights);
  return s;
}

// Every parameter of a fresh embedded model, as one FP32 bucket (what a trainer pushes).
Status push_fresh_weights(Engine& e, uint64_t version) {
  auto fresh = test::embedded_model(small_limits());
  return test::push_bucket(e, test::registry_bucket(fresh->weights()), false, version);
}

TEST(EngineMemory, ReleaseIsRefusedUnlessIdle) {
  auto e = embedded_engine(small_limits());
  RequestSpec s;
  s.rid = "busy";
  s.input_ids = {1, 2, 3};
  s.max_new_tokens = 4;
  ASSERT_TRUE(e->submit(s).ok());
  auto r = e->release_memory({MemoryTag::kKvCache});
  EXPECT_EQ(r.status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_FALSE(e->memory().released(MemoryTag::kKvCache));
  run_to_idle(*e);
  auto b = e->updater().begin({}, 60, kNow);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(e->release_memory({MemoryTag::kWeights}).status().code(), ErrorCode::kFailedPrecondition);
  ASSERT_TRUE(e->updater().abort(b->session, "test").ok());
  EXPECT_TRUE(e->release_memory({MemoryTag::kWeights}).ok());
}

TEST(EngineMemory, ReleaseResumePushGeneratesLikeAFreshEngine) {
  auto fresh = embedded_engine(small_limits());
  const auto expected = greedy(*fresh, "a", {5, 17, 42, 7}, 12);
  ASSERT_EQ(expected.size(), 12u);

  auto e = embedded_engine(small_limits());
  EXPECT_EQ(greedy(*e, "warm", {5, 17, 42, 7}, 12), expected);
  const Snapshot before = snapshot(*e);
  ASSERT_FALSE(before.static_bytes.empty()) << "the decoder registers its expert maps as static state";

  auto rel = e->release_memory({MemoryTag::kWeights, MemoryTag::kKvCache});
  ASSERT_TRUE(rel.ok()) << rel.status().to_string();
  ASSERT_EQ(rel->size(), 2u);
  EXPECT_GT((*rel)[0].op.bytes, 0u);
  EXPECT_GT((*rel)[1].op.bytes, 0u);
  EXPECT_TRUE(e->memory().released(MemoryTag::kWeights));
  EXPECT_FALSE(e->can_step());
  RequestSpec s;
  s.rid = "while-released";
  s.input_ids = {1};
  EXPECT_EQ(e->submit(s).code(), ErrorCode::kNotReady);
  EXPECT_NE(e->updater().broken_reason().find("weights memory was released"), std::string::npos)
      << e->updater().broken_reason();
  EXPECT_EQ(e->updater().begin({}, 60, kNow).status().code(), ErrorCode::kFailedPrecondition);
  std::vector<uint8_t> bytes;
  EXPECT_EQ(e->model().weights().read_checkpoint(0, bytes).code(), ErrorCode::kFailedPrecondition);
  // Releasing again changes nothing and frees nothing.
  auto again = e->release_memory({MemoryTag::kWeights});
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE((*again)[0].op.changed);

  auto res = e->resume_memory({MemoryTag::kWeights, MemoryTag::kKvCache});
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  EXPECT_EQ((*res)[0].op.bytes, (*rel)[0].op.bytes);
  // Resumed but the values are gone: still not servable until weights are pushed.
  EXPECT_FALSE(e->can_step());
  EXPECT_EQ(e->submit(s).code(), ErrorCode::kNotReady);

  ASSERT_TRUE(push_fresh_weights(*e, 3).ok());
  EXPECT_TRUE(e->updater().whole()) << e->updater().broken_reason();
  EXPECT_EQ(greedy(*e, "b", {5, 17, 42, 7}, 12), expected);

  const Snapshot after = snapshot(*e);
  EXPECT_EQ(after.addresses, before.addresses);
  EXPECT_EQ(after.method_state, before.method_state);
  EXPECT_EQ(after.layouts, before.layouts);
  EXPECT_EQ(after.static_bytes, before.static_bytes);
  EXPECT_EQ(after.digest, before.digest);
}

TEST(EngineMemory, APartialPushAfterReleaseLeavesTheModelNotWhole) {
  auto e = embedded_engine(small_limits());
  ASSERT_TRUE(e->release_memory({MemoryTag::kWeights}).ok());
  ASSERT_TRUE(e->resume_memory({MemoryTag::kWeights}).ok());
  auto& u = e->updater();
  auto fresh = test::embedded_model(small_limits());
  std::vector<uint8_t> one;
  ASSERT_TRUE(fresh->weights().read_checkpoint(0, one).ok());
  const auto& p = fresh->weights().parameters()[0];
  std::vector<BucketEntry> entries{
      {p.name, DType::kF32, {p.storage.shape.data(), p.storage.shape.data() + p.storage.rank()}, 0, one.size()}};
  auto b = u.begin({p.name}, 60, kNow);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(u.apply_bucket(b->session, entries, one, std::nullopt, kNow).ok());
  auto end = u.end(b->session, 1, kNow);
  ASSERT_TRUE(end.ok());
  EXPECT_FALSE(end->whole);
  EXPECT_NE(u.broken_reason().find("lost when the weights memory was released"), std::string::npos)
      << u.broken_reason();
  ASSERT_TRUE(push_fresh_weights(*e, 2).ok());
  EXPECT_TRUE(u.whole());
  EXPECT_TRUE(e->memory_blocked_reason().empty());
}

TEST(EngineMemory, KvCacheReleaseBlocksGenerationUntilResumed) {
  auto e = embedded_engine(small_limits());
  const auto expected = greedy(*e, "a", {9, 8, 7}, 6);
  ASSERT_TRUE(e->release_memory({MemoryTag::kKvCache}).ok());
  RequestSpec s;
  s.rid = "b";
  s.input_ids = {9, 8, 7};
  s.max_new_tokens = 6;
  EXPECT_EQ(e->submit(s).code(), ErrorCode::kNotReady);
  EXPECT_NE(e->memory_blocked_reason().find("kv_cache"), std::string::npos);
  ASSERT_TRUE(e->resume_memory({MemoryTag::kKvCache}).ok());
  EXPECT_TRUE(e->updater().whole()) << "the weights were never touched";
  EXPECT_EQ(greedy(*e, "b", {9, 8, 7}, 6), expected);
}

}  // namespace
}  // namespace rolloutd::core
