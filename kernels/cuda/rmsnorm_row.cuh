#pragma once
// One RMSNorm row held in registers as float4s, shared by add_rmsnorm (kernels/cuda/elementwise.cu)
// and the MoE combine that folds the decoder's next add_rmsnorm into its pass
// (kernels/moe/cuda_moe_experts.cu): one source, so both round and reduce in exactly the same
// order and the fused op is bit for bit the unfused sequence.
#include <cstdint>

#include "kernels/bf16.hpp"
#include "kernels/cuda/cuda_common.cuh"

namespace rolloutd::cuda {

// Row `row` of x ([rows, hidden] f32), kPer float4s per thread, blockDim.x threads (a multiple of
// 32, at most 32 warps): with kAdd, x += r (load_r(idx): r's float4 idx of this row, called once
// per idx after every x load of the thread is issued) written back to x; then the sum of squares
// by a block reduction and w * (x * rsqrt(mean + eps)) written to out (kOut) and/or out_bf16
// rounded as `convert` rounds (kBf16). Every thread reads its x before the barrier and writes
// after it, so out may alias x. Needs hidden % 4 == 0, 16-byte aligned rows and w, an 8-byte
// aligned out_bf16, hidden / 4 <= kPer * blockDim.x.
template <int kPer, bool kAdd, bool kOut, bool kBf16, typename LoadR>
__device__ __forceinline__ void rmsnorm_vec_row(float* out, uint16_t* out_bf16, float* x, LoadR&& load_r,
                                                const float* __restrict__ w, int64_t row, int64_t hidden,
                                                float eps) {
  __shared__ float warp_partial[32];
  const int n4 = static_cast<int>(hidden / 4);
  float4* xr = reinterpret_cast<float4*>(x + row * hidden);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  float4 v[kPer];
  float ss = 0.0f;  // (kOut || kBf16)
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = threadIdx.x + i * blockDim.x;
    v[i] = idx < n4 ? xr[idx] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  if constexpr (kAdd) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = threadIdx.x + i * blockDim.x;
      if (idx >= n4) continue;
      const float4 b = load_r(idx);
      v[i] = make_float4(v[i].x + b.x, v[i].y + b.y, v[i].z + b.z, v[i].w + b.w);  // add's one rounding
      xr[idx] = v[i];
    }
  }
  if constexpr (kOut || kBf16) {  // else the add alone
#pragma unroll
    for (int i = 0; i < kPer; ++i) ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
    ss = warp_sum(ss);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) warp_partial[warp] = ss;
    __syncthreads();  // every thread has read its x before any writes out (out may alias x)
    float total = 0.0f;
    for (int i = 0; i < warps; ++i) total += warp_partial[i];
    const float inv = rsqrtf(total / static_cast<float>(hidden) + eps);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = threadIdx.x + i * blockDim.x;
      if (idx >= n4) continue;
      const float4 g = __ldg(w4 + idx);
      const float4 o =
          make_float4(g.x * (v[i].x * inv), g.y * (v[i].y * inv), g.z * (v[i].z * inv), g.w * (v[i].w * inv));
      if constexpr (kOut) reinterpret_cast<float4*>(out + row * hidden)[idx] = o;
      if constexpr (kBf16) {
        const uint2 packed = make_uint2(
            static_cast<uint32_t>(f32_to_bf16_bits(o.x)) | (static_cast<uint32_t>(f32_to_bf16_bits(o.y)) << 16),
            static_cast<uint32_t>(f32_to_bf16_bits(o.z)) | (static_cast<uint32_t>(f32_to_bf16_bits(o.w)) << 16));
        reinterpret_cast<uint2*>(out_bf16 + row * hidden)[idx] = packed;  // little-endian: .x first
      }
    }
  }
}

// The thread count and float4s per thread rmsnorm_vec_row takes for a row of `hidden` floats
// (float4s rounded up to a warp, at most 256 threads, then 1, 2, 4 or 8 per thread); per 0: the
// row does not fit (hidden / 4 > 2,048). The same choice everywhere the row is reduced, so the
// reduction order (hence the bits) does not depend on which op normalised the row.
struct RmsVecShape {
  int threads = 0, per = 0;
};
inline RmsVecShape rms_vec_shape(int64_t hidden) {
  const int64_t n4 = hidden / 4;
  if (hidden % 4 != 0 || n4 > 8 * 256 || n4 == 0) return {};
  const int threads = static_cast<int>(n4 < 256 ? (n4 + 31) / 32 * 32 : 256);
  const int64_t need = (n4 + threads - 1) / threads;
  return {threads, need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : 8};
}

}  // namespace rolloutd::cuda
