// Fidelity against Hugging Face transformers: the golden of tests/reference/hf_golden.py
// (transformers 5.17 on the GPU host's CPU, float32, eager attention) for make-test-model
// qwen3_moe and gpt_oss checkpoints. The checkpoint is regenerated here with make-test-model's writer and must
// be the very file transformers read (CRC-32); then the decoder on the CPU backend must give the
// prompt logits within FP32 tolerance, the same router top-k ids, and the same 32 greedy tokens.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <cstdio>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/model/hf_checkpoint.hpp"
#include "core/model/test_model.hpp"
#include "core/moe/routed_experts.hpp"
#include "core/weights/session.hpp"
#include "hf_test_util.hpp"

namespace rolloutd {
namespace {

nlohmann::json golden(const std::string& file) {
  const char* root = std::getenv("ROLLOUTD_SOURCE_ROOT");
  std::ifstream f(std::string(root ? root : ".") + "/tests/reference/" + file);
  if (!f) return nullptr;
  return nlohmann::json::parse(f);
}

// The make-test-model spec a golden was made from (its "spec": config.json keys).
core::TestModelSpec spec_of(const nlohmann::json& g) {
  const auto& s = g["spec"];
  core::TestModelSpec spec;
  // The first qwen3_moe goldens predate the model_type key.
  spec.family = g.contains("model_type") ? g["model_type"].get<std::string>() : "qwen3_moe";
  const bool oss = spec.family == "gpt_oss";
  spec.layers = s["num_hidden_layers"];
  spec.hidden = s["hidden_size"];
  spec.experts = s[oss ? "num_local_experts" : "num_experts"];
  spec.top_k = s["num_experts_per_tok"];
  spec.heads = s["num_attention_heads"];
  spec.kv_heads = s["num_key_value_heads"];
  spec.head_dim = s["head_dim"];
  spec.intermediate = s[oss ? "intermediate_size" : "moe_intermediate_size"];
  spec.vocab = s["vocab_size"];
  spec.dtype = s["dtype"];
  if (!oss) {
    spec.mlp_only_layers = s["mlp_only_layers"].get<std::vector<int64_t>>();
    spec.decoder_sparse_step = s["decoder_sparse_step"];
  } else if (s.contains("sliding_window")) {
    spec.sliding_window = s["sliding_window"];
  }
  spec.experts_mxfp4 = g.contains("experts_mxfp4") && g["experts_mxfp4"].get<bool>();
  spec.seed = g["make_test_model"]["seed"];
  return spec;
}

// hf_qwen3_moe_golden.json: 2 MoE layers; hf_qwen3_moe_dense_golden.json: 3 layers, the middle
// one dense (mlp_only_layers = [1]); hf_gpt_oss_golden.json: 2 layers (sliding window 128, wider
// than the 44 positions), hf_gpt_oss_sw8_golden.json: 4 layers with a window of 8, so the
// continuation runs far past it; hf_gpt_oss_mxfp4_golden.json: MXFP4 experts as published, which
// transformers dequantizes with its own code (the check on our reading of the format).
class HfFidelity : public ::testing::TestWithParam<const char*> {};

TEST_P(HfFidelity, MatchesTransformers) {
  const nlohmann::json g = golden(GetParam());
  ASSERT_FALSE(g.is_null()) << "missing tests/reference/" << GetParam() << " (ROLLOUTD_SOURCE_ROOT?)";
  const core::TestModelSpec spec = spec_of(g);
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("rolloutd-fid-" + std::to_string(::getpid()) + "-" + std::to_string(spec.seed))).string();
  ASSERT_TRUE(core::write_test_model(spec, dir).ok());
  {
    std::ifstream f(dir + "/model.safetensors", std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), {});
    EXPECT_EQ(core::crc32_of({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}),
              g["checkpoint_crc32"].get<uint32_t>())
        << "make-test-model no longer writes the checkpoint the golden was made from";
  }
  auto hf = core::open_hf_model(dir);
  ASSERT_TRUE(hf.ok()) << hf.status().to_string();
  core::StepLimits limits;
  limits.max_tokens = 64;
  limits.max_seqs = 64;
  limits.num_kv_blocks = 32;
  limits.kv_block_size = 4;
  limits.max_blocks_per_seq = 16;
  auto m = core::MoeDecoder::create(hf->config, limits, cpu_backend(), ExecContext{});
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  ASSERT_TRUE(core::load_checkpoint(**m, *hf->checkpoint).ok());
  std::filesystem::remove_all(dir);
  const auto& c = (*m)->config();
  const int64_t V = c.vocab_size;

  // Prompt logits and router ids.
  const auto prompt = g["prompt"].get<std::vector<int32_t>>();
  core::StepBatch b = test::single_sequence_prefill(prompt, limits.kv_block_size);
  for (int32_t t = 0; t < static_cast<int32_t>(prompt.size()); ++t) b.logits_rows.push_back(t);
  std::vector<float> logits;
  core::RoutedExpertRecorder rec(c.num_moe_layers(), c.num_experts_per_tok, limits.max_tokens);
  ASSERT_TRUE((*m)->forward(b, logits, &rec).ok());
  double num = 0, den = 0, max_abs = 0;
  for (size_t t = 0; t < prompt.size(); ++t)
    for (int64_t v = 0; v < V; ++v) {
      const double r = g["prompt_logits"][t][static_cast<size_t>(v)].get<double>();
      const double d = logits[t * static_cast<size_t>(V) + static_cast<size_t>(v)] - r;
      num += d * d;
      den += r * r;
      max_abs = std::max(max_abs, std::abs(d));
    }
  std::printf("%s: prompt logits rel err %.3g, max abs diff %.3g\n", GetParam(), std::sqrt(num / den), max_abs);
  EXPECT_LT(std::sqrt(num / den), 1e-5) << "prompt logits vs transformers (max abs diff " << max_abs << ")";
  const auto& ids = rec.rows();
  for (size_t t = 0; t < prompt.size(); ++t)
    for (int64_t l = 0; l < c.num_moe_layers(); ++l) {
      std::vector<int32_t> got;
      for (int64_t k = 0; k < c.num_experts_per_tok; ++k)
        got.push_back(ids[(t * static_cast<size_t>(c.num_moe_layers()) + static_cast<size_t>(l)) *
                              static_cast<size_t>(c.num_experts_per_tok) + static_cast<size_t>(k)]);
      std::sort(got.begin(), got.end());
      EXPECT_EQ(got, g["routed_experts"][t][static_cast<size_t>(l)].get<std::vector<int32_t>>())
          << "token " << t << " layer " << l;
    }

  // Greedy continuation (recomputing the whole sequence each step keeps the test independent
  // of the scheduler; the engine's own greedy path is tested elsewhere).
  std::vector<int32_t> seq = prompt;
  const auto want = g["greedy"].get<std::vector<int32_t>>();
  for (size_t i = 0; i < want.size(); ++i) {
    core::StepBatch s = test::single_sequence_prefill(seq, limits.kv_block_size);
    s.logits_rows.push_back(static_cast<int32_t>(seq.size()) - 1);
    ASSERT_TRUE((*m)->forward(s, logits, nullptr).ok());
    seq.push_back(static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
  }
  EXPECT_EQ(std::vector<int32_t>(seq.begin() + static_cast<long>(prompt.size()), seq.end()), want);
}

INSTANTIATE_TEST_SUITE_P(Goldens, HfFidelity,
                         ::testing::Values("hf_qwen3_moe_golden.json", "hf_qwen3_moe_dense_golden.json",
                                           "hf_gpt_oss_golden.json", "hf_gpt_oss_sw8_golden.json",
                                           "hf_gpt_oss_mxfp4_golden.json"));

}  // namespace
}  // namespace rolloutd
