// The MoE layer on CUDA against the same layer on the CPU reference, every family x weight
// format x activation precision: records equal (logical ids, real rows only), outputs within
// the precision's tolerance, padding rows zero; and on CUDA, replacing the expert map by one
// over redundant replicas changes no bit of the output. Skips without a GPU (label gpu).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/moe/moe_math.hpp"
#include "tests/unit/core/moe_layer/moe_layer_test_util.hpp"

namespace rolloutd::core {
namespace {

using test::Arena;
using test::Family;
using test::Rng;

class MoeLayerParity : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!moe::test::have_gpu()) GTEST_SKIP() << "no CUDA device (or no CUDA build)";
  }
};

// The CPU's selection values (what the router ranks: logits + bias, or score + correction
// bias, and DeepSeek-V3's group scores) hold a near-tie around the k-th pick of row r: the two
// backends' gate GEMMs (a CPU loop; cuBLAS or Backend::router's kernel) round the logits
// differently and may then legitimately pick differently.
bool near_tie(const MoeLayerConfig& c, const test::LayerHost& w, const std::vector<float>& logits,
              int64_t r, float eps) {
  const int64_t e = c.num_experts;
  std::vector<float> v(static_cast<size_t>(e));
  for (int64_t j = 0; j < e; ++j) {
    float l = logits[static_cast<size_t>(r * e + j)];
    if (!w.router_bias.empty()) l += w.router_bias[static_cast<size_t>(j)];
    if (c.router.kind == moe::RouterKind::kSigmoidGroupedTopK) l = moe::math::sigmoid(l);
    if (c.router.kind == moe::RouterKind::kSqrtSoftplusTopK) l = moe::math::sqrt_softplus(l);
    if (!w.correction_bias.empty()) l += w.correction_bias[static_cast<size_t>(j)];
    v[static_cast<size_t>(j)] = l;
  }
  auto tie_in = [&](std::vector<float> x, int64_t k) {
    std::sort(x.begin(), x.end(), [](float a, float b) { return a > b; });
    for (int64_t j = 0; j + 1 < static_cast<int64_t>(x.size()) && j <= k; ++j)
      if (std::fabs(x[static_cast<size_t>(j)] - x[static_cast<size_t>(j + 1)]) <= eps * (1.0f + std::fabs(x[static_cast<size_t>(j)])))
        return true;
    return false;
  };
  if (tie_in(v, c.top_k)) return true;
  if (c.router.n_group > 1) {  // group scores: the sum of each group's two best values
    const int64_t gs = e / c.router.n_group;
    std::vector<float> g(static_cast<size_t>(c.router.n_group));
    for (int64_t q = 0; q < c.router.n_group; ++q) {
      std::vector<float> m(v.begin() + q * gs, v.begin() + (q + 1) * gs);
      std::sort(m.begin(), m.end(), [](float a, float b) { return a > b; });
      g[static_cast<size_t>(q)] = m[0] + (gs > 1 ? m[1] : 0.0f);
    }
    if (tie_in(g, c.router.topk_group)) return true;
  }
  return false;
}

TEST_F(MoeLayerParity, EveryFamilyFormatAndPrecision) {
  for (const Family f : {Family::kQwen3, Family::kGptOss, Family::kDeepSeekV3, Family::kDeepSeekV4,
                         Family::kDeepSeekV4Hash}) {
    for (const moe::WeightFormat fmt : {moe::WeightFormat::kBF16, moe::WeightFormat::kMXFP4}) {
      for (const moe::ActPrecision prec : {moe::ActPrecision::kBF16, moe::ActPrecision::kMXFP8}) {
        for (const int64_t t : {int64_t{1}, int64_t{48}}) {
          SCOPED_TRACE(std::string(test::family_name(f)) + " " + moe::weight_format_name(fmt) + " " +
                       moe::act_precision_name(prec) + " T=" + std::to_string(t));
          Rng rng(31 + static_cast<uint64_t>(t));
          MoeLayerConfig c = test::family_config(f, 192, 128, 32, 4);
          c.router.n_group = f == Family::kDeepSeekV3 ? 8 : 1;
          c.router.topk_group = f == Family::kDeepSeekV3 ? 3 : 1;
          c.weight_format = fmt;
          c.act_precision = prec;
          const test::LayerHost w = test::random_layer(c, rng);
          const int64_t nv = t > 1 ? t - 5 : 1;
          const test::Inputs in = test::random_inputs(c, rng, t, nv, f == Family::kGptOss ? 4.0f : 2.0f);
          test::Forwarded got[2];
          std::vector<int32_t> records[2];
          for (int g = 0; g < 2; ++g) {
            Arena a(g == 1);
            test::BuiltLayer lay = test::build_layer(a, c, w);
            ASSERT_TRUE(lay.status.ok()) << lay.status.to_string();
            RoutedExpertRecorder rec(1, c.top_k, c.max_tokens);
            ASSERT_TRUE(rec.begin_step(nv).ok());
            got[g] = test::forward(a, *lay.layer, in, t, nv, &rec);
            ASSERT_TRUE(got[g].status.ok()) << got[g].status.to_string();
            records[g] = rec.rows();
            EXPECT_EQ(records[g], got[g].ids);
          }
          bool same_ids = true;
          for (int64_t r = 0; r < nv; ++r)
            for (int64_t j = 0; j < c.top_k; ++j) {
              const size_t i = static_cast<size_t>(r * c.top_k + j);
              if (got[0].ids[i] == got[1].ids[i]) continue;
              same_ids = false;
              EXPECT_TRUE(c.router.kind != moe::RouterKind::kHash && near_tie(c, w, got[0].logits, r, 1e-5f))
                  << "row " << r << " picks differ without a near-tie";
            }
          if (!same_ids) continue;  // outputs of a flipped near-tie legitimately differ
          const std::vector<float> cpu(got[0].out.begin(), got[0].out.begin() + nv * c.hidden_size),
              gpu(got[1].out.begin(), got[1].out.begin() + nv * c.hidden_size);
          EXPECT_LE(moe::test::rel_l2(gpu, cpu), prec == moe::ActPrecision::kBF16 ? 1e-3 : 5e-3);
          for (int64_t i = nv * c.hidden_size; i < t * c.hidden_size; ++i)
            ASSERT_EQ(got[1].out[static_cast<size_t>(i)], 0.0f);
        }
      }
    }
  }
}

TEST_F(MoeLayerParity, ReplacingTheMapOnCudaChangesNothing) {
  Arena a(true);
  Rng rng(4);
  MoeLayerConfig c = test::family_config(Family::kGptOss, 128, 64, 8, 2);
  c.weight_format = moe::WeightFormat::kMXFP4;
  const std::vector<int64_t> owner{3, 0, 1, 2, 7, 4, 5, 6, 3, 0, 5};
  c.num_physical_experts = static_cast<int64_t>(owner.size());
  const test::LayerHost w = test::random_layer(c, rng, owner);
  test::BuiltLayer lay = test::build_layer(a, c, w);
  ASSERT_TRUE(lay.status.ok()) << lay.status.to_string();
  auto map = [&](std::vector<int32_t> l2p) { return ExpertMap::create(std::move(l2p), 11).value(); };
  ASSERT_TRUE(lay.layer->set_expert_map(map({1, 2, 3, 0, 5, 6, 7, 4})).ok());
  const int64_t t = 40, nv = 37;
  const test::Inputs in = test::random_inputs(c, rng, t, nv, 4.0f);
  RoutedExpertRecorder rec(1, c.top_k, c.max_tokens);
  ASSERT_TRUE(rec.begin_step(nv).ok());
  const test::Forwarded before = test::forward(a, *lay.layer, in, t, nv, &rec);
  ASSERT_TRUE(before.status.ok()) << before.status.to_string();
  const std::vector<int32_t> rows_before = rec.rows();
  ASSERT_TRUE(lay.layer->set_expert_map(map({9, 2, 3, 8, 5, 10, 7, 4})).ok());
  ASSERT_TRUE(rec.begin_step(nv).ok());
  const test::Forwarded after = test::forward(a, *lay.layer, in, t, nv, &rec);
  ASSERT_TRUE(after.status.ok());
  EXPECT_EQ(after.out, before.out);
  EXPECT_EQ(rec.rows(), rows_before);
}

}  // namespace
}  // namespace rolloutd::core
