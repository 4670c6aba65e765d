#pragma once
// Scalar math shared by the CPU reference and the CUDA kernels of kernels/moe/, compiled for
// host and device from this one source.
//
// NOTES:
// - Routing must not depend on the backend: the biased routers rank experts on
//   score(logit) + bias, so CPU and CUDA must compute score() to the same bits. libm's expf and
//   CUDA's expf differ by an ulp here and there, which flips near-ties. So exp and log are
//   written out here (Cody-Waite reduction + the Cephes single-precision polynomials, ~1 ulp)
//   with every multiply-add an explicit fma and every other operation an explicitly rounded
//   one (__fadd_rn & co. on the device, which nvcc never contracts; the host sources that use
//   this header are compiled with -ffp-contract=off, see moe.cmake).
// - The activations go through the same functions, so CPU and CUDA outputs differ only by the
//   GEMMs' accumulation order.
#include <cmath>
#include <cstdint>

#include "kernels/bf16.hpp"  // RD_HOST_DEVICE

namespace rolloutd::moe::math {

RD_HOST_DEVICE inline float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
RD_HOST_DEVICE inline float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
RD_HOST_DEVICE inline float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
RD_HOST_DEVICE inline float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
RD_HOST_DEVICE inline float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
RD_HOST_DEVICE inline float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
RD_HOST_DEVICE inline bool is_nan(float a) { return a != a; }

// e^x, about 1 ulp, NaN in -> NaN out, +inf above 88.72, +0 below -103.97.
RD_HOST_DEVICE inline float exp(float x) {
  if (is_nan(x)) return x;
  if (x > 88.72283935546875f) return INFINITY;
  if (x < -103.97208404541015625f) return 0.0f;
#if defined(__CUDA_ARCH__)
  const float n = rintf(mul(x, 1.44269504088896341f));
#else
  const float n = std::rint(mul(x, 1.44269504088896341f));
#endif
  // r = x - n ln2 in two steps (ln2 = 0.693359375 - 2.12194440e-4; the first product is exact).
  float r = fma(n, -0.693359375f, x);
  r = fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fma(p, r, 1.3981999507e-3f);
  p = fma(p, r, 8.3334519073e-3f);
  p = fma(p, r, 4.1665795894e-2f);
  p = fma(p, r, 1.6666665459e-1f);
  p = fma(p, r, 5.0000001201e-1f);
  const float y = add(fma(p, mul(r, r), r), 1.0f);
  // 2^n exactly (ldexp is correctly rounded on both sides, subnormal results included).
#if defined(__CUDA_ARCH__)
  return ldexpf(y, static_cast<int>(n));
#else
  return std::ldexp(y, static_cast<int>(n));
#endif
}

// ln(u) for finite u >= 1 (the only use: log1p of an exp).
RD_HOST_DEVICE inline float log_ge1(float u) {
  int e = 0;
#if defined(__CUDA_ARCH__)
  float m = frexpf(u, &e);  // u = m 2^e, m in [0.5, 1)
#else
  float m = std::frexp(u, &e);
#endif
  float f;
  if (m < 0.70710678118654752f) {
    e -= 1;
    f = sub(add(m, m), 1.0f);  // exact (Sterbenz)
  } else {
    f = sub(m, 1.0f);  // exact
  }
  const float z = mul(f, f);
  float p = 7.0376836292e-2f;
  p = fma(p, f, -1.1514610310e-1f);
  p = fma(p, f, 1.1676998740e-1f);
  p = fma(p, f, -1.2420140846e-1f);
  p = fma(p, f, 1.4249322787e-1f);
  p = fma(p, f, -1.6668057665e-1f);
  p = fma(p, f, 2.0000714765e-1f);
  p = fma(p, f, -2.4999993993e-1f);
  p = fma(p, f, 3.3333331174e-1f);
  const float fe = static_cast<float>(e);
  float y = mul(mul(p, f), z);
  y = fma(fe, -2.12194440e-4f, y);
  y = fma(-0.5f, z, y);
  float r = add(f, y);
  return fma(fe, 0.693359375f, r);
}

// log(1 + y) for y >= 0 finite, accurate for tiny y (Goldberg's trick).
RD_HOST_DEVICE inline float log1p_nonneg(float y) {
  const float u = add(1.0f, y);
  if (u == 1.0f) return y;
  return div(mul(log_ge1(u), y), sub(u, 1.0f));
}

RD_HOST_DEVICE inline float sigmoid(float x) { return div(1.0f, add(1.0f, exp(-x))); }
RD_HOST_DEVICE inline float silu(float x) { return div(x, add(1.0f, exp(-x))); }
// torch.nn.functional.softplus(x) with beta 1, threshold 20.
RD_HOST_DEVICE inline float softplus(float x) {
  if (is_nan(x)) return x;
  return x > 20.0f ? x : log1p_nonneg(exp(x));
}
RD_HOST_DEVICE inline float sqrt_softplus(float x) { return sqrt(softplus(x)); }

// ---- ranking: descending value, NaN last, equal values -> lower id first -----------------
RD_HOST_DEVICE inline float rank_value(float v) { return is_nan(v) ? -INFINITY : v; }
RD_HOST_DEVICE inline bool ranks_before(float va, int a, float vb, int b) {
  return va > vb || (va == vb && a < b);
}

// w[i] /= (sum + 1e-20) when asked (the sum taken in index order), then w[i] *= scale: the
// DeepSeek order of operations.
RD_HOST_DEVICE inline void normalize_and_scale(float* w, int k, bool renormalize, float scale) {
  if (renormalize) {
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) sum = add(sum, w[i]);
    const float denom = add(sum, 1e-20f);
    for (int i = 0; i < k; ++i) w[i] = div(w[i], denom);
  }
  for (int i = 0; i < k; ++i) w[i] = mul(w[i], scale);
}

// ---- activations (ActivationKind values, kept as ints so this header needs no other) ------
// NaN propagates through the clamps (torch.clamp does; fminf would not).
RD_HOST_DEVICE inline float clamp_max(float v, float hi) { return v > hi ? hi : v; }
RD_HOST_DEVICE inline float clamp_abs(float v, float lim) {
  return v > lim ? lim : (v < -lim ? -lim : v);
}
RD_HOST_DEVICE inline float activate(int kind, float limit, float alpha, float g, float u) {
  if (kind == 1) {  // gpt-oss: glu = g * sigmoid(alpha * g); (u + 1) * glu
    g = clamp_max(g, limit);
    u = clamp_abs(u, limit);
    const float glu = mul(g, sigmoid(mul(g, alpha)));
    return mul(add(u, 1.0f), glu);
  }
  if (kind == 2) {  // DeepSeek-V4
    g = clamp_max(g, limit);
    u = clamp_abs(u, limit);
  }
  return mul(silu(g), u);
}

}  // namespace rolloutd::moe::math
