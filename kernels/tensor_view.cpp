#include "kernels/tensor_view.hpp"

namespace rolloutd {

std::string Device::to_string() const {
  return kind == DeviceKind::kCpu ? std::string("cpu") : "cuda:" + std::to_string(index);
}

Shape::Shape(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) {
    if (rank_ == kMaxDims) break;
    dims_[static_cast<size_t>(rank_++)] = d;
  }
}

Shape Shape::of(const int64_t* dims, int rank) {
  Shape s;
  for (int i = 0; i < rank && i < kMaxDims; ++i) s.dims_[static_cast<size_t>(s.rank_++)] = dims[i];
  return s;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[static_cast<size_t>(i)];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank_ != o.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[static_cast<size_t>(i)] != o.dims_[static_cast<size_t>(i)]) return false;
  return true;
}

std::string Shape::to_string() const {
  std::string s = "[";
  for (int i = 0; i < rank_; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[static_cast<size_t>(i)]);
  }
  return s + "]";
}

TensorView TensorView::contiguous(void* data, DType dtype, Shape shape, Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.shape = shape;
  v.device = device;
  Shape st = shape;
  int64_t acc = 1;
  for (int i = shape.rank() - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= shape[i];
  }
  v.strides = st;
  return v;
}

size_t TensorView::nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }

std::string TensorView::describe() const {
  return std::string(dtype_name(dtype)) + " " + shape.to_string() + " on " + device.to_string();
}

bool TensorView::is_contiguous() const {
  int64_t acc = 1;
  for (int i = shape.rank() - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != acc) return false;
    acc *= shape[i];
  }
  return true;
}

}  // namespace rolloutd
