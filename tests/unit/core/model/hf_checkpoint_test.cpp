// core/model/hf_checkpoint + test_model: a make-test-model checkpoint loads into the decoder;
// an update_weights session with the checkpoint's own tensors gives bit-identical
// parameters; missing, extra, mis-shaped and doubly-written tensors are refused by name.
#include "core/model/hf_checkpoint.hpp"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <unistd.h>
#include <map>
#include <tuple>

#include <gtest/gtest.h>

#include "core/model/embedded_model.hpp"
#include "core/model/family.hpp"
#include "core/model/hf_config.hpp"
#include "core/model/test_model.hpp"
#include "kernels/bf16.hpp"
#include "core/storage/memory_manager.hpp"
#include "core/weights/session.hpp"
#include "kernels/quant/quant_ops.hpp"
#include "hf_test_util.hpp"

namespace rolloutd {
namespace {

core::TestModelSpec small_spec(uint64_t seed = 7) {
  core::TestModelSpec s;
  s.layers = 2;
  s.hidden = 32;
  s.experts = 4;
  s.top_k = 2;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 8;
  s.intermediate = 16;
  s.vocab = 64;
  s.seed = seed;
  return s;
}

core::StepLimits limits() {
  core::StepLimits l;
  l.max_tokens = 32;
  l.max_seqs = 16;
  l.num_kv_blocks = 32;
  l.kv_block_size = 4;
  l.max_blocks_per_seq = 16;
  return l;
}

// `n` greedy tokens after `prompt`: one prefill step, then one decode step a token (argmax,
// lowest id on ties).
std::vector<int32_t> greedy_tokens(core::MoeDecoder& m, const std::vector<int32_t>& prompt, int n) {
  const int64_t bs = m.limits().kv_block_size;
  const int32_t width = static_cast<int32_t>((static_cast<int64_t>(prompt.size()) + n + bs - 1) / bs);
  core::StepBatch b = test::single_sequence_prefill(prompt, bs);
  b.max_blocks_per_seq = width;
  b.block_tables.clear();
  for (int32_t i = 0; i < width; ++i) b.block_tables.push_back(i);
  b.logits_rows = {static_cast<int32_t>(prompt.size()) - 1};
  std::vector<int32_t> out;
  std::vector<float> logits;
  for (int32_t pos = static_cast<int32_t>(prompt.size()); static_cast<int>(out.size()) < n; ++pos) {
    const Status s = m.forward(b, logits, nullptr);
    EXPECT_TRUE(s.ok()) << s.to_string();
    if (!s.ok()) break;
    const int32_t tok = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(tok);
    b.token_ids = {tok};
    b.positions = {pos};
    b.seq_of = {0};
    b.slot_mapping = {pos};
    b.ctx_len = {pos + 1};
    b.logits_rows = {0};
  }
  return out;
}

std::vector<float> prompt_logits(core::MoeDecoder& m, const std::vector<int32_t>& tokens) {
  core::StepBatch b = test::single_sequence_prefill(tokens, 4);
  for (int32_t t = 0; t < static_cast<int32_t>(tokens.size()); ++t) b.logits_rows.push_back(t);
  std::vector<float> logits;
  const Status s = m.forward(b, logits, nullptr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return logits;
}

class HfCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("rolloutd-hf-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir() const { return dir_.string(); }

  // A test model's tensors, edited, written as DIR/model.safetensors with its config.json.
  void write_edited(const std::function<void(std::vector<core::TestTensor>&)>& edit,
                    const core::TestModelSpec& spec = small_spec()) {
    ASSERT_TRUE(core::write_test_model(spec, dir()).ok());
    auto c = core::test_model_config(spec);
    auto t = core::make_test_tensors(*c, spec.seed);
    ASSERT_TRUE(t.ok());
    edit(*t);
    std::vector<core::SafetensorsTensorIn> in;
    for (const auto& x : *t) in.push_back({x.name, x.dtype, x.shape, x.bytes});
    ASSERT_TRUE(core::write_safetensors(dir() + "/model.safetensors", in).ok());
  }

  Status try_load(core::ExpertQuantization quantize = core::ExpertQuantization::kNone) {
    auto m = core::open_hf_model(dir(), quantize);
    if (!m.ok()) return m.status();
    auto model = core::MoeDecoder::create(m->config, limits(), cpu_backend(), ExecContext{});
    if (!model.ok()) return model.status();
    return core::load_checkpoint(**model, *m->checkpoint);
  }

  std::filesystem::path dir_;
};

TEST_F(HfCheckpoint, MakeTestModelIsDeterministicForASeed) {
  ASSERT_TRUE(core::write_test_model(small_spec(7), dir() + "/a").ok());
  ASSERT_TRUE(core::write_test_model(small_spec(7), dir() + "/b").ok());
  ASSERT_TRUE(core::write_test_model(small_spec(8), dir() + "/c").ok());
  auto read = [](const std::string& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  EXPECT_EQ(read(dir() + "/a/model.safetensors"), read(dir() + "/b/model.safetensors"));
  EXPECT_EQ(read(dir() + "/a/config.json"), read(dir() + "/b/config.json"));
  EXPECT_NE(read(dir() + "/a/model.safetensors"), read(dir() + "/c/model.safetensors"));
  // Hugging Face names: per-expert tensors and QK-norm weights, BF16.
  auto c = core::SafetensorsCheckpoint::open(dir() + "/a");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const auto* t = (*c)->find("model.layers.1.mlp.experts.3.down_proj.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->entry->dtype, DType::kBF16);
  EXPECT_EQ(t->entry->shape, (std::vector<int64_t>{32, 16}));
  EXPECT_NE((*c)->find("model.layers.0.self_attn.k_norm.weight"), nullptr);
  EXPECT_EQ((*c)->tensors().size(), 1u + 2u * (9u + 4u * 3u) + 2u);
}

// One weight session (begin, one bucket, end) writing `entries` of `bucket`, as a trainer would.
Status apply_in_one_session(core::WeightRegistry& weights, const std::vector<core::BucketEntry>& entries,
                            const std::vector<uint8_t>& bucket) {
  core::WeightUpdater u(weights);
  const auto now = core::SteadyClock::now();
  auto begin = u.begin({}, 60, now);
  if (!begin.ok()) return begin.status();
  if (auto applied = u.apply_bucket(begin->session, entries, bucket, std::nullopt, now); !applied.ok())
    return applied.status();
  return u.end(begin->session, 1, now).status();
}

// Stacked MXFP4 experts ([E, rows, cols/32, 16] blocks, [E, rows, cols/32] scales) dequantized
// to FP32 [E, rows, cols] with the project's quantization reference.
std::vector<float> dequantized_experts(std::span<const uint8_t> blocks, std::span<const uint8_t> scales, int64_t E,
                                       int64_t rows, int64_t cols) {
  std::vector<uint8_t> bb(blocks.begin(), blocks.end()), ss(scales.begin(), scales.end());
  std::vector<float> deq(static_cast<size_t>(E * rows * cols));
  const Status s = quant::dequantize_mxfp4(ExecContext{},
                                           TensorView::contiguous(bb.data(), DType::kU8, Shape{E, rows, cols / 32, 16}),
                                           TensorView::contiguous(ss.data(), DType::kU8, Shape{E, rows, cols / 32}),
                                           TensorView::contiguous(deq.data(), DType::kF32, Shape{E, rows, cols}));
  EXPECT_TRUE(s.ok()) << s.to_string();
  return deq;
}

// A parameter's checkpoint-layout bytes.
std::vector<uint8_t> param_bytes(const core::MoeDecoder& m, const std::string& name) {
  std::vector<uint8_t> out;
  const size_t i = m.weights().index_of(name);
  EXPECT_NE(i, SIZE_MAX) << name;
  if (i != SIZE_MAX) {
    EXPECT_TRUE(m.weights().read_checkpoint(i, out).ok()) << name;
  }
  return out;
}

// Every parameter of two models of one shape: equal stored bytes.
void expect_same_parameters(const core::MoeDecoder& a, const core::MoeDecoder& b, const char* what) {
  const auto& pa = a.weights().parameters();
  const auto& pb = b.weights().parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_EQ(pa[i].name, pb[i].name);
    ASSERT_EQ(pa[i].storage.nbytes(), pb[i].storage.nbytes());
    EXPECT_EQ(std::memcmp(pa[i].storage.data, pb[i].storage.data, pa[i].storage.nbytes()), 0)
        << pa[i].name << " differs: " << what;
  }
}

// Loading a checkpoint and pushing its own tensors through one weight session into a model of
// random weights give bit-identical parameters and logits.
void expect_update_matches_load(const std::string& dir, const core::StepLimits& limits,
                                core::ExpertQuantization quantize = core::ExpertQuantization::kNone) {
  auto hf = core::open_hf_model(dir, quantize);
  ASSERT_TRUE(hf.ok()) << hf.status().to_string();
  auto loaded = core::MoeDecoder::create(hf->config, limits, cpu_backend(), ExecContext{});
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  Status s = core::load_checkpoint(**loaded, *hf->checkpoint);
  ASSERT_TRUE(s.ok()) << s.to_string();

  // Another model of the same shape, random weights from another seed, then one session
  // writing every checkpoint tensor (as a trainer would: BF16, checkpoint names).
  auto updated = core::MoeDecoder::create(hf->config, limits, cpu_backend(), ExecContext{});
  ASSERT_TRUE(updated.ok());
  ASSERT_TRUE(core::init_random_weights(**updated, 99).ok());
  const auto [entries, bucket] = test::checkpoint_bucket(*hf->checkpoint);
  ASSERT_TRUE(apply_in_one_session((*updated)->weights(), entries, bucket).ok());

  const auto& a = (*loaded)->weights().parameters();
  const auto& b = (*updated)->weights().parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].layout, b[i].layout) << a[i].name;
    ASSERT_EQ(a[i].storage.nbytes(), b[i].storage.nbytes());
    EXPECT_EQ(std::memcmp(a[i].storage.data, b[i].storage.data, a[i].storage.nbytes()), 0)
        << a[i].name << " differs between loading and updating";
  }
  const std::vector<int32_t> prompt = {1, 5, 9, 33, 2, 63, 17};
  const auto la = prompt_logits(**loaded, prompt);
  const auto lb = prompt_logits(**updated, prompt);
  ASSERT_EQ(la.size(), prompt.size() * 64);
  EXPECT_EQ(la, lb);
}

TEST_F(HfCheckpoint, LoadsAndAnUpdateWithItsOwnTensorsIsBitIdentical) {
  ASSERT_TRUE(core::write_test_model(small_spec(), dir()).ok());
  auto hf = core::open_hf_model(dir());
  ASSERT_TRUE(hf.ok()) << hf.status().to_string();
  EXPECT_TRUE(hf->config.qk_norm);
  expect_update_matches_load(dir(), limits());
}

// Every family file (core/model/families/) gets the same check with no test of its own: its
// make-test-model checkpoint loads, and an update with its own tensors is bit-identical to it.
TEST_F(HfCheckpoint, EveryFamilyWritesLoadsAndUpdatesBitIdentically) {
  for (const std::string& family : core::model_family_names()) {
    SCOPED_TRACE(family);
    auto spec = small_spec();
    spec.family = family;
    spec.intermediate = 32;  // a multiple of 32 for families whose experts may be MXFP4
    const std::string d = dir() + "/" + family;
    ASSERT_TRUE(core::write_test_model(spec, d).ok());
    auto hf = core::open_hf_model(d);
    ASSERT_TRUE(hf.ok()) << hf.status().to_string();
    EXPECT_EQ(hf->config.family, family);
    expect_update_matches_load(d, limits());
  }
}

TEST_F(HfCheckpoint, DenseBf16OnlyWhenEveryProjectionIsBf16) {
  // ModelConfig::dense_bf16 (BF16 q/k/v/o and LM head on CUDA) follows the tensors: a BF16
  // checkpoint sets it, an FP32 one does not, and one FP32 projection in a BF16 checkpoint (here
  // the LM head, widened exactly) keeps every projection FP32.
  core::TestModelSpec spec = small_spec();
  ASSERT_TRUE(core::write_test_model(spec, dir()).ok());
  auto bf16 = core::open_hf_model(dir());
  ASSERT_TRUE(bf16.ok()) << bf16.status().to_string();
  EXPECT_TRUE(bf16->config.dense_bf16);
  write_edited([](auto& t) {
    for (auto& x : t) {
      if (x.name != "lm_head.weight" || x.dtype != DType::kBF16) continue;
      std::vector<uint8_t> f(x.bytes.size() * 2);
      for (size_t i = 0; i < x.bytes.size() / 2; ++i) {
        uint16_t b;
        std::memcpy(&b, &x.bytes[2 * i], 2);
        const float v = bf16_bits_to_f32(b);
        std::memcpy(&f[4 * i], &v, 4);
      }
      x.bytes = std::move(f);
      x.dtype = DType::kF32;
    }
  });
  auto mixed = core::open_hf_model(dir());
  ASSERT_TRUE(mixed.ok()) << mixed.status().to_string();
  EXPECT_FALSE(mixed->config.dense_bf16);
  spec.dtype = "float32";
  ASSERT_TRUE(core::write_test_model(spec, dir()).ok());
  auto f32 = core::open_hf_model(dir());
  ASSERT_TRUE(f32.ok());
  EXPECT_FALSE(f32->config.dense_bf16);
}

TEST_F(HfCheckpoint, QkNormChangesTheOutput) {
  // The decoder reads the q/k norm weights: scaling them changes the logits.
  ASSERT_TRUE(core::write_test_model(small_spec(), dir()).ok());
  auto hf = core::open_hf_model(dir());
  ASSERT_TRUE(hf.ok());
  auto m = core::MoeDecoder::create(hf->config, limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(core::load_checkpoint(**m, *hf->checkpoint).ok());
  const auto before = prompt_logits(**m, {3, 4, 5});
  auto* p = (*m)->weights().find("model.layers.0.self_attn.q_norm.weight");
  ASSERT_NE(p, nullptr);
  for (int64_t i = 0; i < p->storage.numel(); ++i) p->storage.as<float>()[i] *= 3.0f;
  EXPECT_NE(prompt_logits(**m, {3, 4, 5}), before);
}

TEST_F(HfCheckpoint, MissingTensorIsNamed) {
  write_edited([](auto& t) {
    std::erase_if(t, [](const core::TestTensor& x) { return x.name == "model.layers.1.mlp.experts.2.up_proj.weight"; });
  });
  Status s = try_load();
  EXPECT_EQ(s.code(), ErrorCode::kNotFound) << s.to_string();
  EXPECT_EQ(s.field(), "model.layers.1.mlp.experts.2.up_proj.weight") << s.to_string();
  write_edited([](auto& t) {
    std::erase_if(t, [](const core::TestTensor& x) { return x.name == "model.layers.0.self_attn.q_norm.weight"; });
  });
  s = try_load();
  EXPECT_EQ(s.field(), "model.layers.0.self_attn.q_norm.weight") << s.to_string();
}

TEST_F(HfCheckpoint, ExtraTensorIsNamed) {
  write_edited([](auto& t) {
    t.push_back({"model.layers.0.mlp.shared_expert.gate_proj.weight", {16, 32}, DType::kBF16,
                 std::vector<uint8_t>(16 * 32 * 2)});
  });
  Status s = try_load();
  EXPECT_EQ(s.code(), ErrorCode::kNotFound) << s.to_string();
  EXPECT_EQ(s.field(), "model.layers.0.mlp.shared_expert.gate_proj.weight");
}

TEST_F(HfCheckpoint, MisShapedOrMistypedTensorIsNamed) {
  write_edited([](auto& t) {
    for (auto& x : t)
      if (x.name == "model.layers.1.self_attn.o_proj.weight") x.shape = {16, 64};  // same bytes, wrong shape
  });
  Status s = try_load();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_EQ(s.field(), "model.layers.1.self_attn.o_proj.weight");
  EXPECT_NE(s.message().find("expected shape [32, 32]"), std::string::npos) << s.to_string();
  write_edited([](auto& t) {
    for (auto& x : t)
      if (x.name == "model.norm.weight") x.dtype = DType::kI16;
  });
  s = try_load();
  EXPECT_EQ(s.field(), "model.norm.weight") << s.to_string();
}

TEST_F(HfCheckpoint, FusedAndSplitCopiesOfOneParameterAreRefused) {
  write_edited([](auto& t) {
    t.push_back({"model.layers.0.mlp.experts.down_proj", {4, 32, 16}, DType::kBF16,
                 std::vector<uint8_t>(4 * 32 * 16 * 2)});
  });
  Status s = try_load();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("both write"), std::string::npos) << s.to_string();
}

TEST_F(HfCheckpoint, FusedExpertTensorsLoadToo) {
  // transformers 5's in-memory names (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]).
  write_edited([](auto& t) {
    std::map<std::string, core::TestTensor> by;
    for (auto& x : t) by[x.name] = x;
    std::vector<core::TestTensor> out;
    for (auto& x : t)
      if (x.name.find(".mlp.experts.") == std::string::npos) out.push_back(x);
    for (int l = 0; l < 2; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
      core::TestTensor gu{p + "gate_up_proj", {4, 32, 32}, DType::kBF16, {}}, dn{p + "down_proj", {4, 32, 16}, DType::kBF16, {}};
      for (int e = 0; e < 4; ++e) {
        const std::string x = p + std::to_string(e) + ".";
        for (const char* part : {"gate_proj.weight", "up_proj.weight"})
          gu.bytes.insert(gu.bytes.end(), by[x + part].bytes.begin(), by[x + part].bytes.end());
        dn.bytes.insert(dn.bytes.end(), by[x + "down_proj.weight"].bytes.begin(), by[x + "down_proj.weight"].bytes.end());
      }
      out.push_back(gu);
      out.push_back(dn);
    }
    t = out;
  });
  auto hf = core::open_hf_model(dir());
  ASSERT_TRUE(hf.ok());
  auto fused = core::MoeDecoder::create(hf->config, limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(core::load_checkpoint(**fused, *hf->checkpoint).ok());
  const std::string split_dir = dir() + "/split";
  ASSERT_TRUE(core::write_test_model(small_spec(), split_dir).ok());
  auto hs = core::open_hf_model(split_dir);
  auto split = core::MoeDecoder::create(hs->config, limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(core::load_checkpoint(**split, *hs->checkpoint).ok());
  EXPECT_EQ(prompt_logits(**fused, {1, 2, 3}), prompt_logits(**split, {1, 2, 3}));
}

TEST_F(HfCheckpoint, DenseLayersLoadRecordOnlyMoeLayersAndUpdateBitIdentically) {
  auto spec = small_spec();
  spec.layers = 4;
  spec.mlp_only_layers = {0};
  spec.decoder_sparse_step = 2;  // MoE layers: 1 and 3; dense: 0 and 2
  ASSERT_TRUE(core::write_test_model(spec, dir()).ok());
  auto hf = core::open_hf_model(dir());
  ASSERT_TRUE(hf.ok()) << hf.status().to_string();
  EXPECT_EQ(hf->config.num_moe_layers(), 2);
  EXPECT_NE(hf->checkpoint->find("model.layers.2.mlp.down_proj.weight"), nullptr);
  EXPECT_EQ(hf->checkpoint->find("model.layers.2.mlp.gate.weight"), nullptr);
  auto m = core::MoeDecoder::create(hf->config, limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  Status s = core::load_checkpoint(**m, *hf->checkpoint);
  ASSERT_TRUE(s.ok()) << s.to_string();
  core::StepBatch b;
  b.max_blocks_per_seq = 1;
  b.block_tables = {0};
  b.token_ids = {5, 6, 7};
  b.positions = {0, 1, 2};
  b.seq_of = {0, 0, 0};
  b.slot_mapping = {0, 1, 2};
  b.ctx_len = {1, 2, 3};
  b.logits_rows = {2};
  std::vector<float> logits;
  core::RoutedExpertRecorder rec(2, hf->config.num_experts_per_tok, 32);
  ASSERT_TRUE((*m)->forward(b, logits, &rec).ok());
  EXPECT_EQ(rec.rows().size(), 3u * 2u * 2u) << "[tokens, MoE layers, top_k]";
  for (float v : logits) ASSERT_TRUE(std::isfinite(v));

  // The dense MLP's checkpoint names go through update_weights too, bit-identically.
  auto u2 = core::MoeDecoder::create(hf->config, limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(core::init_random_weights(**u2, 5).ok());
  const auto [entries, bucket] = test::checkpoint_bucket(*hf->checkpoint);
  core::WeightUpdater u((*u2)->weights());
  const auto now = core::SteadyClock::now();
  auto begin = u.begin({}, 60, now);
  ASSERT_TRUE(u.apply_bucket(begin->session, entries, bucket, std::nullopt, now).ok());
  ASSERT_TRUE(u.end(begin->session, 1, now).ok());
  const auto& pa = (*m)->weights().parameters();
  const auto& pb = (*u2)->weights().parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(std::memcmp(pa[i].storage.data, pb[i].storage.data, pa[i].storage.nbytes()), 0) << pa[i].name;

  // The dense layers' constant expert inputs live in weights memory but are no checkpoint
  // tensor: a release of the weights keeps them (static state), so after resume and a push of
  // the checkpoint the model computes what it did before.
  const auto& st = (*m)->weights().static_state();
  size_t dense_entries = 0;
  for (const auto& e : st.entries()) dense_entries += e.name.rfind("model.dense_mlp.", 0) == 0;
  EXPECT_EQ(dense_entries, 2u);
  core::MemoryManager mm;
  mm.add_arena(&(*m)->arena(core::MemoryTag::kWeights));
  mm.add_static_state(&(*m)->weights().static_state());
  ASSERT_TRUE(mm.release(core::MemoryTag::kWeights).ok());
  ASSERT_TRUE(mm.resume(core::MemoryTag::kWeights).ok());
  core::WeightUpdater um((*m)->weights());
  auto bm = um.begin({}, 60, now);
  ASSERT_TRUE(bm.ok()) << bm.status().to_string();
  ASSERT_TRUE(um.apply_bucket(bm->session, entries, bucket, std::nullopt, now).ok());
  ASSERT_TRUE(um.end(bm->session, 2, now).ok());
  std::vector<float> again;
  ASSERT_TRUE((*m)->forward(b, again, nullptr).ok());
  EXPECT_EQ(again, logits);
}

TEST_F(HfCheckpoint, GptOssLoadsUpdatesBitIdenticallyAndReadsBackItsLayout) {
  auto spec = small_spec();
  spec.family = "gpt_oss";
  spec.intermediate = 32;  // MXFP4 experts: multiples of 32
  ASSERT_TRUE(core::write_test_model(spec, dir()).ok());
  auto c = core::SafetensorsCheckpoint::open(dir());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_NE((*c)->find("model.layers.1.self_attn.sinks"), nullptr);
  EXPECT_NE((*c)->find("model.layers.0.mlp.experts.gate_up_proj_bias"), nullptr);
  expect_update_matches_load(dir(), limits());

  // The experts are stored transposed for the kernels ([E, 2I, H]); reading a parameter back
  // gives the checkpoint's layout ([E, H, 2I]), value for value (BF16 widened to FP32).
  auto hf = core::open_hf_model(dir());
  ASSERT_TRUE(hf.ok());
  auto m = core::MoeDecoder::create(hf->config, limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(core::load_checkpoint(**m, *hf->checkpoint).ok());
  for (const char* name : {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}) {
    const auto* t = (*c)->find(name);
    ASSERT_NE(t, nullptr);
    const size_t i = (*m)->weights().index_of(name);
    ASSERT_NE(i, SIZE_MAX) << name;
    EXPECT_EQ((*m)->weights().parameters()[i].layout, core::Layout::kKernel);
    std::vector<uint8_t> back;
    ASSERT_TRUE((*m)->weights().read_checkpoint(i, back).ok());
    const auto file = (*c)->data(*t);
    ASSERT_EQ(back.size(), file.size() * 2) << name;
    for (size_t k = 0; k < file.size() / 2; ++k) {
      const uint32_t bits = static_cast<uint32_t>(file[2 * k] | (file[2 * k + 1] << 8)) << 16;
      uint32_t got = 0;
      std::memcpy(&got, back.data() + 4 * k, 4);
      ASSERT_EQ(got, bits) << name << " element " << k;
    }
  }
}

TEST_F(HfCheckpoint, GptOssMxfp4ExpertsServeAsTheirDequantizedValues) {
  // make-test-model --experts-mxfp4 writes the experts as published gpt-oss does; the decoder
  // computes from the bytes. A model loaded from the BF16 checkpoint of the same seed, with its
  // experts replaced (through a weight session, in transformers' layout) by the dequantized MXFP4
  // values, gives the same logits bit for bit.
  auto spec = small_spec();
  spec.family = "gpt_oss";
  spec.intermediate = 32;
  spec.experts_mxfp4 = true;
  const std::string mx_dir = dir() + "/mx", bf_dir = dir() + "/bf16";
  ASSERT_TRUE(core::write_test_model(spec, mx_dir).ok());
  spec.experts_mxfp4 = false;
  ASSERT_TRUE(core::write_test_model(spec, bf_dir).ok());
  auto mx = core::open_hf_model(mx_dir);
  ASSERT_TRUE(mx.ok()) << mx.status().to_string();
  EXPECT_TRUE(mx->config.experts_mxfp4);
  EXPECT_NE(mx->checkpoint->find("model.layers.1.mlp.experts.down_proj_scales"), nullptr);
  auto bf = core::open_hf_model(bf_dir);
  ASSERT_TRUE(bf.ok());
  EXPECT_FALSE(bf->config.experts_mxfp4);
  auto m_mx = core::MoeDecoder::create(mx->config, limits(), cpu_backend(), ExecContext{});
  auto m_bf = core::MoeDecoder::create(bf->config, limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(m_mx.ok() && m_bf.ok());
  ASSERT_TRUE(core::load_checkpoint(**m_mx, *mx->checkpoint).ok());
  ASSERT_TRUE(core::load_checkpoint(**m_bf, *bf->checkpoint).ok());
  // The MXFP4 model takes its experts as blocks/scales, and transformers' BF16 tensors of the
  // unsuffixed names as input-major: transposed back, then quantized (never along their rows,
  // which for the square down_proj would transpose it silently).
  EXPECT_NE((*m_mx)->weights().resolve("model.layers.0.mlp.experts.down_proj_blocks"), nullptr);
  const core::CheckpointTensor* down_in = (*m_mx)->weights().resolve("model.layers.0.mlp.experts.down_proj");
  ASSERT_NE(down_in, nullptr);
  ASSERT_TRUE(down_in->mxfp4.has_value());
  EXPECT_TRUE(down_in->mxfp4->input_major);
  const auto& c = mx->config;
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  test::CheckpointBucket deq_bucket;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (const auto& [name, rows, cols] : {std::tuple<std::string, int64_t, int64_t>{"gate_up_proj", 2 * I, H},
                                           {"down_proj", H, I}}) {
      const std::string base = "model.layers." + std::to_string(l) + ".mlp.experts." + name;
      const auto* b = mx->checkpoint->find(base + "_blocks");
      const auto* sc = mx->checkpoint->find(base + "_scales");
      ASSERT_TRUE(b && sc) << base;
      const std::vector<float> deq =
          dequantized_experts(mx->checkpoint->data(*b), mx->checkpoint->data(*sc), E, rows, cols);
      // transformers' layout: [E, cols, rows] (input-major).
      std::vector<float> tr(deq.size());
      for (int64_t e = 0; e < E; ++e)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < cols; ++k)
            tr[static_cast<size_t>((e * cols + k) * rows + r)] = deq[static_cast<size_t>((e * rows + r) * cols + k)];
      test::add_f32_entry(deq_bucket, base, {E, cols, rows}, tr);
    }
  ASSERT_TRUE(apply_in_one_session((*m_bf)->weights(), deq_bucket.entries, deq_bucket.bytes).ok());
  const std::vector<int32_t> prompt = {1, 5, 9, 33, 2, 63, 17};
  const auto la = prompt_logits(**m_mx, prompt);
  const auto lb = prompt_logits(**m_bf, prompt);
  ASSERT_FALSE(la.empty());
  EXPECT_EQ(la, lb);
  // An update with the MXFP4 checkpoint's own tensors (uint8 blocks and scales) is bit-identical.
  expect_update_matches_load(mx_dir, limits());
}

// A gpt_oss model (8 experts) loaded from its MXFP4 checkpoint and the BF16 checkpoint of the
// same seed: make-test-model writes the MXFP4 one as the BF16 values transposed to [E, out, in]
// (its own tiled loop) and quantized, as transformers' dequantization inverts.
struct GptOssPair {
  std::unique_ptr<core::MoeDecoder> mx;  // loaded from the MXFP4 checkpoint
  std::string mx_dir, bf_dir;
};

GptOssPair gptoss_pair(const std::string& root, const core::StepLimits& limits) {
  core::TestModelSpec spec;
  spec.family = "gpt_oss";
  spec.layers = 2;
  spec.hidden = 64;
  spec.experts = 8;
  spec.top_k = 2;
  spec.heads = 4;
  spec.kv_heads = 2;
  spec.head_dim = 16;
  spec.intermediate = 96;  // 2I = 192 rows, K of down = 96: neither square nor a power of two
  spec.vocab = 64;
  spec.seed = 23;
  GptOssPair p;
  p.mx_dir = root + "/mx";
  p.bf_dir = root + "/bf16";
  spec.experts_mxfp4 = true;
  EXPECT_TRUE(core::write_test_model(spec, p.mx_dir).ok());
  spec.experts_mxfp4 = false;
  EXPECT_TRUE(core::write_test_model(spec, p.bf_dir).ok());
  auto mx = core::open_hf_model(p.mx_dir);
  EXPECT_TRUE(mx.ok()) << mx.status().to_string();
  if (!mx.ok()) return p;
  auto m = core::MoeDecoder::create(mx->config, limits, cpu_backend(), ExecContext{});
  EXPECT_TRUE(m.ok());
  if (!m.ok()) return p;
  const Status s = core::load_checkpoint(**m, *mx->checkpoint);
  EXPECT_TRUE(s.ok()) << s.to_string();
  p.mx = std::move(*m);
  return p;
}

TEST_F(HfCheckpoint, GptOssBf16ExpertsQuantizedOnLoadAreThePublishedBlocks) {
  // --quantize-experts mxfp4 on the BF16 checkpoint: each expert's input-major tensor is
  // transposed back and quantized; the stored bytes equal the MXFP4 checkpoint's load, whether
  // the experts go through staging one at a time, three at a time, or all at once.
  auto pair = gptoss_pair(dir(), limits());
  ASSERT_TRUE(pair.mx);
  auto hf = core::open_hf_model(pair.bf_dir, core::ExpertQuantization::kMxfp4);
  ASSERT_TRUE(hf.ok()) << hf.status().to_string();
  ASSERT_TRUE(hf->config.experts_mxfp4);
  const int64_t H = hf->config.hidden_size, I = hf->config.moe_intermediate_size;
  const size_t expert_bytes = static_cast<size_t>(H * 2 * I * 2);  // a BF16 gate_up expert
  for (const size_t staging : {size_t{1}, 3 * expert_bytes, size_t{64} << 20}) {
    auto m = core::MoeDecoder::create(hf->config, limits(), cpu_backend(), ExecContext{});
    ASSERT_TRUE(m.ok());
    (*m)->weights().set_staging_bytes(staging);
    const Status s = core::load_checkpoint(**m, *hf->checkpoint);
    ASSERT_TRUE(s.ok()) << s.to_string();
    expect_same_parameters(**m, *pair.mx, "BF16 checkpoint quantized on load vs the MXFP4 checkpoint");
  }
}

TEST_F(HfCheckpoint, GptOssMxfp4TakesBf16AndFp32ExpertUpdatesInTransformersLayout) {
  // A BF16 trainer of a gpt_oss model served as MXFP4 pushes transformers' input-major tensors:
  // (a) the BF16 experts the MXFP4 checkpoint was made from, (b) the MXFP4 checkpoint's
  // dequantized values (FP32, computed here with the dequantization reference, transposed by
  // this test's own loop; quantizing them again must give the same blocks), each into a model
  // of random weights. Both give the MXFP4 checkpoint's bytes, and the same logits.
  auto pair = gptoss_pair(dir(), limits());
  ASSERT_TRUE(pair.mx);
  auto bf = core::open_hf_model(pair.bf_dir);
  auto mx = core::open_hf_model(pair.mx_dir);
  ASSERT_TRUE(bf.ok() && mx.ok());
  const auto& c = mx->config;
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  test::CheckpointBucket bf16_bucket, deq_bucket;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (const auto& [name, rows, cols] : {std::tuple<std::string, int64_t, int64_t>{"gate_up_proj", 2 * I, H},
                                           {"down_proj", H, I}}) {
      const std::string base = "model.layers." + std::to_string(l) + ".mlp.experts." + name;
      const auto* t = bf->checkpoint->find(base);
      ASSERT_NE(t, nullptr) << base;
      ASSERT_EQ(t->entry->dtype, DType::kBF16);
      ASSERT_EQ(t->entry->shape, (std::vector<int64_t>{E, cols, rows})) << base;
      const auto data = bf->checkpoint->data(*t);
      const size_t off = bf16_bucket.bytes.size();
      bf16_bucket.bytes.insert(bf16_bucket.bytes.end(), data.begin(), data.end());
      core::BucketEntry e;
      e.name = base;
      e.dtype = DType::kBF16;
      e.shape = {E, cols, rows};
      e.byte_offset = off;
      e.nbytes = data.size();
      bf16_bucket.entries.push_back(e);

      const std::vector<float> deq = dequantized_experts(mx->checkpoint->data(*mx->checkpoint->find(base + "_blocks")),
                                                         mx->checkpoint->data(*mx->checkpoint->find(base + "_scales")),
                                                         E, rows, cols);
      std::vector<float> tr(deq.size());
      for (int64_t x = 0; x < E; ++x)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < cols; ++k)
            tr[static_cast<size_t>((x * cols + k) * rows + r)] = deq[static_cast<size_t>((x * rows + r) * cols + k)];
      test::add_f32_entry(deq_bucket, base, {E, cols, rows}, tr);
    }
  const std::vector<int32_t> prompt = {1, 5, 9, 33, 2, 63, 17};
  const auto want = prompt_logits(*pair.mx, prompt);
  ASSERT_FALSE(want.empty());
  for (const auto* bucket : {&bf16_bucket, &deq_bucket}) {
    const char* what = bucket == &bf16_bucket ? "BF16 experts update" : "dequantized FP32 experts update";
    auto m = core::MoeDecoder::create(c, limits(), cpu_backend(), ExecContext{});
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE(core::init_random_weights(**m, 7).ok());
    ASSERT_NE(prompt_logits(**m, prompt), want) << "random weights differ from the checkpoint";
    // The checkpoint's other tensors (expert biases included), then the experts in
    // transformers' layout.
    const auto [entries, bytes] = test::checkpoint_bucket(*mx->checkpoint);
    std::vector<core::BucketEntry> others;
    auto ends = [](const std::string& n, const std::string& suffix) {
      return n.size() >= suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    for (const auto& e : entries)
      if (!ends(e.name, "_proj_blocks") && !ends(e.name, "_proj_scales")) others.push_back(e);
    ASSERT_EQ(others.size() + 4 * static_cast<size_t>(c.num_hidden_layers), entries.size());
    ASSERT_TRUE(apply_in_one_session((*m)->weights(), others, bytes).ok());
    const Status s = apply_in_one_session((*m)->weights(), bucket->entries, bucket->bytes);
    ASSERT_TRUE(s.ok()) << what << ": " << s.to_string();
    expect_same_parameters(**m, *pair.mx, what);
    EXPECT_EQ(prompt_logits(**m, prompt), want) << what;
  }
}

TEST_F(HfCheckpoint, Mxfp4TensorsOutsideGptOssExpertsAreRefusedWithAMessage) {
  // qwen3_moe takes BF16/FP32 experts: MXFP4 blocks in its checkpoint are named and refused.
  auto spec = small_spec();
  auto cfg = core::test_model_config(spec);
  ASSERT_TRUE(cfg.ok());
  auto tensors = core::make_test_tensors(*cfg, spec.seed);
  ASSERT_TRUE(tensors.ok());
  std::vector<core::SafetensorsTensorIn> in;
  const std::vector<uint8_t> blocks(static_cast<size_t>(8 * 64 * 2 * 16), 0);
  for (const auto& t : *tensors) in.push_back({t.name, t.dtype, t.shape, t.bytes});
  in.push_back({"model.layers.0.mlp.experts.gate_up_proj_blocks", DType::kU8, {8, 64, 2, 16}, blocks});
  std::filesystem::create_directories(dir());
  ASSERT_TRUE(core::write_safetensors(dir() + "/model.safetensors", in, {}).ok());
  std::ofstream(dir() + "/config.json") << core::model_config_to_hf(*cfg).dump();
  auto hf = core::open_hf_model(dir());
  ASSERT_TRUE(hf.ok()) << hf.status().to_string();
  auto m = core::MoeDecoder::create(hf->config, limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(m.ok());
  const Status s = core::load_checkpoint(**m, *hf->checkpoint);
  EXPECT_EQ(s.code(), ErrorCode::kUnimplemented) << s.to_string();
  EXPECT_EQ(s.field(), "model.layers.0.mlp.experts.gate_up_proj_blocks");
  EXPECT_NE(s.message().find("input-major experts as published (gpt_oss) only"), std::string::npos) << s.to_string();
}

// qwen3_moe with --quantize-experts mxfp4: BF16 per-expert experts (multiples of 32), a dense
// layer that stays FP32.
core::TestModelSpec qwen3_mxfp4_spec() {
  auto spec = small_spec();
  spec.layers = 3;
  spec.intermediate = 32;
  spec.mlp_only_layers = {1};
  return spec;
}

TEST_F(HfCheckpoint, Qwen3Mxfp4ExpertsServeAsTheirDequantizedValues) {
  // The routed experts are quantized on load from the checkpoint's per-expert tensors and the
  // decoder computes from the MXFP4 bytes. The same checkpoint loaded unquantized, its experts
  // then replaced through a weight session by the dequantized MXFP4 values, gives the same logits
  // bit for bit.
  ASSERT_TRUE(core::write_test_model(qwen3_mxfp4_spec(), dir()).ok());
  auto mx = core::open_hf_model(dir(), core::ExpertQuantization::kMxfp4);
  ASSERT_TRUE(mx.ok()) << mx.status().to_string();
  EXPECT_TRUE(mx->config.experts_mxfp4);
  auto bf = core::open_hf_model(dir());
  ASSERT_TRUE(bf.ok());
  EXPECT_FALSE(bf->config.experts_mxfp4);
  auto m_mx = core::MoeDecoder::create(mx->config, limits(), cpu_backend(), ExecContext{});
  auto m_bf = core::MoeDecoder::create(bf->config, limits(), cpu_backend(), ExecContext{});
  auto m_ref = core::MoeDecoder::create(bf->config, limits(), cpu_backend(), ExecContext{});
  ASSERT_TRUE(m_mx.ok() && m_bf.ok() && m_ref.ok()) << m_mx.status().to_string();
  Status s = core::load_checkpoint(**m_mx, *mx->checkpoint);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(core::load_checkpoint(**m_bf, *bf->checkpoint).ok());
  ASSERT_TRUE(core::load_checkpoint(**m_ref, *bf->checkpoint).ok());

  const auto& c = mx->config;
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  // Routed experts: MXFP4, no FP32 copy; per-expert names land in their expert's rows (gate rows,
  // then up rows). The dense layer's MLP stays FP32.
  const auto& w = (*m_mx)->weights();
  const core::CheckpointTensor* up = w.resolve("model.layers.2.mlp.experts.3.up_proj.weight");
  ASSERT_TRUE(up != nullptr && up->mxfp4.has_value());
  EXPECT_EQ(up->mxfp4->expert, 3);
  EXPECT_EQ(up->mxfp4->row_start, I);
  EXPECT_NE(w.find("model.layers.0.mlp.experts.gate_up_proj_blocks"), nullptr);
  EXPECT_EQ(w.find("model.layers.0.mlp.experts.gate_up_proj"), nullptr);
  EXPECT_EQ(w.find("model.layers.1.mlp.experts.gate_up_proj_blocks"), nullptr);
  const core::RegisteredParameter* dense = w.find("model.layers.1.mlp.gate_up_proj");
  ASSERT_NE(dense, nullptr);
  EXPECT_EQ(dense->storage.dtype, DType::kF32);

  test::CheckpointBucket deq_bucket;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_moe_layer(l)) continue;
    for (const auto& [name, rows, cols] : {std::tuple<std::string, int64_t, int64_t>{"gate_up_proj", 2 * I, H},
                                           {"down_proj", H, I}}) {
      const std::string base = "model.layers." + std::to_string(l) + ".mlp.experts." + name;
      const std::vector<float> deq = dequantized_experts(param_bytes(**m_mx, base + "_blocks"),
                                                         param_bytes(**m_mx, base + "_scales"), E, rows, cols);
      test::add_f32_entry(deq_bucket, base, {E, rows, cols}, deq);  // stacked: gate rows, then up rows
    }
  }
  ASSERT_TRUE(apply_in_one_session((*m_bf)->weights(), deq_bucket.entries, deq_bucket.bytes).ok());
  const std::vector<int32_t> prompt = {1, 5, 9, 33, 2, 63, 17};
  const auto la = prompt_logits(**m_mx, prompt);
  const auto lb = prompt_logits(**m_bf, prompt);
  ASSERT_EQ(la.size(), prompt.size() * 64);
  EXPECT_EQ(la, lb);
  EXPECT_NE(la, prompt_logits(**m_ref, prompt)) << "quantization changes the model";

  // Quantization changes the model: how far greedy decoding agrees is reported, not asserted.
  const auto gq = greedy_tokens(**m_mx, prompt, 32);
  const auto gr = greedy_tokens(**m_ref, prompt, 32);
  ASSERT_EQ(gq.size(), 32u);
  ASSERT_EQ(gr.size(), 32u);
  int agree = 0, first_diff = -1;
  for (size_t i = 0; i < gq.size(); ++i) {
    agree += gq[i] == gr[i];
    if (gq[i] != gr[i] && first_diff < 0) first_diff = static_cast<int>(i);
  }
  std::printf("qwen3_moe MXFP4 experts vs unquantized: %d of 32 greedy tokens agree (first difference at %d)\n",
              agree, first_diff);
  RecordProperty("greedy_tokens_agreeing_of_32", agree);
}

TEST_F(HfCheckpoint, Qwen3Mxfp4LoadsAndAnUpdateWithItsOwnTensorsIsBitIdentical) {
  // Loading quantizes the BF16 per-expert tensors on arrival; a weight session with the same
  // tensors (into a model of random MXFP4 codes) gives the same stored bytes and logits.
  ASSERT_TRUE(core::write_test_model(qwen3_mxfp4_spec(), dir()).ok());
  expect_update_matches_load(dir(), limits(), core::ExpertQuantization::kMxfp4);
}

TEST_F(HfCheckpoint, Qwen3Mxfp4Bf16AndFp32ExportsGiveIdenticalBlocks) {
  // The same experts exported as BF16 and as their lossless FP32 widening, per expert or stacked,
  // quantize to the same blocks and scales.
  const auto spec = qwen3_mxfp4_spec();
  const std::string bf_dir = dir() + "/bf16", f32_dir = dir() + "/f32";
  ASSERT_TRUE(core::write_test_model(spec, bf_dir).ok());
  auto cfg = core::test_model_config(spec);
  ASSERT_TRUE(cfg.ok());
  auto tensors = core::make_test_tensors(*cfg, spec.seed);
  ASSERT_TRUE(tensors.ok());
  std::map<std::string, std::vector<float>> widened;  // every tensor as FP32
  std::vector<core::SafetensorsTensorIn> in;
  for (const auto& t : *tensors) {
    ASSERT_EQ(t.dtype, DType::kBF16) << t.name;
    std::vector<float>& f = widened[t.name];
    f.resize(t.bytes.size() / 2);
    for (size_t k = 0; k < f.size(); ++k) {
      const uint32_t bits = static_cast<uint32_t>(t.bytes[2 * k] | (t.bytes[2 * k + 1] << 8)) << 16;
      std::memcpy(&f[k], &bits, 4);
    }
    in.push_back({t.name, DType::kF32, t.shape, {reinterpret_cast<const uint8_t*>(f.data()), f.size() * 4}});
  }
  std::filesystem::create_directories(f32_dir);
  ASSERT_TRUE(core::write_safetensors(f32_dir + "/model.safetensors", in, {}).ok());
  std::filesystem::copy_file(bf_dir + "/config.json", f32_dir + "/config.json");

  auto load = [&](const std::string& d) -> std::unique_ptr<core::MoeDecoder> {
    auto hf = core::open_hf_model(d, core::ExpertQuantization::kMxfp4);
    EXPECT_TRUE(hf.ok()) << hf.status().to_string();
    if (!hf.ok()) return nullptr;
    auto m = core::MoeDecoder::create(hf->config, limits(), cpu_backend(), ExecContext{});
    EXPECT_TRUE(m.ok());
    if (!m.ok()) return nullptr;
    const Status s = core::load_checkpoint(**m, *hf->checkpoint);
    EXPECT_TRUE(s.ok()) << s.to_string();
    return std::move(*m);
  };
  auto from_bf16 = load(bf_dir);
  auto from_f32 = load(f32_dir);
  ASSERT_TRUE(from_bf16 && from_f32);
  expect_same_parameters(*from_bf16, *from_f32, "BF16 vs FP32 checkpoint");

  // Stacked FP32 tensors (transformers 5: gate_up_proj [E, 2I, H], gate rows then up rows) pushed
  // into the BF16-loaded model change nothing.
  auto before = load(bf_dir);
  ASSERT_TRUE(before);
  const auto& c = *cfg;
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  test::CheckpointBucket stacked;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_moe_layer(l)) continue;
    const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts.";
    std::vector<float> gate_up, down;
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = p + std::to_string(e) + ".";
      for (const char* part : {"gate_proj.weight", "up_proj.weight"})
        gate_up.insert(gate_up.end(), widened[x + part].begin(), widened[x + part].end());
      down.insert(down.end(), widened[x + "down_proj.weight"].begin(), widened[x + "down_proj.weight"].end());
    }
    test::add_f32_entry(stacked, p + "gate_up_proj", {E, 2 * I, H}, gate_up);
    test::add_f32_entry(stacked, p + "down_proj", {E, H, I}, down);
  }
  ASSERT_TRUE(apply_in_one_session(from_bf16->weights(), stacked.entries, stacked.bytes).ok());
  expect_same_parameters(*from_bf16, *before, "stacked FP32 update vs per-expert BF16 load");
}

TEST_F(HfCheckpoint, QuantizeExpertsRefusalsNameTheFieldAndChangeNothing) {
  EXPECT_EQ(*core::parse_expert_quantization("mxfp4"), core::ExpertQuantization::kMxfp4);
  EXPECT_EQ(*core::parse_expert_quantization("none"), core::ExpertQuantization::kNone);
  EXPECT_EQ(core::parse_expert_quantization("fp8").status().field(), "quantize_experts");

  // Shapes that are not multiples of the MXFP4 block of 32: the config field is named, and the
  // config is left as it was.
  for (const auto& [hidden, inter, field] : {std::tuple<int64_t, int64_t, const char*>{32, 16, "moe_intermediate_size"},
                                             {48, 32, "hidden_size"}}) {
    auto spec = small_spec();
    spec.hidden = hidden;
    spec.intermediate = inter;
    const std::string d = dir() + "/" + field;
    ASSERT_TRUE(core::write_test_model(spec, d).ok());
    auto r = core::open_hf_model(d, core::ExpertQuantization::kMxfp4);
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument) << r.status().to_string();
    EXPECT_EQ(r.status().field(), field);
    EXPECT_NE(r.status().message().find("multiple of 32"), std::string::npos) << r.status().to_string();
    EXPECT_TRUE(core::open_hf_model(d).ok()) << "unquantized, the same checkpoint serves";
    auto c = core::test_model_config(spec);
    ASSERT_TRUE(c.ok());
    core::ModelConfig unchanged = *c;
    EXPECT_FALSE(core::apply_expert_quantization(unchanged, core::ExpertQuantization::kMxfp4).ok());
    EXPECT_FALSE(unchanged.experts_mxfp4);
  }

  // gpt_oss with BF16 experts (input-major in transformers): transposed and quantized on load
  // (GptOssBf16ExpertsQuantizedOnLoadAreThePublishedBlocks).
  auto gpt = small_spec();
  gpt.family = "gpt_oss";
  gpt.intermediate = 32;
  ASSERT_TRUE(core::write_test_model(gpt, dir() + "/gpt_bf16").ok());
  auto r = core::open_hf_model(dir() + "/gpt_bf16", core::ExpertQuantization::kMxfp4);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->config.experts_mxfp4);
  // gpt_oss published as MXFP4: the request is already met.
  gpt.experts_mxfp4 = true;
  ASSERT_TRUE(core::write_test_model(gpt, dir() + "/gpt_mx").ok());
  auto ok = core::open_hf_model(dir() + "/gpt_mx", core::ExpertQuantization::kMxfp4);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_TRUE(ok->config.experts_mxfp4);
}

TEST_F(HfCheckpoint, Qwen3Mxfp4MissingOrDoublyWrittenExpertTensorsAreNamed) {
  const auto spec = qwen3_mxfp4_spec();
  write_edited(
      [](std::vector<core::TestTensor>& t) {
        std::erase_if(t, [](const core::TestTensor& x) { return x.name == "model.layers.2.mlp.experts.1.up_proj.weight"; });
      },
      spec);
  Status s = try_load(core::ExpertQuantization::kMxfp4);
  EXPECT_EQ(s.code(), ErrorCode::kNotFound) << s.to_string();
  EXPECT_EQ(s.field(), "model.layers.2.mlp.experts.1.up_proj.weight") << s.to_string();

  // A stacked down_proj beside the per-expert ones: both write the same blocks.
  std::filesystem::remove_all(dir());
  auto cfg = core::test_model_config(spec);
  ASSERT_TRUE(cfg.ok());
  const int64_t E = cfg->num_experts, H = cfg->hidden_size, I = cfg->moe_intermediate_size;
  write_edited(
      [&](std::vector<core::TestTensor>& t) {
        core::TestTensor down{"model.layers.0.mlp.experts.down_proj", {E, H, I}, DType::kBF16,
                              std::vector<uint8_t>(static_cast<size_t>(E * H * I * 2), 0)};
        t.push_back(std::move(down));
      },
      spec);
  s = try_load(core::ExpertQuantization::kMxfp4);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("both write"), std::string::npos) << s.to_string();
}

TEST_F(HfCheckpoint, ConfigErrorsNameTheFile) {
  std::filesystem::create_directories(dir_);
  EXPECT_EQ(core::open_hf_model(dir()).status().code(), ErrorCode::kNotFound);
  std::ofstream(dir() + "/config.json") << "{not json";
  auto r = core::open_hf_model(dir());
  EXPECT_NE(r.status().message().find("config.json"), std::string::npos) << r.status().to_string();
}

}  // namespace
}  // namespace rolloutd
