// Sampling where the logits are (MoeDecoder::step_sample, EngineOptions::device_sampling):
// - step_sample on the CPU backend returns exactly what core::Sampler picks from step()'s
//   logits for the same batch (the CPU op runs the Sampler's code);
// - a row count that differs from the logits rows, or a bad parameter, is a typed error;
// - on CUDA, greedy tokens with device sampling equal those with host sampling and those of
//   the CPU engine, with graphs on and off, log-probs within FP32 tolerance; seeded
//   temperature-1 requests give the same tokens when run again; top log-probs (requests asking
//   for different counts in one batch) equal the host's ids, log-probs within the same tolerance.
// The Cpu tests run everywhere; the Cuda ones skip without a GPU (binary labelled gpu).
#include <algorithm>
#include <array>
#include <map>

#include "../test_util.hpp"

namespace rolloutd::core {
namespace {

using test::small_limits;

// Two prompts (3 and 2 tokens) as one prefill step; both last rows sampled.
StepBatch prefill_batch(const StepLimits& l) {
  StepBatch b;
  b.max_blocks_per_seq = static_cast<int32_t>(l.max_blocks_per_seq);
  const std::vector<std::vector<int32_t>> prompts = {{5, 17, 200}, {9, 31}};
  for (size_t s = 0; s < prompts.size(); ++s) {
    for (size_t p = 0; p < prompts[s].size(); ++p) {
      b.token_ids.push_back(prompts[s][p]);
      b.positions.push_back(static_cast<int32_t>(p));
      b.seq_of.push_back(static_cast<int32_t>(s));
      b.slot_mapping.push_back(static_cast<int32_t>(s * l.kv_block_size + p));
      b.ctx_len.push_back(static_cast<int32_t>(p + 1));
    }
    for (int64_t k = 0; k < l.max_blocks_per_seq; ++k) b.block_tables.push_back(k == 0 ? static_cast<int32_t>(s) : -1);
    b.logits_rows.push_back(static_cast<int32_t>(b.token_ids.size() - 1));
  }
  return b;
}

TEST(DeviceSampling, CpuStepSampleEqualsHostSamplerOnStepLogits) {
  const StepLimits l = small_limits();
  auto m = test::embedded_model(l);
  const StepBatch b = prefill_batch(l);
  auto logits = m->step(b, nullptr);
  ASSERT_TRUE(logits.ok()) << logits.status().to_string();
  const std::vector<float> host(logits->begin(), logits->end());
  const int64_t V = m->config().vocab_size;
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  SamplingParams hot;
  hot.temperature = 1.3f;
  hot.top_p = 0.9f;
  hot.min_p = 0.01f;
  for (uint64_t draw = 0; draw < 20; ++draw) {
    hot.seed = 1000 + draw;
    const std::vector<SamplingRow> rows = {sampling_row(greedy, draw), sampling_row(hot, draw)};
    const int64_t top_n = static_cast<int64_t>(draw % 4) * 5;  // 0, 5, 10, 15
    auto got = m->step_sample(b, rows, nullptr, top_n);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    ASSERT_EQ(got->tokens.size(), 2u);
    Sampler s;
    TopLogprobs top0, top1;
    const SampledToken want0 = s.sample(std::span<const float>(host.data(), V), greedy, draw, top_n, &top0);
    const SampledToken want1 = s.sample(std::span<const float>(host.data() + V, V), hot, draw, top_n, &top1);
    EXPECT_EQ(got->tokens[0], want0.token);
    EXPECT_EQ(got->logprobs[0], want0.logprob);
    EXPECT_EQ(got->tokens[1], want1.token) << "draw " << draw;
    EXPECT_EQ(got->logprobs[1], want1.logprob) << "draw " << draw;
    ASSERT_EQ(got->top_n, top_n);
    ASSERT_EQ(got->top_ids.size(), static_cast<size_t>(2 * top_n));
    for (int64_t j = 0; j < top_n; ++j) {
      EXPECT_EQ(got->top_ids[j], top0.ids[j]);
      EXPECT_EQ(got->top_logprobs[j], top0.logprobs[j]);
      EXPECT_EQ(got->top_ids[top_n + j], top1.ids[j]);
      EXPECT_EQ(got->top_logprobs[top_n + j], top1.logprobs[j]);
    }
  }
}

TEST(DeviceSampling, CpuStepSampleRefusesBadRows) {
  const StepLimits l = small_limits();
  auto m = test::embedded_model(l);
  const StepBatch b = prefill_batch(l);
  SamplingParams p;
  auto one = m->step_sample(b, std::vector<SamplingRow>{sampling_row(p, 0)}, nullptr);
  EXPECT_EQ(one.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(one.status().field(), "rows");
  SamplingRow bad = sampling_row(p, 0);
  bad.top_p = 0.0f;
  auto r = m->step_sample(b, std::vector<SamplingRow>{sampling_row(p, 0), bad}, nullptr);
  EXPECT_EQ(r.status().code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(r.status().field(), "rows[1].top_p");
  auto top = m->step_sample(b, std::vector<SamplingRow>{sampling_row(p, 0), sampling_row(p, 0)}, nullptr,
                            kMaxTopLogprobs + 1);
  EXPECT_EQ(top.status().code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(top.status().field(), "top_n");
}

std::unique_ptr<Engine> make_engine(const Backend& backend, ExecContext ctx, int64_t graph_max_batch,
                                    bool device_sampling) {
  StepLimits limits = small_limits(64, 8, 128);
  limits.graph_max_batch = graph_max_batch;
  auto m = MoeDecoder::create(embedded_model_config(), limits, backend, ctx);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  if (!m.ok()) return nullptr;
  EXPECT_TRUE(init_random_weights(**m, kEmbeddedModelSeed).ok());
  if (graph_max_batch > 0) {
    EXPECT_TRUE((*m)->capture_graphs().ok());
  }
  EngineOptions o;
  o.max_running = limits.max_seqs;
  o.step = limits;
  o.device_sampling = device_sampling;
  auto e = Engine::create(std::move(*m), o);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

struct Output {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, std::vector<float>> logprobs;
  std::map<std::string, std::vector<int32_t>> top_ids;  // requests ask 3, none, 20 and 1
  std::map<std::string, std::vector<float>> top_logprobs;
};

Output run(Engine& e, float temperature) {
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3}, {7, 100, 42, 9, 31, 8, 77}, {200}, {250, 3, 99, 4}};
  const uint32_t lengths[] = {12, 5, 9, 16};
  for (size_t i = 0; i < prompts.size(); ++i) {
    RequestSpec s;
    s.rid = "r" + std::to_string(i);
    s.input_ids = prompts[i];
    s.max_new_tokens = lengths[i];
    s.sampling.temperature = temperature;
    s.sampling.seed = 31 + i;
    s.return_logprob = true;
    s.top_logprobs_num = std::array<uint32_t, 4>{3, 0, 20, 1}[i];
    EXPECT_TRUE(e.submit(s).ok());
  }
  Output out;
  for (const auto& ev : test::run_to_idle(e)) {
    if (ev.kind != EngineEvent::Kind::kTokens) continue;
    auto& t = out.tokens[ev.rid];
    t.insert(t.end(), ev.token_ids.begin(), ev.token_ids.end());
    auto& l = out.logprobs[ev.rid];
    l.insert(l.end(), ev.logprobs.begin(), ev.logprobs.end());
    auto& ti = out.top_ids[ev.rid];
    ti.insert(ti.end(), ev.top_ids.begin(), ev.top_ids.end());
    auto& tl = out.top_logprobs[ev.rid];
    tl.insert(tl.end(), ev.top_logprobs.begin(), ev.top_logprobs.end());
  }
  return out;
}

// exact_top: the same logits on both sides (one device), so the top ids must match exactly;
// otherwise (CUDA against the CPU) two entries may trade places only where their log-probs tie
// within the tolerance.
void expect_same(const Output& got, const Output& want, const char* what, bool exact_top = false) {
  ASSERT_EQ(got.tokens.size(), want.tokens.size()) << what;
  for (const auto& [rid, toks] : want.tokens) {
    EXPECT_EQ(got.tokens.at(rid), toks) << what << ": " << rid;
    const auto& lp = got.logprobs.at(rid);
    const auto& lw = want.logprobs.at(rid);
    ASSERT_EQ(lp.size(), lw.size()) << what;
    for (size_t i = 0; i < lw.size(); ++i)
      EXPECT_NEAR(lp[i], lw[i], 1e-4 + 1e-4 * std::fabs(lw[i])) << what << ": log-prob " << i << " of " << rid;
    const auto& ti = got.top_ids.at(rid);
    const auto& tj = want.top_ids.at(rid);
    const auto& tp = got.top_logprobs.at(rid);
    const auto& tw = want.top_logprobs.at(rid);
    ASSERT_EQ(ti.size(), tj.size()) << what;
    ASSERT_EQ(tp.size(), tw.size()) << what;
    if (exact_top) {
      EXPECT_EQ(ti, tj) << what << ": top ids of " << rid;
    }
    for (size_t i = 0; i < tw.size(); ++i) {
      const double tol = 1e-4 + 1e-4 * std::fabs(tw[i]);
      EXPECT_NEAR(tp[i], tw[i], tol) << what << ": top log-prob " << i << " of " << rid;
      if (ti[i] != tj[i]) {  // a near tie: the other side lists this id next to it in the same token's list
        const size_t n = ti.size() / got.tokens.at(rid).size();
        const size_t first = i / n * n, last = first + n;  // this token's entries
        const auto from = tj.begin() + std::max(first, i > 0 ? i - 1 : 0);
        const auto to = tj.begin() + std::min(last, i + 2);
        EXPECT_TRUE(!exact_top && std::find(from, to, ti[i]) != to)
            << what << ": top id " << i << " of " << rid << " is " << ti[i] << ", not " << tj[i];
      }
    }
  }
}

TEST(DeviceSampling, CudaGreedyTokensEqualHostSamplingAndCpu) {
  if (cuda_backend() == nullptr || cuda_device_count() == 0) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const ExecContext gpu{Device::cuda(0), nullptr};
  auto cpu = make_engine(cpu_backend(), ExecContext{}, 0, true);
  const Output want = run(*cpu, 0.0f);
  for (int64_t graphs : {0, 8}) {
    auto host = make_engine(*cuda_backend(), gpu, graphs, false);
    auto device = make_engine(*cuda_backend(), gpu, graphs, true);
    const Output h = run(*host, 0.0f);
    const Output d = run(*device, 0.0f);
    expect_same(h, want, graphs ? "CUDA host sampling, graphs" : "CUDA host sampling");
    expect_same(d, want, graphs ? "CUDA device sampling, graphs" : "CUDA device sampling");
    expect_same(d, h, "device vs host sampling on CUDA", /*exact_top=*/true);
  }
}

TEST(DeviceSampling, CudaSeededSamplingRepeats) {
  if (cuda_backend() == nullptr || cuda_device_count() == 0) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const ExecContext gpu{Device::cuda(0), nullptr};
  auto a = make_engine(*cuda_backend(), gpu, 8, true);
  auto b = make_engine(*cuda_backend(), gpu, 8, true);
  const Output x = run(*a, 1.0f), y = run(*b, 1.0f);
  EXPECT_EQ(x.tokens, y.tokens);
  EXPECT_EQ(x.logprobs, y.logprobs);
  // The draw is not the argmax everywhere: temperature 1 over 256 tokens of a random model.
  const Output g = run(*a, 0.0f);
  EXPECT_NE(x.tokens, g.tokens);
}

}  // namespace
}  // namespace rolloutd::core
