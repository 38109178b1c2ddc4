#include "kv/kv_cache.h"

#include <algorithm>
#include <limits>
#include <new>
#include <numeric>

#include "backend/backend.h"
#include "core/error.h"

namespace tf {

std::vector<KvGroupPlan> KvCache::plan(const std::vector<KvSpec>& layer_specs, const KvSizing& size, KvType type,
                                       bool prefix_cache) {
  const int64_t kv_tokens = size.kv_tokens;
  std::vector<KvGroupPlan> out;
  for (size_t l = 0; l < layer_specs.size(); ++l) {
    const KvSpec& s = layer_specs[l];
    TF_CHECK(s.valid(), "layer ", l, " declares an invalid KV spec");
    auto it = std::find_if(out.begin(), out.end(), [&](const KvGroupPlan& g) { return g.spec == s; });
    if (it == out.end()) {
      out.push_back(KvGroupPlan{s, {}, 0, 0, 0, 0});
      it = out.end() - 1;
    }
    it->layers.push_back(int(l));
  }
  const uint64_t elem = type == KvType::F32 ? 4 : 2;
  for (KvGroupPlan& g : out) {
    int64_t tokens = kv_tokens;
    const int64_t per_block = int64_t(kBlockSize) * g.spec.compression;
    const bool per_seq = g.spec.window > 0 && size.seqs > 0;
    int64_t seq_tokens = 0;
    if (per_seq) {
      seq_tokens = ((g.spec.window + size.chunk + per_block - 1) / per_block + 1) * per_block;
      if (seq_tokens < kv_tokens && size.seqs < kv_tokens / seq_tokens) tokens = size.seqs * seq_tokens;
    }
    const int64_t entries = (tokens + g.spec.compression - 1) / g.spec.compression;
    g.n_blocks = std::max<int64_t>(1, (entries + kBlockSize - 1) / kBlockSize);
    g.bytes = KvPool::bytes(g.spec, int(g.layers.size()), kBlockSize, g.n_blocks, type);
    if (prefix_cache)
      g.index_bytes = PrefixCache::bytes_per_block(kBlockSize * g.spec.compression) * uint64_t(g.n_blocks);
    uint64_t per = elem;
    bool ovf = false;
    for (uint64_t f : {uint64_t(g.layers.size()), uint64_t(g.spec.values_per_entry())})
      ovf |= __builtin_mul_overflow(per, f, &per);
    g.bytes_per_token = ovf ? 0 : (per + uint64_t(g.spec.compression) - 1) / uint64_t(g.spec.compression);
    if (per_seq) {
      g.seq_tokens = std::min(seq_tokens, kv_tokens);
      g.bytes_per_seq = g.bytes_per_token * uint64_t(g.seq_tokens);
      g.bytes_per_token = 0;
    }
  }
  return out;
}

KvCache::KvCache(const std::vector<KvSpec>& layer_specs, const KvSizing& size, KvType type, Backend& be)
    : type_(type), kv_tokens_(size.kv_tokens), be_(&be) {
  TF_CHECK(!layer_specs.empty() && size.kv_tokens > 0, "invalid KV cache geometry");
  const std::vector<KvGroupPlan> plans = plan(layer_specs, size, type, false);
  layer_group_.assign(layer_specs.size(), 0);
  layer_index_.assign(layer_specs.size(), 0);
  max_seqs_ = kMaxSeqs;
  for (size_t g = 0; g < plans.size(); ++g) {
    const KvGroupPlan& p = plans[g];
    TF_CHECK(p.n_blocks <= std::numeric_limits<int32_t>::max(), "the KV cache has ", p.n_blocks,
             " blocks, more than block ids can number (2^31 - 1); lower kv_tokens");
    if (p.bytes == 0 || p.bytes > uint64_t(std::numeric_limits<std::ptrdiff_t>::max()))
      fail(ErrorKind::OutOfMemory, "the KV cache pool (", p.spec.describe(), ", ", p.layers.size(),
           " layers) would need more memory than can be addressed; lower kv_tokens (or context)");
    Buffer storage = be.alloc(size_t(p.bytes), BufferKind::Device);
    if (!storage)
      fail(ErrorKind::OutOfMemory, "cannot allocate the KV cache pool (", double(p.bytes) / double(1ull << 30),
           " GiB); lower kv_tokens (or context)");
    Group grp;
    grp.spec = p.spec;
    grp.seq_tokens = p.seq_tokens;
    grp.layers = p.layers;
    grp.pool = std::make_unique<KvPool>(p.spec, int(p.layers.size()), kBlockSize, p.n_blocks, type, std::move(storage));
    for (size_t i = 0; i < p.layers.size(); ++i) {
      layer_group_[size_t(p.layers[i])] = int(g);
      layer_index_[size_t(p.layers[i])] = int(i);
    }
    max_seqs_ = int(std::min<int64_t>(max_seqs_, p.n_blocks));
    groups_.push_back(std::move(grp));
  }
}

uint64_t KvCache::bytes() const {
  uint64_t b = 0;
  for (const Group& g : groups_) b += g.pool->bytes();
  return b;
}

void KvCache::prefault() {
  for (Group& g : groups_) g.pool->prefault(be_);
}

int64_t KvCache::free_tokens() const {
  int64_t t = std::numeric_limits<int64_t>::max();
  for (const Group& g : groups_) {
    const int64_t free = g.pool->free_blocks() * g.pool->tokens_per_block();
    // A window group sized by sequences limits no length once it has room for one more of them.
    if (g.seq_tokens > 0 && free >= g.seq_tokens) continue;
    t = std::min(t, free);
  }
  return std::min(t, kv_tokens_);
}

int64_t KvCache::total_blocks() const {
  int64_t n = 0;
  for (const Group& g : groups_) n += g.pool->n_blocks();
  return n;
}
int64_t KvCache::empty_blocks() const {
  int64_t n = 0;
  for (const Group& g : groups_) n += g.pool->empty_blocks();
  return n;
}
int64_t KvCache::cached_blocks() const {
  int64_t n = 0;
  for (const Group& g : groups_) n += g.pool->cached_blocks();
  return n;
}
int64_t KvCache::used_blocks() const { return total_blocks() - empty_blocks() - cached_blocks(); }

void KvCache::enable_prefix_cache(uint64_t seed) {
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g].pool->enable_prefix_cache(seed + g);
  prefix_on_ = true;
}

int KvCache::create_sequence() {
  size_t slot = 0;
  while (slot < slot_used_.size() && slot_used_[slot]) ++slot;
  if (slot == slot_used_.size()) {
    if (int64_t(slot_used_.size()) >= max_seqs_) return -1;
    slot_used_.push_back(false);
    chains_.emplace_back(groups_.size());
  }
  slot_used_[slot] = true;
  for (Group& g : groups_) g.pool->ensure_slot(int(slot));
  for (Chain& c : chains_[slot]) c = Chain{};
  return int(slot);
}

void KvCache::free_sequence(int seq) {
  TF_CHECK(seq >= 0 && size_t(seq) < slot_used_.size() && slot_used_[size_t(seq)],
           "free_sequence: unknown sequence ", seq);
  for (Group& g : groups_) g.pool->release(seq);
  for (Chain& c : chains_[size_t(seq)]) c = Chain{};
  slot_used_[size_t(seq)] = false;
}

bool KvCache::reserve(int seq, int64_t n_tokens) {
  for (const Group& g : groups_)
    if (g.pool->blocks_needed(seq, entries(g, n_tokens)) > g.pool->free_blocks()) return false;
  for (Group& g : groups_) g.pool->grow(seq, g.pool->blocks_needed(seq, entries(g, n_tokens)));
  return true;
}

int64_t KvCache::capacity(int seq) const {
  int64_t c = std::numeric_limits<int64_t>::max();
  for (const Group& g : groups_)
    c = std::min(c, int64_t(g.pool->block_table(seq).size()) * g.pool->tokens_per_block());
  return c;
}

bool KvCache::truncate(int seq, int64_t n_tokens) {
  TF_CHECK(n_tokens >= 0, "truncate: negative length");
  // First every group must be able to: a window group must still hold what the next token reads.
  for (const Group& g : groups_) {
    const KvPool& p = *g.pool;
    const int64_t keep = (entries(g, n_tokens) + p.block_size() - 1) / p.block_size();
    if (keep > 0 && keep <= p.released(seq)) return false;
    if (g.spec.window > 0) {
      const int64_t first_tok = std::max<int64_t>(0, n_tokens + 1 - g.spec.window);
      if (first_tok / g.spec.compression / p.block_size() < p.released(seq) && n_tokens > 0) return false;
    }
    // The block it ends inside, when cached, is copied: that needs a free block.
    const int64_t e = entries(g, n_tokens);
    if (e % p.block_size() != 0 && e / p.block_size() < int64_t(p.block_table(seq).size()) &&
        p.is_cached(p.block_table(seq)[size_t(e / p.block_size())]) && p.free_blocks() == 0)
      return false;
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = groups_[gi];
    const int64_t e = entries(g, n_tokens);
    g.pool->truncate(seq, e);
    if (e % g.pool->block_size() != 0 && e / g.pool->block_size() < int64_t(g.pool->block_table(seq).size()))
      TF_CHECK(g.pool->unshare(seq, size_t(e / g.pool->block_size()), *be_), "truncate: no block for the copy");
    Chain& c = chains_[size_t(seq)][gi];
    const size_t full = size_t(n_tokens / g.pool->tokens_per_block());
    if (c.blocks.size() > full) {
      c.blocks.resize(full);
      c.keys.resize(full);
    }
  }
  return true;
}

void KvCache::advance(int seq, const int32_t* tokens, int64_t n_computed) {
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = groups_[gi];
    if (prefix_on_ && tokens) register_full_blocks(seq, int(gi), tokens, n_computed);
    if (g.spec.window > 0) {
      // The next token (at n_computed) reads tokens from n_computed + 1 - window on.
      const int64_t first_tok = std::max<int64_t>(0, n_computed + 1 - g.spec.window);
      g.pool->release_before(seq, first_tok / g.spec.compression / g.pool->block_size());
    }
  }
}

void KvCache::register_full_blocks(int seq, int gi, const int32_t* tokens, int64_t n_computed) {
  KvPool& p = *groups_[size_t(gi)].pool;
  PrefixCache* pc = p.prefix_cache();
  Chain& c = chains_[size_t(seq)][size_t(gi)];
  if (!pc || c.broken) return;
  const int64_t tpb = p.tokens_per_block();
  const size_t full = size_t(n_computed / tpb);
  const auto& table = p.block_table(seq);
  for (size_t i = c.blocks.size(); i < full && i < table.size(); ++i) {
    if (table[i] < 0) {  // let go of before it was registered (a window behind it)
      c.broken = true;
      return;
    }
    const int32_t* t = tokens + int64_t(i) * tpb;
    const uint64_t key = pc->chain(i == 0 ? pc->root() : c.keys.back(), t);
    const int32_t b = p.register_block(seq, i, key, i == 0 ? -1 : c.blocks.back(), t);
    if (b < 0) {
      c.broken = true;
      return;
    }
    c.keys.push_back(key);
    c.blocks.push_back(b);
  }
}

int64_t KvCache::attach_prefix(int seq, const int32_t* tokens, int64_t n_tokens) {
  if (!prefix_on_ || n_tokens < 2) return 0;
  // Per group, the cached blocks the tokens start with (whole blocks, never the last token).
  std::vector<std::vector<int32_t>> found(groups_.size());
  std::vector<std::vector<uint64_t>> keys(groups_.size());
  int64_t common = n_tokens - 1, align = 1;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    KvPool& p = *groups_[gi].pool;
    PrefixCache* pc = p.prefix_cache();
    const int64_t tpb = p.tokens_per_block();
    align = std::lcm(align, tpb);
    uint64_t key = pc->root();
    int32_t parent = -1;
    for (int64_t i = 0; (i + 1) * tpb <= common; ++i) {
      const int32_t* t = tokens + i * tpb;
      key = pc->chain(key, t);
      const int32_t b = pc->find(key, parent, t);
      if (b < 0) break;
      found[gi].push_back(b);
      keys[gi].push_back(key);
      parent = b;
    }
    common = std::min(common, int64_t(found[gi].size()) * tpb);
  }
  common = common / align * align;
  if (common <= 0) return 0;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    KvPool& p = *groups_[gi].pool;
    const size_t n = size_t(common / p.tokens_per_block());
    Chain& c = chains_[size_t(seq)][gi];
    for (size_t i = 0; i < n; ++i) {
      p.share(seq, found[gi][i]);
      c.blocks.push_back(found[gi][i]);
      c.keys.push_back(keys[gi][i]);
    }
  }
  advance(seq, nullptr, common);  // window groups let go of what the rest does not read
  return common;
}

void KvCache::assign_tables(int seq, int group, const int32_t* blocks, size_t n) {
  TF_CHECK(seq >= 0 && seq < max_seqs_, "assign_tables: sequence slot ", seq, " is outside 0..", max_seqs_ - 1);
  if (size_t(seq) >= slot_used_.size()) {
    slot_used_.resize(size_t(seq) + 1, false);
    chains_.resize(size_t(seq) + 1, std::vector<Chain>(groups_.size()));
  }
  slot_used_[size_t(seq)] = true;
  groups_[size_t(group)].pool->assign_table(seq, blocks, n);
}

}  // namespace tf
