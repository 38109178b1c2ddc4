#include "kv/paged_kv_cache.h"

#include <cstddef>
#include <cstring>
#include <iomanip>
#include <limits>
#include <new>
#include <sstream>
#include <string>

#include "core/error.h"

namespace tf {

namespace {
std::string gib_str(double gib) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(gib < 10 ? 2 : 1) << gib;
  return os.str();
}
}  // namespace

PagedKvCache::PagedKvCache(int n_layer, const KvLayout& layout, int block_size, int64_t n_blocks, KvType type)
    : n_layer_(n_layer), layout_(layout), block_size_(block_size), n_blocks_(n_blocks), type_(type) {
  TF_CHECK(n_layer > 0 && layout.n_heads > 0 && layout.k_dim > 0 && layout.v_dim >= 0 && block_size > 0 &&
               n_blocks > 0,
           "invalid KV cache geometry");
  TF_CHECK(n_blocks <= std::numeric_limits<int32_t>::max(), "the KV cache has ", n_blocks,
           " blocks, more than block ids can number (2^31 - 1); lower kv_tokens");
  // elements = layers x blocks x block_size x values per position, each product checked.
  uint64_t elems = 1;
  bool overflow = false;
  for (uint64_t f : {uint64_t(n_layer), uint64_t(n_blocks), uint64_t(block_size), uint64_t(layout.values_per_position())})
    overflow |= __builtin_mul_overflow(elems, f, &elems);
  uint64_t bytes = 0;
  overflow |= __builtin_mul_overflow(elems, uint64_t(elem_size()), &bytes);
  overflow |= bytes > uint64_t(std::numeric_limits<std::ptrdiff_t>::max());
  const std::string gib = gib_str(double(n_layer) * double(n_blocks) * double(block_size) *
                                  double(layout.values_per_position()) * double(elem_size()) / double(1ull << 30));
  if (overflow)
    fail(ErrorKind::OutOfMemory, "the KV cache pool would need ", gib,
         " GiB, more than can be addressed; lower kv_tokens (or context)");
  n_elems_ = size_t(elems);
  storage_.reset(new (std::nothrow) uint8_t[size_t(bytes)]);
  if (!storage_) {
    fail(ErrorKind::OutOfMemory, "cannot allocate the KV cache pool (", gib, " GiB); lower kv_tokens (or context)");
  }
  free_list_.reserve(size_t(n_blocks));
  // Hand out low block ids first (LIFO stack: push in reverse).
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_list_.push_back(int32_t(b));
  refs_.assign(size_t(n_blocks), 0);
}

void PagedKvCache::enable_prefix_cache(uint64_t seed) {
  if (!prefix_) prefix_ = std::make_unique<PrefixCache>(block_size_, n_blocks_, seed);
}

int32_t PagedKvCache::take_block() {
  // An empty block first; else the cached block released longest ago (forgotten by the index).
  if (!free_list_.empty()) {
    const int32_t b = free_list_.back();
    free_list_.pop_back();
    return b;
  }
  return prefix_ ? prefix_->evict_oldest() : -1;
}

void PagedKvCache::share(int seq, int32_t block) {
  TF_CHECK(prefix_ && block >= 0 && block < n_blocks_ && prefix_->registered(block),
           "share: block ", block, " is not a cached block");
  if (refs_[size_t(block)]++ == 0) prefix_->unpark(block);
  tables_[size_t(seq)].push_back(block);
}

int32_t PagedKvCache::register_block(int seq, size_t index, uint64_t key, int32_t parent, const int32_t* tokens) {
  const int32_t b = tables_[size_t(seq)][index];
  if (prefix_->registered(b)) return b;  // shared from the cache: already there
  return prefix_->insert(b, key, parent, tokens);
}

uint64_t PagedKvCache::bytes_per_token(int n_layer, const KvLayout& layout, KvType type) {
  uint64_t b = type == KvType::F32 ? 4 : 2;
  const int64_t per = layout.values_per_position();
  if (n_layer <= 0 || per <= 0 || layout.n_heads <= 0 || layout.k_dim <= 0 || layout.v_dim < 0) return 0;
  for (uint64_t f : {uint64_t(n_layer), uint64_t(per)})
    if (__builtin_mul_overflow(b, f, &b)) return 0;
  return b;
}

int PagedKvCache::create_sequence() {
  for (size_t i = 0; i < slot_used_.size(); ++i) {
    if (!slot_used_[i]) {
      slot_used_[i] = true;
      tables_[i].clear();
      return int(i);
    }
  }
  if (int64_t(slot_used_.size()) >= max_seqs()) return -1;
  slot_used_.push_back(true);
  tables_.emplace_back();
  return int(tables_.size() - 1);
}

void PagedKvCache::free_sequence(int seq) {
  TF_CHECK(seq >= 0 && size_t(seq) < slot_used_.size() && slot_used_[size_t(seq)],
           "free_sequence: unknown sequence ", seq);
  // Last block first: a cached prefix's deeper blocks are parked before the blocks they follow,
  // so eviction takes a chain from its end and never strands a reachable tail.
  auto& table = tables_[size_t(seq)];
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    const int32_t b = *it;
    if (--refs_[size_t(b)] > 0) continue;  // another sequence still reads it
    if (prefix_ && prefix_->registered(b))
      prefix_->park(b);
    else
      free_list_.push_back(b);
  }
  table.clear();
  slot_used_[size_t(seq)] = false;
}

int64_t PagedKvCache::blocks_needed(int seq, int64_t n_tokens) const {
  const int64_t want = (n_tokens + block_size_ - 1) / block_size_;
  const int64_t have = int64_t(tables_[size_t(seq)].size());
  return want > have ? want - have : 0;
}

bool PagedKvCache::reserve(int seq, int64_t n_tokens) {
  const int64_t need = blocks_needed(seq, n_tokens);
  if (need > free_blocks()) return false;
  auto& table = tables_[size_t(seq)];
  for (int64_t i = 0; i < need; ++i) {
    const int32_t b = take_block();
    refs_[size_t(b)] = 1;
    table.push_back(b);
  }
  return true;
}

void PagedKvCache::assign_table(int seq, const int32_t* blocks, size_t n) {
  TF_CHECK(seq >= 0 && seq < max_seqs(), "assign_table: sequence slot ", seq, " is outside 0..", max_seqs() - 1);
  if (size_t(seq) >= tables_.size()) {
    tables_.resize(size_t(seq) + 1);
    slot_used_.resize(size_t(seq) + 1, false);
  }
  for (size_t i = 0; i < n; ++i)
    TF_CHECK(blocks[i] >= 0 && blocks[i] < n_blocks_, "assign_table: block id ", blocks[i], " out of range");
  tables_[size_t(seq)].assign(blocks, blocks + n);
  slot_used_[size_t(seq)] = true;
}

int64_t PagedKvCache::capacity(int seq) const {
  return int64_t(tables_[size_t(seq)].size()) * block_size_;
}

void* PagedKvCache::k_row(int layer, int seq, int64_t pos, int kv_head) {
  const int32_t block = tables_[size_t(seq)][size_t(pos / block_size_)];
  return static_cast<uint8_t*>(k_block(layer, block, kv_head)) +
         size_t(pos % block_size_) * size_t(layout_.k_dim) * elem_size();
}

void* PagedKvCache::v_row(int layer, int seq, int64_t pos, int kv_head) {
  const int32_t block = tables_[size_t(seq)][size_t(pos / block_size_)];
  const size_t width = size_t(layout_.v_dim > 0 ? layout_.v_dim : layout_.k_dim);
  return static_cast<uint8_t*>(v_block(layer, block, kv_head)) + size_t(pos % block_size_) * width * elem_size();
}

void PagedKvCache::prefault() {
  std::memset(storage_.get(), 0, bytes());
}

}  // namespace tf
