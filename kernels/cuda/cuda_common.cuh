#pragma once
// What every CUDA translation unit of the backend shares: turning CUDA errors into a
// Status, selecting the context's device for the duration of a call, warp reductions.
// No framework headers here (nvcc 13 rejects spdlog/fmt in C++20 mode).
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <utility>

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

// ---- cp.async (sm_80+): global -> shared copies that do not pass through registers ---------------
// Complete per thread at cp_async_wait*(); other threads see the bytes after a barrier that
// follows the wait.
// 16 bytes through L2 only (.cg).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gmem) : "memory");
}
// 16 bytes through L1 (.ca: for bytes that other threads of the SM read again), or 16 zero bytes
// where !valid (gmem is then not read, but must still be a valid address).
__device__ __forceinline__ void cp_async16_ca_zfill(void* smem, const void* gmem, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
// 16 bytes through L2 only, or 16 zero bytes where !valid (gmem not read, but a valid address).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---- tensor cores (sm_80+): mma.sync and ldmatrix ----------------------------------------------
// d += a * b, m16n8k16, BF16 inputs, FP32 accumulators (PTX ISA "Matrix Fragments for
// mma.m16n8k16": a row-major 16 x 16, b column-major 16 x 8).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Four 8 x 8 b16 matrices from shared memory: lanes 8m .. 8m + 7 give the row addresses of
// matrix m (16 bytes each); register m of lane l holds row l / 4, columns 2 (l % 4) and + 1
// (.trans: column l / 4, rows 2 (l % 4) and + 1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// ---- programmatic dependent launch (PDL, sm_90) ------------------------------------------------
// A decode step is ~15 short kernels a layer (2-15 us each at small batches) back to back in one
// stream; between two of them the GPU drains the first grid before it launches the second. A
// kernel launched by launch_dependent() may instead be launched while the kernel ahead of it in
// the stream still runs, once every CTA of that kernel has called pdl_trigger() (or exited); its
// CTAs then sit in pdl_wait() until that kernel has completed and its writes are visible. So a
// kernel launched this way must call pdl_wait() before it reads or writes any global memory
// that another kernel touches, in every CTA (pdl_begin() at the top does both in that order),
// and read the previous kernels' outputs with ordinary or L2 loads, not __ldg (an invariant load
// the compiler may hoist above the wait). Ordering stays transitive: every CTA waits, so a kernel
// completes only after the one ahead of it did, and waiting for the kernel just ahead also waits
// for everything before it. Without the launch attribute (or before sm_90) both instructions are
// no-ops; cuBLAS's kernels and copies between ours keep the ordinary full ordering.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_begin() {
  pdl_wait();
  pdl_trigger();
}

// ROLLOUTD_PDL=0 launches every kernel with the ordinary ordering, the MoE down GEMM's too (for
// an A/B, or to rule PDL out when chasing a race); read once per process.
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("ROLLOUTD_PDL");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent of the kernel ahead
// of it (see above: the kernel must begin with pdl_wait()). Errors also land in the thread's
// last-error slot, so RD_CUDA_CHECK_LAUNCH after it reports them as after a <<<...>>>.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace rolloutd::cuda

// NCCL's checks.h pattern: check, clear, return a typed status with context.
#define RD_CUDA_CHECK(expr)                                                               \
  do {                                                                                    \
    const cudaError_t rd_cuda_err_ = (expr);                                              \
    if (rd_cuda_err_ != cudaSuccess)                                                      \
      return ::rolloutd::cuda::error_status(rd_cuda_err_, #expr, __FILE__, __LINE__);     \
  } while (0)

// Opt `kernel` in to `bytes` of dynamic shared memory once per device (the attribute is set for
// the current device; `opted` holds a bit per device index, larger indices set it every call).
namespace rolloutd::cuda {
template <typename Kernel>
inline Status opt_in_smem(std::atomic<uint64_t>& opted, Kernel* kernel, int bytes, int device) {
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (opted.load(std::memory_order_relaxed) & bit) != 0) return Status::Ok();
  RD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  opted.fetch_or(bit, std::memory_order_relaxed);
  return Status::Ok();
}
}  // namespace rolloutd::cuda

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
