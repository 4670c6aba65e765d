// The MoE layer on the CPU: the one capture point (logical ids before the remap, with a
// non-trivial map over redundant replicas; padding rows absent; hash layers record their table
// ids), draft layers silent, the configurations that would record physical ids refused at
// build, the expert map replaced at run time without changing a bit of the output, shared
// experts added, and every family running.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/unit/core/moe_layer/moe_layer_test_util.hpp"

namespace rolloutd::core {
namespace {

using test::Arena;
using test::Family;
using test::Rng;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Physical slot s holds logical expert kOwner[s]: a permutation of 8 experts plus replicas of
// logical 3, 0 and 5 in slots 8, 9 and 10.
const std::vector<int64_t> kOwner{3, 0, 1, 2, 7, 4, 5, 6, 3, 0, 5};

ExpertMap map_over(const std::vector<int32_t>& l2p) {
  auto m = ExpertMap::create(l2p, static_cast<int64_t>(kOwner.size()));
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return m.ok() ? m.value() : ExpertMap::identity(1);
}

TEST(MoeLayerCapture, LogicalIdsBeforeRemapPaddingAbsentMapReplaceable) {
  Arena a(false);
  Rng rng(11);
  MoeLayerConfig c = test::family_config(Family::kQwen3, 64, 64, 8, 2);
  const test::LayerHost logical = test::random_layer(c, rng);
  // The same experts laid out over 11 physical slots.
  Rng same(11);
  MoeLayerConfig cp = c;
  cp.num_physical_experts = static_cast<int64_t>(kOwner.size());
  const test::LayerHost physical = test::random_layer(c, same, kOwner);
  test::BuiltLayer ref = test::build_layer(a, c, logical);
  test::BuiltLayer lay = test::build_layer(a, cp, physical);
  ASSERT_TRUE(ref.status.ok()) << ref.status.to_string();
  ASSERT_TRUE(lay.status.ok()) << lay.status.to_string();
  // Map A: each logical expert at its first slot; map B: the replicas where there are some.
  const std::vector<int32_t> map_a{1, 2, 3, 0, 5, 6, 7, 4}, map_b{9, 2, 3, 8, 5, 10, 7, 4};
  ASSERT_TRUE(lay.layer->set_expert_map(map_over(map_a)).ok());

  const int64_t t = 7, nv = 5;
  const test::Inputs in = test::random_inputs(c, rng, t, nv, 1.0f);
  RoutedExpertRecorder rec(1, c.top_k, c.max_tokens);
  ASSERT_TRUE(rec.begin_step(nv).ok());
  const test::Forwarded got = test::forward(a, *lay.layer, in, t, nv, &rec);
  ASSERT_TRUE(got.status.ok()) << got.status.to_string();
  const test::Forwarded want = test::forward(a, *ref.layer, in, t, nv, nullptr);
  ASSERT_TRUE(want.status.ok()) << want.status.to_string();

  // Recorded: exactly the router's logical ids, real rows only, never a physical slot.
  EXPECT_EQ(rec.num_layers_captured(), 1);
  ASSERT_EQ(rec.rows().size(), static_cast<size_t>(nv * c.top_k));
  EXPECT_EQ(rec.rows(), got.ids);
  EXPECT_EQ(got.ids, want.ids);
  bool some_remapped = false;
  for (int32_t id : rec.rows()) {
    ASSERT_GE(id, 0);
    ASSERT_LT(id, c.num_experts);
    some_remapped = some_remapped || map_a[static_cast<size_t>(id)] != id;
  }
  EXPECT_TRUE(some_remapped);  // the map really moved the experts that were picked
  // Same experts, same arithmetic per pair: the output is bit-identical to the identity layout.
  EXPECT_EQ(got.out, want.out);
  for (int64_t i = nv * c.hidden_size; i < t * c.hidden_size; ++i) EXPECT_EQ(got.out[static_cast<size_t>(i)], 0.0f);

  // Replace the map (replicas now): nothing changes.
  ASSERT_TRUE(lay.layer->set_expert_map(map_over(map_b)).ok());
  EXPECT_EQ(lay.layer->expert_map().table(), map_b);
  ASSERT_TRUE(rec.begin_step(nv).ok());
  const test::Forwarded again = test::forward(a, *lay.layer, in, t, nv, &rec);
  ASSERT_TRUE(again.status.ok());
  EXPECT_EQ(again.out, got.out);
  EXPECT_EQ(rec.rows(), got.ids);

  // A map of the wrong shape is refused and the old one stays.
  auto wrong = ExpertMap::create({0, 1, 2, 3, 4, 5, 6, 7}, 8);
  ASSERT_TRUE(wrong.ok());
  const Status st = lay.layer->set_expert_map(wrong.value());
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(lay.layer->expert_map().table(), map_b);
}

TEST(MoeLayerCapture, HashLayerRecordsTableIds) {
  Arena a(false);
  Rng rng(3);
  const MoeLayerConfig c = test::family_config(Family::kDeepSeekV4Hash, 64, 64, 8, 2);
  const test::LayerHost w = test::random_layer(c, rng);
  test::BuiltLayer lay = test::build_layer(a, c, w);
  ASSERT_TRUE(lay.status.ok()) << lay.status.to_string();
  const int64_t t = 6, nv = 4;
  const test::Inputs in = test::random_inputs(c, rng, t, nv, 4.0f);  // padding token ids: garbage
  RoutedExpertRecorder rec(1, c.top_k, c.max_tokens);
  ASSERT_TRUE(rec.begin_step(nv).ok());
  const test::Forwarded got = test::forward(a, *lay.layer, in, t, nv, &rec);
  ASSERT_TRUE(got.status.ok()) << got.status.to_string();
  for (int64_t r = 0; r < nv; ++r)
    for (int64_t j = 0; j < c.top_k; ++j)
      EXPECT_EQ(rec.rows()[static_cast<size_t>(r * c.top_k + j)],
                w.tid2eid[static_cast<size_t>(in.token_ids[static_cast<size_t>(r)] * c.top_k + j)]);
  float sum = got.weights[0] + got.weights[1];
  EXPECT_NEAR(sum, 1.5f, 1e-5f);  // normalised, times routed_scaling_factor
}

TEST(MoeLayerCapture, DraftLayerIsSilent) {
  Arena a(false);
  Rng rng(5);
  MoeLayerConfig c = test::family_config(Family::kDeepSeekV3, 64, 64, 16, 4);
  const test::LayerHost w = test::random_layer(c, rng);
  MoeLayerConfig draft = c;
  draft.draft = true;  // record_routed_experts stays true: refused at build, naming both
  test::BuiltLayer bad = test::build_layer(a, draft, w);
  EXPECT_EQ(bad.status.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(bad.status.message(), "draft=true")) << bad.status.to_string();
  EXPECT_TRUE(contains(bad.status.message(), "record_routed_experts=true")) << bad.status.to_string();
  EXPECT_EQ(bad.status.field(), c.name + ".record_routed_experts");

  draft.record_routed_experts = false;
  test::BuiltLayer d = test::build_layer(a, draft, w);
  test::BuiltLayer target = test::build_layer(a, c, w);
  ASSERT_TRUE(d.status.ok() && target.status.ok()) << d.status.to_string();
  EXPECT_FALSE(d.layer->records());
  const int64_t t = 5, nv = 5;
  const test::Inputs in = test::random_inputs(c, rng, t, nv, 1.0f);
  RoutedExpertRecorder rec(1, c.top_k, c.max_tokens);
  ASSERT_TRUE(rec.begin_step(nv).ok());
  const test::Forwarded refused = test::forward(a, *d.layer, in, t, nv, &rec);
  EXPECT_EQ(refused.status.code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(refused.status.field(), c.name + ".recorder");
  EXPECT_EQ(rec.num_layers_captured(), 0);
  for (int32_t v : rec.rows()) EXPECT_EQ(v, -1);  // the target's rows stay untouched
  // Without a recorder the draft computes exactly what the target computes.
  const test::Forwarded dout = test::forward(a, *d.layer, in, t, nv, nullptr);
  const test::Forwarded tout = test::forward(a, *target.layer, in, t, nv, &rec);
  ASSERT_TRUE(dout.status.ok() && tout.status.ok());
  EXPECT_EQ(dout.out, tout.out);
  EXPECT_EQ(rec.num_layers_captured(), 1);
}

TEST(MoeLayerCapture, RefusesConfigurationsThatWouldRecordPhysicalIds) {
  MoeLayerConfig c = test::family_config(Family::kDeepSeekV3);
  c.shared_expert_fusion = true;
  Status st = c.validate();
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(st.message(), "shared_expert_fusion=true")) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "record_routed_experts=true")) << st.to_string();
  EXPECT_EQ(st.field(), c.name + ".shared_expert_fusion");
  c.record_routed_experts = false;
  EXPECT_EQ(c.validate().code(), ErrorCode::kUnimplemented);
  // The same refusal through create().
  Arena a(false);
  Rng rng(1);
  MoeLayerConfig f = test::family_config(Family::kDeepSeekV3, 64, 64, 16, 4);
  const test::LayerHost w = test::random_layer(f, rng);
  f.shared_expert_fusion = true;
  EXPECT_EQ(test::build_layer(a, f, w).status.code(), ErrorCode::kInvalidArgument);
}

TEST(MoeLayer, SharedExpertsAreAlwaysOnAndAdded) {
  Arena a(false);
  Rng rng(8);
  const MoeLayerConfig c = test::family_config(Family::kDeepSeekV3, 64, 64, 16, 4);
  const test::LayerHost w = test::random_layer(c, rng);
  MoeLayerConfig no_shared = c;
  no_shared.num_shared_experts = 0;
  test::BuiltLayer with = test::build_layer(a, c, w), without = test::build_layer(a, no_shared, w);
  ASSERT_TRUE(with.status.ok() && without.status.ok()) << with.status.to_string() << without.status.to_string();
  const int64_t t = 4;
  const test::Inputs in = test::random_inputs(c, rng, t, t, 1.0f);
  const test::Forwarded fw = test::forward(a, *with.layer, in, t, t, nullptr);
  const test::Forwarded fo = test::forward(a, *without.layer, in, t, t, nullptr);
  ASSERT_TRUE(fw.status.ok() && fo.status.ok());
  // The shared expert alone: every token, weight 1.
  moe::ExpertsArgs ea;
  ea.x = a.make(DType::kF32, Shape{t, c.hidden_size}, in.x);
  ea.out = a.make(DType::kF32, Shape{t, c.hidden_size});
  ea.topk_ids = a.make(DType::kI32, Shape{t, 1}, std::vector<int32_t>(static_cast<size_t>(t), 0));
  ea.topk_weights = a.make(DType::kF32, Shape{t, 1}, std::vector<float>(static_cast<size_t>(t), 1.0f));
  ea.logical_to_physical = a.make(DType::kI32, Shape{1}, std::vector<int32_t>{0});
  ea.weights = moe::test::upload_experts(a, c.weight_format, moe::GateUpOrder::kConcatenated, w.sgu, w.sdn);
  ea.activation = c.shared_activation;
  ea.precision = c.act_precision;
  ASSERT_TRUE(moe::experts(a.ctx(), ea).ok());
  const std::vector<float> shared = moe::test::read_f32(a, ea.out);
  for (size_t i = 0; i < shared.size(); ++i) EXPECT_EQ(fw.out[i], fo.out[i] + shared[i]) << i;
  EXPECT_EQ(fw.ids, fo.ids);
}

TEST(MoeLayer, EveryFamilyRunsWithItsWeightRule) {
  for (const Family f : {Family::kQwen3, Family::kGptOss, Family::kDeepSeekV3, Family::kDeepSeekV4,
                         Family::kDeepSeekV4Hash}) {
    for (const moe::WeightFormat fmt : {moe::WeightFormat::kBF16, moe::WeightFormat::kMXFP4}) {
      for (const moe::ActPrecision prec :
           {moe::ActPrecision::kF32, moe::ActPrecision::kBF16, moe::ActPrecision::kMXFP8}) {
        SCOPED_TRACE(std::string(test::family_name(f)) + " " + moe::weight_format_name(fmt) + " " +
                     moe::act_precision_name(prec));
        Arena a(false);
        Rng rng(21);
        MoeLayerConfig c = test::family_config(f, 64, 64, 16, 4);
        c.weight_format = fmt;
        c.act_precision = prec;
        const test::LayerHost w = test::random_layer(c, rng);
        test::BuiltLayer lay = test::build_layer(a, c, w);
        ASSERT_TRUE(lay.status.ok()) << lay.status.to_string();
        const int64_t t = 9, nv = 8;
        const test::Inputs in = test::random_inputs(c, rng, t, nv, 2.0f);
        RoutedExpertRecorder rec(1, c.top_k, c.max_tokens);
        ASSERT_TRUE(rec.begin_step(nv).ok());
        const test::Forwarded got = test::forward(a, *lay.layer, in, t, nv, &rec);
        ASSERT_TRUE(got.status.ok()) << got.status.to_string();
        for (int64_t r = 0; r < nv; ++r) {
          float sum = 0.0f;
          for (int64_t j = 0; j < c.top_k; ++j) sum += got.weights[static_cast<size_t>(r * c.top_k + j)];
          const float want = f == Family::kDeepSeekV3 ? 2.5f : f == Family::kQwen3 || f == Family::kGptOss ? 1.0f : 1.5f;
          EXPECT_NEAR(sum, want, 1e-5f) << "row " << r;
        }
        for (int64_t i = 0; i < nv * c.hidden_size; ++i) ASSERT_TRUE(std::isfinite(got.out[static_cast<size_t>(i)])) << i;
        for (int64_t i = nv * c.hidden_size; i < t * c.hidden_size; ++i) ASSERT_EQ(got.out[static_cast<size_t>(i)], 0.0f);
        EXPECT_EQ(rec.rows(), got.ids);
      }
    }
  }
}

TEST(MoeLayer, RejectsBadCallsAndKeepsStaticState) {
  Arena a(false);
  Rng rng(2);
  const MoeLayerConfig c = test::family_config(Family::kGptOss, 64, 64, 8, 2);
  const test::LayerHost w = test::random_layer(c, rng);
  test::BuiltLayer lay = test::build_layer(a, c, w);
  ASSERT_TRUE(lay.status.ok()) << lay.status.to_string();
  const test::Inputs in = test::random_inputs(c, rng, 4, 4, 1.0f);
  EXPECT_EQ(test::forward(a, *lay.layer, in, 4, 5, nullptr).status.field(), c.name + ".num_valid");
  RoutedExpertRecorder rec(1, c.top_k, c.max_tokens);
  ASSERT_TRUE(rec.begin_step(3).ok());  // a step of 3 rows, a forward of 4
  EXPECT_EQ(test::forward(a, *lay.layer, in, 4, 4, &rec).status.code(), ErrorCode::kInternal);
  const test::Inputs big = test::random_inputs(c, rng, c.max_tokens + 1, 1, 1.0f);
  EXPECT_EQ(test::forward(a, *lay.layer, big, c.max_tokens + 1, 1, nullptr).status.code(),
            ErrorCode::kInvalidArgument);
  MoeLayerConfig no_bias = c;  // biases given without the flag
  no_bias.expert_bias = false;
  EXPECT_EQ(test::build_layer(a, no_bias, w).status.field(), c.name + ".experts.gate_up_bias");

  const MoeLayer::StaticState s = lay.layer->static_state();
  EXPECT_EQ(s.activation.limit, 7.0f);
  EXPECT_EQ(s.activation.alpha, 1.702f);
  MoeLayer::StaticState changed = s;
  changed.activation.limit = 0.5f;
  lay.layer->restore_static_state(changed);
  EXPECT_EQ(lay.layer->config().activation.limit, 0.5f);
  lay.layer->restore_static_state(s);
  EXPECT_EQ(lay.layer->static_state().activation.limit, 7.0f);
}

}  // namespace
}  // namespace rolloutd::core
