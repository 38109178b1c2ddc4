#include "backend/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/vec_ops.h"
#include "core/error.h"
#include "core/half.h"

namespace tf::cpu {

namespace {
constexpr int kMaxHeadDim = 1024;  // MLA: a 512 latent + 64 rope row
constexpr int kMaxGroup = 128;  // query heads per KV head (MLA: all heads share the latent)

// One query row's online-softmax step over n scores of a tile (already scaled): when the tile
// raises the row's running maximum, the row's output and running sum are rescaled (not for
// the first tile: nothing is accumulated yet); the scores become exp(s - max), rounded to half
// with a half cache (llama.cpp's numerics), and join the running sum. Both kernels call this,
// so they agree bit for bit.
void softmax_tile_step(const VecOps& ops, float* sc, int64_t n, bool first_tile, bool half_probs, float& mx,
                       double& sum, float* out_row, int D) {
  float tile_max = -INFINITY;
  for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, sc[j]);
  if (tile_max > mx) {
    if (!first_tile) {
      const float r = std::exp(mx - tile_max);
      ops.scale(D, out_row, r);
      sum *= double(r);
    }
    mx = tile_max;
  }
  sum += double(ops.exp_sub_sum(n, sc, mx));
  if (half_probs) {
    uint16_t half[kAttentionTile];
    ops.f32_to_f16(n, sc, half);
    ops.f16_to_f32(n, half, sc);
  }
}
// Positions per tile: kAttentionTile, fewer for wide rows (MLA's 576) so that the tile's rows
// converted to float stay in L2 between the score and value passes. Both kernels use the same
// tiles, so they still agree bit for bit.
inline int tile_positions(int head_dim) {
  return head_dim <= 128 ? kAttentionTile : head_dim <= 256 ? kAttentionTile / 2 : kAttentionTile / 4;
}
}  // namespace

void paged_attention(const float* q, int G, int D, const PagedKv& kv, int64_t n, float scale, float* out) {
  paged_attention(q, G, D, kv, 0, n, scale, out, vec_ops());
}

void paged_attention(const float* q, int G, int D, const PagedKv& kv, int64_t begin, int64_t n, float scale,
                     float* out, const VecOps& ops) {
  const int Dv = kv.v_dim > 0 ? kv.v_dim : D;
  TF_CHECK(G > 0 && G <= kMaxGroup && D > 0 && D <= kMaxHeadDim && Dv <= D && begin >= 0 && n > begin,
           "paged_attention: bad sizes");
  const int bs = kv.block_size;
  const int T = tile_positions(D);
  // Per-thread scratch, bounded by the tile whatever n is: the G rounded queries, a tile of
  // K (then V) rows as float, converted once for all G heads, and the G heads' tile scores.
  thread_local std::vector<float> scratch;
  const size_t need = size_t(G) * D + size_t(T) * D + size_t(G) * T;
  if (scratch.size() < need) scratch.resize(need);
  float* qr = scratch.data();
  float* rows = qr + size_t(G) * D;
  float* scores = rows + size_t(T) * D;
  for (int i = 0; i < G * D; ++i) qr[i] = kv.f32 ? q[i] : fp16_to_fp32(fp32_to_fp16(q[i]));
  // Online softmax over tiles of T positions: each head's running maximum and running sum of
  // exp(s - max) are rescaled whenever a tile raises that head's maximum.
  float mx[kMaxGroup];
  double sum[kMaxGroup];
  std::fill(mx, mx + G, -INFINITY);
  std::fill(sum, sum + G, 0.0);
  std::fill(out, out + size_t(G) * Dv, 0.f);
  // Rows [j0, j0 + m) of the pages into rows[at ..] as float.
  auto gather = [&](const void* base, int64_t j0, int64_t m, int width, int64_t at_row) {
    int64_t b = j0 / bs, in_page = j0 % bs;
    for (int64_t j = 0; j < m; ++j) {
      const size_t at = size_t(kv.table[b]) * kv.page_stride + size_t(in_page) * size_t(D);
      float* dst = rows + (at_row + j) * D;
      if (kv.f32)
        std::copy_n(static_cast<const float*>(base) + at, width, dst);
      else
        ops.f16_to_f32(width, static_cast<const uint16_t*>(base) + at, dst);
      if (++in_page == bs) { in_page = 0; ++b; }
    }
  };
  // Each tile is met as two small matrix products (heads x K rows, then probabilities x V
  // rows), register-blocked over several heads and rows at once; every score and output
  // element is formed exactly as the prefill block kernel forms it. Tiles lie on the same grid
  // whatever `begin` is (positions before it masked), so both kernels still agree.
  for (int64_t j0 = begin / T * T; j0 < n; j0 += T) {
    const int m = int(std::min<int64_t>(T, n - j0));
    const int lo = int(std::max<int64_t>(0, begin - j0));  // rows before the window: not read
    if (lo > 0) std::fill(rows, rows + size_t(lo) * D, 0.f);
    gather(kv.k_base, j0 + lo, m - lo, D, lo);
    ops.dot_block_f32(D, qr, D, G, rows, D, m, scores, T);
    for (int h = 0; h < G; ++h) {
      float* sc = scores + size_t(h) * T;
      for (int j = lo; j < m; ++j) sc[j] *= scale;
      softmax_tile_step(ops, sc + lo, m - lo, j0 <= begin, !kv.f32, mx[h], sum[h], out + size_t(h) * Dv, Dv);
      std::fill(sc, sc + lo, 0.f);
    }
    if (kv.v_base != kv.k_base) gather(kv.v_base, j0 + lo, m - lo, Dv, lo);  // else the K rows' prefix is V
    ops.axpy_block_f32(Dv, scores, T, G, rows, D, m, out, Dv);
  }
  for (int h = 0; h < G; ++h) ops.scale(Dv, out + size_t(h) * Dv, float(1.0 / sum[h]));
}

void paged_attention_causal(const float* q, int64_t token_stride, int n_tokens, int G, int D, const PagedKv& kv,
                            int64_t pos0, float scale, float* out, int64_t out_token_stride) {
  paged_attention_causal(q, token_stride, n_tokens, G, D, kv, pos0, 0, scale, out, out_token_stride, vec_ops());
}

void paged_attention_causal(const float* q, int64_t token_stride, int n_tokens, int G, int D, const PagedKv& kv,
                            int64_t pos0, int64_t window, float scale, float* out, int64_t out_token_stride,
                            const VecOps& ops) {
  const int R = n_tokens * G;
  const int Dv = kv.v_dim > 0 ? kv.v_dim : D;
  TF_CHECK(G > 0 && D > 0 && D <= kMaxHeadDim && Dv <= D && n_tokens > 0 && R <= kAttentionBlockRows && pos0 >= 0 &&
               window >= 0,
           "paged_attention_causal: bad sizes");
  const int bs = kv.block_size;
  const int T = tile_positions(D);
  // Per-thread scratch, bounded by the block and the tile: rounded queries, one tile of K
  // (then V) rows as float, the block's tile scores and its output accumulators.
  thread_local std::vector<float> scratch;
  const size_t need = size_t(R) * D * 2 + size_t(T) * D + size_t(R) * T;
  if (scratch.size() < need) scratch.resize(need);
  float* qr = scratch.data();
  float* acc = qr + size_t(R) * D;
  float* rows = acc + size_t(R) * D;
  float* scores = rows + size_t(T) * D;
  for (int t = 0; t < n_tokens; ++t)
    for (int i = 0; i < G * D; ++i) {
      const float v = q[t * token_stride + i];
      qr[size_t(t) * G * D + i] = kv.f32 ? v : fp16_to_fp32(fp32_to_fp16(v));
    }
  std::fill(acc, acc + size_t(R) * Dv, 0.f);
  float mx[kAttentionBlockRows];
  double sum[kAttentionBlockRows];
  std::fill(mx, mx + R, -INFINITY);
  std::fill(sum, sum + R, 0.0);
  // Rows [j0, j0 + m) of the pages into rows[at ..] as float.
  auto gather = [&](const void* base, int64_t j0, int64_t m, int width, int64_t at_row) {
    int64_t b = j0 / bs, in_page = j0 % bs;
    for (int64_t j = 0; j < m; ++j) {
      const size_t at = size_t(kv.table[b]) * kv.page_stride + size_t(in_page) * size_t(D);
      float* dst = rows + (at_row + j) * D;
      if (kv.f32)
        std::copy_n(static_cast<const float*>(base) + at, width, dst);
      else
        ops.f16_to_f32(width, static_cast<const uint16_t*>(base) + at, dst);
      if (++in_page == bs) { in_page = 0; ++b; }
    }
  };
  const int64_t n = pos0 + n_tokens;  // keys the last token sees
  // Token t sees keys [first(t), pos0 + t]: all of them, or the last `window`.
  auto first = [&](int t) { return window > 0 ? std::max<int64_t>(0, pos0 + t + 1 - window) : int64_t(0); };
  const int64_t begin = first(0);  // the block's first token's window starts first
  for (int64_t j0 = begin / T * T; j0 < n; j0 += T) {
    const int m = int(std::min<int64_t>(T, n - j0));
    const int lo = int(std::max<int64_t>(0, begin - j0));  // rows no token of the block reads
    if (lo > 0) std::fill(rows, rows + size_t(lo) * D, 0.f);
    gather(kv.k_base, j0 + lo, m - lo, D, lo);
    ops.dot_block_f32(D, qr, D, R, rows, D, m, scores, T);
    for (int r = 0; r < R; ++r) {
      float* sc = scores + size_t(r) * T;
      // The keys this row's token sees in the tile: [a, b) of it.
      const int a = int(std::clamp<int64_t>(first(r / G) - j0, 0, m));
      const int b = int(std::clamp<int64_t>(pos0 + r / G + 1 - j0, 0, m));
      if (b <= a) {
        std::fill(sc, sc + m, 0.f);
        continue;
      }
      for (int j = a; j < b; ++j) sc[j] *= scale;
      softmax_tile_step(ops, sc + a, b - a, j0 <= first(r / G), !kv.f32, mx[r], sum[r], acc + size_t(r) * Dv, Dv);
      std::fill(sc, sc + a, 0.f);
      std::fill(sc + b, sc + m, 0.f);
    }
    if (kv.v_base != kv.k_base) gather(kv.v_base, j0 + lo, m - lo, Dv, lo);  // else the K rows' prefix is V
    ops.axpy_block_f32(Dv, scores, T, R, rows, D, m, acc, Dv);
  }
  for (int t = 0; t < n_tokens; ++t)
    for (int h = 0; h < G; ++h) {
      const int r = t * G + h;
      const float inv = float(1.0 / sum[r]);
      const float* src = acc + size_t(r) * Dv;
      float* dst = out + t * out_token_stride + size_t(h) * Dv;
      for (int i = 0; i < Dv; ++i) dst[i] = src[i] * inv;
    }
}

}  // namespace tf::cpu
