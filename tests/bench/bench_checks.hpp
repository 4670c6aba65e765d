#pragma once
// The GPU benches' fail-fast checks: a bench that cannot run its measurement says where and
// exits 2 (benches are programs, not library code: nothing to return to). For the CUDA benches
// also their shared timer and test-data hash.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "kernels/status.hpp"

#define CHECK_OK(expr)                                                          \
  do {                                                                          \
    const ::rolloutd::Status s_ = (expr);                                       \
    if (!s_.ok()) {                                                             \
      std::fprintf(stderr, "%s failed: %s\n", #expr, s_.to_string().c_str());   \
      std::exit(2);                                                             \
    }                                                                           \
  } while (0)

#ifdef __CUDACC__
#define CHECK_CUDA(expr)                                                              \
  do {                                                                                \
    const cudaError_t e_ = (expr);                                                    \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(e_), \
                   __FILE__, __LINE__);                                               \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

namespace rolloutd::bench {

// Deterministic test data: a 32-bit hash of an element index and a seed.
__device__ __forceinline__ uint32_t mix(uint64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b1u ^ seed ^ static_cast<uint32_t>(i >> 32) * 0x85ebca6bu;
  h ^= h >> 15, h *= 0x2c1b3c6du, h ^= h >> 12, h *= 0x297a2d39u, h ^= h >> 15;
  return h;
}

// Work issued on `stream`, timed by events around each run.
struct Timer {
  cudaStream_t stream;
  // Median of `iters` timed runs after `warmup` untimed ones, in milliseconds.
  double median_ms(const std::function<void()>& run, int warmup, int iters) {
    for (int i = 0; i < warmup; ++i) run();
    cudaEvent_t a, b;
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
    std::vector<double> t;
    for (int i = 0; i < iters; ++i) {
      CHECK_CUDA(cudaEventRecord(a, stream));
      run();
      CHECK_CUDA(cudaEventRecord(b, stream));
      CHECK_CUDA(cudaEventSynchronize(b));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms);
    }
    CHECK_CUDA(cudaEventDestroy(a));
    CHECK_CUDA(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

}  // namespace rolloutd::bench
#endif
