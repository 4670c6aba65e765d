#pragma once
// What every CUDA translation unit of the backend shares: turning CUDA errors into a
// Status, selecting the context's device for the duration of a call, warp reductions.
// No framework headers here (nvcc 13 rejects spdlog/fmt in C++20 mode).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/backend.hpp"

namespace rolloutd::cuda {

// kCudaError with the call, its location and CUDA's own name for the error. Clears the
// thread's last-error slot so the next check does not report this failure again; a
// sticky error (an illegal address in a kernel) survives that and poisons the context,
// which only a process restart clears, so the daemon treats it as fatal.
Status error_status(cudaError_t err, const char* expr, const char* file, int line);

// Makes the context's device current for the lifetime of the guard and restores the
// caller's device afterwards (the caller's thread may be driving another GPU).
class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  Status set(int device);

 private:
  int previous_ = 0;
  bool changed_ = false;
};

inline cudaStream_t stream_of(const ExecContext& ctx) {
  return static_cast<cudaStream_t>(ctx.stream);
}

inline unsigned int blocks_for(int64_t n, int threads, int64_t max_blocks = 1 << 20) {
  int64_t b = (n + threads - 1) / threads;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned int>(b < 1 ? 1 : b);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

}  // namespace rolloutd::cuda

// NCCL's checks.h pattern: check, clear, return a typed status with context.
#define RD_CUDA_CHECK(expr)                                                               \
  do {                                                                                    \
    const cudaError_t rd_cuda_err_ = (expr);                                              \
    if (rd_cuda_err_ != cudaSuccess)                                                      \
      return ::rolloutd::cuda::error_status(rd_cuda_err_, #expr, __FILE__, __LINE__);     \
  } while (0)

// After every <<<...>>> (`what` is a string literal naming the kernel): a bad launch
// configuration is reported here, a fault inside the kernel only at a later
// synchronising call.
#define RD_CUDA_CHECK_LAUNCH(what)                                                        \
  do {                                                                                    \
    const cudaError_t rd_cuda_err_ = cudaGetLastError();                                  \
    if (rd_cuda_err_ != cudaSuccess)                                                      \
      return ::rolloutd::cuda::error_status(rd_cuda_err_, "launch of " what, __FILE__,   \
                                            __LINE__);                                    \
  } while (0)
