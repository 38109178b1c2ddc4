// Paged attention for one query head against one KV head's pages. The caller gives the
// address of the first page and the distance between pages, so the kernel works on any
// pool layout; pages hold block_size rows of head_dim halves.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tf::cpu {

struct PagedKv {
  const void* k_base;       // K rows of page 0 of this (layer, kv head)
  const void* v_base;       // V rows of page 0
  size_t page_stride;       // elements between consecutive pages
  const int32_t* table;     // page ids of the sequence, in position order
  int block_size;
  bool f32 = false;         // rows stored as float instead of half
};

// Positions scored at a time: the kernel's scratch (per thread) is a tile, whatever n is.
constexpr int kAttentionTile = 256;

// For each of the n_heads query heads that share this KV head (GQA; q and out: n_heads rows
// of head_dim): out[h] = softmax(q[h] . K[0..n) * scale) . V[0..n), computed tile by tile
// (online softmax). A half cache's rows are converted to float once per tile for all heads.
// With a half cache, q and the unnormalised probabilities are rounded to half (llama.cpp's
// F16 KV numerics); with a float cache everything stays in float.
void paged_attention(const float* q, int n_heads, int head_dim, const PagedKv& kv, int64_t n, float scale,
                     float* out);

}  // namespace tf::cpu
