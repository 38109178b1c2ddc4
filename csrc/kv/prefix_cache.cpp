#include "kv/prefix_cache.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace tf {

namespace {
// splitmix64's finalizer: every input bit reaches every output bit.
uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

PrefixCache::PrefixCache(int block_size, int64_t n_blocks, uint64_t seed)
    : block_size_(block_size), seed_(mix(seed)), e_(size_t(n_blocks)) {
  TF_CHECK(block_size > 0 && n_blocks > 0, "invalid prefix cache geometry");
  // Left uninitialised like the KV pool: a row is written when its block is registered.
  tokens_.reset(new int32_t[size_t(n_blocks) * size_t(block_size)]);
  index_.reserve(size_t(std::min<int64_t>(n_blocks, int64_t(1) << 20)));
}

uint64_t PrefixCache::bytes_per_block(int block_size) {
  // A map node is a next pointer and the (key, block) pair, plus the allocator's header;
  // then one bucket pointer per block (the map is reserved for all of them).
  constexpr uint64_t kMapNode = sizeof(void*) + sizeof(std::pair<const uint64_t, int32_t>) + 16;
  return sizeof(Entry) + uint64_t(block_size) * sizeof(int32_t) + kMapNode + sizeof(void*);
}

uint64_t PrefixCache::chain(uint64_t parent_key, const int32_t* tokens) const {
  // Two tokens per 64-bit word, each word mixed into the running state.
  uint64_t h = mix(parent_key ^ seed_);
  int i = 0;
  for (; i + 2 <= block_size_; i += 2)
    h = mix(h ^ (uint64_t(uint32_t(tokens[i])) | (uint64_t(uint32_t(tokens[i + 1])) << 32)));
  if (i < block_size_) h = mix(h ^ uint64_t(uint32_t(tokens[i])) ^ (uint64_t(1) << 63));
  return h;
}

int32_t PrefixCache::find(uint64_t key, int32_t parent, const int32_t* tokens) const {
  const auto it = index_.find(key);
  if (it == index_.end()) return -1;
  const int32_t b = it->second;
  const Entry& e = e_[size_t(b)];
  if (e.parent != parent) return -1;
  if (parent >= 0 && (!e_[size_t(parent)].registered || e_[size_t(parent)].gen != e.parent_gen)) return -1;
  if (std::memcmp(tokens_.get() + size_t(b) * size_t(block_size_), tokens, size_t(block_size_) * sizeof(int32_t)))
    return -1;
  return b;
}

int32_t PrefixCache::insert(int32_t block, uint64_t key, int32_t parent, const int32_t* tokens) {
  TF_CHECK(!e_[size_t(block)].registered, "prefix cache: block ", block, " is registered twice");
  const auto it = index_.find(key);
  if (it != index_.end()) {
    const int32_t same = find(key, parent, tokens);
    if (same >= 0) return same;  // another sequence computed this very prefix first
    const Entry& old = e_[size_t(it->second)];
    const bool stale = old.parent >= 0 &&
                       (!e_[size_t(old.parent)].registered || e_[size_t(old.parent)].gen != old.parent_gen);
    if (!stale) return -1;  // a different prefix under the same key (collision): keep the first
    // Its parent was evicted, so no lookup reaches it any more: this block takes the key.
    unregister(it->second);
  }
  Entry& e = e_[size_t(block)];
  e.key = key;
  e.parent = parent;
  e.parent_gen = parent >= 0 ? e_[size_t(parent)].gen : 0;
  ++e.gen;
  e.registered = true;
  std::memcpy(tokens_.get() + size_t(block) * size_t(block_size_), tokens, size_t(block_size_) * sizeof(int32_t));
  index_.emplace(key, block);
  return block;
}

void PrefixCache::unregister(int32_t block) {
  Entry& e = e_[size_t(block)];
  if (!e.registered) return;
  index_.erase(e.key);
  e.registered = false;
}

void PrefixCache::park(int32_t block) {
  Entry& e = e_[size_t(block)];
  if (e.parked) return;
  e.parked = true;
  e.prev = tail_;
  e.next = -1;
  if (tail_ >= 0)
    e_[size_t(tail_)].next = block;
  else
    head_ = block;
  tail_ = block;
  ++n_parked_;
}

void PrefixCache::unpark(int32_t block) {
  Entry& e = e_[size_t(block)];
  if (!e.parked) return;
  if (e.prev >= 0)
    e_[size_t(e.prev)].next = e.next;
  else
    head_ = e.next;
  if (e.next >= 0)
    e_[size_t(e.next)].prev = e.prev;
  else
    tail_ = e.prev;
  e.prev = e.next = -1;
  e.parked = false;
  --n_parked_;
}

int32_t PrefixCache::evict_oldest() {
  const int32_t b = head_;
  if (b < 0) return -1;
  unpark(b);
  unregister(b);
  return b;
}

}  // namespace tf
