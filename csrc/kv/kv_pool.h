// One pool group of the KV cache (kv/kv_cache.h): the layers that share a KvSpec, a fixed pool
// of blocks allocated once at start-up, per-sequence block tables, and blocks returned to the
// free list when a sequence lets go of them. A block holds block_size entries (an entry: one
// token, or `compression` tokens of a compressed cache) of every layer of the group. Rows are
// IEEE half (or float).
// Blocks are reference-counted: with the prefix cache on, a full block may be registered
// (kv/prefix_cache.h) and then shared read-only by every sequence whose tokens start the same
// way; when its last reference goes it stays cached and is evicted, least recently released
// first, only when the free list is empty.
// Every size is checked for overflow before the pool is allocated; block ids are int32.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/buffer.h"
#include "kv/kv_spec.h"
#include "kv/prefix_cache.h"

namespace tf {

class Backend;

class KvPool {
 public:
  // Bytes of the rows of n_blocks blocks (0 when that overflows).
  static uint64_t bytes(const KvSpec& spec, int n_layers, int block_size, int64_t n_blocks, KvType type);
  // `storage` must hold bytes(...) bytes (left uninitialised until prefault()).
  KvPool(const KvSpec& spec, int n_layers, int block_size, int64_t n_blocks, KvType type, Buffer storage);

  const KvSpec& spec() const { return spec_; }
  int n_layers() const { return n_layers_; }
  KvType type() const { return type_; }
  size_t elem_size() const { return type_ == KvType::F32 ? 4 : 2; }
  int block_size() const { return block_size_; }                     // entries per block
  int64_t tokens_per_block() const { return int64_t(block_size_) * spec_.compression; }
  int64_t n_blocks() const { return n_blocks_; }
  int64_t free_blocks() const { return int64_t(free_list_.size()) + cached_blocks(); }
  int64_t empty_blocks() const { return int64_t(free_list_.size()); }
  int64_t cached_blocks() const { return prefix_ ? prefix_->n_parked() : 0; }
  size_t bytes() const { return storage_.size(); }
  // Touches every page now (resident from the start, as planned): zeroed through the backend
  // that owns the storage (a GPU's memory set on the device), or on the host without one.
  void prefault(Backend* be = nullptr);

  // Prefix cache of this group (off until enabled; a TP follower mirrors tables instead).
  void enable_prefix_cache(uint64_t seed);
  PrefixCache* prefix_cache() { return prefix_.get(); }
  void share(int seq, int32_t block);  // appends a registered block (one more reference)
  int32_t register_block(int seq, size_t index, uint64_t key, int32_t parent, const int32_t* tokens);

  // Block tables, indexed by the sequence slots the KvCache hands out.
  void ensure_slot(int seq);
  const std::vector<int32_t>& block_table(int seq) const { return tables_[size_t(seq)]; }
  int64_t blocks_needed(int seq, int64_t n_entries) const;
  bool grow(int seq, int64_t n_blocks);  // all-or-nothing; the caller checked blocks_needed
  void release(int seq);                 // every block of the table
  // Keeps the blocks that hold entries [0, n_entries): false (and no change) when one of them
  // was released already (a window group that moved past it).
  bool truncate(int seq, int64_t n_entries);
  // Gives the sequence its own copy of table entry `index` when that block is cached (the
  // sequence is about to write into it: the cached rows must stay as registered). false when
  // no block is free for the copy.
  bool unshare(int seq, size_t index, Backend& be);
  bool is_cached(int32_t block) const { return prefix_ && block >= 0 && prefix_->registered(block); }
  // Window groups: lets go of the table's blocks before `first_kept` (they become holes, -1).
  void release_before(int seq, int64_t first_kept);
  int64_t released(int seq) const { return released_[size_t(seq)]; }
  // TP follower: mirror a table decided by rank 0 (holes allowed before the first real block).
  void assign_table(int seq, const int32_t* blocks, size_t n);

  // Rows of one (layer of the group, block, head): [block_size][k_dim]; V: [block_size][v_dim],
  // or the K rows themselves when the spec has no V rows.
  void* k_block(int layer, int32_t block, int head) const {
    return base(layer, block) + size_t(head) * size_t(block_size_) * size_t(spec_.k_dim) * elem_size();
  }
  void* v_block(int layer, int32_t block, int head) const {
    if (spec_.v_dim == 0) return k_block(layer, block, head);
    return base(layer, block) +
           (size_t(spec_.n_heads) * size_t(spec_.k_dim) + size_t(head) * size_t(spec_.v_dim)) * size_t(block_size_) *
               elem_size();
  }
  // Elements between the same (layer, head) rows of consecutive blocks (K and V alike).
  size_t page_stride() const { return size_t(block_size_) * size_t(spec_.values_per_entry()); }
  void* k_row(int layer, int seq, int64_t entry, int head) const;
  void* v_row(int layer, int seq, int64_t entry, int head) const;

 private:
  uint8_t* base(int layer, int32_t block) const {
    return static_cast<uint8_t*>(storage_.data()) +
           (size_t(layer) * size_t(n_blocks_) + size_t(block)) * page_stride() * elem_size();
  }
  int32_t take_block();
  void drop(int32_t block);  // one reference less: parked when registered, else freed

  KvSpec spec_;
  int n_layers_;
  int block_size_;
  int64_t n_blocks_;
  KvType type_;
  Buffer storage_;
  std::vector<int32_t> free_list_;
  std::vector<int32_t> refs_;
  std::unique_ptr<PrefixCache> prefix_;
  std::vector<std::vector<int32_t>> tables_;
  std::vector<int64_t> released_;  // per slot: leading blocks let go of (window groups)
};

}  // namespace tf
