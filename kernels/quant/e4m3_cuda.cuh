#pragma once
// E4M3 on the hardware's conversions (sm_89+), bit for bit the integer codecs of minifloat.hpp
// within the MX rule's ranges: shared by the quantization kernels (cuda_quant.cu) and the MoE
// kernels that round activations through MXFP8 where they are made (cuda_moe_experts.cu).
//
// NOTES (why each step is exact; the build has no -ftz, see quant.cmake):
// - Encode: x * 2^-se is exact in FP32 unless it falls below 2^-126, where it rounds to a value
//   still far under the smallest E4M3 half-step (2^-10): the code is +-0 either way. Then
//   cvt.rn.satfinite is round_to_code exactly: RNE onto the E4M3 grid (subnormals included),
//   +-448 for anything larger, the sign kept (-0 -> 0x80). Finite inputs only: a block holding
//   NaN/Inf has a NaN scale and its formats decide what it stores.
// - Decode: every E4M3 value is a float16 (cvt.rn.f16x2.e4m3x2 and cvt.f32.f16 are exact), and
//   v * 2^se has at most 4 significant bits at weights >= 2^-136 (v >= 2^-9, se >= -127), so the
//   FP32 product is exact, a subnormal one too, and +-inf past FLT_MAX as compose_f32 gives.
//   NaN codes (0x7F, 0xFF) give the canonical NaN, as e4m3_decode_bits does.
// Checked against minifloat.hpp through quantize_mxfp8 / dequantize_mxfp8 (quant_parity_test:
// random and heavy-tailed inputs, every bf16 pattern at nine places under its block's scale,
// random code bytes with the extreme and NaN scales).
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/quant/minifloat.hpp"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#error "e4m3_cuda.cuh needs sm_89: cvt.rn.satfinite.e4m3x2.f32 and cvt.rn.f16x2.e4m3x2"
#endif

namespace rolloutd::quant {

// 2^-se as an FP32 (se in [-127, 126]: every scale a finite amax produces).
__device__ __forceinline__ float exp2_neg(int se) { return __uint_as_float(static_cast<uint32_t>(127 - se) << 23); }

// 2^se as an FP32 for any E8M0 exponent (se in [-127, 127]; 2^-127 is the subnormal 0x00400000).
__device__ __forceinline__ float exp2_pos(int se) {
  return __uint_as_float(se >= -126 ? static_cast<uint32_t>(127 + se) << 23 : 0x00400000u);
}

// Two E4M3 codes of x / 2^se: lo in byte 0, hi in byte 1. inv_scale = exp2_neg(se).
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ uint32_t e4m3x2_scaled(float lo, float hi, float inv_scale) {
  return e4m3x2(__fmul_rn(lo, inv_scale), __fmul_rn(hi, inv_scale));
}

// The two codes of `codes` (byte 0 lo, byte 1 hi) times 2^se (scale = exp2_pos(se)) as FP32.
__device__ __forceinline__ float2 e4m3x2_decode(uint32_t codes, float scale) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(codes)));
  const float lo = __fmul_rn(__half2float(__ushort_as_half(static_cast<unsigned short>(h2 & 0xffffu))), scale);
  const float hi = __fmul_rn(__half2float(__ushort_as_half(static_cast<unsigned short>(h2 >> 16))), scale);
  const float nan = __uint_as_float(kF32CanonicalNan);
  return make_float2((codes & 0x7fu) == 0x7fu ? nan : lo, (codes & 0x7f00u) == 0x7f00u ? nan : hi);
}

// lo and hi (finite) through MXFP8 with block exponent se and back:
// e4m3_decode_bits(e4m3_encode(x, se), se) of each, as FP32.
__device__ __forceinline__ float2 mx8_round2(float lo, float hi, int se) {
  return e4m3x2_decode(e4m3x2_scaled(lo, hi, exp2_neg(se)), exp2_pos(se));
}

}  // namespace rolloutd::quant
