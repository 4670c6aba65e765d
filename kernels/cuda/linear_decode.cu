// BF16 x BF16 -> FP32 linear at decode shapes (1-4 rows of x, up to 8,192 outputs):
// y[t, n] = sum_k x[t, k] w[n, k].
//
// NOTES (why not cuBLAS here): at one or a few rows a projection is a stream of its weight, and
// cuBLAS's fastest candidate at these shapes (split-K plus a separate reduce kernel) ran at about
// half of HBM speed in graphs, two launches that each wait for the whole kernel ahead
// (tests/bench/NOTES.md, "Dense GEMMs at decode shapes"). This kernel is a plain GEMV:
// - one warp per weight row, 8 rows a CTA; a lane loads 16 bytes (8 K) per 512-byte run of the row,
//   the warp's loads one whole contiguous run each, up to 16 runs (8 KB of the row) in flight per
//   warp before any arithmetic, no shared memory (measured at 1.6-1.8 x the weight's HBM floor on the
//   decoder's q and o shapes, 5.5 x on the small kv_proj: tests/bench/NOTES.md);
// - launched as a programmatic dependent (cuda_common.cuh), it issues its first weight loads before
//   it waits for the kernel ahead: the weights are not that kernel's output, so the first round trip
//   to HBM overlaps its tail. Contract (backend.hpp, linear): no kernel still running when this one
//   is launched may write w;
// - FP32 products and sums: each lane sums its elements in K order, then a fixed xor-shuffle tree
//   sums the lanes: deterministic, and a row's result is the same bits whatever the number of rows
//   (1-4) in the call.
// A mma.sync version (8 or 16 weight rows a CTA as the A operand, tokens as B, up to 32 rows) was
// measured first: faster than cuBLAS at one row on the q/k/v shapes only, slower at 32 rows, where
// every CTA re-reads all of x (tests/bench/NOTES.md).
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_ops.hpp"

namespace rolloutd::cuda {
namespace {

constexpr int kGvWarps = 8;    // rows per CTA, one per warp
constexpr int kGvRuns = 16;    // 512-byte runs of a row each lane has in flight (8 KB per warp)
constexpr int kGvMaxRows = 4;  // rows of x
// Larger outputs (LM heads) stay with cuBLAS: at N = 16,384 it streamed faster (24.1 against
// 25.4 us a call, tests/bench/NOTES.md).
constexpr int64_t kGvMaxN = 8192;

// A weight vector, streamed: not kept in L1 (x's rows are, for the other warps).
__device__ __forceinline__ uint4 ld_weight(const uint16_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float lo_f32(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_f32(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

// acc += the 8 products of a weight vector and an x vector, in K order.
__device__ __forceinline__ float dot8(float acc, const uint4& w, const uint4& x) {
  acc = fmaf(lo_f32(w.x), lo_f32(x.x), acc);
  acc = fmaf(hi_f32(w.x), hi_f32(x.x), acc);
  acc = fmaf(lo_f32(w.y), lo_f32(x.y), acc);
  acc = fmaf(hi_f32(w.y), hi_f32(x.y), acc);
  acc = fmaf(lo_f32(w.z), lo_f32(x.z), acc);
  acc = fmaf(hi_f32(w.z), hi_f32(x.z), acc);
  acc = fmaf(lo_f32(w.w), lo_f32(x.w), acc);
  acc = fmaf(hi_f32(w.w), hi_f32(x.w), acc);
  return acc;
}

template <int M>
__global__ void __launch_bounds__(kGvWarps * 32, M == 1 ? 3 : 2)
    linear_gemv_kernel(float* y, const uint16_t* x, const uint16_t* w, int n, int k) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * kGvWarps + warp;
  const bool valid = row < n;
  const uint16_t* wrow = w + static_cast<int64_t>(valid ? row : n - 1) * k;
  uint4 wv[kGvRuns];
  auto load = [&](int base) {
#pragma unroll
    for (int r = 0; r < kGvRuns; ++r) {
      const int e = base + (r * 32 + lane) * 8;
      wv[r] = e < k ? ld_weight(wrow + e) : make_uint4(0, 0, 0, 0);
    }
  };
  load(0);  // before the wait: weights are not the kernel ahead's output
  pdl_begin();
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;
  for (int base = 0; base < k; base += kGvRuns * 256) {
    if (base != 0) load(base);
#pragma unroll
    for (int r = 0; r < kGvRuns; ++r) {
      const int e = base + (r * 32 + lane) * 8;
      if (e >= k) break;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        // x is the kernel ahead's output: an ordinary load after the wait, never __ldg.
        const uint4 xv = *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * k + e);
        acc[m] = dot8(acc[m], wv[r], xv);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = warp_sum(acc[m]);
  if (lane == 0 && valid) {
#pragma unroll
    for (int m = 0; m < M; ++m) y[static_cast<int64_t>(m) * n + row] = acc[m];
  }
}

// ROLLOUTD_DENSE_DECODE=0: cuBLAS for every shape (an A/B, or to rule this kernel out).
bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("ROLLOUTD_DENSE_DECODE");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return on;
}

}  // namespace

bool linear_decode_applies(const TensorView& y, const TensorView& x, const TensorView& w) {
  if (!enabled() || w.dtype != DType::kBF16 || x.dtype != DType::kBF16 || y.dtype != DType::kF32) return false;
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t m = k > 0 ? x.numel() / k : 0;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return m >= 1 && m <= kGvMaxRows && k % 8 == 0 && k <= (1 << 28) && n >= 1 && n <= kGvMaxN &&
         aligned(x.data) && aligned(w.data);
}

Status linear_decode(const ExecContext& ctx, TensorView y, TensorView x, TensorView w) {
  const int n = static_cast<int>(w.size(0)), k = static_cast<int>(w.size(1));
  const int m = k > 0 ? static_cast<int>(x.numel() / k) : 0;
  // The launch below handles 1-4 rows only; linear calls this after linear_decode_applies().
  if (m < 1 || m > kGvMaxRows || k % 8 != 0)
    return Status(ErrorCode::kInvalidArgument, "linear_decode: 1-4 rows of x and K % 8 == 0 only", "x");
  const dim3 grid(static_cast<unsigned int>((n + kGvWarps - 1) / kGvWarps));
  auto* yp = y.as<float>();
  const auto* xp = x.as<const uint16_t>();
  const auto* wp = w.as<const uint16_t>();
  auto launch = [&](auto kernel) {
    (void)launch_dependent(kernel, grid, kGvWarps * 32, 0, stream_of(ctx), yp, xp, wp, n, k);
  };
  switch (m) {
    case 1: launch(linear_gemv_kernel<1>); break;
    case 2: launch(linear_gemv_kernel<2>); break;
    case 3: launch(linear_gemv_kernel<3>); break;
    default: launch(linear_gemv_kernel<4>); break;
  }
  RD_CUDA_CHECK_LAUNCH("linear_gemv_kernel");
  return Status::Ok();
}

}  // namespace rolloutd::cuda
