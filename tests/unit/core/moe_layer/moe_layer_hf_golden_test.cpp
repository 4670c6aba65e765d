// The MoE layer against Hugging Face transformers' own MoE blocks (gpt_oss, qwen3_moe,
// deepseek_v3, deepseek_v4 routed and hash-routed): tests/reference/moe/hf_moe_golden.rdqg,
// written on the GPU host by tests/reference/moe/make_hf_moe_golden.py. Skips with a message
// until that file exists.
// - ids equal (in order where the reference sorts, as sets where it calls
//   torch.topk(sorted=False)), weights within 1e-5 (CPU) / 1e-4 (CUDA: its gate GEMM rounds differently);
// - outputs: the CPU's exact float32 mode within 1e-4; bf16 activations within 2e-2 and MXFP8
//   activations within 0.1 (E4M3 keeps 3 mantissa bits: about 5% measured on the NumPy
//   stand-in; the rounding of x and h, on both backends);
// - the same again with four padding rows appended (NaN activations): the real rows do not move.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "tests/unit/core/moe_layer/moe_layer_test_util.hpp"

namespace rolloutd::core {
namespace {

using moe::test::GoldenTensor;
using test::Arena;

const moe::test::Golden* hf_golden(std::string* why) {
  static std::string reason;
  static const moe::test::Golden* g = [] {
    auto* out = new moe::test::Golden();
    // ROLLOUTD_MOE_HF_GOLDEN points elsewhere, e.g. at the NumPy stand-in that
    // `make_hf_moe_golden.py --numpy-only --out FILE` writes to exercise this test without torch.
    const char* env = std::getenv("ROLLOUTD_MOE_HF_GOLDEN");
    const std::string path = env != nullptr ? std::string(env)
                                            : moe::test::source_root() + "/tests/reference/moe/hf_moe_golden.rdqg";
    if (!moe::test::read_golden(path, out, &reason)) {
      delete out;
      return static_cast<const moe::test::Golden*>(nullptr);
    }
    return static_cast<const moe::test::Golden*>(out);
  }();
  *why = reason;
  return g;
}

struct Case {
  MoeLayerConfig cfg;
  test::LayerHost w;
  std::vector<float> x;
  std::vector<int32_t> token_ids, ids;
  std::vector<float> weights, out;
  bool ordered = true;
  int64_t t = 0;
};

Case load(const moe::test::Golden& g, const std::string& name) {
  const std::string p = "hf/" + name + "/";
  auto get = [&](const std::string& f) -> const GoldenTensor* {
    const auto it = g.find(p + f);
    return it == g.end() ? nullptr : &it->second;
  };
  const std::vector<int32_t> ci = get("cfg_i")->as<int32_t>();
  const std::vector<float> cf = get("cfg_f")->as<float>();
  Case c;
  MoeLayerConfig& m = c.cfg;
  m.name = "hf." + name;
  m.router.kind = static_cast<moe::RouterKind>(ci[1]);
  m.activation = {static_cast<moe::ActivationKind>(ci[2]), cf[0], cf[1]};
  m.shared_activation = {static_cast<moe::ActivationKind>(ci[3]), cf[3], cf[4]};
  m.gate_up_order = static_cast<moe::GateUpOrder>(ci[4]);
  m.hidden_size = ci[5];
  m.intermediate_size = ci[6];
  m.num_experts = ci[7];
  m.top_k = ci[8];
  m.router.n_group = ci[9];
  m.router.topk_group = ci[10];
  m.num_shared_experts = ci[11];
  m.shared_intermediate_size = ci[12];
  m.vocab_size = ci[13];
  m.router.renormalize = ci[14] != 0;
  m.router_bias = ci[15] != 0;
  m.correction_bias = ci[16] != 0;
  m.expert_bias = ci[17] != 0;
  c.ordered = ci[18] != 0;
  m.router.hash_score = static_cast<moe::ScoreFunc>(ci[19]);
  m.router.routed_scaling_factor = cf[2];
  m.max_tokens = 32;
  c.x = get("x")->as<float>();
  c.t = get("x")->shape[0];
  c.w.router = get("router")->as<float>();
  if (const auto* b = get("router_bias")) c.w.router_bias = b->as<float>();
  if (const auto* b = get("correction_bias")) c.w.correction_bias = b->as<float>();
  if (const auto* b = get("tid2eid")) c.w.tid2eid = b->as<int32_t>();
  if (const auto* b = get("token_ids")) c.token_ids = b->as<int32_t>();
  c.token_ids.resize(static_cast<size_t>(c.t));
  auto mx = [&](const std::string& prefix) {
    const GoldenTensor& b = *get(prefix + "_blocks");
    return moe::test::Mxfp4Host{b.bytes, get(prefix + "_scales")->bytes, b.shape[0], b.shape[1], b.shape[2] * 32};
  };
  c.w.gu = mx("gate_up");
  c.w.dn = mx("down");
  if (m.num_shared_experts > 0) {
    c.w.sgu = mx("shared_gate_up");
    c.w.sdn = mx("shared_down");
  }
  if (const auto* b = get("gate_up_bias")) c.w.gu_bias = b->as<float>();
  if (const auto* b = get("down_bias")) c.w.dn_bias = b->as<float>();
  c.ids = get("ids")->as<int32_t>();
  c.weights = get("weights")->as<float>();
  c.out = get("out")->as<float>();
  return c;
}

// (id, weight) pairs of one row, sorted by id when the reference does not order them.
std::vector<std::pair<int32_t, float>> row(const std::vector<int32_t>& ids, const std::vector<float>& w,
                                           int64_t r, int64_t k, bool ordered) {
  std::vector<std::pair<int32_t, float>> v;
  for (int64_t j = 0; j < k; ++j) v.emplace_back(ids[static_cast<size_t>(r * k + j)], w[static_cast<size_t>(r * k + j)]);
  if (!ordered) std::sort(v.begin(), v.end());
  return v;
}

class MoeLayerHfGolden : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    std::string why;
    if (hf_golden(&why) == nullptr)
      GTEST_SKIP() << "no Hugging Face golden yet (" << why
                   << "): run `python3 tests/reference/moe/make_hf_moe_golden.py` on the GPU host";
    if (GetParam() && !moe::test::have_gpu()) GTEST_SKIP() << "no CUDA device (or no CUDA build)";
  }
};

TEST_P(MoeLayerHfGolden, EveryFamilyMatchesTheReferenceBlock) {
  std::string why;
  const moe::test::Golden& g = *hf_golden(&why);
  std::vector<std::string> names;
  for (const auto& [key, value] : g)
    if (key.rfind("hf/", 0) == 0 && key.size() > 6 && key.compare(key.size() - 6, 6, "/cfg_i") == 0)
      names.push_back(key.substr(3, key.size() - 9));
  ASSERT_GE(names.size(), 5u) << "expected gpt_oss, qwen3_moe, deepseek_v3, deepseek_v4, deepseek_v4_hash";
  const bool gpu = GetParam();
  for (const std::string& name : names) {
    const Case c0 = load(g, name);
    for (const moe::WeightFormat fmt : {moe::WeightFormat::kBF16, moe::WeightFormat::kMXFP4}) {
      for (const moe::ActPrecision prec :
           {moe::ActPrecision::kF32, moe::ActPrecision::kBF16, moe::ActPrecision::kMXFP8}) {
        if (gpu && prec == moe::ActPrecision::kF32) continue;
        for (const int64_t pad : {int64_t{0}, int64_t{4}}) {
          SCOPED_TRACE(name + " " + moe::weight_format_name(fmt) + " " + moe::act_precision_name(prec) +
                       " padding " + std::to_string(pad));
          Case c = c0;
          c.cfg.weight_format = fmt;
          c.cfg.act_precision = prec;
          const int64_t h = c.cfg.hidden_size, k = c.cfg.top_k, t = c.t + pad;
          test::Inputs in;
          in.x = c.x;
          in.x.resize(static_cast<size_t>(t * h), NAN);
          in.token_ids = c.token_ids;
          in.token_ids.resize(static_cast<size_t>(t), -1);
          Arena a(gpu);
          test::BuiltLayer lay = test::build_layer(a, c.cfg, c.w);
          ASSERT_TRUE(lay.status.ok()) << lay.status.to_string();
          RoutedExpertRecorder rec(1, k, c.cfg.max_tokens);
          ASSERT_TRUE(rec.begin_step(c.t).ok());
          const test::Forwarded f = test::forward(a, *lay.layer, in, t, c.t, &rec);
          ASSERT_TRUE(f.status.ok()) << f.status.to_string();
          EXPECT_EQ(rec.rows(), f.ids);
          for (int64_t r = 0; r < c.t; ++r) {
            const auto got = row(f.ids, f.weights, r, k, c.ordered), want = row(c.ids, c.weights, r, k, c.ordered);
            for (int64_t j = 0; j < k; ++j) {
              EXPECT_EQ(got[static_cast<size_t>(j)].first, want[static_cast<size_t>(j)].first) << "row " << r;
              EXPECT_NEAR(got[static_cast<size_t>(j)].second, want[static_cast<size_t>(j)].second,
                          (gpu ? 1e-4 : 1e-5) * (1.0 + std::fabs(want[static_cast<size_t>(j)].second)))
                  << "row " << r;
            }
          }
          const std::vector<float> got(f.out.begin(), f.out.begin() + c.t * h);
          const double tol = prec == moe::ActPrecision::kF32 ? 1e-4 : prec == moe::ActPrecision::kBF16 ? 2e-2 : 0.1;
          EXPECT_LE(moe::test::rel_l2(got, c.out), tol);
          for (int64_t i = c.t * h; i < t * h; ++i) ASSERT_EQ(f.out[static_cast<size_t>(i)], 0.0f);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, MoeLayerHfGolden, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "cuda" : "cpu"; });

}  // namespace
}  // namespace rolloutd::core
