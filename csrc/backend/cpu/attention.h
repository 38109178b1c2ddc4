// Paged attention for one query head against one KV head's pages. The caller gives the
// address of the first page and the distance between pages, so the kernel works on any
// pool layout; pages hold block_size rows of head_dim halves.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend/cpu/vec_ops.h"

namespace tf::cpu {

struct PagedKv {
  const void* k_base;       // K rows of page 0 of this (layer, kv head)
  const void* v_base;       // V rows of page 0
  size_t page_stride;       // elements between consecutive pages
  const int32_t* table;     // page ids of the sequence, in position order
  int block_size;
  bool f32 = false;         // rows stored as float instead of half
  // Values of a V row that are used (0: head_dim). Multi-head latent attention in absorbed
  // form keeps one row per token, the latent followed by the rope key: K is the whole row, V
  // its first v_dim values, and v_base == k_base (the rows are then read once per tile).
  int v_dim = 0;
};

// Positions scored at a time (at most; fewer for rows wider than 128): the kernel's scratch
// (per thread) is a tile, whatever n is.
constexpr int kAttentionTile = 256;

// For each of the n_heads query heads that share this KV head (GQA; q: n_heads rows of
// head_dim, out: n_heads rows of v_dim): out[h] = softmax(q[h] . K[0..n) * scale) . V[0..n), computed tile by tile
// (online softmax). A half cache's rows are converted to float once per tile for all heads.
// With a half cache, q and the unnormalised probabilities are rounded to half (llama.cpp's
// F16 KV numerics); with a float cache everything stays in float.
void paged_attention(const float* q, int n_heads, int head_dim, const PagedKv& kv, int64_t n, float scale,
                     float* out);
// The same over positions [begin, n) only (a sliding window), with the given vector ops.
void paged_attention(const float* q, int n_heads, int head_dim, const PagedKv& kv, int64_t begin, int64_t n,
                     float scale, float* out, const VecOps& ops);

// Query rows one prefill block attends with at once (tokens x heads sharing a KV head).
constexpr int kAttentionBlockRows = 64;

// The same for n_tokens consecutive tokens of one sequence at positions pos0 .. pos0 +
// n_tokens - 1, causally (token t sees positions 0 .. pos0 + t): head h of token t at
// q + t * token_stride + h * head_dim, its output at out + t * out_token_stride + h * v_dim;
// n_tokens * n_heads <= kAttentionBlockRows.
// Each tile of K and V rows is converted once for the whole block and met as small matrix
// products — prefill's attention cost is there, not in the per-query loop above.
void paged_attention_causal(const float* q, int64_t token_stride, int n_tokens, int n_heads, int head_dim,
                            const PagedKv& kv, int64_t pos0, float scale, float* out, int64_t out_token_stride);
// The same with a sliding window (window > 0: token t sees its last `window` positions only)
// and the given vector ops.
void paged_attention_causal(const float* q, int64_t token_stride, int n_tokens, int n_heads, int head_dim,
                            const PagedKv& kv, int64_t pos0, int64_t window, float scale, float* out,
                            int64_t out_token_stride, const VecOps& ops);

}  // namespace tf::cpu
