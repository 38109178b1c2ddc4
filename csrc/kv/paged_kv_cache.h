// Paged KV cache: one pool of fixed-size blocks allocated once at start-up, per-sequence
// block tables, blocks returned to the free list when a sequence ends. K and V are stored
// as IEEE half; each (layer, block, kv head) holds block_size rows of head_dim values.
// Every size is checked for overflow before the pool is allocated; block ids are int32, so
// the pool holds at most 2^31 - 1 blocks, and at most max_seqs() sequences exist at once.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace tf {

enum class KvType { F16, F32 };

class PagedKvCache {
 public:
  PagedKvCache(int n_layer, int n_kv_head, int head_dim, int block_size, int64_t n_blocks,
               KvType type = KvType::F16);

  // Bytes of K and V one token takes over all layers; 0 when that overflows.
  static uint64_t bytes_per_token(int n_layer, int n_kv_head, int head_dim, KvType type);
  // Sequence slots that may exist at once (a live sequence holds at least one block).
  static constexpr int kMaxSeqs = 1 << 16;
  int max_seqs() const { return int(std::min<int64_t>(n_blocks_, kMaxSeqs)); }

  KvType type() const { return type_; }
  size_t elem_size() const { return type_ == KvType::F32 ? 4 : 2; }

  int block_size() const { return block_size_; }
  int64_t n_blocks() const { return n_blocks_; }
  int64_t free_blocks() const { return int64_t(free_list_.size()); }
  size_t bytes() const { return n_elems_ * elem_size(); }

  // Sequence slots. A slot owns the blocks listed in its block table. create_sequence
  // returns -1 when max_seqs() slots are in use.
  int create_sequence();
  void free_sequence(int seq);
  // Grow the sequence's table to hold n_tokens in total. All-or-nothing: returns false and
  // changes nothing when the pool has too few free blocks.
  bool reserve(int seq, int64_t n_tokens);
  int64_t capacity(int seq) const;
  const std::vector<int32_t>& block_table(int seq) const { return tables_[size_t(seq)]; }
  int64_t blocks_needed(int seq, int64_t n_tokens) const;
  // TP follower: mirror a block table decided by rank 0 (the follower never allocates).
  // Checks the slot and every block id.
  void assign_table(int seq, const int32_t* blocks, size_t n);

  // Rows of one (layer, block, kv head): [block_size][head_dim] elements.
  void* k_block(int layer, int32_t block, int kv_head) { return at(layer, block, 0, kv_head); }
  void* v_block(int layer, int32_t block, int kv_head) { return at(layer, block, 1, kv_head); }
  // Elements between the same (layer, kv head) rows of consecutive blocks.
  size_t page_stride() const { return 2 * size_t(n_kv_head_) * size_t(block_size_) * size_t(head_dim_); }
  // Row of the token at `pos` of sequence `seq`.
  void* k_row(int layer, int seq, int64_t pos, int kv_head);
  void* v_row(int layer, int seq, int64_t pos, int kv_head);

 private:
  uint8_t* at(int layer, int32_t block, int kv, int head) {
    const size_t idx = ((size_t(layer) * size_t(n_blocks_) + size_t(block)) * 2 + size_t(kv)) *
                           size_t(n_kv_head_) + size_t(head);
    return storage_.get() + idx * size_t(block_size_) * size_t(head_dim_) * elem_size();
  }

  int n_layer_, n_kv_head_, head_dim_, block_size_;
  int64_t n_blocks_;
  KvType type_;
  // Left uninitialised: pages are touched only when a block is first written, so a large
  // pool costs nothing at start-up.
  std::unique_ptr<uint8_t[]> storage_;
  size_t n_elems_ = 0;
  std::vector<int32_t> free_list_;
  std::vector<std::vector<int32_t>> tables_;
  std::vector<bool> slot_used_;
};

}  // namespace tf
