#pragma once
// bfloat16 <-> float32 on the host (and device, via __host__ __device__ when nvcc compiles it).
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define RD_HOST_DEVICE __host__ __device__
#else
#define RD_HOST_DEVICE
#endif

namespace rolloutd {

RD_HOST_DEVICE inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even; NaN stays a (quiet) NaN with its sign.
RD_HOST_DEVICE inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace rolloutd
