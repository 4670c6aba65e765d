#pragma once
// Element codecs shared by every quantized format: bit access to FP32, round-to-nearest-even
// of an FP32 magnitude onto a small float grid with saturation, the E4M3 (float8_e4m3fn) and
// E8M0 (float8_e8m0fnu) codes, and the OCP MX shared-scale rule.
//
// NOTES:
// - Encoding is integer arithmetic on the FP32 bit pattern, including the division by the
//   power-of-two block scale (an exponent subtraction), so the host reference and the device
//   kernels give the same bits whatever the floating-point modes (fast-math, flush-to-zero).
// - Decoding composes the result's bits directly (compose_f32): exact wherever the value is
//   representable in FP32, subnormals included, +inf above FLT_MAX.
// - The byte-sized codes live in distinct one-byte structs (E4M3, E8M0, and Fp4x2 in
//   mxfp4.hpp): a kernel boundary says which code it reads, and a signed char never stands
//   for an unsigned code (the packed-FP4 sign-extension bug of the seed notes).
#include <cstdint>
#include <cstring>

#include "kernels/bf16.hpp"  // RD_HOST_DEVICE, f32 <-> bf16

namespace rolloutd::quant {

// ---- storage types: one byte each, never arithmetic types ---------------------------------

// float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; 0x7F and
// 0xFF are NaN; largest finite 448 (0x7E).
struct E4M3 {
  uint8_t bits;
};
// float8_e8m0fnu: 2^(bits - 127); 0xFF is NaN; no sign, no zero. Also called UE8M0.
struct E8M0 {
  uint8_t bits;
};
static_assert(sizeof(E4M3) == 1 && alignof(E4M3) == 1);
static_assert(sizeof(E8M0) == 1 && alignof(E8M0) == 1);

inline constexpr uint32_t kF32AbsMask = 0x7fffffffu;
inline constexpr uint32_t kF32InfBits = 0x7f800000u;   // abs bits >= this: Inf or NaN
inline constexpr uint32_t kF32CanonicalNan = 0x7fc00000u;  // the only NaN a decoder writes
inline constexpr uint8_t kE8M0Nan = 0xff;
inline constexpr uint8_t kE4M3MaxCode = 0x7e;  // 448
inline constexpr float kE4M3Max = 448.0f;
inline constexpr int kE8M0Bias = 127;
inline constexpr int kE8M0MinExp = -127;  // code 0x00
inline constexpr int kE8M0MaxExp = 127;   // code 0xFE

RD_HOST_DEVICE inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
RD_HOST_DEVICE inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Position of the highest set bit of v (v != 0).
RD_HOST_DEVICE inline int msb32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return 31 - __clz(static_cast<int>(v));
#else
  return 31 - __builtin_clz(v);
#endif
}

// floor(log2 |x|) of a finite non-zero FP32 given its magnitude bits; subnormals included.
RD_HOST_DEVICE inline int floor_log2_f32(uint32_t abs_bits) {
  const int biased = static_cast<int>(abs_bits >> 23);
  return biased != 0 ? biased - 127 : msb32(abs_bits) - 149;
}

// FP32 bits of sig * 2^exp (sig < 2^24, exp >= -149): exact when representable, +inf when
// the value exceeds FLT_MAX. Every decoder of this library builds its result here.
RD_HOST_DEVICE inline uint32_t compose_f32(uint32_t sig, int exp) {
  if (sig == 0) return 0;
  const int p = msb32(sig);
  const int e = exp + p;
  if (e > 127) return kF32InfBits;
  if (e >= -126) return (static_cast<uint32_t>(e + 127) << 23) | ((sig << (23 - p)) & 0x7fffffu);
  return sig << (exp + 149);  // subnormal: the value is a multiple of 2^-149, exactly
}

// Exact power of two 2^k as FP32 bits, k in [-149, 127].
RD_HOST_DEVICE inline uint32_t exp2_bits(int k) { return compose_f32(1u, k); }

// Rounds |x| / 2^scale_exp to the magnitude code of a small float with kMan mantissa bits
// and smallest normal exponent kEmin: to nearest, ties to the even code, and saturating at
// kMaxCode (never an infinity or NaN code). `abs_bits` is a finite FP32 magnitude. Codes
// count up the grid (subnormals first), so the even code is the even mantissa, and a
// mantissa that rounds up past its binade carries into the exponent field by itself.
template <int kMan, int kEmin, uint32_t kMaxCode>
RD_HOST_DEVICE inline uint32_t round_to_code(uint32_t abs_bits, int scale_exp) {
  constexpr int kEmax = static_cast<int>(kMaxCode >> kMan) + kEmin - 1;
  if (abs_bits == 0) return 0;
  // Normalise (subnormal inputs too) so that |x| = sig * 2^(e - 23), 2^23 <= sig < 2^24.
  const int e_in = floor_log2_f32(abs_bits);
  const uint32_t frac = abs_bits & 0x7fffffu;
  const uint32_t sig = (abs_bits >> 23) != 0 ? (frac | 0x800000u) : (frac << (23 - (e_in + 149)));
  const int e = e_in - scale_exp;
  if (e > kEmax) return kMaxCode;  // at least 2^(emax+1) > the largest code: saturate
  const int unit = (e < kEmin ? kEmin : e) - kMan;  // exponent of one step of the grid here
  const int shift = unit - (e - 23);                 // >= 23 - kMan
  uint32_t n = 0;
  if (shift <= 24) {  // otherwise |x| < half a step: rounds to zero
    n = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (n & 1u) != 0)) ++n;
  }
  const uint32_t code = (e < kEmin ? 0u : static_cast<uint32_t>(e - kEmin) << kMan) + n;
  return code > kMaxCode ? kMaxCode : code;
}

// ---- E4M3 --------------------------------------------------------------------------------

// x / 2^scale_exp to E4M3, RNE, saturating to +-448; the sign is kept (-0 -> 0x80). `bits`
// must be finite: the formats decide what a NaN/Inf input becomes (see their headers).
RD_HOST_DEVICE inline E4M3 e4m3_encode(uint32_t bits, int scale_exp) {
  const uint32_t code = round_to_code<3, -6, kE4M3MaxCode>(bits & kF32AbsMask, scale_exp);
  return E4M3{static_cast<uint8_t>(((bits >> 24) & 0x80u) | code)};
}

// E4M3 * 2^scale_exp as FP32 bits; NaN codes give the canonical NaN.
RD_HOST_DEVICE inline uint32_t e4m3_decode_bits(E4M3 c, int scale_exp) {
  const uint32_t mag = c.bits & 0x7fu;
  if (mag == 0x7fu) return kF32CanonicalNan;
  const uint32_t e = mag >> 3, m = mag & 7u;
  const uint32_t v = e == 0 ? compose_f32(m, -9 + scale_exp)
                            : compose_f32(8u + m, static_cast<int>(e) - 10 + scale_exp);
  return v | (static_cast<uint32_t>(c.bits & 0x80u) << 24);
}

// ---- E8M0 --------------------------------------------------------------------------------

RD_HOST_DEVICE inline bool e8m0_is_nan(E8M0 s) { return s.bits == kE8M0Nan; }
RD_HOST_DEVICE inline int e8m0_exponent(E8M0 s) { return static_cast<int>(s.bits) - kE8M0Bias; }
RD_HOST_DEVICE inline E8M0 e8m0_from_exponent(int k) {
  k = k < kE8M0MinExp ? kE8M0MinExp : (k > kE8M0MaxExp ? kE8M0MaxExp : k);
  return E8M0{static_cast<uint8_t>(k + kE8M0Bias)};
}
// 2^(s - 127) as FP32 bits (code 0 is the subnormal 2^-127); NaN code -> canonical NaN.
RD_HOST_DEVICE inline uint32_t e8m0_decode_bits(E8M0 s) {
  return e8m0_is_nan(s) ? kF32CanonicalNan : exp2_bits(e8m0_exponent(s));
}

// OCP Microscaling Formats (MX) v1.0, section 6.3: the shared scale of a block is
// X = 2^(floor(log2(amax)) - emax_elem), emax_elem the exponent of the element type's largest
// normal (2 for E2M1, 8 for E4M3), clamped to the E8M0 range. Then:
// - amax == 0 (a block of zeros, either sign): floor(log2) is taken as below the range, so
//   X = 2^-127 (code 0x00), as the OCP reference code does; every element encodes to +-0;
// - amax NaN or +-Inf: X = NaN (code 0xFF), the block is poisoned (elements: see the formats);
// - elements are then V / X rounded to nearest even and *saturated* to the element maximum
//   (a block whose amax mantissa exceeds the element's top mantissa clips its largest
//   values, e.g. amax 7.5 with E2M1 stores 6 * 2^0: that is the OCP rule, not a bug).
RD_HOST_DEVICE inline E8M0 mx_scale_from_amax(uint32_t amax_abs_bits, int emax_elem) {
  if (amax_abs_bits >= kF32InfBits) return E8M0{kE8M0Nan};
  if (amax_abs_bits == 0) return E8M0{0};
  return e8m0_from_exponent(floor_log2_f32(amax_abs_bits) - emax_elem);
}

}  // namespace rolloutd::quant
