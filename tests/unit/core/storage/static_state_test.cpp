// Static state across a release of its memory: backed up, written back at the same addresses,
// bit for bit; the memory manager's order (backup, hooks, unmap / map, restore) and its
// idempotence.
#include "core/storage/static_state.hpp"

#include <cstring>

#include <gtest/gtest.h>

#include "core/storage/memory_manager.hpp"

namespace rolloutd::core {
namespace {

TEST(StaticState, RoundTripAcrossReleaseIsBitIdentical) {
  StableArena arena(cpu_backend(), {}, MemoryTag::kWeights, 1 << 16);
  auto map = arena.allocate(DType::kI32, Shape{16});
  auto limits = arena.allocate(DType::kF32, Shape{3});
  auto param = arena.allocate(DType::kF32, Shape{1000});
  ASSERT_TRUE(map.ok() && limits.ok() && param.ok());
  for (int i = 0; i < 16; ++i) map->as<int32_t>()[i] = 15 - i;
  const float consts[3] = {7.0f, 1.702f, -0.0f};
  std::memcpy(limits->data, consts, sizeof(consts));
  std::memset(param->data, 0x3c, param->nbytes());

  StaticState state(cpu_backend(), {});
  ASSERT_TRUE(state.add("layers.0.logical_to_physical", MemoryTag::kWeights, *map).ok());
  ASSERT_TRUE(state.add("layers.0.swiglu_limit_alpha", MemoryTag::kWeights, *limits).ok());
  EXPECT_EQ(state.add("layers.0.swiglu_limit_alpha", MemoryTag::kWeights, *limits).code(), ErrorCode::kInternal);
  EXPECT_EQ(state.bytes(MemoryTag::kWeights), 16 * 4 + 3 * 4u);
  const uint32_t digest = *state.digest(MemoryTag::kWeights);

  MemoryManager mem;
  mem.add_arena(&arena);
  mem.add_static_state(&state);
  int hook_calls = 0;
  mem.add_release_hook(MemoryTag::kWeights, [&]() -> Result<size_t> {
    ++hook_calls;
    // Runs after the backup and before the unmap: the memory is still readable.
    EXPECT_EQ(map->as<int32_t>()[0], 15);
    return size_t{4096};
  });
  auto rel = mem.release(MemoryTag::kWeights);
  ASSERT_TRUE(rel.ok()) << rel.status().to_string();
  EXPECT_TRUE(rel->changed);
  EXPECT_EQ(rel->bytes, arena.bytes_backed() + 4096);
  EXPECT_TRUE(mem.released(MemoryTag::kWeights));
  EXPECT_FALSE(mem.released(MemoryTag::kKvCache));
  EXPECT_EQ(hook_calls, 1);
  // While released the digest comes from the host backup.
  EXPECT_EQ(*state.digest(MemoryTag::kWeights), digest);
  EXPECT_EQ(*mem.static_state_digest(MemoryTag::kWeights), *mem.static_state_digest(MemoryTag::kWeights));
  auto again = mem.release(MemoryTag::kWeights);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->changed);
  EXPECT_EQ(again->bytes, 0u);
  EXPECT_EQ(hook_calls, 1);

  auto res = mem.resume(MemoryTag::kWeights);
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  EXPECT_TRUE(res->changed);
  EXPECT_EQ(res->bytes, arena.bytes_backed());
  // Static state is back at its addresses; the parameter lost its value (zero on the host).
  for (int i = 0; i < 16; ++i) EXPECT_EQ(map->as<int32_t>()[i], 15 - i);
  EXPECT_EQ(std::memcmp(limits->data, consts, sizeof(consts)), 0);
  EXPECT_EQ(param->as<float>()[0], 0.0f);
  EXPECT_EQ(*state.digest(MemoryTag::kWeights), digest);
  EXPECT_FALSE(state.entries()[0].backed_up);
  EXPECT_TRUE(state.entries()[0].backup.empty()) << "the host copy is freed after the restore";
  EXPECT_FALSE(mem.resume(MemoryTag::kWeights)->changed);

  const MemoryTagStats st = mem.stats(MemoryTag::kWeights);
  EXPECT_EQ(st.num_releases, 1u);
  EXPECT_EQ(st.num_resumes, 1u);
  EXPECT_EQ(st.static_state_entries, 2u);
  EXPECT_EQ(st.resident_bytes, arena.bytes_backed());
}

TEST(StaticState, TagsAreIndependent) {
  StableArena w(cpu_backend(), {}, MemoryTag::kWeights, 1 << 16);
  StableArena kv(cpu_backend(), {}, MemoryTag::kKvCache, 1 << 16);
  auto a = w.allocate(DType::kI32, Shape{4});
  auto b = kv.allocate(DType::kI32, Shape{4});
  ASSERT_TRUE(a.ok() && b.ok());
  a->as<int32_t>()[0] = 42;
  b->as<int32_t>()[0] = 43;
  MemoryManager mem;
  mem.add_arena(&w);
  mem.add_arena(&kv);
  ASSERT_TRUE(mem.release(MemoryTag::kKvCache).ok());
  EXPECT_FALSE(w.released());
  EXPECT_TRUE(kv.released());
  EXPECT_EQ(a->as<int32_t>()[0], 42);
  ASSERT_TRUE(mem.resume(MemoryTag::kKvCache).ok());
  EXPECT_EQ(b->as<int32_t>()[0], 0) << "kv_cache values are not kept";
  // A tag with no arena (cuda_graph before graphs exist) still has a state.
  auto g = mem.release(MemoryTag::kCudaGraph);
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(g->changed);
  EXPECT_EQ(g->bytes, 0u);
  EXPECT_TRUE(mem.released(MemoryTag::kCudaGraph));
}

}  // namespace
}  // namespace rolloutd::core
