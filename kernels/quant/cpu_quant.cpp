// The CPU reference of every quantization op: one block at a time, straight from the rules in
// the format headers. The CUDA kernels are held to it bit for bit
// (tests/unit/kernels/quant/quant_parity_test.cpp), and it is held to independent NumPy and
// PyTorch implementations (quant_golden_test.cpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/quant/quant_plan.hpp"

namespace rolloutd::quant::detail {
namespace {

void store(void* out, bool bf16, int64_t i, uint32_t bits) {
  if (bf16) static_cast<uint16_t*>(out)[i] = f32_to_bf16_bits(f32_from_bits(bits));
  else static_cast<uint32_t*>(out)[i] = bits;
}

}  // namespace

void cpu_quantize_mx(const MxQuantPlan& p) {
  const StridedRows& x = p.x;
  const int emax = p.fp4 ? kE2M1EmaxElem : kE4M3EmaxElem;
  const int64_t row_bytes = p.num_kb * kMxfp4BytesPerBlock;
  for (int64_t r = 0; r < x.rows; ++r) {
    const int64_t ro = x.row_offset(r);
    const int64_t expert = p.kernel_layout ? r / p.rows_per_expert : 0;
    const int64_t lr = p.kernel_layout ? r % p.rows_per_expert : 0;
    for (int64_t kb = 0; kb < p.num_kb; ++kb) {
      const int64_t k0 = kb * kMxBlockSize;
      const int64_t n = std::min<int64_t>(kMxBlockSize, x.cols - k0);
      uint32_t v[kMxBlockSize] = {};  // padding past K is +0: it never raises amax
      uint32_t amax = 0;
      for (int64_t i = 0; i < n; ++i) {
        v[i] = x.load_bits(ro, k0 + i);
        amax = std::max(amax, v[i] & kF32AbsMask);  // NaN/Inf bits sort above every finite
      }
      const E8M0 s = mx_scale_from_amax(amax, emax);
      const bool poisoned = e8m0_is_nan(s);
      const int se = e8m0_exponent(s);
      p.scales[r * p.num_kb + kb] = s;
      if (p.fp4) {
        uint8_t codes[kMxfp4BytesPerBlock];
        for (int j = 0; j < kMxfp4BytesPerBlock; ++j)
          codes[j] = poisoned ? 0 : fp4x2_pack(e2m1_encode(v[2 * j], se), e2m1_encode(v[2 * j + 1], se)).bits;
        // The kernel layout keeps each 4-byte word together (a 16-byte block never straddles a
        // tile row) and stores it arranged.
        for (int j = 0; j < kMxfp4BytesPerBlock; j += 4) {
          const int64_t byte = kb * kMxfp4BytesPerBlock + j;
          Fp4x2* dst = p.kernel_layout ? p.blocks + expert * p.rows_per_expert * row_bytes +
                                             mxfp4_kernel_value_offset(lr, byte, p.rows_per_expert, row_bytes, p.order)
                                       : p.blocks + r * row_bytes + byte;
          std::memcpy(dst, codes + j, 4);
          if (p.kernel_layout) mxfp4_arrange_bytes(reinterpret_cast<uint8_t*>(dst), true);
        }
        if (p.kernel_layout)
          p.kernel_scales[expert * p.rows_per_expert * p.num_kb +
                          mxfp4_kernel_scale_offset(lr, kb, p.rows_per_expert, p.num_kb, p.order)] = s;
      } else {
        for (int64_t i = 0; i < n; ++i)
          p.q[r * x.cols + k0 + i] = poisoned ? E4M3{0} : e4m3_encode(v[i], se);
      }
    }
  }
}

void cpu_dequantize_mx(const MxDequantPlan& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t k = 0; k < p.cols; ++k) {
      const int64_t kb = k / kMxBlockSize;
      const E8M0 s = p.scales[r * p.num_kb + kb];
      uint32_t bits = kF32CanonicalNan;
      if (!e8m0_is_nan(s)) {
        if (p.fp4) {
          const Fp4x2 b = p.blocks[r * p.num_kb * kMxfp4BytesPerBlock + k / 2];
          bits = e2m1_decode_bits(k % 2 == 0 ? fp4x2_even(b) : fp4x2_odd(b), e8m0_exponent(s));
        } else {
          bits = e4m3_decode_bits(p.q[r * p.cols + k], e8m0_exponent(s));
        }
      }
      store(p.out, p.out_bf16, r * p.cols + k, bits);
    }
  }
}

namespace {

// Step 4 of the kernel layout on `bytes` (a multiple of 4) bytes from a word boundary.
void arrange_words(Fp4x2* p, int64_t bytes, bool arrange) {
  for (int64_t i = 0; i < bytes; i += 4) mxfp4_arrange_bytes(reinterpret_cast<uint8_t*>(p + i), arrange);
}

// kPlain, kGateUpInterleaved: one closed group of rows at a time through a group-sized
// scratch buffer (the permutation maps the bytes of rows [g*G, (g+1)*G) onto themselves).
void layout_by_groups(const LayoutPlan& p) {
  const int64_t group = mxfp4_row_multiple(p.order);
  const int64_t span = group * p.row_bytes;
  std::vector<Fp4x2> scratch(static_cast<size_t>(span));
  for (int64_t e = 0; e < p.experts; ++e) {
    Fp4x2* mat = p.blocks + e * p.n * p.row_bytes;
    for (int64_t g0 = 0; g0 < p.n; g0 += group) {
      Fp4x2* base = mat + g0 * p.row_bytes;
      std::memcpy(scratch.data(), base, static_cast<size_t>(span));
      if (!p.to_kernel) arrange_words(scratch.data(), span, false);
      for (int64_t lr = 0; lr < group; ++lr) {
        for (int64_t b = 0; b < p.row_bytes; ++b) {
          const int64_t kernel_pos =
              mxfp4_kernel_value_offset(g0 + lr, b, p.n, p.row_bytes, p.order) - g0 * p.row_bytes;
          const int64_t ckpt_pos = lr * p.row_bytes + b;
          if (p.to_kernel) base[kernel_pos] = scratch[static_cast<size_t>(ckpt_pos)];
          else base[ckpt_pos] = scratch[static_cast<size_t>(kernel_pos)];
        }
      }
      if (p.to_kernel) arrange_words(base, span, true);
    }
  }
}

// One 16-row tile between checkpoint rows [16][row_bytes] and the kernel tiles [K/64][16][32]
// (words arranged); src is scratch and may be changed.
void transpose_tile(Fp4x2* src, Fp4x2* dst, int64_t row_bytes, bool to_kernel) {
  const int64_t tile = kMxfp4TileRows * row_bytes;
  if (!to_kernel) arrange_words(src, tile, false);
  for (int64_t i = 0; i < kMxfp4TileRows; ++i) {
    for (int64_t b = 0; b < row_bytes; ++b) {
      const int64_t ckpt = i * row_bytes + b;
      const int64_t kern = (b / kMxfp4TileRowBytes) * kMxfp4TileBytes + i * kMxfp4TileRowBytes +
                           b % kMxfp4TileRowBytes;
      if (to_kernel) dst[kern] = src[ckpt];
      else dst[ckpt] = src[kern];
    }
  }
  if (to_kernel) arrange_words(dst, tile, true);
}

// kGateUpConcatenated: whole tiles follow the cycles of the gate/up shuffle; each move
// transposes the tile. Scratch: the cycle's first tile and the tile in flight.
void layout_by_tile_cycles(const LayoutPlan& p) {
  const int64_t nt = p.n / kMxfp4TileRows, tile = kMxfp4TileRows * p.row_bytes;
  std::vector<Fp4x2> saved(static_cast<size_t>(tile)), work(static_cast<size_t>(tile));
  // Forward: kernel tile k receives checkpoint tile source(k); inverse: checkpoint tile t
  // receives kernel tile kernel(t).
  auto next = [&](int64_t k) {
    return p.to_kernel ? mxfp4_concat_source_tile(k, nt) : mxfp4_concat_kernel_tile(k, nt);
  };
  std::vector<char> done(static_cast<size_t>(nt));
  for (int64_t e = 0; e < p.experts; ++e) {
    Fp4x2* base = p.blocks + e * p.n * p.row_bytes;
    std::fill(done.begin(), done.end(), 0);
    for (int64_t start = 0; start < nt; ++start) {
      if (done[static_cast<size_t>(start)]) continue;
      std::memcpy(saved.data(), base + start * tile, static_cast<size_t>(tile));
      int64_t cur = start;
      for (int64_t k = next(start); k != start; cur = k, k = next(k)) {
        std::memcpy(work.data(), base + k * tile, static_cast<size_t>(tile));
        transpose_tile(work.data(), base + cur * tile, p.row_bytes, p.to_kernel);
        done[static_cast<size_t>(cur)] = 1;
      }
      transpose_tile(saved.data(), base + cur * tile, p.row_bytes, p.to_kernel);
      done[static_cast<size_t>(cur)] = 1;
    }
  }
}

}  // namespace

void cpu_layout(const LayoutPlan& p) {
  if (p.order == Mxfp4RowOrder::kGateUpConcatenated) layout_by_tile_cycles(p);
  else layout_by_groups(p);
}

void cpu_scales_layout(const ScalesLayoutPlan& p) {
  for (int64_t e = 0; e < p.experts; ++e) {
    const int64_t base = e * p.n * p.row_blocks;
    for (int64_t r = 0; r < p.n; ++r) {
      for (int64_t kb = 0; kb < p.row_blocks; ++kb) {
        const int64_t ckpt = base + r * p.row_blocks + kb;
        const int64_t kern = base + mxfp4_kernel_scale_offset(r, kb, p.n, p.row_blocks, p.order);
        if (p.to_kernel) p.dst[kern] = p.src[ckpt];
        else p.dst[ckpt] = p.src[kern];
      }
    }
  }
}

void cpu_quantize_fp8(const Fp8QuantPlan& p) {
  const StridedRows& x = p.x;
  const Fp8Geometry& g = p.g;
  const int64_t scale_rows = x.rows == 0 ? 0 : g.num_scale_rows();
  for (int64_t sr = 0; sr < scale_rows; ++sr) {
    const int64_t batch = sr / g.row_blocks_per_batch, rb = sr % g.row_blocks_per_batch;
    const int64_t r0 = batch * g.rows_per_batch + rb * g.block_rows;
    const int64_t r1 = std::min(r0 + g.block_rows, (batch + 1) * g.rows_per_batch);
    for (int64_t kb = 0; kb < g.num_kb; ++kb) {
      const int64_t k0 = kb * kFp8BlockK, k1 = std::min<int64_t>(k0 + kFp8BlockK, g.cols);
      uint32_t amax = 0;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t ro = x.row_offset(r);
        for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, x.load_bits(ro, k) & kF32AbsMask);
      }
      const E8M0 s = ue8m0_scale_from_quotient(amax, f32_from_bits(amax) / kE4M3Max);
      const bool poisoned = e8m0_is_nan(s);
      if (p.scales) p.scales[sr * g.num_kb + kb] = f32_from_bits(e8m0_decode_bits(s));
      if (p.packed) p.packed[sr * g.packed_row_bytes + kb] = s;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t ro = x.row_offset(r);
        for (int64_t k = k0; k < k1; ++k)
          p.q[r * g.cols + k] = poisoned ? E4M3{0} : e4m3_encode(x.load_bits(ro, k), e8m0_exponent(s));
      }
    }
    if (p.packed)
      for (int64_t kb = g.num_kb; kb < g.packed_row_bytes; ++kb)
        p.packed[sr * g.packed_row_bytes + kb] = E8M0{0};
  }
}

void cpu_dequantize_fp8(const Fp8DequantPlan& p) {
  const Fp8Geometry& g = p.g;
  for (int64_t r = 0; r < g.rows; ++r) {
    const int64_t sr = g.scale_row(r);
    for (int64_t k = 0; k < g.cols; ++k) {
      const int64_t kb = k / kFp8BlockK;
      const E4M3 c = p.q[r * g.cols + k];
      uint32_t bits;
      if (p.packed) {
        const E8M0 s = p.packed[sr * g.packed_row_bytes + kb];
        bits = e8m0_is_nan(s) ? kF32CanonicalNan : e4m3_decode_bits(c, e8m0_exponent(s));
      } else {
        const float v = f32_from_bits(e4m3_decode_bits(c, 0)) * p.scales[sr * g.num_kb + kb];
        bits = std::isnan(v) ? kF32CanonicalNan : f32_bits(v);
      }
      store(p.out, p.out_bf16, r * g.cols + k, bits);
    }
  }
}

}  // namespace rolloutd::quant::detail
