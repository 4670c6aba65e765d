// Every case of the NumPy goldens (tests/reference/moe/numpy_moe_golden.rdqg, written by
// make_numpy_moe_golden.py from moe_numpy_ref.py, an independent implementation of the model
// families' definitions) on the CPU reference and, where a GPU is visible, on CUDA:
// - routers: ids equal (rank order; hash: table order), weights within 1e-5 relative;
// - experts, both weight formats (the golden weights are MXFP4 values, exact in bf16 too):
//   relative L2 error within the precision's tolerance, padding rows exactly zero.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "tests/unit/kernels/moe/moe_test_util.hpp"

namespace rolloutd::moe {
namespace {

using test::Arena;
using test::Golden;
using test::GoldenTensor;

const Golden& golden() {
  static const Golden g = [] {
    Golden out;
    std::string why;
    const std::string path = test::source_root() + "/tests/reference/moe/numpy_moe_golden.rdqg";
    if (!test::read_golden(path, &out, &why)) ADD_FAILURE() << why;
    return out;
  }();
  return g;
}

std::set<std::string> cases(const std::string& op) {
  std::set<std::string> names;
  for (const auto& [key, value] : golden())
    if (key.rfind(op + "/", 0) == 0) names.insert(key.substr(op.size() + 1, key.find('/', op.size() + 1) - op.size() - 1));
  return names;
}

class MoeGolden : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam() && !test::have_gpu()) GTEST_SKIP() << "no CUDA device (or no CUDA build)";
  }
};

const GoldenTensor* find(const std::string& key) {
  const auto it = golden().find(key);
  return it == golden().end() ? nullptr : &it->second;
}

TensorView upload(Arena& a, const GoldenTensor& t, DType dtype) {
  return a.make(dtype, t.shape, t.bytes.data());
}

TEST_P(MoeGolden, Routers) {
  const std::set<std::string> names = cases("router");
  ASSERT_GE(names.size(), 10u);
  for (const std::string& name : names) {
    SCOPED_TRACE("router/" + name);
    const std::string p = "router/" + name + "/";
    Arena a(GetParam());
    const std::vector<float> prm = find(p + "params")->as<float>();
    RouterParams params;
    params.kind = static_cast<RouterKind>(static_cast<int>(prm[0]));
    params.renormalize = prm[1] != 0.0f;
    params.routed_scaling_factor = prm[2];
    params.n_group = static_cast<int>(prm[3]);
    params.topk_group = static_cast<int>(prm[4]);
    params.hash_score = static_cast<ScoreFunc>(static_cast<int>(prm[5]));
    const GoldenTensor& want_ids = *find(p + "ids");
    RouterArgs args;
    args.logits = upload(a, *find(p + "logits"), DType::kF32);
    if (const GoldenTensor* b = find(p + "logit_bias")) args.logit_bias = upload(a, *b, DType::kF32);
    if (const GoldenTensor* c = find(p + "correction_bias")) args.correction_bias = upload(a, *c, DType::kF32);
    if (const GoldenTensor* tk = find(p + "token_ids")) {
      args.token_ids = upload(a, *tk, DType::kI32);
      args.tid2eid = upload(a, *find(p + "tid2eid"), DType::kI32);
    }
    args.ids = a.make(DType::kI32, want_ids.shape);
    args.weights = a.make(DType::kF32, want_ids.shape);
    const Status st = route(a.ctx(), params, args);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_EQ(test::read_i32(a, args.ids), want_ids.as<int32_t>());
    const std::vector<float> got = test::read_f32(a, args.weights), want = find(p + "weights")->as<float>();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::isnan(want[i])) {
        EXPECT_TRUE(std::isnan(got[i])) << i;
        continue;
      }
      EXPECT_NEAR(got[i], want[i], 1e-5 * (std::fabs(want[i]) + 1e-6)) << i;
    }
  }
}

TEST_P(MoeGolden, Experts) {
  const bool gpu = GetParam();
  const std::set<std::string> names = cases("experts");
  ASSERT_GE(names.size(), 10u);
  for (const std::string& name : names) {
    const std::string p = "experts/" + name + "/";
    const std::vector<float> prm = find(p + "params")->as<float>();
    ActivationParams act{static_cast<ActivationKind>(static_cast<int>(prm[0])), prm[1], prm[2]};
    const auto prec = static_cast<ActPrecision>(static_cast<int>(prm[3]));
    const auto order = static_cast<GateUpOrder>(static_cast<int>(prm[4]));
    const int64_t num_valid = static_cast<int64_t>(prm[5]);
    const bool accumulate = prm[6] != 0.0f;
    if (gpu && prec == ActPrecision::kF32) continue;  // the CPU reference's exact mode only
    const GoldenTensor& gub = *find(p + "gate_up_blocks");
    const GoldenTensor& dnb = *find(p + "down_blocks");
    test::Mxfp4Host gu{gub.bytes, find(p + "gate_up_scales")->bytes, gub.shape[0], gub.shape[1], gub.shape[2] * 32};
    test::Mxfp4Host dn{dnb.bytes, find(p + "down_scales")->bytes, dnb.shape[0], dnb.shape[1], dnb.shape[2] * 32};
    std::vector<float> gu_bias, dn_bias;
    if (const GoldenTensor* b = find(p + "gate_up_bias")) gu_bias = b->as<float>();
    if (const GoldenTensor* b = find(p + "down_bias")) dn_bias = b->as<float>();
    const GoldenTensor& x = *find(p + "x");
    const int64_t t = x.shape[0], h = x.shape[1], k = find(p + "topk_ids")->shape[1];
    for (const WeightFormat fmt : {WeightFormat::kBF16, WeightFormat::kMXFP4}) {
      SCOPED_TRACE(p + weight_format_name(fmt));
      Arena a(gpu);
      ExpertsArgs args;
      args.weights = test::upload_experts(a, fmt, order, gu, dn, gu_bias.empty() ? nullptr : &gu_bias,
                                          dn_bias.empty() ? nullptr : &dn_bias);
      args.x = upload(a, x, DType::kF32);
      args.topk_ids = upload(a, *find(p + "topk_ids"), DType::kI32);
      args.topk_weights = upload(a, *find(p + "topk_weights"), DType::kF32);
      args.logical_to_physical = upload(a, *find(p + "l2p"), DType::kI32);
      args.num_valid_tokens = num_valid;
      args.activation = act;
      args.precision = prec;
      args.accumulate = accumulate;
      args.out = accumulate ? upload(a, *find(p + "out_init"), DType::kF32) : a.make(DType::kF32, x.shape);
      args.workspace = test::experts_workspace(a, t, k, h, gu.n / 2, gu.experts, prec);
      const Status st = experts(a.ctx(), args);
      ASSERT_TRUE(st.ok()) << st.to_string();
      const std::vector<float> got = test::read_f32(a, args.out), want = find(p + "out")->as<float>();
      const size_t valid = static_cast<size_t>(num_valid * h);
      const std::vector<float> gv(got.begin(), got.begin() + static_cast<int64_t>(valid)),
          wv(want.begin(), want.begin() + static_cast<int64_t>(valid));
      const double tol = prec == ActPrecision::kF32 ? 1e-5 : prec == ActPrecision::kBF16 ? (gpu ? 1e-3 : 1e-4)
                                                                                          : (gpu ? 5e-3 : 2e-3);
      EXPECT_LE(test::rel_l2(gv, wv), tol);
      for (size_t i = valid; i < got.size(); ++i) ASSERT_EQ(got[i], 0.0f) << "padding element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, MoeGolden, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "cuda" : "cpu"; });

}  // namespace
}  // namespace rolloutd::moe
