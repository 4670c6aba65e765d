#include "core/storage/arena.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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

// ---- virtual memory: release and resume ----

namespace rolloutd::core {
namespace {

// Pages of [p, p + bytes) resident in RAM (mincore), to see memory really go back.
size_t resident_pages(const void* p, size_t bytes) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const auto base = reinterpret_cast<uintptr_t>(p) & ~(uintptr_t{page} - 1);
  const size_t n = (reinterpret_cast<uintptr_t>(p) + bytes - base + page - 1) / page;
  std::vector<unsigned char> v(n);
  if (::mincore(reinterpret_cast<void*>(base), n * page, v.data()) != 0) return SIZE_MAX;
  size_t r = 0;
  for (unsigned char c : v) r += c & 1;
  return r;
}

TEST(StableArenaMemory, ReleaseGivesMemoryBackAndResumeMapsZerosAtTheSameAddresses) {
  StableArena arena(cpu_backend(), {}, MemoryTag::kWeights, /*chunk_bytes=*/1 << 16, /*reserve_bytes=*/1 << 20);
  std::vector<TensorView> ts;
  for (int i = 0; i < 40; ++i) {  // several pieces, and more than one reserved range
    auto t = arena.allocate(DType::kF32, Shape{8192});
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    std::memset(t->data, 0x7f, t->nbytes());
    ts.push_back(*t);
  }
  const auto ranges = arena.ranges();
  ASSERT_GE(ranges.size(), 2u);
  const size_t backed = arena.bytes_backed();
  EXPECT_EQ(arena.bytes_resident(), backed);
  EXPECT_GT(resident_pages(ts[0].data, ts[0].nbytes()), 0u);

  auto freed = arena.release();
  ASSERT_TRUE(freed.ok()) << freed.status().to_string();
  EXPECT_EQ(*freed, backed);
  EXPECT_TRUE(arena.released());
  EXPECT_EQ(arena.bytes_resident(), 0u);
  EXPECT_EQ(resident_pages(ts[0].data, ts[0].nbytes()), 0u) << "released pages still in RAM";
  EXPECT_EQ(arena.allocate(DType::kF32, Shape{4}).status().code(), ErrorCode::kFailedPrecondition);

  auto mapped = arena.resume();
  ASSERT_TRUE(mapped.ok()) << mapped.status().to_string();
  EXPECT_EQ(*mapped, backed);
  EXPECT_FALSE(arena.released());
  ASSERT_EQ(arena.ranges().size(), ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_EQ(arena.ranges()[i].base, ranges[i].base);
    EXPECT_EQ(arena.ranges()[i].size, ranges[i].size);
  }
  // Defined contents on the host: zero. Writable again, and growth continues after it.
  for (const TensorView& t : ts) {
    const auto* b = static_cast<const unsigned char*>(t.data);
    EXPECT_TRUE(std::all_of(b, b + t.nbytes(), [](unsigned char c) { return c == 0; }));
    std::memset(t.data, 0x11, t.nbytes());
  }
  auto more = arena.allocate(DType::kF32, Shape{8192});
  ASSERT_TRUE(more.ok());
  EXPECT_TRUE(arena.contains(more->data, more->nbytes()));
}

TEST(StableArenaMemory, DoubleReleaseAndDoubleResumeAreNoOps) {
  StableArena arena(cpu_backend(), {}, MemoryTag::kKvCache, 1 << 16);
  ASSERT_TRUE(arena.allocate(DType::kF32, Shape{1000}).ok());
  EXPECT_EQ(*arena.resume(), 0u) << "resume of a resident arena";
  const size_t backed = arena.bytes_backed();
  EXPECT_EQ(*arena.release(), backed);
  EXPECT_EQ(*arena.release(), 0u);
  EXPECT_TRUE(arena.released());
  EXPECT_EQ(*arena.resume(), backed);
  EXPECT_EQ(*arena.resume(), 0u);
  EXPECT_FALSE(arena.released());
}

TEST(StableArenaMemoryDeathTest, ReleasedMemoryFaultsOnAccess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  StableArena arena(cpu_backend(), {}, MemoryTag::kWeights, 1 << 16);
  auto t = arena.allocate(DType::kF32, Shape{16});
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(arena.release().ok());
  volatile float* p = t->as<float>();
  EXPECT_DEATH({ p[3] = 1.0f; }, "");
}

TEST(StableArenaMemory, CpuBackendVirtualMemoryOpsCheckAlignment) {
  const Backend& b = cpu_backend();
  size_t g = 0;
  ASSERT_TRUE(b.vm_granularity({}, &g).ok());
  void* base = nullptr;
  EXPECT_EQ(b.vm_reserve({}, g + 1, &base).code(), ErrorCode::kInvalidArgument);
  ASSERT_TRUE(b.vm_reserve({}, 4 * g, &base).ok());
  EXPECT_EQ(b.vm_map({}, static_cast<char*>(base) + 1, g).code(), ErrorCode::kInvalidArgument);
  ASSERT_TRUE(b.vm_map({}, base, 2 * g).ok());
  static_cast<char*>(base)[0] = 1;
  ASSERT_TRUE(b.vm_unmap({}, base, 2 * g).ok());
  ASSERT_TRUE(b.vm_map({}, base, 2 * g).ok());
  EXPECT_EQ(static_cast<char*>(base)[0], 0);
  ASSERT_TRUE(b.vm_unmap({}, base, 2 * g).ok());
  EXPECT_TRUE(b.vm_free({}, base, 4 * g).ok());
}

}  // namespace
}  // namespace rolloutd::core
