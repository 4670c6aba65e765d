#pragma once
// Blockwise FP8 with power-of-two (UE8M0) scales, as DeepSeek-V3 / DeepGEMM run it: E4M3
// elements, one scale per 128 x 128 block of a weight [.., N, K] or per 1 x 128 block (one
// token, 128 consecutive K) of an activation [.., K].
//
// Scale rule: s = amax / 448 computed in FP32 (correctly rounded division, as the peers do),
// then the power of two at or above s: 2^k with k = exponent(s), plus one when the mantissa
// of s is non-zero, clamped to the E8M0 range [-127, 127]. Elements: E4M3(V_i / 2^k), RNE,
// saturated to +-448 (V_i / 2^k <= 448 except where the FP32 division rounded s down onto a
// power of two; those values round to 448 anyway).
// Edge policies (tested in tests/unit/kernels/quant/fp8_blockwise_test.cpp):
// - a block of zeros (either sign): s = 0, scale 2^-127 (code 0x00, FP32 0x00400000); there is
//   no epsilon floor on amax (the E8M0 range is the only clamp); -0 stays 0x80;
// - subnormal inputs are ordinary small values;
// - a block holding a NaN or +-Inf is poisoned: FP32 scale = canonical NaN, UE8M0 code 0xFF,
//   all element codes 0x00; it dequantizes to NaN everywhere;
// - partial edge blocks (N or K not multiples of 128) take the amax of the elements present;
// - FP32 input is quantized from its own value (never through BF16).
// Scale outputs (either or both):
// - FP32 powers of two, [.., ceil(N/128), ceil(K/128)] (weights) or [.., ceil(K/128)]
//   (activations), row-major;
// - packed UE8M0: int32 [.., ceil(N/128) or rows, ceil(ceil(K/128)/4)], each int32 holding
//   the codes of four K-consecutive blocks, block 4j+i in byte i (little-endian): the int32
//   array read as bytes is the codes in K order. Bytes past the last block are 0x00.
//   (DeepGEMM's TMA-aligned MN-major scale tensor is the transpose of this one, padded; that
//   transpose belongs to the GEMM that wants it.)
// Dequantization: E4M3 * scale, canonical NaN for NaN codes or scales. With packed UE8M0
// scales the product is composed exactly; with FP32 scales it is one FP32 multiply (exact for
// power-of-two scales; a caller's non-power-of-two scale rounds once, to nearest even).
#include <cstdint>

#include "kernels/quant/minifloat.hpp"

namespace rolloutd::quant {

inline constexpr int kFp8BlockK = 128;      // K extent of every scale block
inline constexpr int kFp8WeightBlockN = 128;

enum class Fp8ScaleBlock : uint8_t {
  k1x128 = 0,    // activations: x [.., K], one scale per row per 128 K
  k128x128 = 1,  // weights: x [.., N, K], one scale per 128 x 128 block
};

// The UE8M0 scale of a block whose largest magnitude has FP32 bits `amax_abs_bits`, given the
// already-divided s = amax / 448 (FP32, correctly rounded; the caller divides because the
// host and the device spell a correctly rounded division differently).
RD_HOST_DEVICE inline E8M0 ue8m0_scale_from_quotient(uint32_t amax_abs_bits, float s) {
  if (amax_abs_bits >= kF32InfBits) return E8M0{kE8M0Nan};
  const uint32_t sb = f32_bits(s);
  if (sb == 0) return E8M0{0};
  const int fl = floor_log2_f32(sb);
  const bool exact_pow2 = (sb >> 23) != 0 ? (sb & 0x7fffffu) == 0 : (sb & (sb - 1u)) == 0;
  return e8m0_from_exponent(exact_pow2 ? fl : fl + 1);
}

}  // namespace rolloutd::quant
