#pragma once
// Shared by the MoE kernel and layer tests: deterministic inputs, error measures, expert weights
// in either format built from MXFP4 checkpoint tensors, and the golden reader and buffers of
// the quantization tests (quant_test_util.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/moe/moe_ops.hpp"
#include "kernels/quant/quant_ops.hpp"
#include "tests/unit/kernels/quant/quant_test_util.hpp"

namespace rolloutd::moe::test {

using quant::test::Arena;
using quant::test::Golden;
using quant::test::GoldenTensor;
using quant::test::have_gpu;
using quant::test::read_golden;
using quant::test::Rng;
using quant::test::source_root;

inline const ExecContext kCpu{Device::cpu(), nullptr};

#define MOE_ASSERT_OK(expr)                          \
  do {                                               \
    const ::rolloutd::Status st_ = (expr);           \
    ASSERT_TRUE(st_.ok()) << st_.to_string();        \
  } while (0)

#define MOE_EXPECT_STATUS(expr, code_, field_)       \
  do {                                               \
    const ::rolloutd::Status st_ = (expr);           \
    EXPECT_EQ(st_.code(), code_) << st_.to_string(); \
    EXPECT_EQ(st_.field(), field_) << st_.to_string(); \
  } while (0)

inline float gauss(Rng& rng) {
  const double u1 = rng.uniform() + 1e-12, u2 = rng.uniform();
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}
inline std::vector<float> gauss_vec(Rng& rng, int64_t n, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = scale * gauss(rng);
  return v;
}

// ||a - ref|| / ||ref|| over elements where both are finite; NaN/Inf must sit at the same
// places (a mismatch returns +inf). ||ref|| == 0: the absolute norm.
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  if (a.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool fa = std::isfinite(a[i]), fr = std::isfinite(ref[i]);
    if (fa != fr) return INFINITY;
    if (!fa) {
      if (std::isnan(a[i]) != std::isnan(ref[i])) return INFINITY;
      continue;
    }
    num += (static_cast<double>(a[i]) - ref[i]) * (static_cast<double>(a[i]) - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

template <class T>
std::vector<T> as_vec(const std::vector<uint8_t>& bytes) {
  std::vector<T> v(bytes.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

// Random MXFP4 checkpoint tensors of `experts` matrices [n, k]: blocks [E, n, k/32, 16] and
// scales [E, n, k/32], exponents in [lo, hi].
struct Mxfp4Host {
  std::vector<uint8_t> blocks, scales;
  int64_t experts = 0, n = 0, k = 0;
};
inline Mxfp4Host random_mxfp4(Rng& rng, int64_t experts, int64_t n, int64_t k, int lo = -7,
                              int hi = -4) {
  Mxfp4Host m{std::vector<uint8_t>(static_cast<size_t>(experts * n * k / 2)),
              std::vector<uint8_t>(static_cast<size_t>(experts * n * k / 32)), experts, n, k};
  for (auto& b : m.blocks) b = static_cast<uint8_t>(rng.next() & 0xff);
  for (auto& s : m.scales) s = static_cast<uint8_t>(127 + lo + static_cast<int>(rng.below(hi - lo + 1)));
  return m;
}
// Slot `dst` becomes a copy of slot `src` (a redundant replica).
inline void replicate(Mxfp4Host& m, int64_t dst, int64_t src) {
  const int64_t vb = m.n * m.k / 2, sb = m.n * m.k / 32;
  std::memcpy(m.blocks.data() + dst * vb, m.blocks.data() + src * vb, static_cast<size_t>(vb));
  std::memcpy(m.scales.data() + dst * sb, m.scales.data() + src * sb, static_cast<size_t>(sb));
}

inline quant::Mxfp4RowOrder mxfp4_order(GateUpOrder o, bool gate_up) {
  if (!gate_up) return quant::Mxfp4RowOrder::kPlain;
  return o == GateUpOrder::kInterleaved ? quant::Mxfp4RowOrder::kGateUpInterleaved
                                        : quant::Mxfp4RowOrder::kGateUpConcatenated;
}

// The dequantized values as bfloat16 bits [E, n, k] (exact: MXFP4 values are bf16 numbers).
inline std::vector<uint16_t> mxfp4_to_bf16(const Mxfp4Host& m) {
  std::vector<uint8_t> blocks = m.blocks, scales = m.scales;
  std::vector<uint16_t> out(static_cast<size_t>(m.experts * m.n * m.k));
  const Status st = quant::dequantize_mxfp4(
      kCpu, TensorView::contiguous(blocks.data(), DType::kU8, Shape{m.experts, m.n, m.k / 32, 16}),
      TensorView::contiguous(scales.data(), DType::kU8, Shape{m.experts, m.n, m.k / 32}),
      TensorView::contiguous(out.data(), DType::kBF16, Shape{m.experts, m.n, m.k}));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return out;
}
inline std::vector<float> bf16_to_f32(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_bits_to_f32(b[i]);
  return f;
}

// Kernel-layout blocks and scales of m (rows in checkpoint order `order`).
inline void mxfp4_to_kernel(const Mxfp4Host& m, quant::Mxfp4RowOrder order,
                            std::vector<uint8_t>* blocks, std::vector<uint8_t>* scales) {
  *blocks = m.blocks;
  scales->assign(m.scales.size(), 0);
  std::vector<uint8_t> ck = m.scales;
  Status st = quant::mxfp4_blocks_to_kernel_layout(
      kCpu, TensorView::contiguous(blocks->data(), DType::kU8, Shape{m.experts, m.n, m.k / 32, 16}),
      order);
  EXPECT_TRUE(st.ok()) << st.to_string();
  st = quant::mxfp4_scales_to_kernel_layout(
      kCpu, TensorView::contiguous(ck.data(), DType::kU8, Shape{m.experts, m.n, m.k / 32}),
      TensorView::contiguous(scales->data(), DType::kU8, Shape{m.experts, m.n, m.k / 32}), order);
  EXPECT_TRUE(st.ok()) << st.to_string();
}

// ExpertWeights on `a` in `fmt` from MXFP4 checkpoint tensors (bf16: their exact values).
inline ExpertWeights upload_experts(Arena& a, WeightFormat fmt, GateUpOrder order,
                                   const Mxfp4Host& gu, const Mxfp4Host& dn,
                                   const std::vector<float>* gu_bias = nullptr,
                                   const std::vector<float>* dn_bias = nullptr) {
  ExpertWeights w;
  w.format = fmt;
  w.gate_up_order = order;
  if (fmt == WeightFormat::kBF16) {
    w.gate_up = a.make(DType::kBF16, Shape{gu.experts, gu.n, gu.k}, mxfp4_to_bf16(gu));
    w.down = a.make(DType::kBF16, Shape{dn.experts, dn.n, dn.k}, mxfp4_to_bf16(dn));
  } else {
    std::vector<uint8_t> b, s;
    mxfp4_to_kernel(gu, mxfp4_order(order, true), &b, &s);
    w.gate_up = a.make(DType::kU8, Shape{gu.experts, gu.n, gu.k / 32, 16}, b);
    w.gate_up_scales = a.make(DType::kU8, Shape{gu.experts, gu.n, gu.k / 32}, s);
    mxfp4_to_kernel(dn, quant::Mxfp4RowOrder::kPlain, &b, &s);
    w.down = a.make(DType::kU8, Shape{dn.experts, dn.n, dn.k / 32, 16}, b);
    w.down_scales = a.make(DType::kU8, Shape{dn.experts, dn.n, dn.k / 32}, s);
  }
  if (gu_bias) w.gate_up_bias = a.make(DType::kF32, Shape{gu.experts, gu.n}, *gu_bias);
  if (dn_bias) w.down_bias = a.make(DType::kF32, Shape{dn.experts, dn.n}, *dn_bias);
  return w;
}

// A workspace for ExpertsArgs on `a` (empty on the CPU), 256-byte aligned.
inline TensorView experts_workspace(Arena& a, int64_t tokens, int64_t top_k, int64_t hidden,
                                    int64_t inter, int64_t experts, ActPrecision p) {
  if (!a.gpu()) return TensorView{};
  const int64_t bytes = experts_workspace_bytes(tokens, top_k, hidden, inter, experts, p);
  // cudaMalloc is 256-byte aligned; the Arena puts the view at offset 0 of its own buffer.
  return a.make(DType::kU8, Shape{bytes});
}

inline std::vector<float> read_f32(const Arena& a, const TensorView& v) {
  return as_vec<float>(a.read(v));
}
inline std::vector<int32_t> read_i32(const Arena& a, const TensorView& v) {
  return as_vec<int32_t>(a.read(v));
}

}  // namespace rolloutd::moe::test
