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
// Kernel layout ("tiled v2", what the expert GEMM reads; the helpers at the end):
// 1. Rows. kPlain keeps the checkpoint row order (down_proj, any matrix). The two gate/up
//    orders name how the checkpoint stores a fused gate_up_proj of N = 2I rows:
//    kGateUpInterleaved (gpt-oss: row 2j = gate j, row 2j+1 = up j) and kGateUpConcatenated
//    (Qwen3-MoE / DeepSeek exports, this registry's checkpoint: gate rows [0, I), up rows
//    [I, 2I)). Both become the same kernel rows: each group of 32 holds 16 gate rows then
//    the 16 up rows of the same intermediate features (gate j at 32*(j/16) + j%16, up j 16
//    rows later), so one 32-row GEMM tile computes gate and up together and SwiGLU runs in
//    its epilogue.
// 2. Values. The (row-reordered) matrix is cut into tiles of 16 rows x 64 elements (16 x 32
//    bytes); tiles are stored row-tile-major, K-tile-minor, [N/16][K/64][16][32], each tile
//    512 contiguous bytes: one 16-byte load per lane of a warp fetches a whole tile, where
//    the checkpoint layout would need 16 loads strided by K/2 bytes.
// 3. Scales (a separate copy; the checkpoint scales are never touched, the weight registry
//    restores from them): the 2 scales of each tile row, [N/16][K/64][16][2], 32 contiguous
//    bytes per tile in the same tile order as the values: two 16-byte loads per tile.
// 4. Words (v2; v1 stopped at 3). Each aligned 32-bit word of the tiled values (bytes 4w..4w+3
//    of a tile row, little-endian: element j of the word's 8 in bits 4j..4j+3, code bits
//    m, e0, e1, sign from low to high) is stored with its bits moved by mxfp4_arrange_word().
//    The decode kernel wants each word as four bf16 pairs, slot by slot elements (0,4), (1,5),
//    (3,7), (2,6) (low half first), each element as the bf16 bits of E2M1 * 2^-126: sign at
//    bit 15, e1 e0 m at bits 8..6 (+16 for the high half), so one multiply by 2^(scale - 1)
//    gives the value. From the v1 word that costs 15 integer instructions (each nibble's sign
//    and magnitude need different shifts); from the arranged word A it costs 9, with
//    M = 0x81C081C0 and rotr a 32-bit rotate right:
//      slot 0 = A & M                slot 1 = rotr(A, 4) & M
//      slot 2 = rotr(A, 10) & M      slot 3 = (rotr(A, 6) & 0x81808180) | (rotr(A, 14) & 0x00400040)
//    No four rotations of M tile the word, so one slot takes two. Of the arrangements with
//    this decode shape (one slot unrotated, two rotated once, one split over two rotations:
//    96 sets of rotations that tile the word, times every placement of the 8 elements), this
//    one needs the fewest bit groups to arrange a v1 word: four, each one rotation (found by
//    an exhaustive search; the quantizers and layout moves pay ~8 instructions per word). The
//    arrangement moves whole words, so it commutes with steps 1 and 2; scales are untouched.
// Requirements: K % 64 == 0 and N % 16 == 0 (N % 32 == 0 for the gate/up orders).
// In place, with no second tensor: kPlain and kGateUpInterleaved permute within closed
// groups of 16 / 32 rows (one group of scratch); kGateUpConcatenated moves whole 16-row
// tiles along the cycles of the gate/up shuffle, transposing each tile on the way (two
// tiles of scratch). Applying the permutation twice is NOT the identity; the inverse
// (mxfp4_blocks_to_checkpoint_layout) is, and the registry tracks which layout is live.
#include <cstdint>

#include "kernels/quant/minifloat.hpp"

namespace rolloutd::quant {

inline constexpr int kMxBlockSize = 32;             // elements per E8M0 scale
inline constexpr int kMxfp4BytesPerBlock = 16;      // 32 E2M1 elements
inline constexpr int kE2M1EmaxElem = 2;             // 6 = 1.5 * 2^2
inline constexpr float kE2M1Max = 6.0f;
inline constexpr uint8_t kE2M1MaxCode = 7;

// Two E2M1 codes: element 2j in bits 0..3, element 2j+1 in bits 4..7 (the checkpoint layout;
// the kernel layout's bytes are not such pairs: step 4 arranges the bits of each word).
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

// ---- kernel layout ("tiled v2") -----------------------------------------------------------

enum class Mxfp4RowOrder : uint8_t {
  kPlain = 0,               // rows keep their order
  kGateUpInterleaved = 1,   // checkpoint rows gate0, up0, gate1, up1, ... (gpt-oss gate_up_proj)
  kGateUpConcatenated = 2,  // checkpoint rows gate0..gate(I-1), up0..up(I-1)
};

inline constexpr int kMxfp4LayoutVersion = 2;
inline constexpr int kMxfp4TileRows = 16;
inline constexpr int kMxfp4TileK = 64;                 // elements
inline constexpr int kMxfp4TileRowBytes = 32;          // kMxfp4TileK / 2
inline constexpr int kMxfp4TileBytes = 512;            // 16 x 32
inline constexpr int kMxfp4TileScales = 32;            // 16 rows x 2 scales

// The row count N must be a multiple of this for the order.
RD_HOST_DEVICE inline int mxfp4_row_multiple(Mxfp4RowOrder order) {
  return order == Mxfp4RowOrder::kPlain ? kMxfp4TileRows : 2 * kMxfp4TileRows;
}

// Kernel row of checkpoint row r of an N-row expert matrix, and the inverse.
RD_HOST_DEVICE inline int64_t mxfp4_kernel_row(int64_t r, int64_t n, Mxfp4RowOrder order) {
  switch (order) {
    case Mxfp4RowOrder::kGateUpInterleaved: {
      const int64_t g = r / 32, i = r % 32;
      return g * 32 + (i & 1) * 16 + i / 2;
    }
    case Mxfp4RowOrder::kGateUpConcatenated: {
      const int64_t half = n / 2, up = r >= half ? 1 : 0, j = r - up * half;
      return (j / 16) * 32 + up * 16 + j % 16;
    }
    default:
      return r;
  }
}
RD_HOST_DEVICE inline int64_t mxfp4_checkpoint_row(int64_t kr, int64_t n, Mxfp4RowOrder order) {
  const int64_t g = kr / 32, i = kr % 32;
  switch (order) {
    case Mxfp4RowOrder::kGateUpInterleaved:
      return g * 32 + (i % 16) * 2 + i / 16;
    case Mxfp4RowOrder::kGateUpConcatenated:
      return (i / 16) * (n / 2) + g * 16 + i % 16;
    default:
      return kr;
  }
}

// Where things live in the kernel layout of one expert matrix of n rows x row_bytes (= K/2).
// Byte `b` (0 <= b < K/2) of checkpoint row r:
RD_HOST_DEVICE inline int64_t mxfp4_kernel_value_offset(int64_t r, int64_t b, int64_t n,
                                                        int64_t row_bytes, Mxfp4RowOrder order) {
  const int64_t kr = mxfp4_kernel_row(r, n, order);
  const int64_t k_tiles = row_bytes / kMxfp4TileRowBytes;
  return ((kr / kMxfp4TileRows) * k_tiles + b / kMxfp4TileRowBytes) * kMxfp4TileBytes +
         (kr % kMxfp4TileRows) * kMxfp4TileRowBytes + b % kMxfp4TileRowBytes;
}
// Scale of block kb (0 <= kb < K/32) of checkpoint row r, in the kernel scales buffer:
RD_HOST_DEVICE inline int64_t mxfp4_kernel_scale_offset(int64_t r, int64_t kb, int64_t n,
                                                        int64_t row_blocks, Mxfp4RowOrder order) {
  const int64_t kr = mxfp4_kernel_row(r, n, order);
  const int64_t k_tiles = row_blocks / 2;
  return ((kr / kMxfp4TileRows) * k_tiles + kb / 2) * kMxfp4TileScales +
         (kr % kMxfp4TileRows) * 2 + kb % 2;
}

// Step 4 of the layout: the bits of one 32-bit word (v1 order: element j in bits 4j..4j+3) in
// the arranged order, and back. Four groups of bits move together, each by one left rotation:
// v1 bits 0x76007600 by 4, 0x00770077 by 6, 0x88008800 by 10, 0x01880188 by 12 (a rotate and
// a masked OR per group). tests/unit/kernels/quant/mxfp4_test.cpp checks it against the
// bit-by-bit definition and the decode formulas above.
RD_HOST_DEVICE inline constexpr uint32_t mxfp4_rotl(uint32_t x, int r) {
  return r == 0 ? x : (x << r) | (x >> (32 - r));
}
RD_HOST_DEVICE inline constexpr uint32_t mxfp4_arrange_word(uint32_t w) {
  return (mxfp4_rotl(w, 4) & mxfp4_rotl(0x76007600u, 4)) | (mxfp4_rotl(w, 6) & mxfp4_rotl(0x00770077u, 6)) |
         (mxfp4_rotl(w, 10) & mxfp4_rotl(0x88008800u, 10)) | (mxfp4_rotl(w, 12) & mxfp4_rotl(0x01880188u, 12));
}
RD_HOST_DEVICE inline constexpr uint32_t mxfp4_unarrange_word(uint32_t a) {
  return (mxfp4_rotl(a, 28) & 0x76007600u) | (mxfp4_rotl(a, 26) & 0x00770077u) | (mxfp4_rotl(a, 22) & 0x88008800u) |
         (mxfp4_rotl(a, 20) & 0x01880188u);
}
// The word of four little-endian bytes at p (any alignment) arranged (or back), in place.
RD_HOST_DEVICE inline void mxfp4_arrange_bytes(uint8_t* p, bool arrange) {
  const uint32_t v = uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
  const uint32_t w = arrange ? mxfp4_arrange_word(v) : mxfp4_unarrange_word(v);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(w >> (8 * i));
}

// kGateUpConcatenated moves whole 16-row tiles: kernel tile k holds checkpoint tile
// mxfp4_concat_source_tile(k) (of nt = N/16 tiles), transposed into the tile layout.
RD_HOST_DEVICE inline int64_t mxfp4_concat_source_tile(int64_t k, int64_t nt) {
  return (k % 2) * (nt / 2) + k / 2;
}
RD_HOST_DEVICE inline int64_t mxfp4_concat_kernel_tile(int64_t t, int64_t nt) {
  const int64_t half = nt / 2;
  return t < half ? 2 * t : 2 * (t - half) + 1;
}

}  // namespace rolloutd::quant
