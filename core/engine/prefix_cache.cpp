#include "core/engine/prefix_cache.hpp"

#include <algorithm>

namespace rolloutd::core {

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

void PrefixCache::touch(uint64_t key, Entry& e) {
  if (e.used) lru_.erase(e.used);
  e.used = ++tick_;
  lru_.emplace(e.used, key);
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
    touch(key, e);
    hit.blocks.push_back(e.block);
    hit.records.push_back(e.records.empty() ? nullptr : &e.records);
    hit.key = key;
  }
  return hit;
}

uint64_t PrefixCache::insert(uint64_t parent, std::span<const int32_t> block_tokens, int32_t block,
                             std::vector<int32_t> records) {
  const uint64_t key = chain(parent, block_tokens);
  const bool full_records = static_cast<int64_t>(records.size()) == pool_.block_size() * rows_per_token_;
  if (auto it = entries_.find(key); it != entries_.end()) {
    // Computed twice (two requests at once, or one that could not reuse it): keep the first
    // block, and the second's records if the first has none (the same tokens after the same
    // tokens under the same weights: the same routing).
    Entry& e = it->second;
    if (e.records.empty() && full_records && e.parent == parent &&
        std::equal(block_tokens.begin(), block_tokens.end(), e.tokens.begin(), e.tokens.end()))
      e.records = std::move(records);
    return key;
  }
  if (!pool_.retain(block).ok()) return key;
  Entry& e = entries_[key];
  e.parent = parent;
  e.tokens.assign(block_tokens.begin(), block_tokens.end());
  e.block = block;
  if (full_records) e.records = std::move(records);
  touch(key, e);
  return key;
}

int64_t PrefixCache::evict(int64_t n) {
  int64_t freed = 0;
  for (auto it = lru_.begin(); it != lru_.end() && freed < n;) {
    auto e = entries_.find(it->second);
    if (e == entries_.end() || pool_.refs(e->second.block) != 1) {  // a request reads it
      ++it;
      continue;
    }
    std::vector<int32_t> one{e->second.block};
    (void)pool_.release(one);
    entries_.erase(e);
    it = lru_.erase(it);
    ++freed;
  }
  return freed;
}

void PrefixCache::clear() {
  for (auto& [key, e] : entries_) {
    std::vector<int32_t> one{e.block};
    (void)pool_.release(one);
  }
  entries_.clear();
  lru_.clear();
}

}  // namespace rolloutd::core
