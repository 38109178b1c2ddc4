// Paged KV cache: one pool of fixed-size blocks allocated once at start-up, per-sequence
// block tables, blocks returned to the free list when a sequence ends. K and V are stored
// as IEEE half (or float); the attention kind decides the rows (KvLayout).
// Blocks are reference-counted: with the prefix cache on (enable_prefix_cache), a full block
// may be registered (kv/prefix_cache.h) and then shared read-only by every sequence whose
// prompt starts with the same tokens; when its last reference goes it stays cached and is
// evicted, least recently released first, only when the free list is empty.
// Every size is checked for overflow before the pool is allocated; block ids are int32, so
// the pool holds at most 2^31 - 1 blocks, and at most max_seqs() sequences exist at once.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "kv/prefix_cache.h"

namespace tf {

enum class KvType { F16, F32 };

// The cache rows of one attention kind, per (layer, block): n_heads K rows of k_dim values for
// each position, then n_heads V rows of v_dim. v_dim == 0: no V rows — the attention reads V
// as a prefix of the K row (multi-head latent attention keeps one row per token: the latent,
// then the rope key). GQA: {kv heads, head_dim, head_dim}.
struct KvLayout {
  int n_heads = 0, k_dim = 0, v_dim = 0;
  int64_t values_per_position() const { return int64_t(n_heads) * (int64_t(k_dim) + int64_t(v_dim)); }
};

class PagedKvCache {
 public:
  PagedKvCache(int n_layer, const KvLayout& layout, int block_size, int64_t n_blocks, KvType type = KvType::F16);

  // Bytes of K and V one token takes over all layers; 0 when that overflows.
  static uint64_t bytes_per_token(int n_layer, const KvLayout& layout, KvType type);
  const KvLayout& layout() const { return layout_; }
  // Sequence slots that may exist at once (a live sequence holds at least one block).
  static constexpr int kMaxSeqs = 1 << 16;
  int max_seqs() const { return int(std::min<int64_t>(n_blocks_, kMaxSeqs)); }

  KvType type() const { return type_; }
  size_t elem_size() const { return type_ == KvType::F32 ? 4 : 2; }

  int block_size() const { return block_size_; }
  int64_t n_blocks() const { return n_blocks_; }
  // Blocks a reservation may take: empty ones plus cached ones no sequence uses.
  int64_t free_blocks() const { return int64_t(free_list_.size()) + cached_blocks(); }
  int64_t empty_blocks() const { return int64_t(free_list_.size()); }
  int64_t cached_blocks() const { return prefix_ ? prefix_->n_parked() : 0; }
  int64_t used_blocks() const { return n_blocks_ - free_blocks(); }

  // Prefix cache (off until enabled; rank 0 only: a TP follower mirrors tables).
  void enable_prefix_cache(uint64_t seed);
  PrefixCache* prefix_cache() { return prefix_.get(); }
  // Appends a registered block to the sequence's table (one more reference).
  void share(int seq, int32_t block);
  // Registers the table's full block `index` (see PrefixCache::insert for the result).
  int32_t register_block(int seq, size_t index, uint64_t key, int32_t parent, const int32_t* tokens);
  size_t bytes() const { return n_elems_ * elem_size(); }
  // Touches every page of the pool now (the memory plan counts it resident from the start;
  // nothing is faulted in while serving).
  void prefault();

  // Sequence slots. A slot holds a reference to each block of its block table. create_sequence
  // returns -1 when max_seqs() slots are in use.
  int create_sequence();
  void free_sequence(int seq);
  // Grow the sequence's table to hold n_tokens in total. All-or-nothing: returns false and
  // changes nothing when the pool has too few free blocks (empty or evictable).
  bool reserve(int seq, int64_t n_tokens);
  int64_t capacity(int seq) const;
  const std::vector<int32_t>& block_table(int seq) const { return tables_[size_t(seq)]; }
  int64_t blocks_needed(int seq, int64_t n_tokens) const;
  // TP follower: mirror a block table decided by rank 0 (the follower never allocates).
  // Checks the slot and every block id.
  void assign_table(int seq, const int32_t* blocks, size_t n);

  // Rows of one (layer, block, kv head): [block_size][k_dim] (V: [block_size][v_dim], or the
  // K rows themselves when the layout has no V rows).
  void* k_block(int layer, int32_t block, int kv_head) {
    return base(layer, block) + size_t(kv_head) * size_t(block_size_) * size_t(layout_.k_dim) * elem_size();
  }
  void* v_block(int layer, int32_t block, int kv_head) {
    if (layout_.v_dim == 0) return k_block(layer, block, kv_head);
    return base(layer, block) + (size_t(layout_.n_heads) * size_t(layout_.k_dim) + size_t(kv_head) * size_t(layout_.v_dim)) *
                                    size_t(block_size_) * elem_size();
  }
  // Elements between the same (layer, kv head) rows of consecutive blocks (K and V alike).
  size_t page_stride() const { return size_t(block_size_) * size_t(layout_.values_per_position()); }
  // Row of the token at `pos` of sequence `seq`.
  void* k_row(int layer, int seq, int64_t pos, int kv_head);
  void* v_row(int layer, int seq, int64_t pos, int kv_head);

 private:
  uint8_t* base(int layer, int32_t block) {
    return storage_.get() + (size_t(layer) * size_t(n_blocks_) + size_t(block)) * page_stride() * elem_size();
  }

  int n_layer_;
  KvLayout layout_;
  int block_size_;
  int64_t n_blocks_;
  KvType type_;
  // Uninitialised until prefault() touches it.
  std::unique_ptr<uint8_t[]> storage_;
  size_t n_elems_ = 0;
  int32_t take_block();
  std::vector<int32_t> free_list_;
  std::vector<int32_t> refs_;  // references per block (sequence tables holding it)
  std::unique_ptr<PrefixCache> prefix_;
  std::vector<std::vector<int32_t>> tables_;
  std::vector<bool> slot_used_;
};

}  // namespace tf
