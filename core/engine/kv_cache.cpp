#include "core/engine/kv_cache.hpp"

#include <string>

namespace rolloutd::core {

KvBlockPool::KvBlockPool(int64_t num_blocks, int64_t block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  free_.reserve(static_cast<size_t>(num_blocks));
  // Hand out low block ids first (pop from the back).
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
  refs_.assign(static_cast<size_t>(num_blocks), 0);
  watched_.assign(static_cast<size_t>(num_blocks), 0);
}

Status KvBlockPool::allocate(int64_t n, std::vector<int32_t>& out) {
  if (n < 0) return Status(ErrorCode::kInternal, "negative block count", "n");
  if (n > num_free())
    return Status(ErrorCode::kResourceExhausted,
                  "KV cache has " + std::to_string(num_free()) + " free blocks, " +
                      std::to_string(n) + " needed",
                  "kv_blocks");
  for (int64_t i = 0; i < n; ++i) {
    const int32_t b = free_.back();
    free_.pop_back();
    refs_[static_cast<size_t>(b)] = 1;
    out.push_back(b);
  }
  return Status::Ok();
}

Status KvBlockPool::retain(int32_t b) {
  if (b < 0 || b >= num_blocks_ || refs_[static_cast<size_t>(b)] == 0)
    return Status(ErrorCode::kInternal, "retain of a block not in use", "block " + std::to_string(b));
  ++refs_[static_cast<size_t>(b)];
  changed(b);
  return Status::Ok();
}

Status KvBlockPool::release(std::vector<int32_t>& blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int32_t b = *it;
    if (b < 0 || b >= num_blocks_ || refs_[static_cast<size_t>(b)] == 0)
      return Status(ErrorCode::kInternal, "release of a block not in use", "block " + std::to_string(b));
    if (--refs_[static_cast<size_t>(b)] == 0) free_.push_back(b);
    changed(b);
  }
  blocks.clear();
  return Status::Ok();
}

}  // namespace rolloutd::core
