// CPU reference of the routed experts: the same permutation by physical expert, the same
// rounding of the GEMM inputs (bfloat16 or MXFP8 per 32 along K, or none for kF32), FP32
// accumulation, the same epilogue functions (moe_math.hpp) and the combine in k order. Weights
// are dequantized one expert at a time, only for experts that received tokens.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/moe/moe_math.hpp"
#include "kernels/moe/moe_plan.hpp"
#include "kernels/quant/mxfp4.hpp"
#include "kernels/quant/mxfp8.hpp"

namespace rolloutd::moe::detail {
namespace {

using quant::E4M3;
using quant::E8M0;

float dot(const float* a, const float* b, int64_t n) {
  float s[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] = math::add(s[j], math::mul(a[i + j], b[i + j]));
  for (; i < n; ++i) s[0] = math::add(s[0], math::mul(a[i], b[i]));
  return math::add(math::add(math::add(s[0], s[1]), math::add(s[2], s[3])),
                   math::add(math::add(s[4], s[5]), math::add(s[6], s[7])));
}

// In place: v[0..n) rounded as a GEMM input of precision `p` (n % 32 == 0 for kMXFP8).
void round_activations(float* v, int64_t n, ActPrecision p) {
  if (p == ActPrecision::kBF16) {
    for (int64_t i = 0; i < n; ++i) v[i] = bf16_bits_to_f32(f32_to_bf16_bits(v[i]));
  } else if (p == ActPrecision::kMXFP8) {
    for (int64_t b = 0; b < n; b += quant::kMxBlockSize) {
      uint32_t amax = 0;
      for (int i = 0; i < quant::kMxBlockSize; ++i)
        amax = std::max(amax, quant::f32_bits(v[b + i]) & quant::kF32AbsMask);
      const E8M0 s = quant::mx_scale_from_amax(amax, quant::kE4M3EmaxElem);
      const int se = quant::e8m0_exponent(s);
      for (int i = 0; i < quant::kMxBlockSize; ++i) {
        float& x = v[b + i];
        x = quant::e8m0_is_nan(s)
                ? quant::f32_from_bits(quant::kF32CanonicalNan)
                : quant::f32_from_bits(
                      quant::e4m3_decode_bits(quant::e4m3_encode(quant::f32_bits(x), se), se));
      }
    }
  }
}

quant::Mxfp4RowOrder mxfp4_order(GateUpOrder o) {
  return o == GateUpOrder::kInterleaved ? quant::Mxfp4RowOrder::kGateUpInterleaved
                                        : quant::Mxfp4RowOrder::kGateUpConcatenated;
}

// Expert `e` of an [E, n, k] matrix as float32 rows in checkpoint order.
void dequantize_expert(const ExpertsPlan& p, bool gate_up, int64_t e, std::vector<float>& w) {
  const int64_t n = gate_up ? 2 * p.inter : p.hidden, k = gate_up ? p.hidden : p.inter;
  w.resize(static_cast<size_t>(n * k));
  if (p.format == WeightFormat::kBF16) {
    const uint16_t* src = (gate_up ? p.gate_up_bf16 : p.down_bf16) + e * n * k;
    for (int64_t i = 0; i < n * k; ++i) w[static_cast<size_t>(i)] = bf16_bits_to_f32(src[i]);
    return;
  }
  const uint8_t* blocks = (gate_up ? p.gate_up_blocks : p.down_blocks) + e * n * k / 2;
  const uint8_t* scales = (gate_up ? p.gate_up_scales : p.down_scales) + e * n * k / 32;
  const quant::Mxfp4RowOrder order = gate_up ? mxfp4_order(p.order) : quant::Mxfp4RowOrder::kPlain;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t kb = 0; kb < k / 32; ++kb) {
      const E8M0 s{scales[quant::mxfp4_kernel_scale_offset(r, kb, n, k / 32, order)]};
      const int se = quant::e8m0_exponent(s);
      for (int64_t b0 = kb * 16; b0 < kb * 16 + 16; b0 += 4) {
        // One arranged word of 8 elements (its 4 bytes stay together in the kernel layout).
        uint8_t word[4];
        std::memcpy(word, blocks + quant::mxfp4_kernel_value_offset(r, b0, n, k / 2, order), 4);
        quant::mxfp4_arrange_bytes(word, false);
        for (int64_t j = 0; j < 8; ++j)
          w[static_cast<size_t>(r * k + 2 * b0 + j)] =
              quant::e8m0_is_nan(s) ? quant::f32_from_bits(quant::kF32CanonicalNan)
                                    : quant::f32_from_bits(quant::e2m1_decode_bits((word[j / 2] >> (4 * (j % 2))) & 15u, se));
      }
    }
  }
}

}  // namespace

Status cpu_experts(const ExpertsPlan& p) {
  int64_t nv = p.num_valid;
  if (p.num_valid_device) {
    const int64_t d = *p.num_valid_device;
    if (d < 0 || d > p.num_tokens)
      return Status(ErrorCode::kOutOfRange,
                    "row count " + std::to_string(d) + " outside [0, " + std::to_string(p.num_tokens) + "]",
                    "num_valid_device");
    nv = std::min(nv, d);
  }
  const int64_t h = p.hidden, inter = p.inter, k = p.top_k;
  // The whole map and the ids of real rows before any output is written; padding rows' ids
  // are garbage by contract and never read.
  for (int64_t e = 0; e < p.num_logical; ++e)
    if (p.l2p[e] < 0 || p.l2p[e] >= p.num_physical)
      return Status(ErrorCode::kOutOfRange,
                    "logical expert " + std::to_string(e) + " maps to physical slot " +
                        std::to_string(p.l2p[e]) + " outside [0, " +
                        std::to_string(p.num_physical) + ")",
                    "logical_to_physical");
  for (int64_t i = 0; i < nv * k; ++i)
    if (p.ids[i] < 0 || p.ids[i] >= p.num_logical)
      return Status(ErrorCode::kOutOfRange,
                    "expert id " + std::to_string(p.ids[i]) + " at [" + std::to_string(i / k) +
                        ", " + std::to_string(i % k) + "] outside [0, " +
                        std::to_string(p.num_logical) + ")",
                    "topk_ids");

  // GEMM-1 inputs, one row per real token.
  std::vector<float> xa(static_cast<size_t>(nv * h));
  for (int64_t t = 0; t < nv; ++t) {
    float* row = xa.data() + t * h;
    for (int64_t c = 0; c < h; ++c)
      row[c] = p.x_bf16 ? bf16_bits_to_f32(static_cast<const uint16_t*>(p.x)[t * h + c])
                        : static_cast<const float*>(p.x)[t * h + c];
    round_activations(row, h, p.precision);
  }

  // Pairs by physical expert.
  std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(p.num_physical));
  for (int64_t i = 0; i < nv * k; ++i) pairs[static_cast<size_t>(p.l2p[p.ids[i]])].push_back(i);

  std::vector<float> y(static_cast<size_t>(nv * k * h));
  std::vector<float> wgu, wd, gu(static_cast<size_t>(2 * inter)), hv(static_cast<size_t>(inter));
  for (int64_t e = 0; e < p.num_physical; ++e) {
    const std::vector<int64_t>& mine = pairs[static_cast<size_t>(e)];
    if (mine.empty()) continue;
    dequantize_expert(p, true, e, wgu);
    dequantize_expert(p, false, e, wd);
    for (const int64_t i : mine) {
      const float* xr = xa.data() + (i / k) * h;
      for (int64_t r = 0; r < 2 * inter; ++r) {
        float v = dot(wgu.data() + r * h, xr, h);
        if (p.gate_up_bias) v = math::add(v, p.gate_up_bias[e * 2 * inter + r]);
        gu[static_cast<size_t>(r)] = v;
      }
      for (int64_t j = 0; j < inter; ++j)
        hv[static_cast<size_t>(j)] = math::activate(
            static_cast<int>(p.act.kind), p.act.limit, p.act.alpha,
            gu[static_cast<size_t>(gate_row(j, inter, p.order))],
            gu[static_cast<size_t>(up_row(j, inter, p.order))]);
      round_activations(hv.data(), inter, p.precision);
      float* yr = y.data() + i * h;
      for (int64_t n = 0; n < h; ++n) {
        float v = dot(wd.data() + n * inter, hv.data(), inter);
        if (p.down_bias) v = math::add(v, p.down_bias[e * h + n]);
        yr[n] = v;
      }
    }
  }

  for (int64_t t = 0; t < p.num_tokens; ++t) {
    float* row = p.out + t * h;
    if (t >= nv) {
      std::fill(row, row + h, 0.0f);
      continue;
    }
    for (int64_t c = 0; c < h; ++c) {
      float acc = p.accumulate ? row[c] : 0.0f;
      for (int64_t j = 0; j < k; ++j)
        acc = math::add(acc, math::mul(p.topk_weights[t * k + j], y[static_cast<size_t>((t * k + j) * h + c)]));
      row[c] = acc;
    }
  }
  return Status::Ok();
}

}  // namespace rolloutd::moe::detail
