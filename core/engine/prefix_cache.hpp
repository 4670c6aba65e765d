#pragma once
// Full KV blocks kept after their request ends, keyed by the tokens that fill them and every
// token before them, so that a request starting with the same blocks reuses their KV instead of
// computing it again: the n samples of one prompt (GRPO), a conversation's next turn.
//
// NOTES:
// - A block's key is a hash chain: key(i) = mix(key(i - 1), tokens of block i). An entry keeps
//   its tokens and its parent's key, and a lookup compares both, so a 64-bit collision can
//   only miss, never return another prompt's KV.
// - The cache holds one reference on every block it keeps (KvBlockPool::retain); a request
//   reading a cached block holds another. Only blocks nobody else holds are evicted, least
//   recently used first, when the pool runs short.
// - KV depends on the weights: the engine clears the cache whenever they may have changed.
// - Routed-expert records of a cached block's tokens are kept beside it when the step that
//   computed them recorded (a request asking for records gets them for the positions it did
//   not compute; a block without them ends the reuse of a request that needs them).
#include <cstdint>
#include <map>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/engine/kv_cache.hpp"

namespace rolloutd::core {

class PrefixCache {
 public:
  // rows_per_token: routed-expert ids per token (MoE layers x top-k).
  PrefixCache(KvBlockPool& pool, int64_t rows_per_token) : pool_(pool), rows_per_token_(rows_per_token) {}

  static uint64_t chain(uint64_t parent, std::span<const int32_t> block_tokens);
  static constexpr uint64_t kRoot = 0x9e3779b97f4a7c15ull;  // the key before block 0

  struct Hit {
    std::vector<int32_t> blocks;                     // retained for the caller (release them)
    std::vector<const std::vector<int32_t>*> records;  // per block; null where none were kept
    uint64_t key = kRoot;                             // chain key of the last block of the hit
  };
  // The longest run of cached blocks that starts `tokens` and covers at most `max_tokens` of
  // them. records_from >= 0: the caller needs the records of positions >= records_from, so the
  // run ends before the first block that holds such a position and has no records.
  Hit lookup(std::span<const int32_t> tokens, int64_t max_tokens, int64_t records_from);
  // Keeps `block`, whose KV holds `block_tokens` after the tokens of chain key `parent`
  // (records: block_size x rows_per_token ids, or empty). A key already cached keeps its block;
  // it takes these records if it had none. Returns the block's key.
  uint64_t insert(uint64_t parent, std::span<const int32_t> block_tokens, int32_t block, std::vector<int32_t> records);
  // Frees up to `n` blocks that only the cache holds, least recently used first; returns how many.
  int64_t evict(int64_t n);
  // Drops every entry (the weights changed, or the KV memory goes away).
  void clear();

  int64_t num_blocks() const { return static_cast<int64_t>(entries_.size()); }

 private:
  struct Entry {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    int32_t block = -1;
    std::vector<int32_t> records;
    uint64_t used = 0;  // tick of the last lookup or insert (lru_'s key)
  };
  void touch(uint64_t key, Entry& e);

  KvBlockPool& pool_;
  int64_t rows_per_token_;
  std::unordered_map<uint64_t, Entry> entries_;
  std::map<uint64_t, uint64_t> lru_;  // tick -> key, oldest first
  uint64_t tick_ = 0;
};

}  // namespace rolloutd::core
