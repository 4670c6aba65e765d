#include "core/storage/arena.hpp"

#include <cstdint>
#include <cstring>

#include <gtest/gtest.h>

namespace rolloutd::core {
namespace {

TEST(StableArena, AlignsAndNeverMovesEarlierTensors) {
  StableArena arena(cpu_backend(), {}, MemoryTag::kWeights, /*chunk_bytes=*/4096);
  auto a = arena.allocate(DType::kF32, Shape{10});
  ASSERT_TRUE(a.ok());
  std::memset(a->data, 0x5a, a->nbytes());
  void* first = a->data;
  // Forces new chunks: earlier tensors keep their address and contents.
  for (int i = 0; i < 20; ++i) {
    auto b = arena.allocate(DType::kBF16, Shape{1000}, 1024);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data) % 1024, 0u);
  }
  EXPECT_EQ(first, a->data);
  EXPECT_EQ(static_cast<unsigned char*>(first)[39], 0x5a);
  EXPECT_GE(arena.bytes_reserved(), arena.bytes_used());
}

TEST(StableArena, RejectsBadArguments) {
  StableArena arena(cpu_backend(), {}, MemoryTag::kScratch);
  EXPECT_EQ(arena.allocate(DType::kF32, Shape{4}, 3).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(arena.allocate(DType::kF32, Shape{-1}).status().code(), ErrorCode::kInvalidArgument);
  auto empty = arena.allocate(DType::kF32, Shape{0});
  ASSERT_TRUE(empty.ok());
  EXPECT_NE(empty->data, nullptr);
}

}  // namespace
}  // namespace rolloutd::core
