// The sliding KV pool (StepLimits::num_sliding_kv_blocks) on the CUDA engine, graphs on: a
// random gpt_oss model with head dimension 64 (the tensor-core attention over BF16 caches) and a
// window of 32, six requests of 20 to 300 prompt tokens (prefill chunks of 128) and 40 new tokens
// each, greedy and seeded, against the same CUDA engine with one pool: tokens and routed-expert
// records equal, log-probs within 1e-5 (the same kernels over the same values in other slots:
// bit for bit expected), with FP32 and BF16 caches. The window layers then read their K and V
// through the sliding tables in decode graphs, eager decode and prefill chunks, with entries
// before the window at -1, which is what this checks on the device. No block leaked.
// Skips without a GPU (binary labelled gpu). Not yet run: written on 2026-12-05 with no device.
#include <cmath>
#include <map>

#include "core/model/test_model.hpp"
#include "../test_util.hpp"

namespace rolloutd::core {
namespace {

bool have_gpu() { return cuda_backend() != nullptr && cuda_device_count() > 0; }

ModelConfig config() {
  TestModelSpec spec;
  spec.family = "gpt_oss";
  spec.layers = 4;
  spec.hidden = 128;
  spec.heads = 4;
  spec.kv_heads = 2;
  spec.head_dim = 64;
  spec.intermediate = 64;
  spec.sliding_window = 32;
  auto c = test_model_config(spec);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return *c;
}

StepLimits limits(DType kv_dtype, bool pool) {
  StepLimits l;
  l.max_tokens = 128;
  l.max_seqs = 8;
  l.kv_block_size = 16;
  l.max_blocks_per_seq = 32;
  l.num_kv_blocks = 256;
  l.graph_max_batch = 8;
  l.kv_dtype = kv_dtype;
  l.num_sliding_kv_blocks = pool ? sliding_kv_blocks_needed(config(), l) : 0;
  return l;
}

std::unique_ptr<Engine> make(DType kv_dtype, bool pool) {
  ExecContext g;
  g.device = Device::cuda(0);
  const StepLimits l = limits(kv_dtype, pool);
  auto m = MoeDecoder::create(config(), l, *cuda_backend(), g);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  if (!m.ok()) return nullptr;
  EXPECT_TRUE(init_random_weights(**m, 5).ok());
  EngineOptions o;
  o.max_running = 8;
  o.step = l;
  auto e = Engine::create(std::move(*m), o);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

struct Out {
  test::RequestLog log;
  int64_t most_sliding_held = 0;
};

Out run(Engine& e) {
  const int lens[] = {20, 300, 75, 140, 33, 260};
  for (int i = 0; i < 6; ++i) {
    RequestSpec s;
    s.rid = "r" + std::to_string(i);
    for (int j = 0; j < lens[i]; ++j) s.input_ids.push_back((j * 37 + i * 11 + 5) % 256);
    s.max_new_tokens = 40;
    s.sampling.temperature = i % 2 ? 0.8f : 0.0f;
    s.sampling.seed = static_cast<uint64_t>(i);
    s.return_logprob = true;
    s.return_routed_experts = true;
    EXPECT_TRUE(e.submit(s).ok()) << s.rid;
  }
  int64_t most_held = 0;
  test::RequestLog log = test::step_to_idle(e, [&](int) {
    const EngineStats s = e.stats();
    most_held = std::max(most_held, s.sliding_kv_blocks_total - s.sliding_kv_blocks_free);
  });
  return {std::move(log), most_held};
}

TEST(SlidingKvPoolDevice, CudaWithThePoolGivesWhatOnePoolGives) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  for (const DType kv : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(std::string("KV cache ") + std::string(dtype_name(kv)));
    auto one = make(kv, false);
    auto two = make(kv, true);
    ASSERT_TRUE(one && two);
    const Out want = run(*one);
    const Out got = run(*two);
    for (int i = 0; i < 6; ++i) {
      const std::string rid = "r" + std::to_string(i);
      EXPECT_EQ(got.log.tokens.at(rid).size(), 40u) << rid;
      EXPECT_EQ(got.log.tokens.at(rid), want.log.tokens.at(rid)) << rid;
      EXPECT_EQ(got.log.routed.at(rid), want.log.routed.at(rid)) << rid;
      const auto& lp = got.log.logprobs.at(rid);
      const auto& lw = want.log.logprobs.at(rid);
      ASSERT_EQ(lp.size(), lw.size()) << rid;
      for (size_t t = 0; t < lw.size(); ++t) EXPECT_NEAR(lp[t], lw[t], 1e-5 + 1e-5 * std::fabs(lw[t])) << rid << " " << t;
    }
    // Six requests of up to 340 positions (22 blocks each with one pool) hold, between steps,
    // the blocks of the 31 positions their next one sees: 3 blocks of 16 each.
    EXPECT_GT(got.most_sliding_held, 0);
    EXPECT_LE(got.most_sliding_held, 6 * 3);
    const EngineStats st = two->stats();
    EXPECT_EQ(st.sliding_kv_blocks_free, st.sliding_kv_blocks_total);
    EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
    EXPECT_GT(st.graph_steps, 0u);
  }
}

}  // namespace
}  // namespace rolloutd::core
