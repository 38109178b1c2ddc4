// Attention over two sources of entries with sinks (attention_sparse.h). Each item walks the
// entries it reads — the first source's [begin, end), then the second source's range or list —
// in tiles: a tile's K rows are converted to float once for the item's query heads, scored as
// one small product (heads x rows), folded into each head's online softmax, and its V rows
// (their own rows, or the K rows' prefix when the layer keeps one row per entry) added as a
// second product. A sink starts a head's softmax as if it were an entry scored `sink` with a
// zero value. q and the probabilities stay float whatever the cache type (a half cache's rows
// convert exactly).
#include "backend/cpu/attention_sparse.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kv/kv_cache.h"

namespace tf::cpu {

namespace {

// The rows of one (layer, cache head) of one sequence: entry e lives in block table[e / bs],
// row e % bs; blocks are page_bytes apart from the rows of block 0.
struct Source {
  const uint8_t* k_base = nullptr;
  const uint8_t* v_base = nullptr;  // nullptr: V is the first v_dim values of the K row
  size_t page_bytes = 0, k_row_bytes = 0, v_row_bytes = 0;
  const int32_t* table = nullptr;
  int64_t n_blocks = 0;
  int block_size = 0;
  bool f32 = false;

  // Byte offset of entry e's row within its (layer, head) page run, or -1 when no block holds it.
  int64_t page_offset(int64_t e) const {
    const int64_t b = e / block_size;
    if (e < 0 || b >= n_blocks || table[b] < 0) return -1;
    return int64_t(table[b]) * int64_t(page_bytes);
  }
};

Source source_of(const KvLayer& l, int seq, int head) {
  const KvPool& p = *l.pool;
  const KvSpec& s = p.spec();
  const auto& table = p.block_table(seq);
  Source src;
  src.k_base = static_cast<const uint8_t*>(p.k_block(l.layer, 0, head));
  src.v_base = s.v_dim > 0 ? static_cast<const uint8_t*>(p.v_block(l.layer, 0, head)) : nullptr;
  src.page_bytes = p.page_stride() * p.elem_size();
  src.k_row_bytes = size_t(s.k_dim) * p.elem_size();
  src.v_row_bytes = size_t(s.v_dim) * p.elem_size();
  src.table = table.data();
  src.n_blocks = int64_t(table.size());
  src.block_size = p.block_size();
  src.f32 = p.type() == KvType::F32;
  return src;
}

// The layer's rows must hold head_dim K values and v_dim V values (own rows or K's prefix).
void check_layer(const KvLayer& l, int n_heads, int head_dim, int v_dim, const char* what) {
  TF_CHECK(l.pool != nullptr && l.layer >= 0 && l.layer < l.pool->n_layers(), "attention: no ", what, " layer");
  const KvSpec& s = l.pool->spec();
  TF_CHECK(s.n_heads == n_heads && s.k_dim == head_dim && (s.v_dim == 0 ? v_dim <= head_dim : v_dim <= s.v_dim),
           "attention: the ", what, " layer's rows (", s.describe(), ") do not match ", n_heads, " heads of ",
           head_dim, " (V ", v_dim, ")");
}

inline int tile_rows(int head_dim) { return head_dim <= 128 ? 256 : head_dim <= 256 ? 128 : 64; }

void to_float(const uint8_t* row, bool f32, int n, float* dst, const VecOps& ops) {
  if (f32)
    std::memcpy(dst, row, size_t(n) * sizeof(float));
  else
    ops.f16_to_f32(n, reinterpret_cast<const uint16_t*>(row), dst);
}

// Query heads [h0, h1) of cache head g of token t (nh = h1 - h0 consecutive heads).
void attend_item(const AttentionBatch& a, const KvLayer& kv, int64_t t, int g, int h0, int h1, const VecOps& ops) {
  const int D = a.head_dim, Dv = a.v_dim, nh = h1 - h0, TILE = tile_rows(D);
  const int seq = a.seq[t];
  const Source s1 = source_of(kv, seq, g);
  Source s2;
  const int32_t* list = nullptr;
  int64_t n2 = 0;
  if (a.extra) {
    s2 = source_of(*a.extra, seq, 0);
    if (a.extra_list) {
      list = a.extra_list + t * a.extra_len;
      n2 = a.extra_len;
    } else {
      n2 = a.extra_count[t];
      TF_CHECK(n2 >= 0, "attention: negative extra_count");
    }
  }
  const int64_t end = a.end[t], begin = a.window > 0 ? std::max<int64_t>(0, end - a.window) : 0;
  const int64_t n1 = std::max<int64_t>(0, end - begin);
  // V from its own rows when either source has them, else read in place from the K rows.
  const bool own_v = s1.v_base != nullptr || (a.extra && s2.v_base != nullptr);

  thread_local std::vector<float> scratch;
  thread_local std::vector<double> sums;
  thread_local std::vector<float> maxes;
  const size_t need = size_t(TILE) * D + (own_v ? size_t(TILE) * Dv : 0) + size_t(nh) * TILE;
  if (scratch.size() < need) scratch.resize(need);
  if (sums.size() < size_t(nh)) {
    sums.resize(size_t(nh));
    maxes.resize(size_t(nh));
  }
  float* krows = scratch.data();
  float* vrows = krows + size_t(TILE) * D;
  float* scores = vrows + (own_v ? size_t(TILE) * Dv : 0);
  const float* vsrc = own_v ? vrows : krows;
  const int64_t ldv = own_v ? Dv : D;

  const float* q = a.q + t * a.q_stride + (int64_t(g) * a.group + h0) * D;
  float* out = a.out + t * a.out_stride + (int64_t(g) * a.group + h0) * Dv;
  std::fill(out, out + size_t(nh) * Dv, 0.f);
  for (int h = 0; h < nh; ++h) {
    // A sink is an entry scored `sink` whose value is zero: it starts the softmax.
    maxes[size_t(h)] = a.sinks ? a.sinks[int64_t(g) * a.group + h0 + h] : -INFINITY;
    sums[size_t(h)] = a.sinks ? 1.0 : 0.0;
  }

  const int64_t n_total = n1 + n2;
  int64_t i = 0;
  while (i < n_total) {
    int m = 0;
    for (; i < n_total && m < TILE; ++i) {
      const Source* s = &s1;
      int64_t e = begin + i;
      if (i >= n1) {
        s = &s2;
        e = list ? int64_t(list[i - n1]) : i - n1;
        if (e < 0) continue;  // a list's empty place
      }
      const int64_t page = s->page_offset(e);
      TF_CHECK(page >= 0, "attention: entry ", e, " of sequence ", seq, " is not in the cache");
      const int64_t in_page = e % s->block_size;
      const uint8_t* k = s->k_base + page + in_page * int64_t(s->k_row_bytes);
      to_float(k, s->f32, D, krows + size_t(m) * D, ops);
      if (own_v) {
        const uint8_t* v = s->v_base ? s->v_base + page + in_page * int64_t(s->v_row_bytes) : k;
        to_float(v, s->f32, Dv, vrows + size_t(m) * Dv, ops);
      }
      ++m;
    }
    if (m == 0) break;
    ops.dot_block_f32(D, q, D, nh, krows, D, m, scores, TILE);
    for (int h = 0; h < nh; ++h) {
      float* sc = scores + size_t(h) * TILE;
      float tile_max = -INFINITY;
      for (int j = 0; j < m; ++j) {
        sc[j] *= a.scale;
        tile_max = std::max(tile_max, sc[j]);
      }
      float& mx = maxes[size_t(h)];
      if (tile_max > mx) {  // rescale what the head has so far to the new maximum
        const float r = std::exp(mx - tile_max);
        ops.scale(Dv, out + size_t(h) * Dv, r);
        sums[size_t(h)] *= double(r);
        mx = tile_max;
      }
      sums[size_t(h)] += double(ops.exp_sub_sum(m, sc, mx));
    }
    ops.axpy_block_f32(Dv, scores, TILE, nh, vsrc, ldv, m, out, Dv);
  }
  for (int h = 0; h < nh; ++h) {
    const double s = sums[size_t(h)];
    ops.scale(Dv, out + size_t(h) * Dv, s > 0 ? float(1.0 / s) : 0.f);  // nothing read, no sink: zeros
  }
}

}  // namespace

void attention_sparse(const AttentionBatch& a, const KvLayer& kv, ThreadPool& pool, const VecOps& ops) {
  if (a.T <= 0) return;
  const int HK = a.n_cache_heads, group = a.group;
  TF_CHECK(HK >= 1 && group >= 1 && a.head_dim >= 1 && a.v_dim >= 1 && a.v_dim <= a.head_dim && a.window >= 0,
           "attention: bad sizes");
  TF_CHECK(a.q && a.out && a.seq && a.end, "attention: null buffer");
  check_layer(kv, HK, a.head_dim, a.v_dim, "attended");
  if (a.extra) {
    check_layer(*a.extra, 1, a.head_dim, a.v_dim, "extra");
    TF_CHECK(a.extra_list ? a.extra_len >= 0 : a.extra_count != nullptr,
             "attention: extra entries need extra_count or extra_list");
  }
  // Items: (token, cache head, part of its query heads). Decode of one sequence with one cache
  // head (every query head reads it) has a single (token, head) pair: its heads are split into
  // parts so that every thread has some (each part converts the rows it reads itself).
  const int64_t pairs = a.T * HK;
  const int threads = pool.size();
  const int parts = int(std::min<int64_t>(group, std::max<int64_t>(1, (2 * int64_t(threads) + pairs - 1) / pairs)));
  const int64_t items = pairs * parts;
  const int64_t runs = std::min<int64_t>(items, int64_t(threads) * 16);
  pool.run_chunks(runs, [&](int64_t r, int) {
    for (int64_t it = r * items / runs; it < (r + 1) * items / runs; ++it) {
      const int part = int(it % parts);
      const int64_t pair = it / parts;
      const int64_t t = pair / HK;
      const int g = int(pair % HK);
      attend_item(a, kv, t, g, group * part / parts, group * (part + 1) / parts, ops);
    }
  });
}

}  // namespace tf::cpu
