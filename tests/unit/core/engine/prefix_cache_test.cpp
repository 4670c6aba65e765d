// core/engine/prefix_cache.cpp and the engine's use of it (EngineOptions::prefix_cache): a
// request that starts with the same full blocks as an earlier one reuses their KV and records,
// and gets what it gets without the cache; blocks are shared by reference, evicted only when
// nobody reads them, and dropped whenever the weights may change.
#include "core/engine/prefix_cache.hpp"

#include <map>
#include <numeric>

#include "core/engine/engine.hpp"
#include "../test_util.hpp"

namespace rolloutd::core {
namespace {

using test::embedded_engine;
using test::run_to_idle;
using test::small_limits;

TEST(KvBlockPool, SharedBlocksReturnWithTheirLastReference) {
  KvBlockPool pool(4, 16);
  std::vector<int32_t> a;
  ASSERT_TRUE(pool.allocate(2, a).ok());
  ASSERT_TRUE(pool.retain(a[0]).ok());
  EXPECT_EQ(pool.refs(a[0]), 2u);
  std::vector<int32_t> copy = a;
  ASSERT_TRUE(pool.release(a).ok());
  EXPECT_EQ(pool.num_free(), 3) << "a[0] is still held once";
  std::vector<int32_t> first{copy[0]};
  ASSERT_TRUE(pool.release(first).ok());
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_EQ(pool.retain(copy[0]).code(), ErrorCode::kInternal) << "a free block cannot be shared";
}

TEST(PrefixCache, FindsTheLongestRunOfWholeBlocksAndChecksTheirTokens) {
  KvBlockPool pool(8, 4);
  PrefixCache cache(pool, 2);
  const std::vector<int32_t> t = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  std::vector<int32_t> blocks;
  ASSERT_TRUE(pool.allocate(2, blocks).ok());
  const std::vector<int32_t> ones(8, 1);
  const uint64_t k0 = cache.insert(PrefixCache::kRoot, std::span(t).subspan(0, 4), blocks[0], ones).value();
  const uint64_t k = cache.insert(k0, std::span(t).subspan(4, 4), blocks[1], {}).value();  // no records
  EXPECT_EQ(cache.num_evictable(), 0) << "the request still reads them";
  ASSERT_TRUE(pool.release(blocks).ok());  // the request ends: only the cache holds them
  EXPECT_EQ(pool.num_free(), 6);
  EXPECT_EQ(cache.num_blocks(), 2);
  EXPECT_EQ(cache.num_evictable(), 2);

  auto hit = cache.lookup(t, 9, -1);
  ASSERT_EQ(hit.blocks.size(), 2u);
  EXPECT_EQ(hit.key, k);
  ASSERT_NE(hit.records[0], nullptr);
  EXPECT_EQ(*hit.records[0], std::vector<uint16_t>(8, 1));
  EXPECT_EQ(hit.records[1], nullptr);
  EXPECT_EQ(pool.refs(hit.blocks[0]), 2u) << "retained for the caller";
  EXPECT_EQ(cache.num_evictable(), 0) << "lent";
  ASSERT_TRUE(pool.release(hit.blocks).ok());
  EXPECT_EQ(cache.num_evictable(), 2);
  // At most max_tokens tokens; records needed from position 5 end the run before block 1.
  auto short_hit = cache.lookup(t, 7, -1);
  EXPECT_EQ(short_hit.blocks.size(), 1u);
  ASSERT_TRUE(pool.release(short_hit.blocks).ok());
  auto need = cache.lookup(t, 9, 5);
  EXPECT_EQ(need.blocks.size(), 1u);
  ASSERT_TRUE(pool.release(need.blocks).ok());
  // A block computed again with records replaces the one without, records and block together
  // (the records must describe the KV a reader gets).
  std::vector<int32_t> again;
  ASSERT_TRUE(pool.allocate(1, again).ok());
  const int32_t again_block = again[0];
  EXPECT_EQ(cache.insert(k0, std::span(t).subspan(4, 4), again_block, std::vector<int32_t>(8, 2)), k);
  ASSERT_TRUE(pool.release(again).ok());
  EXPECT_EQ(pool.num_free(), 6) << "the block without records went back to the pool";
  auto full = cache.lookup(t, 9, 0);
  ASSERT_EQ(full.blocks.size(), 2u);
  EXPECT_EQ(full.blocks[1], again_block);
  ASSERT_NE(full.records[1], nullptr);
  EXPECT_EQ(*full.records[1], std::vector<uint16_t>(8, 2));
  ASSERT_TRUE(pool.release(full.blocks).ok());
  // Another first block: nothing, even with the same second block.
  const std::vector<int32_t> u = {1, 2, 3, 9, 5, 6, 7, 8, 9};
  EXPECT_TRUE(cache.lookup(u, 9, -1).blocks.empty());

  // Eviction frees only blocks nobody else holds.
  auto held = cache.lookup(t, 4, -1);  // block 0
  ASSERT_EQ(held.blocks.size(), 1u);
  EXPECT_EQ(cache.evict(2), 1) << "block 0 is read by a request";
  EXPECT_EQ(cache.num_blocks(), 1);
  ASSERT_TRUE(pool.release(held.blocks).ok());
  cache.clear();
  EXPECT_EQ(cache.num_blocks(), 0);
  EXPECT_EQ(pool.num_free(), 8);
}

TEST(PrefixCache, ARequestsTailIsEvictedBeforeItsPrefix) {
  // Blocks become evictable as the request lets them go, last block first: eviction takes the
  // tail and keeps the prefix that other prompts (and this one's next turn) start with.
  KvBlockPool pool(6, 2);
  PrefixCache cache(pool, 0);
  const std::vector<int32_t> t = {1, 2, 3, 4, 5, 6, 7};
  std::vector<int32_t> blocks;
  ASSERT_TRUE(pool.allocate(3, blocks).ok());
  uint64_t key = PrefixCache::kRoot;
  for (int i = 0; i < 3; ++i) key = cache.insert(key, std::span(t).subspan(2 * i, 2), blocks[i], {}).value();
  ASSERT_TRUE(pool.release(blocks).ok());
  EXPECT_EQ(cache.evict(1), 1);
  auto hit = cache.lookup(t, 7, -1);
  EXPECT_EQ(hit.blocks.size(), 2u) << "blocks 0 and 1 kept, block 2 evicted";
  ASSERT_TRUE(pool.release(hit.blocks).ok());
  EXPECT_EQ(cache.evict(5), 2);
  EXPECT_EQ(pool.num_free(), 6);
}

RequestSpec request(const std::string& rid, std::vector<int32_t> prompt, uint32_t max_new) {
  RequestSpec s;
  s.rid = rid;
  s.input_ids = std::move(prompt);
  s.max_new_tokens = max_new;
  s.sampling.temperature = 0.0f;
  s.return_logprob = true;
  s.return_routed_experts = true;
  return s;
}

struct Result1 {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::map<int64_t, std::vector<int32_t>> routed;  // position -> ids
  int finals = 0;
};

std::map<std::string, Result1> gather(const std::vector<EngineEvent>& events, int64_t row) {
  std::map<std::string, Result1> m;
  for (const auto& e : events) {
    auto& r = m[e.rid];
    if (e.kind != EngineEvent::Kind::kTokens) {
      ++r.finals;
      continue;
    }
    r.tokens.insert(r.tokens.end(), e.token_ids.begin(), e.token_ids.end());
    r.logprobs.insert(r.logprobs.end(), e.logprobs.begin(), e.logprobs.end());
    for (int64_t t = 0; t < e.routed_num_tokens; ++t) {
      const int64_t pos = e.routed_start_pos + t;
      EXPECT_EQ(r.routed.count(pos), 0u) << e.rid << ": position " << pos << " recorded twice";
      r.routed[pos].assign(e.routed_rows.begin() + t * row, e.routed_rows.begin() + (t + 1) * row);
    }
  }
  return m;
}

// Each request of `reqs` ended once in `with` (an engine with the cache) with the tokens, the
// log-probs (FP32 noise) and the records by position it has in `without`.
void expect_as_without_the_cache(const std::vector<EngineEvent>& with, const std::vector<EngineEvent>& without,
                                 const std::vector<RequestSpec>& reqs) {
  const ModelConfig c = embedded_engine(small_limits())->model_config();
  const int64_t row = c.num_moe_layers() * c.num_experts_per_tok;
  auto a = gather(with, row), b = gather(without, row);
  for (const auto& r : reqs) {
    SCOPED_TRACE(r.rid);
    EXPECT_EQ(a[r.rid].finals, 1);
    EXPECT_EQ(a[r.rid].tokens, b[r.rid].tokens);
    ASSERT_EQ(a[r.rid].logprobs.size(), b[r.rid].logprobs.size());
    for (size_t i = 0; i < a[r.rid].logprobs.size(); ++i) EXPECT_NEAR(a[r.rid].logprobs[i], b[r.rid].logprobs[i], 1e-4);
    EXPECT_EQ(a[r.rid].routed.size(), r.input_ids.size() + r.max_new_tokens - 1);  // every position once
    EXPECT_EQ(a[r.rid].routed, b[r.rid].routed);
  }
}

std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[static_cast<size_t>(i)] = (i * 7 + salt * 13 + 1) % 200;
  return p;
}

TEST(EnginePrefixCache, AReusedPromptGivesTheSameTokensLogprobsAndRecords) {
  // 4-token blocks. "a" computes a 22-token prompt; "b" (the same prompt) and "c" (its first
  // 13 tokens, then others) reuse 5 and 3 blocks of it, and get what an engine without the
  // cache gives them: tokens, log-probs within FP32 noise, and every record position once,
  // equal (those of the reused positions come from the cache).
  const auto base = prompt_of(22, 1);
  std::vector<int32_t> other(base.begin(), base.begin() + 13);
  for (int i = 0; i < 6; ++i) other.push_back(150 + i);
  const std::vector<RequestSpec> reqs = {request("a", base, 12), request("b", base, 12), request("c", other, 9)};
  auto run = [&](bool cache, EngineStats* st) {
    auto e = embedded_engine(small_limits(64, 8, 128), 8, 64, cache);
    std::vector<EngineEvent> events;
    for (const auto& r : reqs) {  // one after the other: each finds what the one before left
      EXPECT_TRUE(e->submit(r).ok());
      auto ev = run_to_idle(*e);
      events.insert(events.end(), ev.begin(), ev.end());
    }
    *st = e->stats();
    EXPECT_EQ(st->kv_blocks_free + st->kv_blocks_cached, st->kv_blocks_total) << "no block leaked";
    return events;
  };
  EngineStats on, off;
  const auto with = run(true, &on);
  const auto without = run(false, &off);
  expect_as_without_the_cache(with, without, reqs);
  // b reuses 20 of its 21 lookable tokens (5 blocks), c 12 (3 blocks; the 4th differs).
  EXPECT_EQ(on.num_prefix_cache_hit_tokens_total, 20u + 12u);
  EXPECT_EQ(on.num_prefix_cache_queried_tokens_total, 21u + 21u + 18u);
  EXPECT_EQ(on.num_prompt_tokens_total, off.num_prompt_tokens_total);
  EXPECT_EQ(off.num_prefix_cache_hit_tokens_total, 0u);
  EXPECT_EQ(off.kv_blocks_cached, 0);
  EXPECT_GT(on.kv_blocks_cached, 0);
}

TEST(EnginePrefixCache, AGroupSubmittedAtOnceComputesItsPromptOnce) {
  // A GRPO step submits a prompt's samples together: the first admitted computes the prompt, the
  // others wait a step for its blocks (and another group's requests behind them too: FIFO).
  std::vector<RequestSpec> reqs;
  for (int g = 0; g < 2; ++g)
    for (int k = 0; k < 4; ++k) {
      auto r = request("g" + std::to_string(g) + "-" + std::to_string(k), prompt_of(22, 20 + g), 8);
      r.sampling.temperature = 0.8f;
      r.sampling.seed = static_cast<uint64_t>(k);
      reqs.push_back(r);
    }
  auto run = [&](bool cache, EngineStats* st) {
    auto e = embedded_engine(small_limits(64, 8, 128), 8, 64, cache);
    for (const auto& r : reqs) EXPECT_TRUE(e->submit(r).ok());
    auto events = run_to_idle(*e);
    *st = e->stats();
    return events;
  };
  EngineStats on, off;
  const auto with = run(true, &on);
  const auto without = run(false, &off);
  expect_as_without_the_cache(with, without, reqs);
  EXPECT_EQ(on.num_prefix_cache_hit_tokens_total, 2u * 3u * 20u) << "3 followers a group, 5 blocks each";
  EXPECT_EQ(on.kv_blocks_free + on.kv_blocks_cached, on.kv_blocks_total);
}

TEST(EnginePrefixCache, RecordsStartWhereAskedAndBlocksWithoutThemAreNotReusedForThem) {
  auto e = embedded_engine(small_limits(64, 8, 128), 8, 64, true);
  const auto p = prompt_of(17, 2);
  auto quiet = request("quiet", p, 4);
  quiet.return_routed_experts = false;  // its steps record nothing: its blocks keep no records
  ASSERT_TRUE(e->submit(quiet).ok());
  (void)run_to_idle(*e);
  auto loud = request("loud", p, 4);
  loud.routed_experts_start_len = 9;
  ASSERT_TRUE(e->submit(loud).ok());
  const ModelConfig c = e->model_config();
  const int64_t row = c.num_moe_layers() * c.num_experts_per_tok;
  auto got = gather(run_to_idle(*e), row);
  // Block 0 (positions 0-3) and 1 (4-7) hold no position it needs records of: reused. Block 2
  // holds 9: it has no records, so the run stops there.
  EXPECT_EQ(e->stats().num_prefix_cache_hit_tokens_total, 8u);
  ASSERT_FALSE(got["loud"].routed.empty());
  EXPECT_EQ(got["loud"].routed.begin()->first, 9);
  EXPECT_EQ(got["loud"].routed.size(), 17u + 4u - 1u - 9u);
  // Blocks 0-1 still keep no records (quiet computed them, loud reused them); 2-3 took loud's.
  // A request needing every record reuses nothing and computes them all; the next reuses 4
  // blocks, records and all.
  ASSERT_TRUE(e->submit(request("all", p, 4)).ok());
  auto all = gather(run_to_idle(*e), row);
  EXPECT_EQ(e->stats().num_prefix_cache_hit_tokens_total, 8u);
  EXPECT_EQ(all["all"].routed.size(), 17u + 4u - 1u);
  ASSERT_TRUE(e->submit(request("again", p, 4)).ok());
  auto again = gather(run_to_idle(*e), row);
  EXPECT_EQ(e->stats().num_prefix_cache_hit_tokens_total, 8u + 16u);
  EXPECT_EQ(again["again"].routed, all["all"].routed);
  EXPECT_EQ(again["again"].tokens, all["all"].tokens);
}

TEST(EnginePrefixCache, AWeightUpdateDropsTheCacheAndInPlaceRequestsAreNotCached) {
  auto e = embedded_engine(small_limits(64, 8, 128), 8, 64, true);
  const auto p = prompt_of(13, 3);
  ASSERT_TRUE(e->submit(request("a", p, 3)).ok());
  (void)run_to_idle(*e);
  EXPECT_EQ(e->stats().kv_blocks_cached, 3);
  // A request running through an in_place update: its earlier KV came from the old weights, so
  // nothing it computes is cached, then or after.
  ASSERT_TRUE(e->submit(request("long", prompt_of(9, 4), 40)).ok());
  std::vector<EngineEvent> events;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(e->step(events).ok());
  e->pause(Engine::PauseMode::kInPlace, events);
  const auto now = SteadyClock::now();
  auto s = e->updater().begin({}, 60, now);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(e->updater().end(s->session, 1, now).ok());
  e->set_weight_version(1);
  e->resume();
  auto rest = run_to_idle(*e);
  EXPECT_EQ(e->stats().kv_blocks_cached, 0) << "a's blocks dropped, long's never kept";
  EXPECT_EQ(e->stats().kv_blocks_free, e->stats().kv_blocks_total);
  ASSERT_TRUE(e->submit(request("b", p, 3)).ok());
  (void)run_to_idle(*e);
  EXPECT_EQ(e->stats().num_prefix_cache_hit_tokens_total, 0u) << "a's KV was from the old weights";
  EXPECT_EQ(e->stats().kv_blocks_cached, 3) << "b's blocks are kept, under the new weights";
}

TEST(EnginePrefixCache, AfterAnUpdateToOtherWeightsRequestsGetWhatAnEngineWithThoseWeightsGives) {
  // New weights (another seed's) pushed in place while: "a" is cached; "b" (a's prompt) was
  // admitted with a's blocks but has not begun (its step's token budget went to four decoding
  // requests); "d1".."d4" are decoding. After the update, b and a later "c" (a's prompt again)
  // must compute everything under the new weights: their tokens and records equal those of an
  // engine built with the new weights and no cache. (Without the cache b would hold no KV at the
  // update: it must not keep a's, computed under the old weights.)
  const auto p = prompt_of(21, 5);
  auto other = MoeDecoder::create(embedded_model_config(), small_limits(4, 8, 128), cpu_backend(), ExecContext{});
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(init_random_weights(**other, 12345).ok());
  const auto bucket = test::registry_bucket((*other)->weights());
  auto e = embedded_engine(small_limits(4, 8, 128), 8, 64, true);
  ASSERT_TRUE(e->submit(request("a", p, 2)).ok());
  (void)run_to_idle(*e);
  std::vector<EngineEvent> events;
  for (int i = 1; i <= 4; ++i) ASSERT_TRUE(e->submit(request("d" + std::to_string(i), {i, 7}, 30)).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(e->step(events).ok());  // their 2-token prompts, 4 tokens a step
  ASSERT_TRUE(e->submit(request("b", p, 6)).ok());
  ASSERT_TRUE(e->step(events).ok());  // b admitted with 20 reused tokens; the 4 decodes take the budget
  ASSERT_EQ(e->stats().num_running, 5u);
  ASSERT_GE(e->stats().kv_blocks_cached - e->stats().kv_blocks_evictable, 5) << "b reads a's 5 blocks of 4";
  // Counted when b computes with them, which it never will: the update sends it back first.
  ASSERT_EQ(e->stats().num_prefix_cache_hit_tokens_total, 0u);
  ASSERT_EQ(e->stats().num_prefix_cache_queried_tokens_total, 20u + 4u) << "a's 20, the d's 1 each";
  e->pause(Engine::PauseMode::kInPlace, events);
  ASSERT_TRUE(test::push_bucket(*e, bucket, false, 1).ok());
  e->resume();
  auto rest = run_to_idle(*e);
  ASSERT_TRUE(e->submit(request("c", p, 6)).ok());
  auto tail = run_to_idle(*e);
  rest.insert(rest.end(), tail.begin(), tail.end());
  EXPECT_EQ(e->stats().num_prefix_cache_hit_tokens_total, 20u) << "c reuses b's blocks (new weights); b's void "
                                                                  "lookup is not counted";
  EXPECT_EQ(e->stats().num_prefix_cache_queried_tokens_total, 20u + 4u + 20u + 20u) << "b's lookup counted once";
  EXPECT_EQ(e->stats().num_preemptions_total, 0u) << "b was sent back before it began: no preemption";

  auto fresh = embedded_engine(small_limits(4, 8, 128), 8, 64, false);
  ASSERT_TRUE(test::push_bucket(*fresh, bucket, false, 1).ok());
  ASSERT_TRUE(fresh->submit(request("b", p, 6)).ok());
  auto want = run_to_idle(*fresh);
  ASSERT_TRUE(fresh->submit(request("c", p, 6)).ok());
  auto want_c = run_to_idle(*fresh);
  want.insert(want.end(), want_c.begin(), want_c.end());
  const ModelConfig c = e->model_config();
  const int64_t row = c.num_moe_layers() * c.num_experts_per_tok;
  auto got = gather(rest, row), ref = gather(want, row);
  for (const char* rid : {"b", "c"}) {
    SCOPED_TRACE(rid);
    EXPECT_EQ(got[rid].tokens, ref[rid].tokens);
    EXPECT_EQ(got[rid].routed, ref[rid].routed);
    EXPECT_EQ(got[rid].routed.size(), 21u + 6u - 1u);
  }
}

TEST(EnginePrefixCache, APreemptedRequestReadmittedOnItsOwnBlocksRecomputesThemAfterAnUpdate) {
  // "b" has streamed tokens and records, is preempted when the pool runs dry, and is admitted
  // again on its own cached blocks (lent KV: computed before its preemption, under the old
  // weights); four one-token requests take the step's budget of 4, so b computes nothing before
  // new weights arrive in place. b must not keep those blocks: its tokens after the update are
  // what an engine with the new weights and no cache gives for its prompt and the tokens it had,
  // and its records go on from the position it had streamed, each position once.
  auto other = MoeDecoder::create(embedded_model_config(), small_limits(4, 8, 20), cpu_backend(), ExecContext{});
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(init_random_weights(**other, 12345).ok());
  const auto bucket = test::registry_bucket((*other)->weights());
  const auto prompt = prompt_of(13, 6);
  constexpr uint32_t kMaxNew = 40;
  auto e = embedded_engine(small_limits(4, 8, 20), 8, 64, true);
  ASSERT_TRUE(e->submit(request("a", {5}, 70)).ok());  // older: its growth preempts b
  ASSERT_TRUE(e->submit(request("b", prompt, kMaxNew)).ok());
  std::vector<EngineEvent> before;
  for (int i = 0; i < 200 && e->stats().num_preemptions_total == 0; ++i) ASSERT_TRUE(e->step(before).ok());
  ASSERT_EQ(e->stats().num_preemptions_total, 1u) << "20 blocks of 4 run dry before a or b ends";
  ASSERT_EQ(e->stats().num_running, 1u) << "b, the younger, went back to the queue";
  ASSERT_TRUE(e->abort("a", "test", before));
  for (int i = 1; i <= 4; ++i) ASSERT_TRUE(e->submit(request("d" + std::to_string(i), {i + 20}, 6)).ok());
  ASSERT_TRUE(e->step(before).ok());  // b admitted on its cached prefix; d1..d4 decode, budget 4
  ASSERT_EQ(e->stats().num_running, 5u);
  ASSERT_GE(e->stats().kv_blocks_cached - e->stats().kv_blocks_evictable, 1) << "b reads its own cached blocks";
  ASSERT_EQ(e->stats().num_prefix_cache_hit_tokens_total, 0u) << "b has not computed with them";

  const ModelConfig c = e->model_config();
  const int64_t row = c.num_moe_layers() * c.num_experts_per_tok;
  auto had = gather(before, row)["b"];
  ASSERT_GT(had.tokens.size(), 0u);
  ASSERT_LT(had.tokens.size(), kMaxNew);
  ASSERT_EQ(had.finals, 0);

  e->pause(Engine::PauseMode::kInPlace, before);
  ASSERT_TRUE(test::push_bucket(*e, bucket, false, 1).ok());
  e->resume();
  auto after = run_to_idle(*e);
  EXPECT_EQ(e->stats().num_preemptions_total, 1u) << "sent back before it computed: no second preemption";
  EXPECT_EQ(e->stats().num_prefix_cache_hit_tokens_total, 0u) << "its void lookup is not a hit";
  EXPECT_EQ(e->stats().kv_blocks_free + e->stats().kv_blocks_cached, e->stats().kv_blocks_total);
  auto got = gather(after, row);
  EXPECT_EQ(got["b"].finals, 1);
  for (int i = 1; i <= 4; ++i) EXPECT_EQ(got["d" + std::to_string(i)].finals, 1);

  // The reference: new weights, no cache, b's prompt and the tokens it had as the prompt.
  auto fresh = embedded_engine(small_limits(4, 8, 20), 8, 64, false);
  ASSERT_TRUE(test::push_bucket(*fresh, bucket, false, 1).ok());
  std::vector<int32_t> context = prompt;
  context.insert(context.end(), had.tokens.begin(), had.tokens.end());
  ASSERT_TRUE(fresh->submit(request("b", context, kMaxNew - static_cast<uint32_t>(had.tokens.size()))).ok());
  auto want = gather(run_to_idle(*fresh), row)["b"];
  EXPECT_EQ(got["b"].tokens, want.tokens);
  ASSERT_EQ(got["b"].logprobs.size(), want.logprobs.size());
  for (size_t i = 0; i < want.logprobs.size(); ++i) EXPECT_NEAR(got["b"].logprobs[i], want.logprobs[i], 1e-4);
  // Records: every position once across the update, those after it as the new weights route.
  ASSERT_FALSE(got["b"].routed.empty());
  for (const auto& [pos, ids] : got["b"].routed) {
    EXPECT_EQ(had.routed.count(pos), 0u) << "position " << pos << " recorded before and after";
    EXPECT_EQ(ids, want.routed[pos]) << "position " << pos;
  }
  EXPECT_EQ(had.routed.size() + got["b"].routed.size(), prompt.size() + kMaxNew - 1);
}

TEST(EnginePrefixCache, UnderATinyPoolCachedBlocksAreEvictedAndNothingLeaks) {
  // 20 blocks of 4 tokens; 24 requests of four prompts (a GRPO group each), 6 at once, with
  // preemptions: every request ends once with the tokens an uncached engine gives it, and at
  // the end every block is free or cached (then free once the cache is cleared by an update).
  std::vector<RequestSpec> reqs;
  for (int g = 0; g < 4; ++g)
    for (int k = 0; k < 6; ++k) {
      auto r = request("g" + std::to_string(g) + "-" + std::to_string(k), prompt_of(14, 10 + g), 20);
      r.sampling.temperature = k % 2 ? 0.8f : 0.0f;
      r.sampling.seed = static_cast<uint64_t>(k);
      reqs.push_back(r);
    }
  auto run = [&](bool cache, EngineStats* st) {
    auto e = embedded_engine(small_limits(16, 8, 20), 6, 64, cache);
    for (const auto& r : reqs) EXPECT_TRUE(e->submit(r).ok());
    auto events = run_to_idle(*e);
    *st = e->stats();
    EXPECT_EQ(st->kv_blocks_free + st->kv_blocks_cached, st->kv_blocks_total);
    if (cache) {
      const auto now = SteadyClock::now();
      auto s = e->updater().begin({}, 60, now);
      EXPECT_TRUE(s.ok());
      EXPECT_TRUE(e->updater().end(s->session, 1, now).ok());
      EXPECT_TRUE(e->submit(request("after", {1, 2}, 1)).ok());
      (void)run_to_idle(*e);
      EXPECT_EQ(e->stats().kv_blocks_cached, 0);
      EXPECT_EQ(e->stats().kv_blocks_free, e->stats().kv_blocks_total);
    }
    return events;
  };
  EngineStats on, off;
  const auto with = run(true, &on);
  const auto without = run(false, &off);
  expect_as_without_the_cache(with, without, reqs);
  EXPECT_GT(on.num_prefix_cache_hit_tokens_total, 0u);
  EXPECT_GT(off.num_preemptions_total, 0u) << "the pool is meant to run dry";
  std::printf("tiny pool: preemptions %llu with the cache, %llu without\n",
              static_cast<unsigned long long>(on.num_preemptions_total),
              static_cast<unsigned long long>(off.num_preemptions_total));
}

}  // namespace
}  // namespace rolloutd::core
