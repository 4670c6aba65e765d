// The sliding KV pool (StepLimits::num_sliding_kv_blocks): gpt-oss's sliding-window layers keep
// their K and V in blocks of their own, and a request holds there only the blocks its next
// positions can still see. Against an engine with one pool (every layer's whole context kept):
// the same tokens, log-probs and routed-expert records, bit for bit on the CPU, through chunked
// prefills, decode steps and preemptions; no block leaked; the sliding blocks held bounded by
// the window, not by the context. A block freed too early is caught: its table entry is -1, and
// the CPU attention refuses to follow it.
#include <map>

#include "core/engine/engine.hpp"
#include "core/model/embedded_model.hpp"
#include "core/model/test_model.hpp"
#include "../model/hf_test_util.hpp"
#include "../test_util.hpp"

namespace rolloutd::core {
namespace {

constexpr int64_t kWindow = 10;  // 2.5 blocks of 4: windows start inside blocks

ModelConfig sliding_config() {
  TestModelSpec spec;
  spec.family = "gpt_oss";
  spec.layers = 3;  // sliding, full, sliding
  spec.intermediate = 32;
  spec.sliding_window = kWindow;
  auto c = test_model_config(spec);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return *c;
}

StepLimits limits(int64_t kv_blocks, int64_t sliding_blocks) {
  StepLimits l = test::small_limits(/*max_tokens=*/16, /*max_seqs=*/4, kv_blocks);
  l.num_sliding_kv_blocks = sliding_blocks;
  return l;
}

Result<std::unique_ptr<Engine>> make(const StepLimits& l, bool prefix_cache = false) {
  RD_ASSIGN_OR_RETURN(auto m, MoeDecoder::create(sliding_config(), l, cpu_backend(), ExecContext{}));
  RD_RETURN_IF_ERROR(init_random_weights(*m, 11));
  EngineOptions o;
  o.max_running = 4;
  o.step = l;
  o.prefix_cache = prefix_cache;
  return Engine::create(std::move(m), o);
}

RequestSpec request(const std::string& rid, int prompt_len, uint32_t max_new) {
  RequestSpec s;
  s.rid = rid;
  for (int i = 0; i < prompt_len; ++i) s.input_ids.push_back((i * 37 + prompt_len * 5 + 3) % 200);
  s.max_new_tokens = max_new;
  s.sampling.temperature = 0.0f;
  s.return_logprob = true;
  s.return_routed_experts = true;
  return s;
}

using Out = test::RequestLog;

// Runs to idle; after every step, the sliding blocks held stay within `per_seq` per running
// request (when given).
Out run(Engine& e, const std::vector<RequestSpec>& reqs, int64_t per_seq = 0) {
  for (const auto& r : reqs) EXPECT_TRUE(e.submit(r).ok()) << r.rid;
  int64_t most_held = 0;
  Out out = test::step_to_idle(e, [&](int i) {
    const EngineStats s = e.stats();
    const int64_t held = s.sliding_kv_blocks_total - s.sliding_kv_blocks_free;
    most_held = std::max(most_held, held);
    if (per_seq > 0) {
      EXPECT_LE(held, per_seq * static_cast<int64_t>(s.num_running)) << "step " << i;
    }
  });
  if (per_seq > 0) {
    EXPECT_GT(most_held, 0) << "the sliding pool was never used";
  }
  return out;
}

void expect_same(const Out& a, const Out& b, const std::vector<RequestSpec>& reqs, float logprob_tol) {
  for (const auto& r : reqs) {
    SCOPED_TRACE(r.rid);
    EXPECT_EQ(a.finals.at(r.rid), 1);
    EXPECT_EQ(a.tokens.at(r.rid).size(), r.max_new_tokens);
    EXPECT_EQ(a.tokens.at(r.rid), b.tokens.at(r.rid));
    EXPECT_EQ(a.routed.at(r.rid), b.routed.at(r.rid));
    ASSERT_EQ(a.logprobs.at(r.rid).size(), b.logprobs.at(r.rid).size());
    for (size_t i = 0; i < a.logprobs.at(r.rid).size(); ++i)
      EXPECT_NEAR(a.logprobs.at(r.rid)[i], b.logprobs.at(r.rid)[i], logprob_tol) << "token " << i;
  }
}

void expect_nothing_held(const Engine& e) {
  const EngineStats s = e.stats();
  EXPECT_EQ(s.kv_blocks_free, s.kv_blocks_total);
  EXPECT_EQ(s.sliding_kv_blocks_free, s.sliding_kv_blocks_total);
}

TEST(SlidingKvPool, SizesFollowTheLayersAndTheWindow) {
  const ModelConfig c = sliding_config();
  ASSERT_EQ(c.num_sliding_layers(), 2);
  // K and V rows of 2 kv heads x 16 dims in FP32, 4 per block: 2 x 512 bytes per layer and block.
  EXPECT_EQ(kv_cache_bytes_per_block(c, 4, DType::kF32), 3 * 1024);
  EXPECT_EQ(kv_cache_bytes_per_block(c, 4, DType::kF32, /*sliding=*/false), 1 * 1024);
  EXPECT_EQ(kv_cache_bytes_per_block(c, 4, DType::kF32, /*sliding=*/true), 2 * 1024);
  EXPECT_EQ(kv_cache_bytes_per_block(c, 4, DType::kBF16, /*sliding=*/true), 2 * 512);
  // 4 sequences x (ceil(10 / 4) + 2) + ceil(16 / 4).
  EXPECT_EQ(sliding_kv_blocks_needed(c, limits(128, 0)), 4 * 5 + 4);
  EXPECT_EQ(sliding_kv_blocks_needed(embedded_model_config(), limits(128, 0)), 0);
}

TEST(SlidingKvPool, GivesWhatOnePoolGivesHoldingOnlyTheWindow) {
  const ModelConfig c = sliding_config();
  auto one = make(limits(128, 0));
  auto two = make(limits(128, sliding_kv_blocks_needed(c, limits(128, 0))));
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  // Prompts shorter than the window, spanning it, and of several chunks (16 tokens a step);
  // 40 new tokens take every request well past its window.
  const std::vector<RequestSpec> reqs = {request("a", 3, 40), request("b", 17, 40), request("c", 45, 40),
                                         request("d", 9, 40), request("e", 30, 25)};
  // Between steps a request holds the blocks of positions n - 9 .. n - 1 (what position n sees
  // before it is computed): 9 positions, 3 blocks of 4 wherever they start.
  const Out a = run(**two, reqs, /*per_seq=*/3);
  const Out b = run(**one, reqs);
  expect_same(a, b, reqs, 0.0f);  // the same arithmetic on the same values: bit for bit
  expect_nothing_held(**two);
  expect_nothing_held(**one);
  EXPECT_EQ((*two)->stats().num_preemptions_total, 0u);
}

TEST(SlidingKvPool, PreemptionsFromEitherPoolLoseNothingAndLeakNothing) {
  auto roomy = make(limits(256, 0));
  ASSERT_TRUE(roomy.ok()) << roomy.status().to_string();
  const std::vector<RequestSpec> reqs = {request("a", 20, 30), request("b", 35, 30), request("c", 12, 30),
                                         request("d", 50, 35), request("e", 5, 30)};
  const Out b = run(**roomy, reqs);
  // A full pool of 24 blocks (96 positions) for requests of up to 85, with a sliding pool that
  // holds everything; then a full pool that holds everything with a sliding pool of its
  // smallest size, one request's window and a step (ceil(10 / 4) + 2 + 4 = 9 blocks), for four
  // running requests of up to 4 blocks each between steps.
  const int64_t enough = sliding_kv_blocks_needed(sliding_config(), limits(24, 0));
  for (const auto& [kv, sliding] : {std::pair<int64_t, int64_t>{24, enough}, {256, 9}}) {
    SCOPED_TRACE("kv " + std::to_string(kv) + ", sliding " + std::to_string(sliding));
    auto tiny = make(limits(kv, sliding));
    ASSERT_TRUE(tiny.ok()) << tiny.status().to_string();
    const Out a = run(**tiny, reqs);
    EXPECT_GT((*tiny)->stats().num_preemptions_total, 0u);
    // A recomputed prefix is computed in other chunks than the first time: FP32 summation-order
    // noise in the log-probs, the tokens and records equal.
    expect_same(a, b, reqs, 1e-4f);
    expect_nothing_held(**tiny);
  }
}

TEST(SlidingKvPool, AbortsAndRetractionsGiveTheSlidingBlocksBack) {
  auto e = make(limits(128, sliding_kv_blocks_needed(sliding_config(), limits(128, 0))));
  ASSERT_TRUE(e.ok());
  for (const char* rid : {"a", "b", "c"}) ASSERT_TRUE((*e)->submit(request(rid, 30, 50)).ok());
  std::vector<EngineEvent> evs;
  for (int i = 0; i < 6; ++i) ASSERT_TRUE((*e)->step(evs).ok());
  EXPECT_LT((*e)->stats().sliding_kv_blocks_free, (*e)->stats().sliding_kv_blocks_total);
  EXPECT_TRUE((*e)->abort("a", "test", evs));
  (*e)->pause(Engine::PauseMode::kRetract, evs);
  expect_nothing_held(**e);
  (*e)->resume();
  for (int i = 0; i < 6; ++i) ASSERT_TRUE((*e)->step(evs).ok());
  EXPECT_EQ((*e)->abort_all("test", evs), 2u);
  expect_nothing_held(**e);
}

TEST(SlidingKvPool, RefusedWhereItCannotWork) {
  const ModelConfig c = sliding_config();
  const int64_t enough = sliding_kv_blocks_needed(c, limits(128, 0));
  // With the prefix cache: cached prompts would need the sliding blocks the pool frees.
  auto cached = make(limits(128, enough), /*prefix_cache=*/true);
  ASSERT_FALSE(cached.ok());
  EXPECT_EQ(cached.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(cached.status().field(), "prefix_cache");
  // Smaller than one request's window and step: it would preempt itself forever.
  auto small = make(limits(128, 8));
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().field(), "num_sliding_kv_blocks");
  EXPECT_NE(small.status().message().find("need 9"), std::string::npos) << small.status().message();
  // A model without sliding layers has nothing to put there.
  auto dense = MoeDecoder::create(embedded_model_config(), limits(128, 16), cpu_backend(), ExecContext{});
  ASSERT_FALSE(dense.ok());
  EXPECT_EQ(dense.status().field(), "num_sliding_kv_blocks");
  // A batch without the sliding slots and tables is refused, not run on stale ones.
  auto m = MoeDecoder::create(c, limits(128, enough), cpu_backend(), ExecContext{});
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(init_random_weights(**m, 11).ok());
  std::vector<float> logits;
  StepBatch b = test::single_sequence_prefill({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14}, 4);
  Status st = (*m)->forward(b, logits, nullptr);
  EXPECT_EQ(st.code(), ErrorCode::kInternal);
  EXPECT_EQ(st.field(), "sliding_block_tables");
  // With them it runs; with a block its rows still see marked freed (-1), it is refused before
  // any kernel (the CUDA attention would skip the entry and compute a wrong row).
  b.sliding_slot_mapping = b.slot_mapping;
  b.sliding_block_tables = b.block_tables;
  b.logits_rows = {13};
  st = (*m)->forward(b, logits, nullptr);
  EXPECT_TRUE(st.ok()) << st.to_string();
  b.sliding_block_tables[1] = -1;  // positions 4..7, in the window of positions up to 16
  st = (*m)->forward(b, logits, nullptr);
  EXPECT_EQ(st.code(), ErrorCode::kInternal);
  EXPECT_EQ(st.field(), "sliding_block_tables");
  EXPECT_NE(st.message().find("sliding block 1"), std::string::npos) << st.message();
  // Block 0 (positions 0..3) is before the window of every row from position 13 on, but rows
  // 0..12 still see it: refused too. Only a batch of rows past it may leave it freed.
  b.sliding_block_tables[1] = 1;
  b.sliding_block_tables[0] = -1;
  EXPECT_EQ((*m)->forward(b, logits, nullptr).field(), "sliding_block_tables");
}

TEST(SlidingKvPool, AnInPlacePauseKeepsTheWindowAndGivesWhatOnePoolGives) {
  // Requests paused in place (a weight update's in_place mode, here without one) keep their
  // sliding blocks and go on from them after the resume.
  const ModelConfig c = sliding_config();
  const std::vector<RequestSpec> reqs = {request("a", 23, 30), request("b", 6, 30), request("c", 40, 20)};
  Out want, got;
  for (const bool pool : {false, true}) {
    auto e = make(limits(128, pool ? sliding_kv_blocks_needed(c, limits(128, 0)) : 0));
    ASSERT_TRUE(e.ok());
    for (const auto& r : reqs) ASSERT_TRUE((*e)->submit(r).ok());
    std::vector<EngineEvent> evs;
    for (int i = 0; i < 7; ++i) ASSERT_TRUE((*e)->step(evs).ok());
    (*e)->pause(Engine::PauseMode::kInPlace, evs);
    if (pool) {
      EXPECT_LT((*e)->stats().sliding_kv_blocks_free, (*e)->stats().sliding_kv_blocks_total);
    }
    ASSERT_TRUE((*e)->step(evs).ok());  // paused: nothing runs
    (*e)->resume();
    Out& out = pool ? got : want;
    for (const auto& ev : evs) out.add(ev);  // before the pause
    for (int i = 0; i < 10000 && (*e)->has_work(); ++i) {
      evs.clear();
      ASSERT_TRUE((*e)->step(evs).ok());
      for (const auto& ev : evs) out.add(ev);
    }
    expect_nothing_held(**e);
  }
  expect_same(got, want, reqs, 0.0f);
}

}  // namespace
}  // namespace rolloutd::core
