// StableArena on the CUDA backend (label gpu; skips without a GPU): release gives the memory
// back to the device (cudaMemGetInfo sees it), resume maps memory at the same addresses, and
// static state written before the release is back bit for bit.
#include <cstdio>
#include <vector>

#include <gtest/gtest.h>

#include "core/storage/memory_manager.hpp"

#if ROLLOUTD_WITH_CUDA
#include <cuda_runtime_api.h>

namespace rolloutd::core {
namespace {

bool have_gpu() { return cuda_backend() != nullptr && cuda_device_count() > 0; }

size_t free_bytes() {
  size_t free = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  return free;
}

TEST(CudaArena, ReleaseFreesDeviceMemoryAndResumeKeepsAddressesAndStaticState) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA backend or no visible GPU";
  const Backend& g = *cuda_backend();
  const ExecContext ctx{Device::cuda(0), nullptr};
  size_t gran = 0;
  ASSERT_TRUE(g.vm_granularity(ctx, &gran).ok());
  EXPECT_GT(gran, 0u);
  StableArena arena(g, ctx, MemoryTag::kWeights);
  constexpr int64_t kBig = int64_t{1} << 30;  // 1 GiB of parameters
  auto big = arena.allocate(DType::kU8, Shape{kBig});
  auto map = arena.allocate(DType::kI32, Shape{64});
  ASSERT_TRUE(big.ok() && map.ok()) << big.status().to_string();
  std::vector<int32_t> host(64);
  for (int i = 0; i < 64; ++i) host[i] = 63 - i;
  ASSERT_EQ(cudaMemcpy(map->data, host.data(), 256, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(big->data, 0x5a, static_cast<size_t>(kBig)), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  StaticState state(g, ctx);
  ASSERT_TRUE(state.add("map", MemoryTag::kWeights, *map).ok());
  MemoryManager mem;
  mem.add_arena(&arena);
  mem.add_static_state(&state);
  const auto ranges = arena.ranges();

  const size_t free_before = free_bytes();
  auto rel = mem.release(MemoryTag::kWeights);
  ASSERT_TRUE(rel.ok()) << rel.status().to_string();
  const size_t free_released = free_bytes();
  EXPECT_GE(free_released, free_before + static_cast<size_t>(kBig)) << "the device did not get the memory back";
  std::printf("cuda arena: released %zu bytes in %.3f ms; device free %zu -> %zu\n", rel->bytes,
              rel->duration_s * 1e3, free_before, free_released);

  auto res = mem.resume(MemoryTag::kWeights);
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  std::printf("cuda arena: resumed %zu bytes in %.3f ms\n", res->bytes, res->duration_s * 1e3);
  EXPECT_LE(free_bytes() + static_cast<size_t>(kBig), free_released + gran);
  ASSERT_EQ(arena.ranges().size(), ranges.size());
  EXPECT_EQ(arena.ranges()[0].base, ranges[0].base);
  std::vector<int32_t> back(64);
  ASSERT_EQ(cudaMemcpy(back.data(), map->data, 256, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  // The resumed memory is usable at the old addresses.
  ASSERT_EQ(cudaMemset(big->data, 0x11, static_cast<size_t>(kBig)), cudaSuccess);
  unsigned char last = 0;
  ASSERT_EQ(cudaMemcpy(&last, static_cast<char*>(big->data) + kBig - 1, 1, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(last, 0x11);
}

}  // namespace
}  // namespace rolloutd::core
#else
TEST(CudaArena, ReleaseFreesDeviceMemoryAndResumeKeepsAddressesAndStaticState) {
  GTEST_SKIP() << "built without CUDA";
}
#endif
