#include "backend/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/vec_ops.h"
#include "core/error.h"
#include "core/half.h"

namespace tf::cpu {

namespace {
constexpr int kMaxHeadDim = 512;
constexpr int kMaxGroup = 64;  // query heads per KV head
}

void paged_attention(const float* q, int G, int D, const PagedKv& kv, int64_t n, float scale, float* out) {
  TF_CHECK(G > 0 && G <= kMaxGroup && D > 0 && D <= kMaxHeadDim && n > 0, "paged_attention: bad sizes");
  const VecOps& ops = vec_ops();
  const int bs = kv.block_size;
  // Per-thread scratch, bounded by the tile whatever n is: the G rounded queries, a tile of
  // K (then V) rows converted to float once for all G heads, and the G heads' tile scores.
  thread_local std::vector<float> scratch;
  const size_t need = size_t(G) * D + size_t(kAttentionTile) * D + size_t(G) * kAttentionTile;
  if (scratch.size() < need) scratch.resize(need);
  float* qr = scratch.data();
  float* rows = qr + size_t(G) * D;
  float* scores = rows + size_t(kAttentionTile) * D;
  for (int i = 0; i < G * D; ++i) qr[i] = kv.f32 ? q[i] : fp16_to_fp32(fp32_to_fp16(q[i]));
  // Online softmax over tiles of kAttentionTile positions: each head's running maximum and
  // running sum of exp(s - max) are rescaled whenever a tile raises that head's maximum.
  float mx[kMaxGroup];
  double sum[kMaxGroup];
  std::fill(mx, mx + G, -INFINITY);
  std::fill(sum, sum + G, 0.0);
  std::fill(out, out + size_t(G) * D, 0.f);
  // Row j of the tile: in the cache (float) or converted into `rows` (half).
  const float* row_ptr[kAttentionTile];
  auto gather = [&](const void* base, int64_t j0, int64_t m) {
    int64_t b = j0 / bs, in_page = j0 % bs;
    for (int64_t j = 0; j < m; ++j) {
      const size_t at = size_t(kv.table[b]) * kv.page_stride + size_t(in_page) * size_t(D);
      if (kv.f32) {
        row_ptr[j] = static_cast<const float*>(base) + at;
      } else {
        ops.f16_to_f32(D, static_cast<const uint16_t*>(base) + at, rows + j * D);
        row_ptr[j] = rows + j * D;
      }
      if (++in_page == bs) { in_page = 0; ++b; }
    }
  };
  for (int64_t j0 = 0; j0 < n; j0 += kAttentionTile) {
    const int64_t m = std::min<int64_t>(kAttentionTile, n - j0);
    gather(kv.k_base, j0, m);
    // Scores: each K row against all G queries at once (independent dot chains).
    float dots[kMaxGroup];
    for (int64_t j = 0; j < m; ++j) {
      ops.dot_rows_f32(D, qr, D, G, row_ptr[j], dots);
      for (int h = 0; h < G; ++h) scores[size_t(h) * kAttentionTile + size_t(j)] = dots[h] * scale;
    }
    for (int h = 0; h < G; ++h) {
      float* sc = scores + size_t(h) * kAttentionTile;
      float tile_max = -INFINITY;
      for (int64_t j = 0; j < m; ++j) tile_max = std::max(tile_max, sc[j]);
      if (tile_max > mx[h]) {
        if (j0 > 0) {
          const float r = std::exp(mx[h] - tile_max);
          ops.scale(D, out + size_t(h) * D, r);
          sum[h] *= double(r);
        }
        mx[h] = tile_max;
      }
      sum[h] += double(ops.exp_sub_sum(m, sc, mx[h]));
      // With a half cache the probabilities are rounded to half (llama.cpp's numerics).
      if (!kv.f32) {
        uint16_t half[kAttentionTile];
        ops.f32_to_f16(m, sc, half);
        ops.f16_to_f32(m, half, sc);
      }
    }
    gather(kv.v_base, j0, m);
    float p[kMaxGroup];
    for (int64_t j = 0; j < m; ++j) {
      for (int h = 0; h < G; ++h) p[h] = scores[size_t(h) * kAttentionTile + size_t(j)];
      ops.axpy_rows_f32(D, p, G, row_ptr[j], out, D);
    }
  }
  for (int h = 0; h < G; ++h) ops.scale(D, out + size_t(h) * D, float(1.0 / sum[h]));
}

}  // namespace tf::cpu
