#include "core/engine/kv_cache.hpp"

#include <set>

#include <gtest/gtest.h>

namespace rolloutd::core {
namespace {

TEST(KvBlockPool, AllocatesDistinctBlocksAndReturnsThem) {
  KvBlockPool pool(8, 16);
  EXPECT_EQ(pool.blocks_for(1), 1);
  EXPECT_EQ(pool.blocks_for(16), 1);
  EXPECT_EQ(pool.blocks_for(17), 2);
  std::vector<int32_t> a, b;
  ASSERT_TRUE(pool.allocate(3, a).ok());
  ASSERT_TRUE(pool.allocate(5, b).ok());
  std::set<int32_t> all(a.begin(), a.end());
  all.insert(b.begin(), b.end());
  EXPECT_EQ(all.size(), 8u);
  EXPECT_EQ(pool.num_free(), 0);
  ASSERT_TRUE(pool.release(a).ok());
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(pool.num_free(), 3);
}

TEST(KvBlockPool, ExhaustionIsAllOrNothing) {
  KvBlockPool pool(4, 16);
  std::vector<int32_t> a;
  ASSERT_TRUE(pool.allocate(3, a).ok());
  std::vector<int32_t> b;
  Status s = pool.allocate(2, b);
  EXPECT_EQ(s.code(), ErrorCode::kResourceExhausted);
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(pool.num_free(), 1);
}

TEST(KvBlockPool, DoubleReleaseIsReported) {
  KvBlockPool pool(4, 16);
  std::vector<int32_t> a;
  ASSERT_TRUE(pool.allocate(1, a).ok());
  std::vector<int32_t> copy = a;
  ASSERT_TRUE(pool.release(a).ok());
  EXPECT_EQ(pool.release(copy).code(), ErrorCode::kInternal);
  EXPECT_EQ(pool.num_free(), 4);
}

}  // namespace
}  // namespace rolloutd::core
