// CPU reference of the MoE ops: softmax top-k routing and the SwiGLU expert combine
// (plain or gpt-oss clamped activation, optional expert biases).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.hpp"
#include "kernels/cpu/op_checks.hpp"
#include "kernels/quant/mxfp4.hpp"

namespace rolloutd::cpu {
namespace {

// Experts are ranked on their logits: softmax is monotone, so this is the probability
// order, but it cannot be reordered by exp() rounding differing between backends, which
// would make CPU and CUDA record different experts. NaN ranks last; equal logits: lower id.
inline float rank_value(float logit) { return std::isnan(logit) ? -INFINITY : logit; }
inline bool ranks_before(float va, int32_t a, float vb, int32_t b) {
  return va > vb || (va == vb && a < b);
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
// gpt-oss: clamped gate and up, gate * sigmoid(alpha * gate) * (up + 1).
inline float gpt_oss_glu(float g, float u, float limit, float alpha) {
  g = std::min(g, limit);
  u = std::clamp(u, -limit, limit);
  return g / (1.0f + std::exp(-alpha * g)) * (u + 1.0f);
}

// Row `row` of an MXFP4 matrix (blocks [rows, cols/32, 16], scales [rows, cols/32]) dequantized
// into `buf`, exactly as quant::dequantize_mxfp4 does.
const float* mx_row(const TensorView& blocks, const TensorView& scales, int64_t row, int64_t cols,
                    std::vector<float>& buf) {
  const int64_t nkb = cols / quant::kMxBlockSize;
  const auto* b = blocks.as<const uint8_t>() + row * nkb * quant::kMxfp4BytesPerBlock;
  const auto* s = scales.as<const uint8_t>() + row * nkb;
  for (int64_t c = 0; c < cols; ++c) {
    const quant::E8M0 sc{s[c / quant::kMxBlockSize]};
    const quant::Fp4x2 p{b[c / 2]};
    const uint32_t bits = quant::e8m0_is_nan(sc) ? quant::kF32CanonicalNan
                                                 : quant::e2m1_decode_bits(c % 2 == 0 ? quant::fp4x2_even(p)
                                                                                      : quant::fp4x2_odd(p),
                                                                           quant::e8m0_exponent(sc));
    buf[static_cast<size_t>(c)] = quant::f32_from_bits(bits);
  }
  return buf.data();
}

}  // namespace

Status router_softmax_topk(const ExecContext& ctx, TensorView ids, TensorView weights,
                           TensorView logits, bool renormalize) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCpu));
  RD_RETURN_IF_ERROR(op_checks::router_softmax_topk(ctx, ids, weights, logits));
  const int64_t num_tokens = logits.size(0), num_experts = logits.size(1);
  const int64_t top_k = ids.size(1);
  std::vector<char> taken(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* l = logits.as<const float>() + t * num_experts;
    int32_t* id = ids.as<int32_t>() + t * top_k;
    float* w = weights.as<float>() + t * top_k;
    float max_logit = -INFINITY;
    for (int64_t e = 0; e < num_experts; ++e)
      if (l[e] > max_logit) max_logit = l[e];
    float sum = 0.0f;
    for (int64_t e = 0; e < num_experts; ++e) sum += std::exp(l[e] - max_logit);

    std::fill(taken.begin(), taken.end(), 0);
    float picked_sum = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) {
      int32_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e) {
        if (taken[static_cast<size_t>(e)]) continue;
        const auto ei = static_cast<int32_t>(e);
        if (best < 0 || ranks_before(rank_value(l[e]), ei, rank_value(l[best]), best)) best = ei;
      }
      taken[static_cast<size_t>(best)] = 1;
      id[k] = best;
      w[k] = std::exp(l[best] - max_logit) / sum;
      picked_sum += w[k];
    }
    if (renormalize)
      for (int64_t k = 0; k < top_k; ++k) w[k] = w[k] / picked_sum;
  }
  return Status::Ok();
}

Status router(const ExecContext& ctx, const RouterArgs& a) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCpu));
  RD_RETURN_IF_ERROR(op_checks::router(ctx, a));
  // The three ops it stands for, so the CPU decoder's results stay what they were.
  RD_RETURN_IF_ERROR(linear(ctx, a.logits, a.x, a.w));
  if (a.bias.data != nullptr) RD_RETURN_IF_ERROR(add_bias(ctx, a.logits, a.bias));
  return router_softmax_topk(ctx, a.ids, a.weights, a.logits, a.renormalize);
}

Status moe_experts(const ExecContext& ctx, const MoeExpertsArgs& a) {
  RD_RETURN_IF_ERROR(op_checks::context(ctx, DeviceKind::kCpu));
  RD_RETURN_IF_ERROR(op_checks::moe_experts(ctx, a));
  const int64_t num_tokens = a.x.size(0), hidden = a.x.size(1);
  int64_t num_valid = op_checks::moe_valid_rows(a);
  if (a.num_valid_device.data != nullptr) {
    const int32_t dev = *a.num_valid_device.as<const int32_t>();
    if (dev < 0 || dev > num_tokens)
      return Status(ErrorCode::kOutOfRange,
                    "device row count " + std::to_string(dev) + " outside [0, " + std::to_string(num_tokens) + "]",
                    "num_valid_device");
    num_valid = std::min<int64_t>(num_valid, dev);
  }
  const int64_t top_k = a.topk_ids.size(1);
  const bool mx = a.w_gate_up_blocks.data != nullptr;
  const int64_t inter = (mx ? a.w_gate_up_blocks.size(1) : a.w_gate_up.size(1)) / 2;
  const int64_t num_phys = mx ? a.w_gate_up_blocks.size(0) : a.w_gate_up.size(0);
  const int64_t num_logical = a.logical_to_physical.size(0);
  const int32_t* ids = a.topk_ids.as<const int32_t>();
  const int32_t* map = a.logical_to_physical.as<const int32_t>();

  // Ids of real rows and the whole map before any output is written; padding rows'
  // ids are garbage by contract and never read.
  for (int64_t e = 0; e < num_logical; ++e) {
    if (map[e] < 0 || map[e] >= num_phys)
      return Status(ErrorCode::kOutOfRange,
                    "logical expert " + std::to_string(e) + " maps to physical slot " +
                        std::to_string(map[e]) + " outside [0, " + std::to_string(num_phys) +
                        ")",
                    "logical_to_physical");
  }
  for (int64_t i = 0; i < num_valid * top_k; ++i) {
    if (ids[i] < 0 || ids[i] >= num_logical)
      return Status(ErrorCode::kOutOfRange,
                    "expert id " + std::to_string(ids[i]) + " at [" +
                        std::to_string(i / top_k) + ", " + std::to_string(i % top_k) +
                        "] outside [0, " + std::to_string(num_logical) + ")",
                    "topk_ids");
  }

  std::vector<float> gate_up(static_cast<size_t>(2 * inter));
  std::vector<float> h(static_cast<size_t>(inter));
  const float* x = a.x.as<const float>();
  const float* w_gate_up = mx ? nullptr : a.w_gate_up.as<const float>();
  const float* w_down = mx ? nullptr : a.w_down.as<const float>();
  std::vector<float> wrow(static_cast<size_t>(std::max(hidden, inter)));  // one dequantized MXFP4 row
  const float* topk_w = a.topk_weights.as<const float>();
  float* out = a.out.as<float>();
  const float* b_gate_up = a.b_gate_up.data ? a.b_gate_up.as<const float>() : nullptr;
  const float* b_down = a.b_down.data ? a.b_down.as<const float>() : nullptr;
  const bool gpt_oss = a.activation == MoeExpertsArgs::Activation::kGptOss;
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* orow = out + t * hidden;
    std::fill(orow, orow + hidden, 0.0f);
    if (t >= num_valid) continue;
    const float* xr = x + t * hidden;
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t e = map[ids[t * top_k + k]];
      const float* bgu = b_gate_up ? b_gate_up + e * 2 * inter : nullptr;
      for (int64_t r = 0; r < 2 * inter; ++r) {
        const float* row = mx ? mx_row(a.w_gate_up_blocks, a.w_gate_up_scales, e * 2 * inter + r, hidden, wrow)
                              : w_gate_up + (e * 2 * inter + r) * hidden;
        gate_up[static_cast<size_t>(r)] = dot(row, xr, hidden) + (bgu ? bgu[r] : 0.0f);
      }
      for (int64_t i = 0; i < inter; ++i) {
        const float g = gate_up[static_cast<size_t>(a.gate_up_interleaved ? 2 * i : i)];
        const float u = gate_up[static_cast<size_t>(a.gate_up_interleaved ? 2 * i + 1 : inter + i)];
        h[static_cast<size_t>(i)] = gpt_oss ? gpt_oss_glu(g, u, a.swiglu_limit, a.swiglu_alpha) : silu(g) * u;
      }
      const float wk = topk_w[t * top_k + k];
      const float* bd = b_down ? b_down + e * hidden : nullptr;
      for (int64_t j = 0; j < hidden; ++j) {
        const float* row = mx ? mx_row(a.w_down_blocks, a.w_down_scales, e * hidden + j, inter, wrow)
                              : w_down + (e * hidden + j) * inter;
        orow[j] += wk * (dot(row, h.data(), inter) + (bd ? bd[j] : 0.0f));
      }
    }
  }
  return Status::Ok();
}

}  // namespace rolloutd::cpu
