#include "core/moe/routed_experts.hpp"

#include <gtest/gtest.h>

#include "core/moe/expert_map.hpp"

namespace rolloutd::core {
namespace {

TensorView ids_view(std::vector<int32_t>& v, int64_t rows, int64_t k) {
  return TensorView::contiguous(v.data(), DType::kI32, Shape{rows, k});
}

TEST(RoutedExpertRecorder, RecordsOnlyRealRowsTokenMajor) {
  RoutedExpertRecorder rec(/*layers=*/2, /*top_k=*/2, /*max_tokens=*/8);
  ASSERT_TRUE(rec.begin_step(2).ok());
  // 4 rows, of which the last 2 pad the batch: their ids must never appear.
  std::vector<int32_t> l0 = {1, 2, 3, 4, 99, 99, 99, 99};
  std::vector<int32_t> l1 = {5, 6, 7, 8, 99, 99, 99, 99};
  ASSERT_TRUE(rec.capture(cpu_backend(), {}, 0, ids_view(l0, 4, 2)).ok());
  ASSERT_TRUE(rec.capture(cpu_backend(), {}, 1, ids_view(l1, 4, 2)).ok());
  EXPECT_EQ(rec.num_layers_captured(), 2);
  EXPECT_EQ(rec.rows(), (std::vector<int32_t>{1, 2, 5, 6, 3, 4, 7, 8}));
}

TEST(RoutedExpertRecorder, ALayerCannotRecordTwiceInAStep) {
  RoutedExpertRecorder rec(1, 1, 4);
  ASSERT_TRUE(rec.begin_step(1).ok());
  std::vector<int32_t> ids = {3};
  ASSERT_TRUE(rec.capture(cpu_backend(), {}, 0, ids_view(ids, 1, 1)).ok());
  EXPECT_EQ(rec.capture(cpu_backend(), {}, 0, ids_view(ids, 1, 1)).code(), ErrorCode::kInternal);
  ASSERT_TRUE(rec.begin_step(1).ok());
  EXPECT_TRUE(rec.capture(cpu_backend(), {}, 0, ids_view(ids, 1, 1)).ok());
}

TEST(RoutedExpertRecorder, RejectsOversizedStepsAndBadViews) {
  RoutedExpertRecorder rec(1, 2, 4);
  EXPECT_EQ(rec.begin_step(5).code(), ErrorCode::kOutOfRange);
  ASSERT_TRUE(rec.begin_step(3).ok());
  std::vector<int32_t> ids(4);
  EXPECT_FALSE(rec.capture(cpu_backend(), {}, 0, ids_view(ids, 2, 2)).ok()) << "fewer rows than tokens";
  EXPECT_FALSE(rec.capture(cpu_backend(), {}, 1, ids_view(ids, 2, 2)).ok()) << "no such layer";
}

TEST(ExpertMap, ValidatesSlots) {
  auto id = ExpertMap::identity(4);
  EXPECT_EQ(id.logical_to_physical(3), 3);
  auto ok = ExpertMap::create({2, 0, 1}, 4);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->logical_to_physical(0), 2);
  EXPECT_EQ(ExpertMap::create({0, 4}, 4).status().code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(ExpertMap::create({0, 4}, 4).status().field(), "logical_to_physical[1]");
  EXPECT_FALSE(ExpertMap::create({}, 4).ok());
  EXPECT_FALSE(ExpertMap::create({0, 1, 2}, 2).ok());
}

}  // namespace
}  // namespace rolloutd::core
