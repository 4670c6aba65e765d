#pragma once
// A non-owning view of a strided tensor: pointer, dtype, shape, strides (in
// elements), device. Kernels take views and a context; they never allocate the
// tensors they are handed and never see where the memory came from.
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kernels/dtype.hpp"

namespace rolloutd {

enum class DeviceKind : uint8_t { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;
  bool operator==(const Device&) const = default;
  static Device cpu() { return {}; }
  static Device cuda(int i) { return {DeviceKind::kCuda, i}; }
  std::string to_string() const;
};

inline constexpr int kMaxDims = 6;

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  static Shape of(const int64_t* dims, int rank);

  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[static_cast<size_t>(i)]; }
  int64_t& operator[](int i) { return dims_[static_cast<size_t>(i)]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string to_string() const;  // "[2, 3]"
  const int64_t* data() const { return dims_.data(); }

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  Shape strides;  // in elements; contiguous row-major when built by contiguous()
  Device device;

  static TensorView contiguous(void* data, DType dtype, Shape shape, Device device = {});

  int rank() const { return shape.rank(); }
  int64_t numel() const { return shape.numel(); }
  int64_t size(int i) const { return shape[i]; }
  size_t nbytes() const;  // numel * element size (contiguous views only)
  bool is_contiguous() const;
  // No tensor at all (an optional argument left out): no data and rank 0.
  bool absent() const { return data == nullptr && rank() == 0; }
  // "bf16 [2, 3] on cuda:0", for error messages.
  std::string describe() const;

  template <class T>
  T* as() const { return static_cast<T*>(data); }
};

}  // namespace rolloutd
