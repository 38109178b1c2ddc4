#include "kv/kv_pool.h"

#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include "backend/backend.h"
#include "core/error.h"

namespace tf {

std::string KvSpec::describe() const {
  std::ostringstream os;
  if (v_dim == 0)
    os << n_heads << (n_heads == 1 ? " row" : " rows") << " of " << k_dim;
  else if (v_dim == k_dim)
    os << n_heads << " heads x K and V of " << k_dim;
  else
    os << n_heads << " heads x (K " << k_dim << " + V " << v_dim << ")";
  if (compression > 1) os << ", one entry per " << compression << " tokens";
  if (window > 0) os << ", window " << window;
  if (state_bytes > 0) os << ", " << state_bytes << " B state per sequence";
  return os.str();
}

uint64_t KvPool::bytes(const KvSpec& spec, int n_layers, int block_size, int64_t n_blocks, KvType type) {
  if (!spec.valid() || n_layers <= 0 || block_size <= 0 || n_blocks <= 0) return 0;
  uint64_t b = type == KvType::F32 ? 4 : 2;
  for (uint64_t f : {uint64_t(n_layers), uint64_t(n_blocks), uint64_t(block_size), uint64_t(spec.values_per_entry())})
    if (__builtin_mul_overflow(b, f, &b)) return 0;
  return b;
}

KvPool::KvPool(const KvSpec& spec, int n_layers, int block_size, int64_t n_blocks, KvType type, Buffer storage)
    : spec_(spec), n_layers_(n_layers), block_size_(block_size), n_blocks_(n_blocks), type_(type),
      storage_(std::move(storage)) {
  TF_CHECK(spec.valid() && n_layers > 0 && block_size > 0 && n_blocks > 0, "invalid KV cache geometry");
  TF_CHECK(n_blocks <= std::numeric_limits<int32_t>::max(), "the KV cache has ", n_blocks,
           " blocks, more than block ids can number (2^31 - 1); lower kv_tokens");
  TF_CHECK(storage_.size() >= bytes(spec, n_layers, block_size, n_blocks, type), "KV pool storage is too small");
  free_list_.reserve(size_t(n_blocks));
  // Hand out low block ids first (LIFO stack: push in reverse).
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_list_.push_back(int32_t(b));
  refs_.assign(size_t(n_blocks), 0);
}

void KvPool::prefault(Backend* be) {
  if (be) be->zero(storage_.data(), storage_.size());
  else std::memset(storage_.data(), 0, storage_.size());
}

void KvPool::enable_prefix_cache(uint64_t seed) {
  if (!prefix_) prefix_ = std::make_unique<PrefixCache>(int(tokens_per_block()), n_blocks_, seed);
}

int32_t KvPool::take_block() {
  // An empty block first; else the cached block released longest ago (forgotten by the index).
  if (!free_list_.empty()) {
    const int32_t b = free_list_.back();
    free_list_.pop_back();
    return b;
  }
  return prefix_ ? prefix_->evict_oldest() : -1;
}

void KvPool::drop(int32_t b) {
  if (b < 0 || --refs_[size_t(b)] > 0) return;  // a hole, or another sequence still reads it
  if (prefix_ && prefix_->registered(b))
    prefix_->park(b);
  else
    free_list_.push_back(b);
}

void KvPool::share(int seq, int32_t block) {
  TF_CHECK(prefix_ && block >= 0 && block < n_blocks_ && prefix_->registered(block),
           "share: block ", block, " is not a cached block");
  if (refs_[size_t(block)]++ == 0) prefix_->unpark(block);
  tables_[size_t(seq)].push_back(block);
}

int32_t KvPool::register_block(int seq, size_t index, uint64_t key, int32_t parent, const int32_t* tokens) {
  const int32_t b = tables_[size_t(seq)][index];
  if (prefix_->registered(b)) return b;  // shared from the cache: already there
  return prefix_->insert(b, key, parent, tokens);
}

void KvPool::ensure_slot(int seq) {
  if (size_t(seq) >= tables_.size()) {
    tables_.resize(size_t(seq) + 1);
    released_.resize(size_t(seq) + 1, 0);
  }
}

int64_t KvPool::blocks_needed(int seq, int64_t n_entries) const {
  const int64_t want = (n_entries + block_size_ - 1) / block_size_;
  const int64_t have = int64_t(tables_[size_t(seq)].size());
  return want > have ? want - have : 0;
}

bool KvPool::grow(int seq, int64_t n) {
  if (n > free_blocks()) return false;
  auto& table = tables_[size_t(seq)];
  for (int64_t i = 0; i < n; ++i) {
    const int32_t b = take_block();
    refs_[size_t(b)] = 1;
    table.push_back(b);
  }
  return true;
}

void KvPool::release(int seq) {
  // Last block first: a cached prefix's deeper blocks are parked before the blocks they follow,
  // so eviction takes a chain from its end and never strands a reachable tail.
  auto& table = tables_[size_t(seq)];
  for (auto it = table.rbegin(); it != table.rend(); ++it) drop(*it);
  table.clear();
  released_[size_t(seq)] = 0;
}

bool KvPool::truncate(int seq, int64_t n_entries) {
  auto& table = tables_[size_t(seq)];
  const int64_t keep = (n_entries + block_size_ - 1) / block_size_;
  if (keep > 0 && keep <= released_[size_t(seq)]) return false;  // the block it ends in is gone
  while (int64_t(table.size()) > keep) {
    drop(table.back());
    table.pop_back();
  }
  return true;
}

bool KvPool::unshare(int seq, size_t index, Backend& be) {
  auto& table = tables_[size_t(seq)];
  const int32_t old = table[index];
  if (!is_cached(old)) return true;
  const int32_t b = take_block();  // never `old`: the sequence still references it
  if (b < 0) return false;
  for (int l = 0; l < n_layers_; ++l) be.copy(base(l, b), base(l, old), page_stride() * elem_size());
  refs_[size_t(b)] = 1;
  table[index] = b;
  drop(old);
  return true;
}

void KvPool::release_before(int seq, int64_t first_kept) {
  auto& table = tables_[size_t(seq)];
  int64_t& done = released_[size_t(seq)];
  first_kept = std::min<int64_t>(first_kept, int64_t(table.size()));
  for (; done < first_kept; ++done) {
    drop(table[size_t(done)]);
    table[size_t(done)] = -1;
  }
}

void KvPool::assign_table(int seq, const int32_t* blocks, size_t n) {
  ensure_slot(seq);
  int64_t holes = 0;
  while (size_t(holes) < n && blocks[holes] == -1) ++holes;
  for (size_t i = size_t(holes); i < n; ++i)
    TF_CHECK(blocks[i] >= 0 && blocks[i] < n_blocks_, "assign_table: block id ", blocks[i], " out of range");
  tables_[size_t(seq)].assign(blocks, blocks + n);
  released_[size_t(seq)] = holes;
}

void* KvPool::k_row(int layer, int seq, int64_t entry, int head) const {
  const int32_t block = tables_[size_t(seq)][size_t(entry / block_size_)];
  return static_cast<uint8_t*>(k_block(layer, block, head)) +
         size_t(entry % block_size_) * size_t(spec_.k_dim) * elem_size();
}

void* KvPool::v_row(int layer, int seq, int64_t entry, int head) const {
  const int32_t block = tables_[size_t(seq)][size_t(entry / block_size_)];
  const size_t width = size_t(spec_.v_dim > 0 ? spec_.v_dim : spec_.k_dim);
  return static_cast<uint8_t*>(v_block(layer, block, head)) + size_t(entry % block_size_) * width * elem_size();
}

}  // namespace tf
