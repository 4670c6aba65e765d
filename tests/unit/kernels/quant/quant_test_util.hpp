#pragma once
// Shared by the quantization tests: deterministic inputs, host views, the golden-file reader
// (format: tests/reference/quant/golden_format.py) and, in CUDA builds, a device buffer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/bf16.hpp"
#include "kernels/quant/quant_ops.hpp"

#if defined(ROLLOUTD_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace rolloutd::quant::test {

inline const ExecContext kCpu{Device::cpu(), nullptr};

#define EXPECT_STATUS(expr, code_, field_)               \
  do {                                                   \
    const ::rolloutd::Status st_ = (expr);               \
    EXPECT_EQ(st_.code(), code_) << st_.to_string();     \
    EXPECT_EQ(st_.field(), field_) << st_.to_string();   \
  } while (0)

#define ASSERT_OK(expr)                                  \
  do {                                                   \
    const ::rolloutd::Status st_ = (expr);               \
    ASSERT_TRUE(st_.ok()) << st_.to_string();            \
  } while (0)

// SplitMix64: the same stream on every platform (std:: distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  // Heavy-tailed: a Cauchy-like magnitude (ratio of uniforms) times 2^[-30, 30), random sign,
  // with exact zeros, signed zeros, and occasional huge and subnormal values.
  float heavy() {
    const uint64_t pick = next() % 64;
    if (pick == 0) return 0.0f;
    if (pick == 1) return -0.0f;
    if (pick == 2) return (next() & 1 ? 1.0f : -1.0f) * std::ldexp(1.0f, -130 - static_cast<int>(below(10)));
    if (pick == 3) return (next() & 1 ? 1.0f : -1.0f) * 1.0e38f * static_cast<float>(uniform());
    const double t = (uniform() - 0.5) / (uniform() + 1e-3);
    return static_cast<float>(std::ldexp(t, static_cast<int>(below(60)) - 30));
  }

 private:
  uint64_t state_;
};

inline uint16_t bf16(float f) { return f32_to_bf16_bits(f); }
inline float from_bf16(uint16_t b) { return bf16_bits_to_f32(b); }
inline uint32_t bits(float f) { return f32_bits(f); }

template <class T>
TensorView view(std::vector<T>& v, DType dtype, Shape shape, Device device = {}) {
  return TensorView::contiguous(v.data(), dtype, shape, device);
}

// Random bf16 values (as bits) with heavy tails; every row may use a different magnitude.
inline std::vector<uint16_t> random_bf16(Rng& rng, int64_t n) {
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& b : v) b = bf16(rng.heavy());
  return v;
}
inline std::vector<float> widen(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = from_bf16(b[i]);
  return f;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- goldens ------------------------------------------------------------------------------

struct GoldenTensor {
  std::string dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
  template <class T>
  std::vector<T> as() const {
    std::vector<T> v(bytes.size() / sizeof(T));
    std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
    return v;
  }
};
using Golden = std::map<std::string, GoldenTensor>;

// ctest sets ROLLOUTD_SOURCE_ROOT; a test binary run by hand falls back to the checkout it
// was configured from.
inline std::string source_root() {
  const char* root = std::getenv("ROLLOUTD_SOURCE_ROOT");
#if defined(ROLLOUTD_QUANT_SOURCE_ROOT)
  if (root == nullptr) return ROLLOUTD_QUANT_SOURCE_ROOT;
#endif
  return root ? root : ".";
}

// Reads a golden file; false (and a reason) when missing or malformed.
inline bool read_golden(const std::string& path, Golden* out, std::string* why) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    *why = "cannot open " + path;
    return false;
  }
  std::vector<char> d((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  size_t o = 0;
  auto take = [&](void* dst, size_t n) {
    if (o + n > d.size()) return false;
    std::memcpy(dst, d.data() + o, n);
    o += n;
    return true;
  };
  char magic[8];
  uint32_t count = 0;
  if (!take(magic, 8) || std::memcmp(magic, "RDQGOLD1", 8) != 0 || !take(&count, 4)) {
    *why = path + ": not a golden file";
    return false;
  }
  for (uint32_t i = 0; i < count; ++i) {
    uint16_t len = 0;
    std::string name, dtype;
    if (!take(&len, 2)) break;
    name.resize(len);
    if (!take(name.data(), len) || !take(&len, 2)) break;
    dtype.resize(len);
    uint8_t rank = 0;
    if (!take(dtype.data(), len) || !take(&rank, 1) || rank > kMaxDims) break;
    int64_t dims[kMaxDims] = {};
    uint64_t nbytes = 0;
    if (!take(dims, 8u * rank) || !take(&nbytes, 8)) break;
    GoldenTensor t{dtype, Shape::of(dims, rank), std::vector<uint8_t>(nbytes)};
    if (!take(t.bytes.data(), nbytes)) break;
    (*out)[name] = std::move(t);
  }
  if (out->size() != count || o != d.size()) {
    *why = path + ": truncated or malformed after " + std::to_string(out->size()) + " records";
    return false;
  }
  return true;
}

// ---- device buffers (CUDA builds) -----------------------------------------------------------

inline bool have_gpu() { return cuda_backend() != nullptr && cuda_device_count() > 0; }

#if defined(ROLLOUTD_WITH_CUDA)
// Device copy of a host vector; freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) {
      EXPECT_EQ(cudaMalloc(&ptr_, bytes_), cudaSuccess);
    }
    if (ptr_) {
      EXPECT_EQ(cudaMemset(ptr_, 0xA5, bytes_), cudaSuccess);  // poison
    }
  }
  template <class T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    if (bytes_ > 0) {
      EXPECT_EQ(cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) (void)cudaFree(ptr_);
  }
  void* get() const { return ptr_; }
  TensorView view(DType dtype, Shape shape) const {
    return TensorView::contiguous(ptr_, dtype, shape, Device::cuda(0));
  }
  template <class T>
  std::vector<T> download() const {
    std::vector<T> v(bytes_ / sizeof(T));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (bytes_ > 0) {
      EXPECT_EQ(cudaMemcpy(v.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return v;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};
inline const ExecContext kGpu{Device::cuda(0), nullptr};
#endif

// Buffers on one backend (host memory, or device 0), poisoned with 0xA5 so that an output a
// backend forgets to write shows up; read() brings any contiguous view back to the host.
class Arena {
 public:
  explicit Arena(bool gpu) : gpu_(gpu) {}
  bool gpu() const { return gpu_; }
  ExecContext ctx() const { return gpu_ ? ExecContext{Device::cuda(0), nullptr} : ExecContext{Device::cpu(), nullptr}; }

  // A contiguous view `offset` bytes into a fresh buffer, holding `init` when given.
  TensorView make(DType dtype, Shape shape, const void* init = nullptr, size_t offset = 0) {
    const size_t nbytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
    std::vector<uint8_t> host(offset + nbytes + 16, 0xA5);
    if (init != nullptr && nbytes > 0) std::memcpy(host.data() + offset, init, nbytes);
    void* base = nullptr;
    if (gpu_) {
#if defined(ROLLOUTD_WITH_CUDA)
      dev_.push_back(std::make_unique<DeviceBuffer>(host));
      base = dev_.back()->get();
#else
      ADD_FAILURE() << "GPU arena in a build without CUDA";
#endif
    } else {
      host_.push_back(std::make_unique<std::vector<uint8_t>>(std::move(host)));
      base = host_.back()->data();
    }
    return TensorView::contiguous(static_cast<uint8_t*>(base) + offset, dtype, shape,
                                  gpu_ ? Device::cuda(0) : Device::cpu());
  }
  template <class T>
  TensorView make(DType dtype, Shape shape, const std::vector<T>& init, size_t offset = 0) {
    EXPECT_EQ(init.size() * sizeof(T), static_cast<size_t>(shape.numel()) * dtype_size(dtype));
    return make(dtype, shape, init.data(), offset);
  }

  std::vector<uint8_t> read(const TensorView& v) const {
    std::vector<uint8_t> out(v.nbytes());
    if (out.empty()) return out;
    if (gpu_) {
#if defined(ROLLOUTD_WITH_CUDA)
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(out.data(), v.data, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
#endif
    } else {
      std::memcpy(out.data(), v.data, out.size());
    }
    return out;
  }

 private:
  bool gpu_;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> host_;
#if defined(ROLLOUTD_WITH_CUDA)
  std::vector<std::unique_ptr<DeviceBuffer>> dev_;
#endif
};

// "first mismatch at byte i of n (got xx, want yy), m bytes differ", or empty when equal.
inline std::string diff(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size())
    return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
  size_t first = got.size(), count = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      if (first == got.size()) first = i;
      ++count;
    }
  if (count == 0) return {};
  return "first mismatch at byte " + std::to_string(first) + " of " + std::to_string(got.size()) +
         " (got " + std::to_string(got[first]) + ", want " + std::to_string(want[first]) + "), " +
         std::to_string(count) + " bytes differ";
}

}  // namespace rolloutd::quant::test
