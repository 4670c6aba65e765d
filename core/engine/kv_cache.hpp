#pragma once
// Bookkeeping of the paged KV cache: a pool of fixed-size blocks and a free list.
// The cache tensors themselves belong to the model (one pair per layer, in the
// kv_cache arena); this class decides which block a sequence's position lives in.
#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/status.hpp"

namespace rolloutd::core {

class KvBlockPool {
 public:
  KvBlockPool(int64_t num_blocks, int64_t block_size);

  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  // Takes `n` blocks (all or nothing), each with one reference; kResourceExhausted when fewer
  // are free.
  Status allocate(int64_t n, std::vector<int32_t>& out);
  // One more holder of an allocated block (a block shared through the prefix cache: the cache
  // and every sequence that reads it hold one reference each). kInternal for a free block.
  Status retain(int32_t block);
  // Drops one reference of each block, the last block first (a request's tail blocks then reach
  // a watcher before its head: the prefix cache evicts tails before the prefixes others share);
  // a block whose last reference goes returns to the pool. Releasing a free block is a bug and
  // returns kInternal.
  Status release(std::vector<int32_t>& blocks);
  uint32_t refs(int32_t block) const { return refs_[static_cast<size_t>(block)]; }
  // The watcher (one, set once) hears every reference count change of a watched block, after it.
  void set_watcher(std::function<void(int32_t block, uint32_t refs)> fn) { watcher_ = std::move(fn); }
  void watch(int32_t block, bool on) { watched_[static_cast<size_t>(block)] = on; }

 private:
  void changed(int32_t b) {
    if (watched_[static_cast<size_t>(b)] && watcher_) watcher_(b, refs_[static_cast<size_t>(b)]);
  }

  int64_t num_blocks_;
  int64_t block_size_;
  std::vector<int32_t> free_;
  std::vector<uint32_t> refs_;
  std::vector<uint8_t> watched_;
  std::function<void(int32_t, uint32_t)> watcher_;
};

}  // namespace rolloutd::core
