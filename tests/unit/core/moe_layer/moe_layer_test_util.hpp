#pragma once
// Shared by the MoE layer tests: family configs, random weights kept on the host (so the same
// layer can be built on the CPU and on CUDA), and a builder that uploads them and creates the
// layer on an Arena's device.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/moe/layer/moe_layer.hpp"
#include "tests/unit/kernels/moe/moe_test_util.hpp"

namespace rolloutd::core::test {

using moe::test::Arena;
using moe::test::Mxfp4Host;
using moe::test::Rng;

enum class Family { kQwen3, kGptOss, kDeepSeekV3, kDeepSeekV4, kDeepSeekV4Hash };

inline const char* family_name(Family f) {
  switch (f) {
    case Family::kQwen3: return "qwen3_moe";
    case Family::kGptOss: return "gpt_oss";
    case Family::kDeepSeekV3: return "deepseek_v3";
    case Family::kDeepSeekV4: return "deepseek_v4";
    case Family::kDeepSeekV4Hash: return "deepseek_v4_hash";
  }
  return "?";
}

// A small layer of the family's kind (moe_layer.hpp lists what each family uses).
inline MoeLayerConfig family_config(Family f, int64_t hidden = 128, int64_t inter = 64,
                                    int64_t experts = 16, int64_t top_k = 4) {
  MoeLayerConfig c;
  c.name = std::string("layers.0.") + family_name(f);
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_experts = experts;
  c.top_k = top_k;
  c.max_tokens = 64;
  c.vocab_size = 50;
  switch (f) {
    case Family::kQwen3:
      c.router.kind = moe::RouterKind::kSoftmaxTopK;
      c.router.renormalize = true;
      break;
    case Family::kGptOss:
      c.router.kind = moe::RouterKind::kTopKSoftmax;
      c.router_bias = true;
      c.activation = {moe::ActivationKind::kGptOssSwiGLU, 7.0f, 1.702f};
      c.gate_up_order = moe::GateUpOrder::kInterleaved;
      c.expert_bias = true;
      break;
    case Family::kDeepSeekV3:
      c.router.kind = moe::RouterKind::kSigmoidGroupedTopK;
      c.router.n_group = 4;
      c.router.topk_group = 2;
      c.router.routed_scaling_factor = 2.5f;
      c.correction_bias = true;
      c.num_shared_experts = 1;
      c.shared_intermediate_size = inter;
      break;
    case Family::kDeepSeekV4:
    case Family::kDeepSeekV4Hash:
      c.router.kind = f == Family::kDeepSeekV4 ? moe::RouterKind::kSqrtSoftplusTopK : moe::RouterKind::kHash;
      c.router.routed_scaling_factor = 1.5f;
      c.correction_bias = f == Family::kDeepSeekV4;
      c.activation = {moe::ActivationKind::kClampedSwiGLU, 10.0f, 1.702f};
      c.shared_activation = c.activation;
      c.num_shared_experts = 1;
      c.shared_intermediate_size = inter;
      break;
  }
  return c;
}

// Weights on the host. Physical slot s holds logical expert owner[s] (default: identity).
struct LayerHost {
  std::vector<float> router, router_bias, correction_bias;
  std::vector<int32_t> tid2eid;
  Mxfp4Host gu, dn, sgu, sdn;
  std::vector<float> gu_bias, dn_bias;
};

inline LayerHost random_layer(const MoeLayerConfig& c, Rng& rng, const std::vector<int64_t>& owner = {}) {
  LayerHost w;
  const int64_t e = c.num_experts, h = c.hidden_size, i = c.intermediate_size;
  w.router = moe::test::gauss_vec(rng, e * h, 0.5f / std::sqrt(static_cast<float>(h)));
  if (c.router_bias) w.router_bias = moe::test::gauss_vec(rng, e, 0.5f);
  if (c.correction_bias) w.correction_bias = moe::test::gauss_vec(rng, e, 0.05f);
  if (c.router.kind == moe::RouterKind::kHash) {
    w.tid2eid.resize(static_cast<size_t>(c.vocab_size * c.top_k));
    for (int64_t v = 0; v < c.vocab_size; ++v)
      for (int64_t j = 0; j < c.top_k; ++j)
        w.tid2eid[static_cast<size_t>(v * c.top_k + j)] = static_cast<int32_t>((v * 5 + j * 3) % e);
  }
  Mxfp4Host gu = moe::test::random_mxfp4(rng, e, 2 * i, h), dn = moe::test::random_mxfp4(rng, e, h, i);
  std::vector<float> gub, dnb;
  if (c.expert_bias) {
    gub = moe::test::gauss_vec(rng, e * 2 * i, 0.5f);
    dnb = moe::test::gauss_vec(rng, e * h, 0.5f);
  }
  // Lay the logical experts out over the physical slots.
  const int64_t ep = owner.empty() ? e : static_cast<int64_t>(owner.size());
  w.gu = {std::vector<uint8_t>(static_cast<size_t>(ep * 2 * i * h / 2)),
          std::vector<uint8_t>(static_cast<size_t>(ep * 2 * i * h / 32)), ep, 2 * i, h};
  w.dn = {std::vector<uint8_t>(static_cast<size_t>(ep * h * i / 2)),
          std::vector<uint8_t>(static_cast<size_t>(ep * h * i / 32)), ep, h, i};
  if (c.expert_bias) {
    w.gu_bias.resize(static_cast<size_t>(ep * 2 * i));
    w.dn_bias.resize(static_cast<size_t>(ep * h));
  }
  for (int64_t s = 0; s < ep; ++s) {
    const int64_t l = owner.empty() ? s : owner[static_cast<size_t>(s)];
    auto copy = [&](std::vector<uint8_t>& dst, const std::vector<uint8_t>& src, int64_t per) {
      std::copy(src.begin() + l * per, src.begin() + (l + 1) * per, dst.begin() + s * per);
    };
    copy(w.gu.blocks, gu.blocks, 2 * i * h / 2);
    copy(w.gu.scales, gu.scales, 2 * i * h / 32);
    copy(w.dn.blocks, dn.blocks, h * i / 2);
    copy(w.dn.scales, dn.scales, h * i / 32);
    if (c.expert_bias) {
      std::copy(gub.begin() + l * 2 * i, gub.begin() + (l + 1) * 2 * i, w.gu_bias.begin() + s * 2 * i);
      std::copy(dnb.begin() + l * h, dnb.begin() + (l + 1) * h, w.dn_bias.begin() + s * h);
    }
  }
  if (c.num_shared_experts > 0) {
    w.sgu = moe::test::random_mxfp4(rng, c.num_shared_experts, 2 * c.shared_intermediate_size, h);
    w.sdn = moe::test::random_mxfp4(rng, c.num_shared_experts, h, c.shared_intermediate_size);
  }
  return w;
}

inline const Backend& backend_of(const Arena& a) { return a.gpu() ? *cuda_backend() : cpu_backend(); }

struct BuiltLayer {
  Status status;
  std::unique_ptr<MoeLayer> layer;
};

// Uploads `w` to `a` and creates the layer (config's format and order).
inline BuiltLayer build_layer(Arena& a, const MoeLayerConfig& c, const LayerHost& w) {
  MoeLayerWeights lw;
  lw.router = a.make(DType::kF32, Shape{c.num_experts, c.hidden_size}, w.router);
  if (!w.router_bias.empty()) lw.router_bias = a.make(DType::kF32, Shape{c.num_experts}, w.router_bias);
  if (!w.correction_bias.empty()) lw.correction_bias = a.make(DType::kF32, Shape{c.num_experts}, w.correction_bias);
  if (!w.tid2eid.empty()) lw.tid2eid = a.make(DType::kI32, Shape{c.vocab_size, c.top_k}, w.tid2eid);
  lw.experts = moe::test::upload_experts(a, c.weight_format, c.gate_up_order, w.gu, w.dn,
                                         w.gu_bias.empty() ? nullptr : &w.gu_bias,
                                         w.dn_bias.empty() ? nullptr : &w.dn_bias);
  if (c.num_shared_experts > 0)
    lw.shared = moe::test::upload_experts(a, c.weight_format, moe::GateUpOrder::kConcatenated, w.sgu, w.sdn);
  auto r = MoeLayer::create(c, lw, backend_of(a), a.ctx());
  BuiltLayer b;
  b.status = r.status();
  if (r.ok()) b.layer = std::move(r).value();
  return b;
}

// Activations [T, H]: rows past num_valid are NaN (padding must never be read); token ids of
// padding rows are garbage.
struct Inputs {
  std::vector<float> x;
  std::vector<int32_t> token_ids;
};
inline Inputs random_inputs(const MoeLayerConfig& c, Rng& rng, int64_t t, int64_t num_valid, float scale) {
  Inputs in;
  in.x = moe::test::gauss_vec(rng, t * c.hidden_size, scale);
  for (int64_t i = num_valid * c.hidden_size; i < t * c.hidden_size; ++i) in.x[static_cast<size_t>(i)] = NAN;
  in.token_ids.resize(static_cast<size_t>(t));
  for (int64_t r = 0; r < t; ++r)
    in.token_ids[static_cast<size_t>(r)] = r < num_valid ? static_cast<int32_t>(rng.below(c.vocab_size)) : -12345;
  return in;
}

struct Forwarded {
  Status status;
  std::vector<float> out;
  std::vector<int32_t> ids;   // rows [0, num_valid)
  std::vector<float> weights;
  std::vector<float> logits;
};

inline Forwarded forward(Arena& a, MoeLayer& layer, const Inputs& in, int64_t t, int64_t num_valid,
                         RoutedExpertRecorder* recorder) {
  const MoeLayerConfig& c = layer.config();
  const TensorView x = a.make(DType::kF32, Shape{t, c.hidden_size}, in.x);
  const TensorView out = a.make(DType::kF32, Shape{t, c.hidden_size});
  const TensorView tok = a.make(DType::kI32, Shape{t}, in.token_ids);
  Forwarded f;
  f.status = layer.forward(out, x, tok, num_valid, recorder);
  if (!f.status.ok()) return f;
  f.out = moe::test::read_f32(a, out);
  auto rows = [&](const TensorView& v, int64_t cols, DType d) {
    return TensorView::contiguous(v.data, d, Shape{num_valid, cols}, v.device);
  };
  f.ids = moe::test::read_i32(a, rows(layer.topk_ids(), c.top_k, DType::kI32));
  f.weights = moe::test::read_f32(a, rows(layer.topk_weights(), c.top_k, DType::kF32));
  f.logits = moe::test::read_f32(a, rows(layer.router_logits(), c.num_experts, DType::kF32));
  return f;
}

}  // namespace rolloutd::core::test
