#pragma once
// MXFP4 (OCP Microscaling Formats v1.0): E2M1 elements, one E8M0 scale per 32 consecutive
// elements along K, two elements per byte.
//
// Elements: E2M1 = sign, 2 exponent bits (bias 1), 1 mantissa bit; magnitudes
// {0, 0.5, 1, 1.5, 2, 3, 4, 6} for codes 0..7, code | 8 is the negative. No Inf, no NaN.
// Packing: byte j of a block holds element 2j in its low nibble and element 2j+1 in its high
// nibble (gpt-oss checkpoints and PyTorch's float4_e2m1fn_x2 agree).
//
// Quantization of a block V[0..32) (OCP MX v1.0 section 6.3; minifloat.hpp has the rule):
//   X = 2^(floor(log2 amax) - 2) as E8M0, clamped to [2^-127, 2^127]; P_i = E2M1(V_i / X)
//   rounded to nearest, ties to even, saturated to +-6.
// Edge policies (tested in tests/unit/kernels/quant/mxfp4_test.cpp):
// - zeros: amax == 0 gives scale code 0x00; -0 keeps its sign (code 0x8), as does any value
//   that rounds to zero;
// - subnormal inputs are ordinary small values (no flush to zero);
// - a block holding a NaN or +-Inf is poisoned: scale code 0xFF (NaN) and all 32 element
//   codes 0; it dequantizes to NaN everywhere. Other blocks of the row are unaffected;
// - FP32 input is quantized from its own value (no rounding through BF16 first), so an FP32
//   tensor whose values are exact BF16 gives the same bytes as the BF16 tensor;
// - K not a multiple of 32: the last block is padded with +0 (does not change amax).
// Dequantization: element * 2^(s-127), exact in FP32 (+-inf above FLT_MAX, only reachable
// from foreign scales); scale 0xFF gives the canonical NaN; BF16 output rounds that FP32
// value to nearest even.
//
// Checkpoint layout (gpt-oss `*_blocks` / `*_scales`): blocks uint8 [E, N, K/32, 16],
// scales uint8 [E, N, K/32], row-major, one row of the weight per output feature n.
//
// Kernel layout ("tiled v1", what the expert GEMM reads; Mxfp4KernelLayout below):
// 1. Rows. kPlain keeps the checkpoint row order (down_proj, any matrix). kGateUpInterleaved
//    is for a gpt-oss gate_up_proj, whose checkpoint rows alternate gate/up (row 2i = gate i,
//    row 2i+1 = up i): each group of 32 rows becomes 16 gate rows then their 16 up rows, so
//    one 32-row GEMM tile holds the gate and up outputs of the same 16 intermediate features
//    and SwiGLU runs in the epilogue.
// 2. Values. The (row-reordered) matrix is cut into tiles of 16 rows x 64 elements (16 x 32
//    bytes); tiles are stored row-tile-major, K-tile-minor, [N/16][K/64][16][32], each tile
//    512 contiguous bytes: one 16-byte load per lane of a warp fetches a whole tile, where
//    the checkpoint layout would need 16 loads strided by K/2 bytes.
// 3. Scales (a separate copy; the checkpoint scales are never touched, the weight registry
//    restores from them): the 2 scales of each tile row, [N/16][K/64][16][2], 32 contiguous
//    bytes per tile in the same tile order as the values: two 16-byte loads per tile.
// Requirements: K % 64 == 0 and N % 16 == 0 (N % 32 == 0 for kGateUpInterleaved).
// The value permutation is closed on every group of 16 rows (32 when interleaved), so it is
// applied in place a group at a time: the extra memory is one group (16 or 32 rows x K/2
// bytes), never a second tensor. Applying it twice is NOT the identity; the inverse
// (mxfp4_blocks_to_checkpoint_layout) is, and the registry tracks which layout is live.
#include <cstdint>

#include "kernels/quant/minifloat.hpp"

namespace rolloutd::quant {

inline constexpr int kMxBlockSize = 32;             // elements per E8M0 scale
inline constexpr int kMxfp4BytesPerBlock = 16;      // 32 E2M1 elements
inline constexpr int kE2M1EmaxElem = 2;             // 6 = 1.5 * 2^2
inline constexpr float kE2M1Max = 6.0f;
inline constexpr uint8_t kE2M1MaxCode = 7;

// Two E2M1 codes: element 2j in bits 0..3, element 2j+1 in bits 4..7.
struct Fp4x2 {
  uint8_t bits;
};
static_assert(sizeof(Fp4x2) == 1 && alignof(Fp4x2) == 1);

RD_HOST_DEVICE inline Fp4x2 fp4x2_pack(uint32_t even, uint32_t odd) {
  return Fp4x2{static_cast<uint8_t>((even & 0xfu) | ((odd & 0xfu) << 4))};
}
RD_HOST_DEVICE inline uint32_t fp4x2_even(Fp4x2 p) { return p.bits & 0xfu; }
RD_HOST_DEVICE inline uint32_t fp4x2_odd(Fp4x2 p) { return static_cast<uint32_t>(p.bits) >> 4; }

// x / 2^scale_exp to an E2M1 code (sign in bit 3), RNE, saturating to +-6. `bits` finite.
RD_HOST_DEVICE inline uint32_t e2m1_encode(uint32_t bits, int scale_exp) {
  return ((bits >> 28) & 0x8u) | round_to_code<1, 0, kE2M1MaxCode>(bits & kF32AbsMask, scale_exp);
}

// E2M1 code * 2^scale_exp as FP32 bits.
RD_HOST_DEVICE inline uint32_t e2m1_decode_bits(uint32_t code, int scale_exp) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t v = e == 0 ? compose_f32(m, -1 + scale_exp)
                            : compose_f32(2u + m, static_cast<int>(e) - 2 + scale_exp);
  return v | ((code & 0x8u) << 28);
}

// ---- kernel layout ("tiled v1") -----------------------------------------------------------

enum class Mxfp4RowOrder : uint8_t {
  kPlain = 0,              // rows keep their order
  kGateUpInterleaved = 1,  // checkpoint rows gate0, up0, gate1, up1, ... (gpt-oss gate_up_proj)
};

inline constexpr int kMxfp4LayoutVersion = 1;
inline constexpr int kMxfp4TileRows = 16;
inline constexpr int kMxfp4TileK = 64;                 // elements
inline constexpr int kMxfp4TileRowBytes = 32;          // kMxfp4TileK / 2
inline constexpr int kMxfp4TileBytes = 512;            // 16 x 32
inline constexpr int kMxfp4TileScales = 32;            // 16 rows x 2 scales

// Rows that the in-place permutation moves together (the closed groups).
RD_HOST_DEVICE inline int mxfp4_group_rows(Mxfp4RowOrder order) {
  return order == Mxfp4RowOrder::kGateUpInterleaved ? 2 * kMxfp4TileRows : kMxfp4TileRows;
}

// Kernel row of checkpoint row r (within one expert), and the inverse.
RD_HOST_DEVICE inline int64_t mxfp4_kernel_row(int64_t r, Mxfp4RowOrder order) {
  if (order == Mxfp4RowOrder::kPlain) return r;
  const int64_t g = r / 32, i = r % 32;
  return g * 32 + (i & 1) * 16 + i / 2;
}
RD_HOST_DEVICE inline int64_t mxfp4_checkpoint_row(int64_t kr, Mxfp4RowOrder order) {
  if (order == Mxfp4RowOrder::kPlain) return kr;
  const int64_t g = kr / 32, i = kr % 32;
  return g * 32 + (i % 16) * 2 + i / 16;
}

// Where things live in the kernel layout of one expert matrix with `row_bytes` = K/2.
// Byte `b` (0 <= b < K/2) of checkpoint row r:
RD_HOST_DEVICE inline int64_t mxfp4_kernel_value_offset(int64_t r, int64_t b, int64_t row_bytes,
                                                        Mxfp4RowOrder order) {
  const int64_t kr = mxfp4_kernel_row(r, order);
  const int64_t k_tiles = row_bytes / kMxfp4TileRowBytes;
  return ((kr / kMxfp4TileRows) * k_tiles + b / kMxfp4TileRowBytes) * kMxfp4TileBytes +
         (kr % kMxfp4TileRows) * kMxfp4TileRowBytes + b % kMxfp4TileRowBytes;
}
// Scale of block kb (0 <= kb < K/32) of checkpoint row r, in the kernel scales buffer:
RD_HOST_DEVICE inline int64_t mxfp4_kernel_scale_offset(int64_t r, int64_t kb, int64_t row_blocks,
                                                        Mxfp4RowOrder order) {
  const int64_t kr = mxfp4_kernel_row(r, order);
  const int64_t k_tiles = row_blocks / 2;
  return ((kr / kMxfp4TileRows) * k_tiles + kb / 2) * kMxfp4TileScales +
         (kr % kMxfp4TileRows) * 2 + kb % 2;
}

}  // namespace rolloutd::quant
