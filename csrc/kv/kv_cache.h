// The KV cache organised by spec: every layer declares a KvSpec (model/block.h), layers with
// equal specs share a pool group (kv/kv_pool.h) with its own block tables, and a sequence has
// one slot, the same in every group. A sequence grows, shrinks (truncate: a draft's rejected
// tokens), lets go of what a window has moved past, and reuses cached prefixes, in every group
// at once; the engine sees one cache.
//
// Prefix cache: each group indexes its full blocks by the whole token prefix they end
// (kv/prefix_cache.h, keyed per group: a block of a compressed group covers more tokens). A
// new sequence reuses the longest prefix every group has, aligned to every group's blocks.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kv/kv_pool.h"
#include "kv/kv_spec.h"

namespace tf {

class Backend;

// A layer's place in the cache, as its attention block reads and writes it.
struct KvLayer {
  KvPool* pool = nullptr;
  int layer = 0;  // index of the layer within its group
};

// The sizes of one group, for the memory plan (before anything is allocated).
struct KvGroupPlan {
  KvSpec spec;
  std::vector<int> layers;  // model layers in the group
  int64_t n_blocks = 0;
  uint64_t bytes = 0;       // rows of all blocks (0: overflow)
  uint64_t index_bytes = 0; // its prefix cache index
  uint64_t bytes_per_token = 0;  // rows of one token over the group's layers (compressed: rounded up; window: 0)
  uint64_t bytes_per_seq = 0;    // window groups sized by sequences: the rows one sequence may hold
  int64_t seq_tokens = 0;        // ... and their tokens (0: the group is sized by tokens)
};

// The tokens each group holds: kv_tokens, except window groups when seqs > 0: seqs sequences of
// window + chunk tokens each (a step writes up to `chunk` tokens before the blocks behind the
// window are let go), in whole blocks plus one for alignment, never more than kv_tokens.
struct KvSizing {
  int64_t kv_tokens = 0;
  int64_t seqs = 0;
  int64_t chunk = 0;
};

class KvCache {
 public:
  static constexpr int kBlockSize = 16;        // entries per block
  static constexpr int kMaxSeqs = 1 << 16;     // sequence slots at most
  // The groups of these layer specs for a pool of kv_tokens tokens (whole blocks in every group).
  static std::vector<KvGroupPlan> plan(const std::vector<KvSpec>& layer_specs, const KvSizing& size, KvType type,
                                       bool prefix_cache);
  static std::vector<KvGroupPlan> plan(const std::vector<KvSpec>& layer_specs, int64_t kv_tokens, KvType type,
                                       bool prefix_cache) {
    return plan(layer_specs, KvSizing{kv_tokens, 0, 0}, type, prefix_cache);
  }
  KvCache(const std::vector<KvSpec>& layer_specs, const KvSizing& size, KvType type, Backend& be);
  KvCache(const std::vector<KvSpec>& layer_specs, int64_t kv_tokens, KvType type, Backend& be)
      : KvCache(layer_specs, KvSizing{kv_tokens, 0, 0}, type, be) {}

  int n_groups() const { return int(groups_.size()); }
  KvPool& group(int g) { return *groups_[size_t(g)].pool; }
  const KvPool& group(int g) const { return *groups_[size_t(g)].pool; }
  const std::vector<int>& group_layers(int g) const { return groups_[size_t(g)].layers; }
  KvLayer layer(int l) const { return {groups_[size_t(layer_group_[size_t(l)])].pool.get(), layer_index_[size_t(l)]}; }
  KvType type() const { return type_; }
  int64_t kv_tokens() const { return kv_tokens_; }
  uint64_t bytes() const;
  void prefault();
  int max_seqs() const { return max_seqs_; }
  // Tokens a new sequence could still get (the tightest group), and block counts summed over groups.
  int64_t free_tokens() const;
  int64_t used_blocks() const;
  int64_t empty_blocks() const;
  int64_t cached_blocks() const;
  int64_t total_blocks() const;

  // Sequences. create_sequence returns -1 when every slot is in use.
  int create_sequence();
  void free_sequence(int seq);
  // Room for n_tokens in every group (all-or-nothing across groups).
  bool reserve(int seq, int64_t n_tokens);
  int64_t capacity(int seq) const;  // tokens the tables hold (the tightest group)
  // Shortens a sequence to its first n_tokens (the rest of its blocks let go; a cached block it
  // now ends inside is replaced by a private copy, so the cache keeps what it registered).
  // false, with nothing changed, when a window group has already let go of blocks the shorter
  // sequence would read, or no block is free for that copy: the caller recomputes instead.
  bool truncate(int seq, int64_t n_tokens);
  // The sequence has computed n_computed tokens: window groups let go of blocks behind their
  // window; with the prefix cache on, its newly full blocks join the cache (tokens: its tokens).
  void advance(int seq, const int32_t* tokens, int64_t n_computed);

  // Prefix cache (rank 0; a TP follower mirrors tables).
  void enable_prefix_cache(uint64_t seed);
  bool prefix_cache_enabled() const { return prefix_on_; }
  // A new sequence's cached prefix: maps the blocks every group has for the longest common
  // prefix of `tokens` (never the last token) into its tables; returns the tokens covered.
  int64_t attach_prefix(int seq, const int32_t* tokens, int64_t n_tokens);

  // TP follower: the tables rank 0 decided.
  void assign_tables(int seq, int group, const int32_t* blocks, size_t n);

 private:
  struct Group {
    KvSpec spec;
    int64_t seq_tokens = 0;  // sized by sequences: the tokens one of them may hold (KvGroupPlan)
    std::vector<int> layers;
    std::unique_ptr<KvPool> pool;
  };
  // A slot's prefix chain in one group: the key and block after each registered block.
  struct Chain {
    std::vector<uint64_t> keys;
    std::vector<int32_t> blocks;
    bool broken = false;
  };
  int64_t entries(const Group& g, int64_t n_tokens) const {
    return (n_tokens + g.spec.compression - 1) / g.spec.compression;
  }
  void register_full_blocks(int seq, int g, const int32_t* tokens, int64_t n_computed);

  std::vector<Group> groups_;
  std::vector<int> layer_group_, layer_index_;
  KvType type_;
  int64_t kv_tokens_ = 0;
  int max_seqs_ = 0;
  Backend* be_ = nullptr;  // copies blocks (truncate)
  bool prefix_on_ = false;
  std::vector<bool> slot_used_;
  std::vector<std::vector<Chain>> chains_;  // [slot][group]
};

}  // namespace tf
