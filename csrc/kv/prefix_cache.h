// Prefix cache: an index of full KV blocks by the tokens of the whole prefix they end, so a
// request whose prompt starts like an earlier one (a shared system prompt, the next turn of
// a chat) reuses that K/V instead of recomputing it.
//
// Key of block i of a sequence = hash(key of block i-1, the block's tokens), seeded per
// engine (crafted collisions cannot be aimed at it). The hash only finds a candidate: a hit
// is exact because each entry also stores its own tokens and its parent (the block it
// follows, with that block's registration generation), and a lookup walks the chain from the
// first block, verifying the tokens and the parent link at each step. Equal chains therefore
// mean equal whole prefixes, whatever the hash does.
//
// The index does not own blocks: PagedKvCache counts references and asks the index to park
// a registered block when its last reference goes (it is kept, evictable, in least recently
// released order) and to give up the oldest parked one when the free list runs dry.
#pragma once
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace tf {

class PrefixCache {
 public:
  PrefixCache(int block_size, int64_t n_blocks, uint64_t seed);
  // Host memory the index of n_blocks blocks takes (for the memory plan): the entries, the
  // token rows and the hash map's nodes and buckets.
  static uint64_t bytes_per_block(int block_size);

  int block_size() const { return block_size_; }
  // Key of the first block's parent (the empty prefix).
  uint64_t root() const { return seed_; }
  uint64_t chain(uint64_t parent_key, const int32_t* tokens) const;

  // The registered block that holds `tokens` (block_size of them) right after the prefix
  // ending in block `parent` (-1: at the start), or -1.
  int32_t find(uint64_t key, int32_t parent, const int32_t* tokens) const;
  // Registers the full block `block`. Returns the block that now stands for this prefix:
  // `block` itself, or an equal block registered earlier (same tokens, same parent), or -1
  // when the key is held by a different prefix (a hash collision: the chain stops here).
  int32_t insert(int32_t block, uint64_t key, int32_t parent, const int32_t* tokens);
  bool registered(int32_t block) const { return e_[size_t(block)].registered; }

  // Parking: registered blocks no sequence references, oldest released first.
  void park(int32_t block);
  void unpark(int32_t block);
  // Unregisters the oldest parked block and returns it (-1 when none is parked).
  int32_t evict_oldest();
  int64_t n_parked() const { return n_parked_; }
  int64_t n_registered() const { return int64_t(index_.size()); }

 private:
  struct Entry {
    uint64_t key = 0;
    int32_t parent = -1;
    uint32_t parent_gen = 0;
    uint32_t gen = 0;  // bumped each time the block is registered: stale children never match
    bool registered = false;
    bool parked = false;
    int32_t prev = -1, next = -1;  // parked list links (head: oldest)
  };
  void unregister(int32_t block);

  int block_size_;
  uint64_t seed_;
  std::vector<Entry> e_;
  std::unique_ptr<int32_t[]> tokens_;  // [n_blocks][block_size]; a block's row is valid while registered
  std::unordered_map<uint64_t, int32_t> index_;
  int32_t head_ = -1, tail_ = -1;
  int64_t n_parked_ = 0;
};

}  // namespace tf
