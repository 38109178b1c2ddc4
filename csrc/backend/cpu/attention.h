// Paged attention for one query head against one KV head's pages. The caller gives the
// address of the first page and the distance between pages, so the kernel works on any
// pool layout; pages hold block_size rows of head_dim halves.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tf::cpu {

struct PagedKv {
  const uint16_t* k_base;   // K rows of page 0 of this (layer, kv head)
  const uint16_t* v_base;   // V rows of page 0
  size_t page_stride;       // elements between consecutive pages
  const int32_t* table;     // page ids of the sequence, in position order
  int block_size;
};

// out[0..D) = softmax(q . K[0..n) * scale) . V[0..n). `scores` is scratch of n floats.
// q and the probabilities are rounded to half, matching llama.cpp's F16 KV numerics.
void paged_attention(const float* q, int head_dim, const PagedKv& kv, int64_t n, float scale,
                     float* scores, float* out);

}  // namespace tf::cpu
