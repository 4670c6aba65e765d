#pragma once
// The GPU benches' fail-fast checks: a bench that cannot run its measurement says where and
// exits 2 (benches are programs, not library code: nothing to return to).
#include <cstdio>
#include <cstdlib>

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
#endif
