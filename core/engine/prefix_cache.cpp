#include "core/engine/prefix_cache.hpp"

#include <algorithm>
#include <cassert>

namespace rolloutd::core {

PrefixCache::PrefixCache(KvBlockPool& pool, int64_t rows_per_token)
    : pool_(pool), rows_per_token_(rows_per_token), key_of_block_(static_cast<size_t>(pool.num_blocks()), 0) {
  pool_.set_watcher([this](int32_t block, uint32_t refs) { on_refs(block, refs); });
}

PrefixCache::~PrefixCache() { pool_.set_watcher(nullptr); }

uint64_t PrefixCache::chain(uint64_t parent, std::span<const int32_t> block_tokens) {
  // splitmix64's finalizer over the parent key and each token: cheap, and every input bit
  // reaches every output bit. Collisions are caught by the entry's tokens and parent.
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(parent + 0x9e3779b97f4a7c15ull);
  for (int32_t t : block_tokens) h = mix(h ^ static_cast<uint32_t>(t));
  return h;
}

void PrefixCache::on_refs(int32_t block, uint32_t refs) {
  // The cache holds a reference on every block it watches: 0 here is a double release elsewhere.
  assert(refs > 0 && "a block the prefix cache holds was released by someone else");
  auto it = entries_.find(key_of_block_[static_cast<size_t>(block)]);
  if (it == entries_.end() || it->second.block != block) return;
  Entry& e = it->second;
  if (refs == 1 && e.evictable_at == 0) {  // the last reader let it go
    e.evictable_at = ++tick_;
    evictable_.emplace(e.evictable_at, it->first);
  } else if (refs > 1 && e.evictable_at != 0) {  // lent again
    evictable_.erase(e.evictable_at);
    e.evictable_at = 0;
  }
}

void PrefixCache::keep(uint64_t key, Entry& e, int32_t block) {
  e.block = block;
  key_of_block_[static_cast<size_t>(block)] = key;
  pool_.watch(block, true);
  on_refs(block, pool_.refs(block));
}

void PrefixCache::drop_block(Entry& e) {
  if (e.evictable_at != 0) evictable_.erase(e.evictable_at);
  e.evictable_at = 0;
  pool_.watch(e.block, false);
  std::vector<int32_t> one{e.block};
  (void)pool_.release(one);
  e.block = -1;
}

PrefixCache::Hit PrefixCache::lookup(std::span<const int32_t> tokens, int64_t max_tokens, int64_t records_from) {
  Hit hit;
  const int64_t bs = pool_.block_size();
  const int64_t limit = std::min<int64_t>(max_tokens, static_cast<int64_t>(tokens.size()));
  for (int64_t i = 0; (i + 1) * bs <= limit; ++i) {
    const auto part = tokens.subspan(static_cast<size_t>(i * bs), static_cast<size_t>(bs));
    const uint64_t key = chain(hit.key, part);
    auto it = entries_.find(key);
    if (it == entries_.end()) break;
    Entry& e = it->second;
    if (e.parent != hit.key || !std::equal(part.begin(), part.end(), e.tokens.begin(), e.tokens.end())) break;
    if (records_from >= 0 && (i + 1) * bs > records_from && e.records.empty()) break;
    if (!pool_.retain(e.block).ok()) break;  // cannot happen: the cache holds it
    hit.blocks.push_back(e.block);
    hit.records.push_back(e.records.empty() ? nullptr : &e.records);
    hit.key = key;
  }
  return hit;
}

std::optional<uint64_t> PrefixCache::insert(uint64_t parent, std::span<const int32_t> block_tokens, int32_t block,
                                            std::span<const int32_t> records) {
  const uint64_t key = chain(parent, block_tokens);
  const bool full_records = static_cast<int64_t>(records.size()) == pool_.block_size() * rows_per_token_ &&
                            rows_per_token_ > 0;
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    Entry& e = it->second;
    if (e.parent != parent || !std::equal(block_tokens.begin(), block_tokens.end(), e.tokens.begin(), e.tokens.end()))
      return std::nullopt;  // the key names other tokens
    // Computed twice (requests at once, or one that could not reuse it). The first block stays,
    // unless it has no records and this one has: then this block and its records replace it
    // (the records must describe the KV a reader gets: bits may differ between computations).
    if (!e.records.empty() || !full_records || e.block == block) return key;
    if (!pool_.retain(block).ok()) return key;
    drop_block(e);
    e.records.assign(records.begin(), records.end());
    keep(key, e, block);
    return key;
  }
  if (!pool_.retain(block).ok()) return key;
  Entry& e = entries_[key];
  e.parent = parent;
  e.tokens.assign(block_tokens.begin(), block_tokens.end());
  if (full_records) e.records.assign(records.begin(), records.end());  // ids < 65,536 experts
  keep(key, e, block);
  return key;
}

int64_t PrefixCache::evict(int64_t n) {
  int64_t freed = 0;
  while (freed < n && !evictable_.empty()) {
    const uint64_t key = evictable_.begin()->second;
    auto it = entries_.find(key);
    if (it == entries_.end()) {  // cannot happen: entries leave evictable_ when they go
      evictable_.erase(evictable_.begin());
      continue;
    }
    drop_block(it->second);
    entries_.erase(it);
    ++freed;
  }
  return freed;
}

void PrefixCache::clear() {
  for (auto& [key, e] : entries_) drop_block(e);
  entries_.clear();
  evictable_.clear();
}

}  // namespace rolloutd::core
