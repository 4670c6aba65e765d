#pragma once
// MXFP8 (OCP Microscaling Formats v1.0), the activation format of the MXFP4 x MXFP8 expert
// GEMM: E4M3 elements (float8_e4m3fn, largest normal 448 = 1.75 * 2^8), one E8M0 scale per
// 32 consecutive elements along K.
//
// Quantization of a block V[0..32) (OCP MX v1.0 section 6.3; minifloat.hpp has the rule):
//   X = 2^(floor(log2 amax) - 8) as E8M0, clamped to [2^-127, 2^127]; P_i = E4M3(V_i / X)
//   rounded to nearest, ties to even, saturated to +-448 (V_i / X can reach 511.x; the
//   E4M3 NaN code 0x7F is never produced from a finite input).
// Edge policies (tested in tests/unit/kernels/quant/mxfp8_test.cpp):
// - zeros: amax == 0 gives scale code 0x00; -0 and negative values that round to zero keep
//   their sign (0x80);
// - subnormal inputs are ordinary small values; E4M3 subnormals (multiples of 2^-9 of the
//   scale) are produced;
// - a block holding a NaN or +-Inf is poisoned: scale 0xFF and all 32 element codes 0x00;
//   it dequantizes to NaN everywhere;
// - FP32 input is quantized from its own value (never through BF16): exact-BF16 FP32 input
//   gives the same bytes as the BF16 tensor;
// - K not a multiple of 32: the last block covers the remaining elements (scales [.., ceil(K/32)]).
// Dequantization: element * 2^(s-127) exact in FP32; a NaN element (0x7F/0xFF) or a NaN scale
// gives the canonical NaN.
//
// Layout: q [..., K] (float8_e4m3fn or uint8), scales [..., ceil(K/32)] (float8_e8m0fnu or
// uint8), both row-major.
#include "kernels/quant/minifloat.hpp"

namespace rolloutd::quant {

inline constexpr int kE4M3EmaxElem = 8;  // 448 = 1.75 * 2^8

}  // namespace rolloutd::quant
