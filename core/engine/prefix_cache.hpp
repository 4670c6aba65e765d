#pragma once
// Full KV blocks kept after their request ends, keyed by the tokens that fill them and every
// token before them, so that a request starting with the same blocks reuses their KV instead of
// computing it again: the n samples of one prompt (GRPO), a conversation's next turn.
//
// NOTES:
// - A block's key is a hash chain: key(i) = mix(key(i - 1), tokens of block i). An entry keeps
//   its tokens and its parent's key; a lookup compares both, and an insert whose key is taken by
//   other tokens or another parent is refused (the request stops keying its blocks), so every
//   stored entry's key names exactly one token prefix: a 64-bit collision can only miss.
// - The cache holds one reference on every block it keeps (KvBlockPool::retain); a request
//   reading a cached block holds another. A block only the cache holds is evictable: it joins
//   the eviction order when its last reader lets it go (the pool's watcher), and leaves it when
//   a lookup lends it again; the oldest goes first. Requests release their last block first, so
//   a prompt's tail is evicted before the prefix other prompts may share. O(log n) a block.
// - KV depends on the weights: the engine clears the cache whenever they may have changed.
// - Routed-expert records of a cached block's tokens are kept beside it (as uint16) when the
//   step that computed them recorded; a block without them ends the reuse of a request that
//   needs them. The records always describe the block's own KV: a later computation of the same
//   tokens that recorded replaces block and records together. (Blocks already keyed under the
//   replaced one were computed over its bits, not the new block's: equal wherever the
//   computation does not depend on the batch; otherwise within its rounding.)
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/engine/kv_cache.hpp"

namespace rolloutd::core {

class PrefixCache {
 public:
  // rows_per_token: routed-expert ids per token (MoE layers x top-k). Sets the pool's watcher.
  PrefixCache(KvBlockPool& pool, int64_t rows_per_token);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  static uint64_t chain(uint64_t parent, std::span<const int32_t> block_tokens);
  static constexpr uint64_t kRoot = 0x9e3779b97f4a7c15ull;  // the key before block 0

  struct Hit {
    std::vector<int32_t> blocks;                         // retained for the caller (release them)
    std::vector<const std::vector<uint16_t>*> records;  // per block; null where none were kept
    uint64_t key = kRoot;                                // chain key of the last block of the hit
  };
  // The longest run of cached blocks that starts `tokens` and covers at most `max_tokens` of
  // them. records_from >= 0: the caller needs the records of positions >= records_from, so the
  // run ends before the first block that holds such a position and has no records.
  Hit lookup(std::span<const int32_t> tokens, int64_t max_tokens, int64_t records_from);
  // Keeps `block`, whose KV holds `block_tokens` after the tokens of chain key `parent`
  // (records: block_size x rows_per_token ids, or empty). A key already cached for these
  // tokens keeps its block unless it has no records and these come with some (then both are
  // replaced). Returns the block's key; nullopt when the key belongs to other tokens (a hash
  // collision: the caller must not key further blocks on it).
  std::optional<uint64_t> insert(uint64_t parent, std::span<const int32_t> block_tokens, int32_t block,
                                 std::span<const int32_t> records);
  // Frees up to `n` evictable blocks, oldest first; returns how many.
  int64_t evict(int64_t n);
  // Drops every entry (the weights changed, or the KV memory goes away).
  void clear();

  int64_t num_blocks() const { return static_cast<int64_t>(entries_.size()); }
  int64_t num_evictable() const { return static_cast<int64_t>(evictable_.size()); }

 private:
  struct Entry {
    uint64_t parent = 0;
    std::vector<int32_t> tokens;
    int32_t block = -1;
    std::vector<uint16_t> records;
    uint64_t evictable_at = 0;  // its key in evictable_ (0: some request reads the block)
  };
  void on_refs(int32_t block, uint32_t refs);
  void keep(uint64_t key, Entry& e, int32_t block);  // e takes `block` (retained by the caller)
  void drop_block(Entry& e);                         // e lets its block go

  KvBlockPool& pool_;
  int64_t rows_per_token_;
  std::unordered_map<uint64_t, Entry> entries_;
  std::vector<uint64_t> key_of_block_;  // the entry holding each block (watched blocks only)
  std::map<uint64_t, uint64_t> evictable_;  // tick -> key, oldest first
  uint64_t tick_ = 0;
};

}  // namespace rolloutd::core
