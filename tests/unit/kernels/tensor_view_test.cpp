// kernels/tensor_view.cpp: shapes, contiguous strides and the contiguity test the backends
// rely on to reject strided views.
#include "kernels/tensor_view.hpp"

#include <gtest/gtest.h>

namespace rolloutd {
namespace {

TEST(Shape, RankNumelAndPrinting) {
  const Shape s{2, 3, 4};
  EXPECT_EQ(s.rank(), 3);
  EXPECT_EQ(s.numel(), 24);
  EXPECT_EQ(s.to_string(), "[2, 3, 4]");
  EXPECT_EQ(Shape{}.numel(), 1);  // a scalar
  EXPECT_EQ(Shape{}.to_string(), "[]");
  EXPECT_EQ((Shape{5, 0}).numel(), 0);
  const int64_t dims[] = {7, 1};
  EXPECT_EQ(Shape::of(dims, 2), (Shape{7, 1}));
  EXPECT_FALSE((Shape{7, 1}) == (Shape{7}));
}

TEST(TensorView, ContiguousStridesAreRowMajor) {
  float buf[24];
  const TensorView v = TensorView::contiguous(buf, DType::kF32, {2, 3, 4});
  EXPECT_EQ(v.strides, (Shape{12, 4, 1}));
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.nbytes(), 96u);
  EXPECT_EQ(v.device, Device::cpu());
  EXPECT_EQ(Device::cuda(1).to_string(), "cuda:1");
}

TEST(TensorView, TransposedOrPaddedViewIsNotContiguous) {
  float buf[24];
  TensorView v = TensorView::contiguous(buf, DType::kF32, {4, 6});
  v.shape = Shape{6, 4};
  v.strides = Shape{1, 6};  // a transpose
  EXPECT_FALSE(v.is_contiguous());
  TensorView padded = TensorView::contiguous(buf, DType::kF32, {3, 4});
  padded.strides = Shape{6, 1};  // rows of 4 out of a pitch of 6
  EXPECT_FALSE(padded.is_contiguous());
  TensorView unit = TensorView::contiguous(buf, DType::kF32, {1, 4});
  unit.strides = Shape{99, 1};  // a size-1 dimension's stride does not matter
  EXPECT_TRUE(unit.is_contiguous());
}

}  // namespace
}  // namespace rolloutd
