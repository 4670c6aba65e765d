// Decode steps padded to a bucket (StepLimits::graph_max_batch), replayed from CUDA graphs on
// the GPU and run padded eagerly on the CPU, against the same engine with every step eager:
// - the same greedy tokens, log-probs within FP32 tolerance and the same routed-expert records;
// - rows that only pad a bucket are never recorded (the device record table holds -1 there)
//   and write no KV slot (the set of KV words a run changes equals the eager run's);
// - after weight-update sessions (full and partial, many of them, alternating), the graphs
//   compute with the new weights: tokens equal a fresh eager engine loaded with the same
//   weights, parameters never move, nothing is re-captured.
// The Cpu tests run everywhere; the Cuda ones skip without a GPU (binary labelled gpu).
#include <cmath>
#include <cstring>
#include <map>

#include "../test_util.hpp"
#include "core/weights/session.hpp"

namespace rolloutd::core {
namespace {

using test::small_limits;

struct Target {
  const Backend* backend;
  ExecContext ctx;
};

std::optional<Target> target(DeviceKind kind) {
  if (kind == DeviceKind::kCpu) return Target{&cpu_backend(), ExecContext{}};
  if (cuda_backend() == nullptr || cuda_device_count() == 0) return std::nullopt;
  return Target{cuda_backend(), ExecContext{Device::cuda(0), nullptr}};
}

StepLimits graph_limits(int64_t graph_max_batch) {
  StepLimits l = small_limits(64, 8, 128);
  l.graph_max_batch = graph_max_batch;
  return l;
}

std::unique_ptr<Engine> make_engine(const Target& t, int64_t graph_max_batch, uint64_t seed = kEmbeddedModelSeed) {
  const StepLimits limits = graph_limits(graph_max_batch);
  auto m = MoeDecoder::create(embedded_model_config(), limits, *t.backend, t.ctx);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  if (!m.ok()) return nullptr;
  EXPECT_TRUE(init_random_weights(**m, seed).ok());
  EngineOptions o;
  o.max_running = limits.max_seqs;
  o.step = limits;
  auto e = Engine::create(std::move(*m), o);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

struct Output {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, std::vector<float>> logprobs;
  std::map<std::string, std::vector<int32_t>> routed;  // rows of every event, in order
};

// Requests of several prompt lengths decoding together: a few steps mix prefill, then the
// batch decodes with 5, then fewer sequences as the short ones finish (buckets 8, 4, 2, 1).
Output run_batch(Engine& e, const std::string& tag) {
  const std::vector<std::vector<int32_t>> prompts = {
      {1, 2, 3}, {7, 100, 42, 9, 31, 8, 77}, {200}, {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {250, 3, 99}};
  const uint32_t lengths[] = {12, 5, 9, 3, 16};
  for (size_t i = 0; i < prompts.size(); ++i) {
    RequestSpec s;
    s.rid = tag + std::to_string(i);
    s.input_ids = prompts[i];
    s.max_new_tokens = lengths[i];
    s.sampling.temperature = 0.0f;
    s.return_logprob = true;
    s.return_routed_experts = true;
    EXPECT_TRUE(e.submit(s).ok());
  }
  Output out;
  for (const auto& ev : test::run_to_idle(e)) {
    if (ev.kind != EngineEvent::Kind::kTokens) continue;
    auto& t = out.tokens[ev.rid];
    t.insert(t.end(), ev.token_ids.begin(), ev.token_ids.end());
    auto& l = out.logprobs[ev.rid];
    l.insert(l.end(), ev.logprobs.begin(), ev.logprobs.end());
    auto& r = out.routed[ev.rid];
    r.insert(r.end(), ev.routed_rows.begin(), ev.routed_rows.end());
  }
  return out;
}

void expect_same_output(const Output& got, const Output& want, const char* what) {
  ASSERT_EQ(got.tokens.size(), want.tokens.size()) << what;
  for (const auto& [rid, toks] : want.tokens) {
    // Keys differ only in the tag prefix: compare by request index.
    const std::string idx = rid.substr(rid.size() - 1);
    const auto match = [&](const auto& m) {
      for (const auto& [k, v] : m)
        if (k.substr(k.size() - 1) == idx) return v;
      return std::decay_t<decltype(m.begin()->second)>{};
    };
    EXPECT_EQ(match(got.tokens), toks) << what << ": tokens of request " << idx;
    EXPECT_EQ(match(got.routed), want.routed.at(rid)) << what << ": routed experts of request " << idx;
    const auto lp = match(got.logprobs);
    const auto& lw = want.logprobs.at(rid);
    ASSERT_EQ(lp.size(), lw.size()) << what;
    for (size_t i = 0; i < lw.size(); ++i)
      EXPECT_NEAR(lp[i], lw[i], 1e-4 + 1e-4 * std::fabs(lw[i])) << what << ": log-prob " << i << " of request " << idx;
  }
}

// Host copy of the model's KV arena (one virtual range at these sizes).
std::vector<uint32_t> kv_words(Engine& e, const Target& t) {
  const StableArena& kv = e.model().arena(MemoryTag::kKvCache);
  EXPECT_EQ(kv.ranges().size(), 1u);
  std::vector<uint32_t> words(kv.bytes_used() / 4);
  const CopyKind k = t.ctx.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kDeviceToHost;
  EXPECT_TRUE(t.backend->copy(t.ctx, words.data(), reinterpret_cast<const void*>(kv.ranges()[0].base),
                              words.size() * 4, k)
                  .ok());
  EXPECT_TRUE(t.backend->synchronize(t.ctx).ok());
  return words;
}

void fill_kv(Engine& e, const Target& t, uint32_t pattern) {
  const StableArena& kv = e.model().arena(MemoryTag::kKvCache);
  std::vector<uint32_t> words(kv.bytes_used() / 4, pattern);
  const CopyKind k = t.ctx.device.kind == DeviceKind::kCpu ? CopyKind::kHostToHost : CopyKind::kHostToDevice;
  ASSERT_TRUE(t.backend->copy(t.ctx, reinterpret_cast<void*>(kv.ranges()[0].base), words.data(), words.size() * 4, k)
                  .ok());
  ASSERT_TRUE(t.backend->synchronize(t.ctx).ok());
}

void padded_decode_matches_eager(DeviceKind kind) {
  const auto t = target(kind);
  if (!t) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  auto eager = make_engine(*t, 0);
  auto graphs = make_engine(*t, 8);
  ASSERT_TRUE(eager && graphs);
  const GraphStats& gs = graphs->model().graph_stats();
  EXPECT_EQ(gs.buckets, (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(gs.num_graphs, kind == DeviceKind::kCuda ? 8 : 0) << "a graph per bucket, records on and off";
  EXPECT_TRUE(eager->model().graph_stats().buckets.empty());

  // A sentinel in every KV word: the words a run changes are the slots it wrote.
  constexpr uint32_t kSentinel = 0x7fc0dead;  // a NaN no computation produces
  fill_kv(*eager, *t, kSentinel);
  fill_kv(*graphs, *t, kSentinel);
  const Output want = run_batch(*eager, "e");
  const Output got = run_batch(*graphs, "g");
  expect_same_output(got, want, "padded decode vs eager");
  EXPECT_GT(gs.graph_steps, 10u) << "decode steps should have run padded";
  EXPECT_GT(gs.eager_steps, 0u) << "prefill steps run eagerly";
  EXPECT_EQ(eager->model().graph_stats().graph_steps, 0u);

  const auto we = kv_words(*eager, *t), wg = kv_words(*graphs, *t);
  ASSERT_EQ(we.size(), wg.size());
  size_t written = 0;
  for (size_t i = 0; i < we.size(); ++i) {
    ASSERT_EQ(we[i] == kSentinel, wg[i] == kSentinel) << "KV word " << i << " written by one run only";
    written += we[i] != kSentinel;
  }
  EXPECT_GT(written, 0u);
}

// One decode step of 3 sequences runs in bucket 4: the record table's fourth row is -1 in
// every MoE layer, the first three equal what the recorder handed out.
void padding_rows_are_not_recorded(DeviceKind kind) {
  const auto t = target(kind);
  if (!t) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  auto e = make_engine(*t, 8);
  ASSERT_TRUE(e);
  MoeDecoder& m = e->model();
  const ModelConfig& c = m.config();
  const int64_t L = c.num_moe_layers(), K = c.num_experts_per_tok, maxT = m.limits().max_tokens;
  // Three sequences at positions 0 (their first token), one block each.
  StepBatch b;
  b.max_blocks_per_seq = 1;
  for (int32_t s = 0; s < 3; ++s) {
    b.token_ids.push_back(10 + s);
    b.positions.push_back(0);
    b.seq_of.push_back(s);
    b.slot_mapping.push_back(s * static_cast<int32_t>(m.limits().kv_block_size));
    b.ctx_len.push_back(1);
    b.block_tables.push_back(s);
    b.logits_rows.push_back(s);
  }
  // Poison the table first, so -1 is what the step wrote.
  const TensorView table = m.routed_table();
  std::vector<int32_t> poison(static_cast<size_t>(L * maxT * K), 12345);
  const bool cpu = kind == DeviceKind::kCpu;
  ASSERT_TRUE(t->backend->copy(t->ctx, table.data, poison.data(), poison.size() * 4,
                               cpu ? CopyKind::kHostToHost : CopyKind::kHostToDevice).ok());
  RoutedExpertRecorder rec(L, K, maxT);
  std::vector<float> logits;
  const uint64_t before = m.graph_stats().graph_steps;
  ASSERT_TRUE(m.forward(b, logits, &rec).ok());
  EXPECT_EQ(m.graph_stats().graph_steps, before + 1) << "a 3-sequence decode step runs in bucket 4";
  EXPECT_EQ(logits.size(), static_cast<size_t>(3 * c.vocab_size));
  std::vector<int32_t> host(poison.size());
  ASSERT_TRUE(t->backend->copy(t->ctx, host.data(), table.data, host.size() * 4,
                               cpu ? CopyKind::kHostToHost : CopyKind::kDeviceToHost).ok());
  ASSERT_TRUE(t->backend->synchronize(t->ctx).ok());
  ASSERT_EQ(rec.num_layers_captured(), L);
  ASSERT_EQ(rec.rows().size(), static_cast<size_t>(3 * L * K));
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(host[static_cast<size_t>((l * maxT + 3) * K + k)], -1) << "padding row recorded in MoE layer " << l;
      EXPECT_EQ(host[static_cast<size_t>((l * maxT + 4) * K + k)], 12345) << "a row past the bucket was written";
      for (int64_t r = 0; r < 3; ++r) {
        const int32_t id = host[static_cast<size_t>((l * maxT + r) * K + k)];
        EXPECT_GE(id, 0);
        EXPECT_LT(id, c.num_experts);
        EXPECT_EQ(id, rec.rows()[static_cast<size_t>((r * L + l) * K + k)]);
      }
    }
  }
}

using test::push_bucket;
using test::registry_bucket;

std::map<std::string, const void*> addresses(Engine& e) {
  std::map<std::string, const void*> a;
  for (const auto& p : e.model().weights().parameters()) a[p.name] = p.storage.data;
  return a;
}

void replay_after_updates_matches_fresh(DeviceKind kind) {
  const auto t = target(kind);
  if (!t) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  auto e = make_engine(*t, 8);
  ASSERT_TRUE(e);
  const auto where = addresses(*e);
  const Output before = run_batch(*e, "b");
  const uint64_t padded_before = e->model().graph_stats().graph_steps;
  constexpr int kSessions = 8;
  for (int i = 0; i < kSessions; ++i) {
    // Even sessions: every parameter from a new seed; odd ones: a third of them from another.
    const bool partial = i % 2 == 1;
    auto donor = make_engine(*t, 0, 1000 + static_cast<uint64_t>(i));
    ASSERT_TRUE(donor);
    const auto b = registry_bucket(donor->model().weights(), partial ? 3 : 1, static_cast<size_t>(i % 3));
    const Status st = push_bucket(*e, b, partial, static_cast<uint64_t>(i + 1));
    ASSERT_TRUE(st.ok()) << st.to_string();
    // A fresh eager engine with exactly e's parameters now.
    auto fresh = make_engine(*t, 0, 1);
    ASSERT_TRUE(fresh);
    const Status pf = push_bucket(*fresh, registry_bucket(e->model().weights()), false, 1);
    ASSERT_TRUE(pf.ok()) << pf.to_string();
    const Output got = run_batch(*e, "s" + std::to_string(i) + "_");
    expect_same_output(got, run_batch(*fresh, "f"), ("session " + std::to_string(i)).c_str());
    if (i == 0) {
      bool changed = false;
      for (const auto& [rid, toks] : got.tokens) changed |= toks != before.tokens.at("b" + rid.substr(rid.size() - 1));
      EXPECT_TRUE(changed) << "new weights should change some greedy tokens";
    }
  }
  EXPECT_EQ(addresses(*e), where) << "a parameter moved";
  // The sessions' decode steps ran from the graphs captured at start (CUDA) or padded (CPU).
  EXPECT_GT(e->model().graph_stats().graph_steps, padded_before + 8 * 10);
}

TEST(DecodeGraphs, CpuPaddedDecodeMatchesEager) { padded_decode_matches_eager(DeviceKind::kCpu); }
TEST(DecodeGraphs, CpuPaddingRowsAreNotRecorded) { padding_rows_are_not_recorded(DeviceKind::kCpu); }
TEST(DecodeGraphs, CpuReplayAfterUpdatesMatchesFresh) { replay_after_updates_matches_fresh(DeviceKind::kCpu); }
TEST(DecodeGraphs, CudaGraphDecodeMatchesEager) { padded_decode_matches_eager(DeviceKind::kCuda); }
TEST(DecodeGraphs, CudaPaddingRowsAreNotRecorded) { padding_rows_are_not_recorded(DeviceKind::kCuda); }
TEST(DecodeGraphs, CudaReplayAfterUpdatesMatchesFresh) { replay_after_updates_matches_fresh(DeviceKind::kCuda); }

// A recorder of another shape is refused before anything runs; a context longer than the
// batch's block table reaches the padding entries (-1), refused on the CPU, never another
// sequence's block.
TEST(DecodeGraphs, CpuRefusesMismatchedRecorderAndContextPastTheTable) {
  const auto t = target(DeviceKind::kCpu);
  auto e = make_engine(*t, 8);
  ASSERT_TRUE(e);
  MoeDecoder& m = e->model();
  const ModelConfig& c = m.config();
  StepBatch b;
  b.max_blocks_per_seq = 1;
  b.token_ids = {5};
  b.positions = {0};
  b.seq_of = {0};
  b.slot_mapping = {0};
  b.ctx_len = {1};
  b.block_tables = {0};
  b.logits_rows = {0};
  std::vector<float> logits;
  RoutedExpertRecorder wrong(c.num_moe_layers() + 1, c.num_experts_per_tok, m.limits().max_tokens);
  Status st = m.forward(b, logits, &wrong);
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument) << st.to_string();
  EXPECT_EQ(st.field(), "recorder");
  RoutedExpertRecorder right(c.num_moe_layers(), c.num_experts_per_tok, m.limits().max_tokens);
  ASSERT_TRUE(m.forward(b, logits, &right).ok());
  b.ctx_len = {static_cast<int32_t>(m.limits().kv_block_size) + 1};  // one position past block 0
  b.positions = {static_cast<int32_t>(m.limits().kv_block_size)};
  b.slot_mapping = {-1};
  st = m.forward(b, logits, nullptr);
  EXPECT_EQ(st.code(), ErrorCode::kOutOfRange) << st.to_string();
}

TEST(DecodeGraphs, BucketsAreCappedBySequencesAndTokens) {
  StepLimits l = graph_limits(100);
  l.max_seqs = 6;
  auto m = MoeDecoder::create(embedded_model_config(), l, cpu_backend(), ExecContext{});
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)->graph_stats().buckets, (std::vector<int64_t>{1, 2, 4, 6}));
  EXPECT_EQ((*m)->bucket_for(5), 6);
  EXPECT_EQ((*m)->bucket_for(3), 4);
  EXPECT_EQ((*m)->bucket_for(7), 0);
  l.graph_max_batch = 0;
  auto off = MoeDecoder::create(embedded_model_config(), l, cpu_backend(), ExecContext{});
  ASSERT_TRUE(off.ok());
  EXPECT_EQ((*off)->bucket_for(1), 0);
}

}  // namespace
}  // namespace rolloutd::core
