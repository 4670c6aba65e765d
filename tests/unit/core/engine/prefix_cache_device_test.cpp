// The prefix cache (EngineOptions::prefix_cache) on the CUDA engine, graphs on: a GRPO group (one
// 300-token prompt: a greedy sample, then three submitted together, one greedy and two seeded)
// and a conversation's next turn (the first prompt, its answer and new tokens), with a pool that
// holds everything and one that must evict. The greedy requests against the CPU engine without
// the cache: tokens and routed-expert records equal, log-probs within the CUDA-vs-CPU bound of
// long_context_test.cpp (1e-4 + 1e-4 |lp|; the embedded model is FP32 on both). The seeded ones
// against the CUDA engine without the cache (device sampling draws differ from the host's:
// backend.hpp): tokens equal. Cached blocks are read by later requests' prefill chunks and decode
// steps (graphs replay them through the block table), which is what this checks on the device.
// Skips without a GPU (binary labelled gpu). Not yet run: written on 2026-12-04 with no device.
#include <cmath>
#include <map>

#include "../test_util.hpp"

namespace rolloutd::core {
namespace {

bool have_gpu() { return cuda_backend() != nullptr && cuda_device_count() > 0; }

std::unique_ptr<Engine> make(const Backend& backend, ExecContext ctx, bool cache, int64_t kv_blocks) {
  StepLimits l;
  l.max_tokens = 256;  // the 300-token prompts take two chunks
  l.max_seqs = 8;
  l.kv_block_size = 16;
  l.max_blocks_per_seq = 32;
  l.num_kv_blocks = kv_blocks;
  l.graph_max_batch = 8;
  auto m = MoeDecoder::create(embedded_model_config(), l, backend, ctx);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  if (!m.ok()) return nullptr;
  EXPECT_TRUE(init_random_weights(**m, kEmbeddedModelSeed).ok());
  EngineOptions o;
  o.max_running = 8;
  o.step = l;
  o.prefix_cache = cache;
  auto e = Engine::create(std::move(*m), o);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

struct Out {
  std::map<std::string, std::vector<int32_t>> tokens, routed;
  std::map<std::string, std::vector<float>> logprobs;
};

RequestSpec req(const std::string& rid, std::vector<int32_t> prompt, float temperature, uint64_t seed) {
  RequestSpec s;
  s.rid = rid;
  s.input_ids = std::move(prompt);
  s.max_new_tokens = 24;
  s.sampling.temperature = temperature;
  s.sampling.seed = seed;
  s.return_logprob = true;
  s.return_routed_experts = true;
  return s;
}

// Runs `rounds` of requests, each round submitted together and run to idle; a round's prompts
// may continue an earlier request (turn2 = turn1's prompt, its tokens, new tokens).
Out run(Engine& e, const std::vector<int32_t>& prompt) {
  Out out;
  auto go = [&](const std::vector<RequestSpec>& round) {
    for (const auto& r : round) EXPECT_TRUE(e.submit(r).ok()) << r.rid;
    for (const auto& ev : test::run_to_idle(e)) {
      EXPECT_NE(ev.kind, EngineEvent::Kind::kFailed) << ev.rid << ": " << ev.error.to_string();
      if (ev.kind != EngineEvent::Kind::kTokens) continue;
      out.tokens[ev.rid].insert(out.tokens[ev.rid].end(), ev.token_ids.begin(), ev.token_ids.end());
      out.logprobs[ev.rid].insert(out.logprobs[ev.rid].end(), ev.logprobs.begin(), ev.logprobs.end());
      out.routed[ev.rid].insert(out.routed[ev.rid].end(), ev.routed_rows.begin(), ev.routed_rows.end());
    }
  };
  go({req("g0", prompt, 0.0f, 0)});
  go({req("g1", prompt, 0.0f, 0), req("g2", prompt, 0.9f, 2), req("g3", prompt, 0.9f, 3)});  // together
  std::vector<int32_t> turn2 = prompt;
  turn2.insert(turn2.end(), out.tokens["g0"].begin(), out.tokens["g0"].end());
  for (int i = 0; i < 20; ++i) turn2.push_back((i * 11 + 5) % 256);
  go({req("t2", turn2, 0.0f, 0)});
  return out;
}

const std::vector<std::string> kGreedy = {"g0", "g1", "t2"}, kSeeded = {"g2", "g3"};

void expect_same(const Out& got, const Out& want, const std::vector<std::string>& rids, const std::string& what) {
  for (const auto& rid : rids) {
    const auto& toks = want.tokens.at(rid);
    EXPECT_EQ(got.tokens.at(rid), toks) << what << ": tokens of " << rid;
    EXPECT_EQ(got.routed.at(rid), want.routed.at(rid)) << what << ": records of " << rid;
    const auto& lp = got.logprobs.at(rid);
    const auto& lw = want.logprobs.at(rid);
    ASSERT_EQ(lp.size(), lw.size()) << what << ": " << rid;
    for (size_t i = 0; i < lw.size(); ++i)
      EXPECT_NEAR(lp[i], lw[i], 1e-4 + 1e-4 * std::fabs(lw[i])) << what << ": log-prob " << i << " of " << rid;
  }
}

TEST(PrefixCacheDevice, CudaWithTheCacheMatchesTheCpuWithout) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  std::vector<int32_t> prompt(300);
  for (int i = 0; i < 300; ++i) prompt[static_cast<size_t>(i)] = (i * 37 + 11) % 256;
  auto cpu = make(cpu_backend(), ExecContext{}, false, 256);
  ASSERT_TRUE(cpu);
  const Out want = run(*cpu, prompt);
  ExecContext g;
  g.device = Device::cuda(0);
  auto uncached = make(*cuda_backend(), g, false, 256);
  ASSERT_TRUE(uncached);
  const Out want_seeded = run(*uncached, prompt);
  for (const int64_t blocks : {int64_t{256}, int64_t{40}}) {  // 40: the cache must evict
    auto gpu = make(*cuda_backend(), g, true, blocks);
    ASSERT_TRUE(gpu);
    const Out got = run(*gpu, prompt);
    const EngineStats st = gpu->stats();
    EXPECT_GT(st.num_prefix_cache_hit_tokens_total, 0u) << blocks << " blocks";
    EXPECT_EQ(st.kv_blocks_free + st.kv_blocks_cached, st.kv_blocks_total) << blocks << " blocks";
    const std::string what = "CUDA with the prefix cache, " + std::to_string(blocks) + " blocks";
    expect_same(got, want, kGreedy, what + " vs the CPU");
    for (const auto& rid : kSeeded) EXPECT_EQ(got.tokens.at(rid), want_seeded.tokens.at(rid)) << what << ": " << rid;
  }
}

}  // namespace
}  // namespace rolloutd::core
