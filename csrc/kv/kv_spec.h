// What one layer's attention keeps in the KV cache, declared by its block (model/block.h).
// Layers with equal specs share a pool group (kv/kv_cache.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace tf {

enum class KvType { F16, F32 };

// One entry per token, or per `compression` tokens (a compressed cache): n_heads rows of k_dim
// values, then n_heads rows of v_dim values. v_dim == 0: no V rows, the attention reads V as a
// prefix of the K row (multi-head latent attention keeps one row per token: the latent, then
// the rope key). window > 0: the attention reads only the last `window` tokens, and a
// sequence's blocks wholly before them are released as it advances. state_bytes: per-sequence
// state kept beside the rows (e.g. a compressor's pending tokens), 0 for none.
struct KvSpec {
  int n_heads = 0, k_dim = 0, v_dim = 0;
  int compression = 1;
  int64_t window = 0;
  size_t state_bytes = 0;

  int64_t values_per_entry() const { return int64_t(n_heads) * (int64_t(k_dim) + int64_t(v_dim)); }
  bool valid() const {
    return n_heads > 0 && k_dim > 0 && v_dim >= 0 && compression >= 1 && window >= 0;
  }
  bool operator==(const KvSpec& o) const {
    return n_heads == o.n_heads && k_dim == o.k_dim && v_dim == o.v_dim && compression == o.compression &&
           window == o.window && state_bytes == o.state_bytes;
  }
  bool operator!=(const KvSpec& o) const { return !(*this == o); }
  // "3 heads x (K 64 + V 64)", "1 row of 576 (V: its first 512)", "... every 4 tokens", "... window 128"
  std::string describe() const;
};

}  // namespace tf
