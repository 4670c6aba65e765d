// CUDA against the CPU reference for every router and for every activation x weight format x
// activation precision of the experts, on random sizes: a single token, empty experts,
// padding rows (NaN activations, garbage ids), redundant replicas, K tails (hidden not a
// multiple of the 128-wide K step), every tile height (decode and prefill; the MXFP4 prefill
// kernel's 64 and 128 rows, a half-empty last N tile, a single K step), the MXFP4 decode
// kernel (passes of 8, 16 and 32 tokens at every K split, K staged in segments, the same bits
// whatever the tokens per pass), accumulate. The
// workspace starts poisoned, so reading anything the kernels did not write shows up.
// Skips itself without a CUDA build or a visible GPU (label gpu).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <vector>

#include "tests/unit/kernels/moe/moe_test_util.hpp"

namespace rolloutd::moe {
namespace {

using test::Arena;
using test::Rng;

class MoeParity : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device (or no CUDA build)";
  }
};

struct RouterCase {
  std::string name;
  RouterParams p;
  int64_t t, e, k;
  bool bias = false, corr = false, ties = false;
  int64_t vocab = 0;
};

TEST_F(MoeParity, Routers) {
  std::vector<RouterCase> cs;
  auto add = [&](std::string n, RouterKind kind, int64_t t, int64_t e, int64_t k) -> RouterCase& {
    RouterCase c;
    c.name = std::move(n);
    c.p.kind = kind;
    c.t = t;
    c.e = e;
    c.k = k;
    cs.push_back(c);
    return cs.back();
  };
  add("softmax_one_token", RouterKind::kSoftmaxTopK, 1, 8, 2);
  add("softmax_qwen3", RouterKind::kSoftmaxTopK, 300, 128, 8);
  add("softmax_ties_plain", RouterKind::kSoftmaxTopK, 64, 40, 6).ties = true;
  cs.back().p.renormalize = false;
  add("topk_softmax_gpt_oss", RouterKind::kTopKSoftmax, 77, 128, 4).bias = true;
  add("topk_softmax_ties", RouterKind::kTopKSoftmax, 50, 33, 5).ties = true;
  {
    RouterCase& c = add("sigmoid_grouped_v3", RouterKind::kSigmoidGroupedTopK, 200, 256, 8);
    c.corr = true;
    c.p.n_group = 8;
    c.p.topk_group = 4;
    c.p.routed_scaling_factor = 2.5f;
  }
  {
    RouterCase& c = add("sigmoid_grouped_ties", RouterKind::kSigmoidGroupedTopK, 40, 64, 6);
    c.ties = true;
    c.p.n_group = 8;
    c.p.topk_group = 3;
  }
  add("sigmoid_flat_plain", RouterKind::kSigmoidGroupedTopK, 50, 64, 6).corr = true;
  cs.back().p.renormalize = false;
  {
    RouterCase& c = add("sqrt_softplus_v4", RouterKind::kSqrtSoftplusTopK, 100, 256, 6);
    c.corr = true;
    c.p.routed_scaling_factor = 1.5f;
  }
  {
    RouterCase& c = add("sqrt_softplus_grouped", RouterKind::kSqrtSoftplusTopK, 30, 64, 4);
    c.corr = true;
    c.p.n_group = 4;
    c.p.topk_group = 2;
  }
  add("softmax_wide", RouterKind::kSoftmaxTopK, 5, 1000, 16);
  for (const ScoreFunc f : {ScoreFunc::kSqrtSoftplus, ScoreFunc::kSigmoid, ScoreFunc::kSoftmax}) {
    RouterCase& c = add("hash_" + std::to_string(static_cast<int>(f)), RouterKind::kHash, 64, 256, 6);
    c.p.hash_score = f;
    c.p.routed_scaling_factor = 1.5f;
    c.vocab = 1000;
  }
  add("empty_batch", RouterKind::kSoftmaxTopK, 0, 16, 2);

  Rng rng(99);
  for (const RouterCase& c : cs) {
    SCOPED_TRACE(c.name);
    std::vector<float> logits = test::gauss_vec(rng, c.t * c.e, c.p.kind == RouterKind::kSqrtSoftplusTopK ? 8.0f : 2.0f);
    if (c.ties)
      for (float& v : logits) v = std::round(v);  // many exact ties
    if (!logits.empty() && c.t > 2) logits[3] = NAN;
    std::vector<float> bias = test::gauss_vec(rng, c.e, 0.5f), corr = test::gauss_vec(rng, c.e, 0.05f);
    if (c.ties)
      for (float& v : corr) v = 0.0f;
    std::vector<int32_t> tokens(static_cast<size_t>(c.t)), table(static_cast<size_t>(c.vocab * c.k));
    for (auto& tk : tokens) tk = static_cast<int32_t>(c.vocab > 0 ? rng.below(c.vocab) : 0);
    for (int64_t v = 0; v < c.vocab; ++v)
      for (int64_t j = 0; j < c.k; ++j) table[static_cast<size_t>(v * c.k + j)] = static_cast<int32_t>((v * 7 + j * 13) % c.e);
    std::vector<int32_t> ids[2];
    std::vector<float> w[2];
    for (int g = 0; g < 2; ++g) {
      Arena a(g == 1);
      RouterArgs args;
      args.logits = a.make(DType::kF32, Shape{c.t, c.e}, logits);
      if (c.bias) args.logit_bias = a.make(DType::kF32, Shape{c.e}, bias);
      if (c.corr) args.correction_bias = a.make(DType::kF32, Shape{c.e}, corr);
      if (c.vocab > 0) {
        args.token_ids = a.make(DType::kI32, Shape{c.t}, tokens);
        args.tid2eid = a.make(DType::kI32, Shape{c.vocab, c.k}, table);
      }
      args.ids = a.make(DType::kI32, Shape{c.t, c.k});
      args.weights = a.make(DType::kF32, Shape{c.t, c.k});
      const Status st = route(a.ctx(), c.p, args);
      ASSERT_TRUE(st.ok()) << st.to_string();
      ids[g] = test::read_i32(a, args.ids);
      w[g] = test::read_f32(a, args.weights);
    }
    EXPECT_EQ(ids[1], ids[0]);
    for (size_t i = 0; i < w[0].size(); ++i) {
      if (std::isnan(w[0][i])) {
        EXPECT_TRUE(std::isnan(w[1][i])) << i;
        continue;
      }
      EXPECT_NEAR(w[1][i], w[0][i], 2e-6 + 1e-5 * std::fabs(w[0][i])) << i;
    }
  }
}

struct ExpertCase {
  std::string size;
  int64_t t, nv, k, e_log, replicas, h, inter;
};

TEST_F(MoeParity, Experts) {
  const ExpertCase sizes[] = {
      {"decode_one_token", 1, 1, 4, 16, 0, 128, 64},        // 12 empty experts, BM 16
      {"small_k_tail_replicas", 37, 33, 2, 8, 2, 192, 128},  // K step 128 + a 64 tail
      {"prefill_tile64", 256, 250, 4, 8, 0, 256, 128},       // about 125 rows per expert: BM 64
      // ~262 rows per expert: MXFP4 prefill tiles of 128 rows (two full and a partial per
      // expert), a replica, down's N = 192 (the last 128-row N tile holds 64)
      {"prefill_tile128", 600, 590, 4, 8, 1, 192, 320},
      // one 64-wide K step in both GEMMs, N = 64 in down
      {"prefill_one_k_step", 300, 300, 2, 4, 0, 64, 64},
      // ~100 rows per expert (tiles of 64), down's N = 192 (its second 128-row N tile half
      // empty) and a single K step
      {"prefill_tile64_n_tails", 200, 200, 2, 4, 0, 192, 64},
      {"empty_experts", 3, 3, 2, 64, 1, 320, 192},           // hidden and intermediate with tails
      // MXFP4 decode kernel: ~30 pairs per expert (32-token passes), K split 8
      {"decode_hot_experts", 64, 60, 8, 16, 0, 256, 128},
      // decode kernel with K split 1 (gate_up) and 2 (down); 1088 = 8.5 chunks of 128
      {"decode_ksplit", 40, 40, 4, 64, 0, 1088, 1088},
      // one token, top-1: the decode kernel stages one row of K = 8512 (gate_up) and the mma
      // lanes of the 7 absent rows must stay inside it (they read past the CTA's shared memory:
      // an illegal address on the H200 on 2026-12-01, found by this case)
      {"decode_one_row_long_k", 1, 1, 1, 1, 0, 8512, 128},
      // decode kernel, K split 8, more 32-row groups than two CTAs per SM on an H200: CTAs loop
      // over row blocks of their expert (gate_up: 268 groups, 2 chunks per warp; down: 266
      // groups, 1 chunk per warp, two tokens)
      {"decode_row_blocks_gate_up", 1, 1, 1, 1, 0, 2048, 4288},
      {"decode_row_blocks_down", 2, 2, 1, 1, 0, 8512, 1024},
  };
  const ActivationParams acts[] = {{ActivationKind::kSwiGLU, 7.0f, 1.702f},
                                   {ActivationKind::kGptOssSwiGLU, 7.0f, 1.702f},
                                   {ActivationKind::kClampedSwiGLU, 10.0f, 1.702f}};
  Rng rng(2026);
  int variant = 0;
  for (const ExpertCase& s : sizes) {
    for (const ActivationParams& act : acts) {
      const bool gpt_oss = act.kind == ActivationKind::kGptOssSwiGLU;
      const GateUpOrder order = gpt_oss ? GateUpOrder::kInterleaved : GateUpOrder::kConcatenated;
      const int64_t ep = s.e_log + s.replicas;
      test::Mxfp4Host gu = test::random_mxfp4(rng, ep, 2 * s.inter, s.h), dn = test::random_mxfp4(rng, ep, s.h, s.inter);
      std::vector<int32_t> l2p(static_cast<size_t>(s.e_log));
      for (int64_t e = 0; e < s.e_log; ++e) l2p[static_cast<size_t>(e)] = static_cast<int32_t>(e);
      for (int64_t r = 0; r < s.replicas; ++r) {  // logical r*3 served by replica slot e_log + r
        test::replicate(gu, s.e_log + r, r * 3);
        test::replicate(dn, s.e_log + r, r * 3);
        l2p[static_cast<size_t>(r * 3)] = static_cast<int32_t>(s.e_log + r);
      }
      std::vector<float> gub = test::gauss_vec(rng, ep * 2 * s.inter, 0.5f), dnb = test::gauss_vec(rng, ep * s.h, 0.5f);
      std::vector<float> x = test::gauss_vec(rng, s.t * s.h, gpt_oss ? 5.0f : 4.0f);
      for (int64_t i = s.nv * s.h; i < s.t * s.h; ++i) x[static_cast<size_t>(i)] = NAN;
      std::vector<int32_t> ids(static_cast<size_t>(s.t * s.k));
      for (int64_t t = 0; t < s.t; ++t)
        for (int64_t j = 0; j < s.k; ++j)
          ids[static_cast<size_t>(t * s.k + j)] =
              t < s.nv ? static_cast<int32_t>((rng.below(s.e_log) + j * (s.e_log / s.k)) % s.e_log) : 1 << 30;
      std::vector<float> w = test::gauss_vec(rng, s.t * s.k, 0.5f);
      std::vector<float> init = test::gauss_vec(rng, s.t * s.h, 1.0f);
      for (const WeightFormat fmt : {WeightFormat::kBF16, WeightFormat::kMXFP4}) {
        for (const ActPrecision prec : {ActPrecision::kBF16, ActPrecision::kMXFP8}) {
          const bool accumulate = (variant % 3) == 1;
          // BF16 x: the MXFP4 x BF16 cases of every size, and every other MXFP4 x MXFP8 case (FP32 x
          // in the rest): the decoder passes BF16 x to both precisions.
          const bool x_bf16 = ((variant % 4) == 2 && prec == ActPrecision::kBF16) ||
                              ((variant % 8) == 7 && prec == ActPrecision::kMXFP8);
          // Every other variant gives the real row count on the device (a graph replay padded to
          // a bucket) and num_valid_tokens = T: the padding rows must still cost and write nothing.
          const bool device_count = (variant % 2) == 0;
          ++variant;
          SCOPED_TRACE(s.size + " " + activation_kind_name(act.kind) + " " + weight_format_name(fmt) + " " +
                       act_precision_name(prec) + (accumulate ? " accumulate" : "") + (x_bf16 ? " x_bf16" : "") +
                       (device_count ? " device_count" : ""));
          std::vector<float> out[2];
          for (int g = 0; g < 2; ++g) {
            Arena a(g == 1);
            ExpertsArgs args;
            args.weights = test::upload_experts(a, fmt, order, gu, dn, gpt_oss ? &gub : nullptr, gpt_oss ? &dnb : nullptr);
            if (x_bf16) {
              std::vector<uint16_t> xb(x.size());
              for (size_t i = 0; i < x.size(); ++i) xb[i] = f32_to_bf16_bits(x[i]);
              args.x = a.make(DType::kBF16, Shape{s.t, s.h}, xb);
            } else {
              args.x = a.make(DType::kF32, Shape{s.t, s.h}, x);
            }
            args.topk_ids = a.make(DType::kI32, Shape{s.t, s.k}, ids);
            args.topk_weights = a.make(DType::kF32, Shape{s.t, s.k}, w);
            args.logical_to_physical = a.make(DType::kI32, Shape{s.e_log}, l2p);
            args.num_valid_tokens = s.nv;
            if (device_count) {
              args.num_valid_tokens = -1;
              args.num_valid_device = a.make(DType::kI32, Shape{1}, std::vector<int32_t>{static_cast<int32_t>(s.nv)});
            }
            args.activation = act;
            args.precision = prec;
            args.accumulate = accumulate;
            args.out = accumulate ? a.make(DType::kF32, Shape{s.t, s.h}, init) : a.make(DType::kF32, Shape{s.t, s.h});
            args.workspace = test::experts_workspace(a, s.t, s.k, s.h, s.inter, ep, prec);
            const Status st = experts(a.ctx(), args);
            ASSERT_TRUE(st.ok()) << st.to_string();
            out[g] = test::read_f32(a, args.out);
            if (g == 1) {  // deterministic: a second run gives the same bits
              if (accumulate) args.out = a.make(DType::kF32, Shape{s.t, s.h}, init);
              ASSERT_TRUE(experts(a.ctx(), args).ok());
              EXPECT_EQ(test::read_f32(a, args.out), out[1]);
            }
          }
          const size_t valid = static_cast<size_t>(s.nv * s.h);
          const std::vector<float> c(out[0].begin(), out[0].begin() + static_cast<int64_t>(valid)),
              gp(out[1].begin(), out[1].begin() + static_cast<int64_t>(valid));
          EXPECT_LE(test::rel_l2(gp, c), prec == ActPrecision::kBF16 ? 1e-3 : 5e-3);
          for (size_t i = valid; i < out[1].size(); ++i) ASSERT_EQ(out[1][i], 0.0f) << "padding " << i;
        }
      }
    }
  }
}

// One run of the MXFP4 experts (gpt-oss activation, interleaved gate_up, biases) on the device or
// the CPU; ids[t * k + j] may name any of the e experts.
std::vector<float> run_mxfp4_experts(bool gpu, ActPrecision prec, int64_t e, int64_t k, int64_t h, int64_t inter,
                                     const test::Mxfp4Host& gu, const test::Mxfp4Host& dn,
                                     const std::vector<float>& gub, const std::vector<float>& dnb,
                                     const std::vector<float>& x, const std::vector<int32_t>& ids,
                                     const std::vector<float>& w) {
  const int64_t t = static_cast<int64_t>(ids.size()) / k;
  Arena a(gpu);
  ExpertsArgs args;
  args.weights = test::upload_experts(a, WeightFormat::kMXFP4, GateUpOrder::kInterleaved, gu, dn, &gub, &dnb);
  args.x = a.make(DType::kF32, Shape{t, h}, std::vector<float>(x.begin(), x.begin() + t * h));
  args.topk_ids = a.make(DType::kI32, Shape{t, k}, ids);
  args.topk_weights = a.make(DType::kF32, Shape{t, k}, std::vector<float>(w.begin(), w.begin() + t * k));
  std::vector<int32_t> l2p(static_cast<size_t>(e));
  for (int64_t i = 0; i < e; ++i) l2p[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  args.logical_to_physical = a.make(DType::kI32, Shape{e}, l2p);
  args.num_valid_tokens = t;
  args.activation = {ActivationKind::kGptOssSwiGLU, 7.0f, 1.702f};
  args.precision = prec;
  args.out = a.make(DType::kF32, Shape{t, h});
  args.workspace = test::experts_workspace(a, t, k, h, inter, e, prec);
  const Status st = experts(a.ctx(), args);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return test::read_f32(a, args.out);
}

// A routed MXFP4 experts case for run_mxfp4_experts, and its random inputs besides the weights:
// biases, x (sigma x_sigma), combine weights and ids that spread each token's k choices.
struct MxCase {
  std::string name;
  int64_t t, k, e, h, inter;
};
struct MxInputs {
  std::vector<float> gub, dnb, x, w;
  std::vector<int32_t> ids;
};
MxInputs mx_inputs(Rng& rng, const MxCase& c, float x_sigma) {
  MxInputs in;
  in.gub = test::gauss_vec(rng, c.e * 2 * c.inter, 0.5f);
  in.dnb = test::gauss_vec(rng, c.e * c.h, 0.5f);
  in.x = test::gauss_vec(rng, c.t * c.h, x_sigma);
  in.w = test::gauss_vec(rng, c.t * c.k, 0.5f);
  in.ids.resize(static_cast<size_t>(c.t * c.k));
  for (int64_t t = 0; t < c.t; ++t)
    for (int64_t j = 0; j < c.k; ++j)
      in.ids[static_cast<size_t>(t * c.k + j)] = static_cast<int32_t>((rng.below(c.e) + j * (c.e / c.k)) % c.e);
  return in;
}
// run_mxfp4_experts for case c with its weights and inputs.
std::vector<float> run_mx_case(bool gpu, ActPrecision prec, const MxCase& c, const test::Mxfp4Host& gu,
                               const test::Mxfp4Host& dn, const MxInputs& in) {
  return run_mxfp4_experts(gpu, prec, c.e, c.k, c.h, c.inter, gu, dn, in.gub, in.dnb, in.x, in.ids, in.w);
}

// The MXFP4 decode kernel at every K split (1, 2, 4 and 8 ways) with passes of 8, 16 and 32
// tokens, K staged whole or in segments, experts with more tokens than a pass (a remainder pass
// of fewer n-tiles): CUDA against the CPU reference. What each case takes is worked out for the
// H200's 132 SMs (decode_ksplit; decode_shape: 32 or 16 tokens, segments where K does not fit two
// CTAs per SM); on another GPU the cases still check the same kernels, with other splits. The
// tokens per expert are random (a token's k draws may repeat an expert), so a pass holds up to
// its capacity, and the remainder passes come from the top-1 cases. (Not covered at this cost:
// a launch of 16-token passes at split 1 over segments.) gu = gate_up (K = hidden),
// dn = down (K = intermediate); 8-token passes read bf16 rows directly, wider ones stage them.
TEST_F(MoeParity, DecodeTokensPerPass) {
  const MxCase cases[] = {
      // top-1 of one expert (40 tokens): gu split 8, 16-token passes (16 + 16 + 8), K whole, then
      // in 2 segments; dn split 8, one 40-token pass (32 + 8 under ROLLOUTD_MOE_FIVE_NT=0: ctest
      // moe_parity_test_four_nt)
      {"gu8_tok16_dn8_tok40", 40, 1, 1, 832, 128},
      {"gu8_tok16_segs_dn8_tok40", 40, 1, 1, 1728, 128},
      {"gu4_tok16_dn8_tok16_segs", 8, 4, 4, 256, 1728},       // ~8 each; dn's K in 2 segments
      {"gu4_tok32_dn2_tok32", 160, 4, 64, 448, 128},          // ~10 per expert, K whole
      {"gu4_tok16_segs_dn2_tok16", 24, 4, 16, 1728, 448},     // ~6 per expert
      {"gu2_tok32_segs_dn4_tok32_segs", 40, 4, 16, 832, 832},  // ~10 per expert
      {"gu2_tok16_segs_dn1_tok16", 192, 4, 128, 1728, 128},   // ~6 per expert
      {"gu1_tok32_dn4_tok32_segs", 160, 4, 64, 256, 1088},    // dn's K in 3 segments
      {"gu1_tok32_segs_dn4_tok32_segs", 160, 4, 64, 832, 1088},
      // about one token per expert: 8-token passes
      {"tok8_gu8_dn8", 8, 4, 8, 256, 128},
      {"tok8_gu4_dn4", 16, 4, 64, 256, 128},
      {"tok8_gu2_dn2", 32, 4, 128, 256, 128},
      {"tok8_gu1_dn4", 16, 4, 64, 256, 1088},
      {"tok8_gu2_dn1", 32, 4, 128, 1088, 128},
  };
  Rng rng(77);
  for (const MxCase& c : cases) {
    const test::Mxfp4Host gu = test::random_mxfp4(rng, c.e, 2 * c.inter, c.h), dn = test::random_mxfp4(rng, c.e, c.h, c.inter);
    const MxInputs in = mx_inputs(rng, c, 5.0f);
    for (const ActPrecision prec : {ActPrecision::kBF16, ActPrecision::kMXFP8}) {
      SCOPED_TRACE(c.name + " " + act_precision_name(prec));
      auto run = [&](bool gpu) { return run_mx_case(gpu, prec, c, gu, dn, in); };
      const std::vector<float> ref = run(false), got = run(true);
      EXPECT_LE(test::rel_l2(got, ref), prec == ActPrecision::kBF16 ? 1e-3 : 5e-3);
      EXPECT_EQ(run(true), got);
    }
  }
}

// The MXFP4 prefill kernel's 128-row tiles (~260-300 pairs an expert) with biases and the gpt-oss
// activation, both activation precisions (MXFP8: h rounded in gate_up's epilogue), the same bits
// on a second run: down's N = 320 (its last 128-row N tile half empty), N = 384 in both GEMMs, a
// single K step in both (down's N = 64). Written for a warp-specialized wgmma kernel with 256- and
// 192-wide N tiles (branch prefill-ws, tests/bench/NOTES.md: gate_up's 640 and down's 320 end
// in partial 256-row tiles there, 384 takes 192-row tiles); the mma.sync kernel passes them too.
TEST_F(MoeParity, PrefillTiles) {
  const MxCase cases[] = {{"n256_with_tails", 600, 4, 8, 320, 320},
                          {"n192_both_gemms", 520, 4, 8, 384, 192},
                          {"one_k_step", 600, 2, 4, 64, 64}};
  Rng rng(404);
  for (const MxCase& c : cases) {
    const test::Mxfp4Host gu = test::random_mxfp4(rng, c.e, 2 * c.inter, c.h),
                          dn = test::random_mxfp4(rng, c.e, c.h, c.inter);
    const MxInputs in = mx_inputs(rng, c, 5.0f);
    for (const ActPrecision prec : {ActPrecision::kBF16, ActPrecision::kMXFP8}) {
      SCOPED_TRACE(c.name + " " + act_precision_name(prec));
      auto run = [&](bool gpu) { return run_mx_case(gpu, prec, c, gu, dn, in); };
      const std::vector<float> ref = run(false), got = run(true);
      ASSERT_EQ(got.size(), ref.size());
      EXPECT_LE(test::rel_l2(got, ref), prec == ActPrecision::kBF16 ? 1e-3 : 5e-3);
      EXPECT_EQ(run(true), got);  // the same bits again
    }
  }
}

// Block scales above 2^1 (codes 129 and 130) take the decode kernel's second multiply and the
// prefill kernel's other branch, and a NaN scale (255) poisons its block: every kernel must give
// the CPU reference's values, NaN exactly where the reference has NaN. Decode: ~4 tokens per
// expert; prefill: ~300.
TEST_F(MoeParity, LargeAndNanBlockScales) {
  const MxCase cases[] = {{"decode", 8, 4, 8, 256, 128}, {"prefill", 600, 2, 4, 256, 128}};
  Rng rng(91);
  for (const MxCase& c : cases) {
    test::Mxfp4Host gu = test::random_mxfp4(rng, c.e, 2 * c.inter, c.h, -2, 3),
                    dn = test::random_mxfp4(rng, c.e, c.h, c.inter, -3, 2);
    gu.scales[static_cast<size_t>(1 * 2 * c.inter * (c.h / 32) + 5)] = 255;  // expert 1, row 0, block 5
    dn.scales[static_cast<size_t>(2 * c.h * (c.inter / 32) + 7 * (c.inter / 32))] = 255;  // expert 2, row 7
    const MxInputs in = mx_inputs(rng, c, 1.0f);
    for (const ActPrecision prec : {ActPrecision::kBF16, ActPrecision::kMXFP8}) {
      SCOPED_TRACE(c.name + " " + act_precision_name(prec));
      auto run = [&](bool gpu) { return run_mx_case(gpu, prec, c, gu, dn, in); };
      const std::vector<float> ref = run(false), got = run(true);
      ASSERT_EQ(got.size(), ref.size());
      std::vector<float> ref_finite, got_finite;
      size_t nans = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_EQ(std::isnan(got[i]), std::isnan(ref[i])) << i;
        if (std::isnan(ref[i])) {
          ++nans;
          continue;
        }
        ref_finite.push_back(ref[i]);
        got_finite.push_back(got[i]);
      }
      EXPECT_GT(nans, 0u) << "the NaN scales reached no output";
      EXPECT_GT(ref_finite.size(), ref.size() / 4) << "too few finite outputs to compare";
      EXPECT_LE(test::rel_l2(got_finite, ref_finite), prec == ActPrecision::kBF16 ? 1e-3 : 5e-3);
    }
  }
}

// One value rounded as an element of an MXFP8 block whose largest magnitude is `amax` (OCP MX
// v1.0, kernels/quant/mxfp8.hpp): the CPU model for the check below.
float mx8_round(float v, float amax) {
  const int se = quant::e8m0_exponent(
      quant::mx_scale_from_amax(quant::f32_bits(amax) & quant::kF32AbsMask, quant::kE4M3EmaxElem));
  return quant::f32_from_bits(quant::e4m3_decode_bits(quant::e4m3_encode(quant::f32_bits(v), se), se));
}

// h (gate_up's output after the activation, rounded as down's input) bit for bit. The rel_l2
// tolerances above are dominated by the large values, so an MXFP8 block formed from the wrong 32
// features or with another token's maximum could pass them. Here down is the identity (MXFP4 1.0
// on the diagonal, scale 2^0, no biases, top-1, combine weight 1), so the layer's output is h as
// rounded for down, exactly. x holds small integers times a power of two per token and the weights
// are MXFP4, so gate_up's sums are exact in any order, and the activation is math::activate on
// both sides (its own exp, the same bits on host and device): the GPU's FP32 h equals the CPU
// reference's, and its bf16 or MXFP8 rounding must give the same bits (no element differs on an
// H100, 2026-12-07). Elements more than one rounding step away are counted apart, as the sign of a
// wrong rounding rule rather than of a different h. Feature blocks' magnitudes alternate by ~2^20
// (gate_up's scale exponents) and tokens' by 2^6, so a wrong grouping either saturates a block or
// flushes one: the CPU checks below show that regrouping the reference's h by 16 features, or
// taking the next token's maximum, puts many elements more than a step away. Cases: decode (8
// tokens), 64-row and 128-row prefill tiles (~75 and ~300 tokens an expert).
TEST_F(MoeParity, HiddenRoundedBitForBit) {
  const MxCase cases[] = {{"decode", 8, 1, 4, 256, 256}, {"prefill_64_rows", 600, 1, 8, 256, 256},
                          {"prefill_128_rows", 600, 1, 2, 256, 256}};
  const int block_exp[] = {-5, -25, -7, -27, -4, -24, -6, -26};  // gate_up scale exponent per 32 features
  Rng rng(606);
  for (const MxCase& c : cases) {
    test::Mxfp4Host gu = test::random_mxfp4(rng, c.e, 2 * c.inter, c.h);
    const int64_t kb = c.h / 32;
    for (int64_t e = 0; e < c.e; ++e)
      for (int64_t r = 0; r < 2 * c.inter; ++r)  // interleaved: rows 2f and 2f + 1 are feature f's
        for (int64_t b = 0; b < kb; ++b)
          gu.scales[static_cast<size_t>((e * 2 * c.inter + r) * kb + b)] =
              static_cast<uint8_t>(127 + block_exp[(r / 2 / 32) % 8]);
    test::Mxfp4Host dn{std::vector<uint8_t>(static_cast<size_t>(c.e * c.h * c.inter / 2), 0),
                       std::vector<uint8_t>(static_cast<size_t>(c.e * c.h * c.inter / 32), 127), c.e, c.h,
                       c.inter};
    for (int64_t e = 0; e < c.e; ++e)
      for (int64_t r = 0; r < c.h; ++r)  // E2M1 code 2 is 1.0; even elements in the low nibble
        dn.blocks[static_cast<size_t>((e * c.h + r) * (c.inter / 2) + r / 2)] = r % 2 ? 0x20 : 0x02;
    MxInputs in;
    in.gub.assign(static_cast<size_t>(c.e * 2 * c.inter), 0.0f);
    in.dnb.assign(static_cast<size_t>(c.e * c.h), 0.0f);
    in.w.assign(static_cast<size_t>(c.t), 1.0f);
    in.x.resize(static_cast<size_t>(c.t * c.h));
    for (int64_t i = 0; i < c.t * c.h; ++i)
      in.x[static_cast<size_t>(i)] =
          std::ldexp(static_cast<float>(static_cast<int>(rng.below(9)) - 4), -6 * static_cast<int>((i / c.h) % 3));
    in.ids.resize(static_cast<size_t>(c.t));
    for (int64_t t = 0; t < c.t; ++t) in.ids[static_cast<size_t>(t)] = static_cast<int32_t>(rng.below(c.e));
    const int64_t nf = c.inter;

    // got within one step of ref in precision prec (MXFP8: the step of ref's block scale, from the
    // block's largest magnitude; subnormal steps are 2^-9 of the scale); returns the elements that
    // are not, and counts in *differ those that differ at all.
    auto check = [&](const std::vector<float>& got, const std::vector<float>& ref, ActPrecision prec,
                     size_t* differ) {
      size_t bad = 0;
      *differ = 0;
      for (int64_t t = 0; t < c.t; ++t)
        for (int64_t b = 0; b < nf / 32; ++b) {
          float amax = 0.0f;
          for (int64_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(ref[static_cast<size_t>(t * nf + b * 32 + i)]));
          for (int64_t i = 0; i < 32; ++i) {
            const size_t j = static_cast<size_t>(t * nf + b * 32 + i);
            if (quant::f32_bits(got[j]) == quant::f32_bits(ref[j])) continue;
            ++*differ;
            const float step = prec == ActPrecision::kBF16 ? std::ldexp(std::fabs(ref[j]), -7)
                                                          : std::max(0.125f * std::fabs(ref[j]), std::ldexp(amax, -16));
            if (!(std::fabs(got[j] - ref[j]) <= step)) ++bad;
          }
        }
      return bad;
    };

    std::vector<float> ref_bf16;
    for (const ActPrecision prec : {ActPrecision::kBF16, ActPrecision::kMXFP8}) {
      SCOPED_TRACE(c.name + " " + act_precision_name(prec));
      auto run = [&](bool gpu) {
        return run_mxfp4_experts(gpu, prec, c.e, c.k, c.h, c.inter, gu, dn, in.gub, in.dnb, in.x, in.ids, in.w);
      };
      const std::vector<float> ref = run(false), got = run(true);
      ASSERT_EQ(got.size(), ref.size());
      size_t differ = 0;
      EXPECT_EQ(check(got, ref, prec, &differ), 0u) << "elements of h more than one step from the reference's";
      EXPECT_EQ(differ, 0u) << "of " << ref.size() << " elements of h differ from the reference's";
      if (prec == ActPrecision::kBF16) {
        ref_bf16 = ref;
        continue;
      }
      // The data tells the groupings apart: the reference's h (as bf16) rounded in blocks shifted
      // by 16 features, or with the next token's block maximum, is more than a step away on many
      // elements.
      std::vector<float> shifted(ref.size()), other_token(ref.size());
      for (int64_t t = 0; t < c.t; ++t)
        for (int64_t b = 0; b < nf / 32; ++b) {
          float amax_s = 0.0f, amax_n = 0.0f;
          const int64_t tn = (t + 1) % c.t;
          for (int64_t i = 0; i < 32; ++i) {
            amax_s = std::max(amax_s, std::fabs(ref_bf16[static_cast<size_t>(t * nf + (b * 32 + 16 + i) % nf)]));
            amax_n = std::max(amax_n, std::fabs(ref_bf16[static_cast<size_t>(tn * nf + b * 32 + i)]));
          }
          for (int64_t i = 0; i < 32; ++i) {
            const size_t js = static_cast<size_t>(t * nf + (b * 32 + 16 + i) % nf), j = static_cast<size_t>(t * nf + b * 32 + i);
            shifted[js] = mx8_round(ref_bf16[js], amax_s);
            other_token[j] = mx8_round(ref_bf16[j], amax_n);
          }
        }
      if (c.t > 1) {
        EXPECT_GT(check(shifted, ref, prec, &differ), ref.size() / 5) << "blocks shifted by 16 features";
        EXPECT_GT(check(other_token, ref, prec, &differ), ref.size() / 5) << "the next token's maximum";
      }
    }
  }
}

// Skewed routing at decode sizes (4 pairs a busy expert on average, so one-n-tile passes of 8):
// a few experts take more than a pass (every token's first choice is expert 3: 32 tokens, four
// passes; expert 20 gets 12 and experts 0-2 get 10-11, two passes; expert 9 exactly 8, one; all
// 32 busy). The permutation lists such experts ahead of the rest (heavy_first() in the kernels);
// whatever the order, every expert's rows must be computed once, with the CPU reference's values.
// (The order itself does not show in the outputs: the engine A/B with ROLLOUTD_MOE_HEAVY_FIRST=0
// measured it, tests/bench/NOTES.md.)
TEST_F(MoeParity, DecodeWithExpertsPastOnePass) {
  const MxCase cases[] = {{"gate_up_k256_down_k128", 32, 4, 32, 256, 128},
                          {"gate_up_k1088_down_k1088", 32, 4, 32, 1088, 1088}};
  Rng rng(53);
  for (const MxCase& c : cases) {
    const test::Mxfp4Host gu = test::random_mxfp4(rng, c.e, 2 * c.inter, c.h), dn = test::random_mxfp4(rng, c.e, c.h, c.inter);
    MxInputs in = mx_inputs(rng, c, 5.0f);
    std::vector<int> per(static_cast<size_t>(c.e), 0);
    for (int64_t t = 0; t < c.t; ++t) {
      int32_t* row = in.ids.data() + t * c.k;
      row[0] = 3;
      row[1] = t < 12 ? 20 : t < 20 ? 9 : static_cast<int32_t>(21 + t % 11);
      // The other two: light experts, distinct from the first two.
      static constexpr int32_t kLight[] = {4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
      row[2] = kLight[(t * 7) % 15];
      row[3] = static_cast<int32_t>(t % 3);
      for (int64_t j = 0; j < c.k; ++j) ++per[static_cast<size_t>(row[j])];
    }
    ASSERT_EQ(per[3], 32);
    ASSERT_EQ(per[20], 12);
    ASSERT_EQ(per[9], 8);
    for (const ActPrecision prec : {ActPrecision::kBF16, ActPrecision::kMXFP8}) {
      SCOPED_TRACE(c.name + " " + act_precision_name(prec));
      auto run = [&](bool gpu) { return run_mx_case(gpu, prec, c, gu, dn, in); };
      const std::vector<float> ref = run(false), got = run(true);
      EXPECT_LE(test::rel_l2(got, ref), prec == ActPrecision::kBF16 ? 1e-3 : 5e-3);
      EXPECT_EQ(run(true), got);
    }
  }
}

// Every token gets the same bits whatever its expert's pass holds (8 to 40 tokens): four experts
// take every token while 32 exist and the pairs (4 a token) are at least 32 from 8 tokens on, so
// the grid bound (the busy experts the host assumes) and the K split stay the same and only the
// tokens per expert change. Launches: 8 and 16 tokens take 8-token passes (one n-tile; over bf16
// rows B comes straight from global memory, which these check against the staged passes); 40,
// 80 and 88 take 16- and 32-token passes (80 and 88 end in passes of 16 and 24); from 201 on the
// host's estimate (pairs / 32 experts, 25 to 29) takes 40-token passes, ending in passes of 1, 10,
// 18, 28 and 36 tokens (201, 210, 218, 228, 236), so every n-tile count runs in that kernel too.
// Every run is compared, token for token, with the 236-token run. (64 experts made 8 tokens a
// smaller grid bound, hence another K split: other sums.)
TEST_F(MoeParity, DecodeBitsDoNotDependOnTokensPerPass) {
  const int64_t e = 32, k = 4, h = 1088, inter = 1088, t_max = 236;
  Rng rng(31);
  const test::Mxfp4Host gu = test::random_mxfp4(rng, e, 2 * inter, h), dn = test::random_mxfp4(rng, e, h, inter);
  const std::vector<float> gub = test::gauss_vec(rng, e * 2 * inter, 0.5f), dnb = test::gauss_vec(rng, e * h, 0.5f);
  const std::vector<float> x = test::gauss_vec(rng, t_max * h, 5.0f), w = test::gauss_vec(rng, t_max * k, 0.5f);
  std::vector<int32_t> ids(static_cast<size_t>(t_max * k));
  for (int64_t t = 0; t < t_max; ++t)
    for (int64_t j = 0; j < k; ++j) ids[static_cast<size_t>(t * k + j)] = static_cast<int32_t>((t + j) % 4 + 7);
  for (const ActPrecision prec : {ActPrecision::kBF16, ActPrecision::kMXFP8}) {
    SCOPED_TRACE(act_precision_name(prec));
    std::vector<float> first;
    for (const int64_t t : std::initializer_list<int64_t>{t_max, 8, 16, 40, 80, 88, 201, 210, 218, 228}) {
      const std::vector<int32_t> sub(ids.begin(), ids.begin() + t * k);
      std::vector<float> out = run_mxfp4_experts(true, prec, e, k, h, inter, gu, dn, gub, dnb, x, sub, w);
      if (first.empty()) {
        first = out;
        continue;
      }
      const std::vector<float> want(first.begin(), first.begin() + static_cast<std::ptrdiff_t>(out.size()));
      EXPECT_EQ(out, want) << t << " tokens";
    }
  }
}

TEST_F(MoeParity, RefusesFloat32PrecisionSmallWorkspaceAndMisalignedScales) {
  Arena a(true);
  Rng rng(5);
  test::Mxfp4Host gu = test::random_mxfp4(rng, 2, 128, 64), dn = test::random_mxfp4(rng, 2, 64, 64);
  ExpertsArgs args;
  args.weights = test::upload_experts(a, WeightFormat::kMXFP4, GateUpOrder::kConcatenated, gu, dn);
  args.x = a.make(DType::kF32, Shape{2, 64});
  args.out = a.make(DType::kF32, Shape{2, 64});
  args.topk_ids = a.make(DType::kI32, Shape{2, 1}, std::vector<int32_t>{0, 1});
  args.topk_weights = a.make(DType::kF32, Shape{2, 1});
  args.logical_to_physical = a.make(DType::kI32, Shape{2}, std::vector<int32_t>{0, 1});
  args.precision = ActPrecision::kF32;
  args.workspace = test::experts_workspace(a, 2, 1, 64, 64, 2, ActPrecision::kBF16);
  MOE_EXPECT_STATUS(experts(a.ctx(), args), ErrorCode::kUnimplemented, "precision");
  args.precision = ActPrecision::kMXFP8;  // needs more scratch than the bf16 workspace
  const int64_t need = experts_workspace_bytes(2, 1, 64, 64, 2, ActPrecision::kMXFP8);
  args.workspace = a.make(DType::kU8, Shape{need - 1});
  MOE_EXPECT_STATUS(experts(a.ctx(), args), ErrorCode::kInvalidArgument, "workspace");
  // The MXFP4 kernels copy scales as 4-byte words: a scale view at an odd address is refused.
  args.precision = ActPrecision::kBF16;
  args.workspace = test::experts_workspace(a, 2, 1, 64, 64, 2, ActPrecision::kBF16);
  ASSERT_TRUE(experts(a.ctx(), args).ok());
  const TensorView gus = args.weights.gate_up_scales;
  const TensorView spare = a.make(DType::kU8, Shape{gus.numel() + 4});
  args.weights.gate_up_scales = TensorView::contiguous(static_cast<uint8_t*>(spare.data) + 1, gus.dtype,
                                                        Shape{2, 128, 2}, gus.device);
  MOE_EXPECT_STATUS(experts(a.ctx(), args), ErrorCode::kInvalidArgument, "weights.gate_up_scales");
}

}  // namespace
}  // namespace rolloutd::moe
