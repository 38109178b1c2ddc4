#include "backend/cpu/index_topk.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kv/kv_cache.h"

namespace tf::cpu {

namespace {

constexpr int kTile = 128;               // entries scored at a time (their rows converted once)
constexpr int64_t kMinRange = 2048;      // entries a range is worth splitting off for

using Scored = std::pair<float, int32_t>;  // (score, entry)

// Higher score first; equal scores: the lower entry first.
inline bool better(const Scored& x, const Scored& y) {
  return x.first > y.first || (x.first == y.first && x.second < y.second);
}

// The best min(k, n) of v[0, n), best first, to v[0, ..).
int64_t keep_best(std::vector<Scored>& v, int64_t n, int k) {
  const int64_t kk = std::min<int64_t>(k, n);
  if (kk < n) std::nth_element(v.begin(), v.begin() + kk, v.begin() + n, better);
  std::sort(v.begin(), v.begin() + kk, better);
  return kk;
}

// Scores of entries [lo, hi) of token t's sequence: sum_h w[h] * relu(q[h] . k_s).
void score_range(const float* q, int H, int64_t D, const float* w, const KvLayer& kv, int seq, int64_t lo,
                 int64_t hi, std::vector<Scored>& out, const VecOps& ops) {
  const KvPool& p = *kv.pool;
  const auto& table = p.block_table(seq);
  const int bs = p.block_size();
  const bool f32 = p.type() == KvType::F32;
  const uint8_t* base = static_cast<const uint8_t*>(p.k_block(kv.layer, 0, 0));
  const size_t page = p.page_stride() * p.elem_size(), row = size_t(D) * p.elem_size();
  // The queries transposed and padded to a multiple of 16 heads (zero query, zero weight: adds 0).
  const int hp = (H + 15) / 16 * 16;
  thread_local std::vector<float> scratch;
  const size_t need = size_t(kTile) * size_t(D) + size_t(D) * hp + hp + kTile;
  if (scratch.size() < need) scratch.resize(need);
  float* rows = scratch.data();
  float* qt = rows + size_t(kTile) * size_t(D);
  float* wp = qt + size_t(D) * hp;
  float* scores = wp + hp;
  std::fill(qt, qt + size_t(D) * hp, 0.f);
  std::fill(wp, wp + hp, 0.f);
  for (int h = 0; h < H; ++h) {
    wp[h] = w[h];
    for (int64_t i = 0; i < D; ++i) qt[size_t(i) * hp + h] = q[size_t(h) * D + i];
  }
  const auto score_rows = ops.index_scores ? ops.index_scores : vec_ops_scalar().index_scores;
  out.resize(size_t(hi - lo));
  for (int64_t j0 = lo; j0 < hi; j0 += kTile) {
    const int m = int(std::min<int64_t>(kTile, hi - j0));
    for (int j = 0; j < m; ++j) {
      const int64_t e = j0 + j, b = e / bs;
      TF_CHECK(b < int64_t(table.size()) && table[size_t(b)] >= 0, "index_topk: entry ", e, " of sequence ", seq,
               " is not in the cache");
      const uint8_t* src = base + size_t(table[size_t(b)]) * page + size_t(e % bs) * row;
      if (f32)
        std::memcpy(rows + size_t(j) * D, src, size_t(D) * sizeof(float));
      else
        ops.f16_to_f32(D, reinterpret_cast<const uint16_t*>(src), rows + size_t(j) * D);
    }
    score_rows(D, qt, hp, wp, rows, D, m, scores);
    for (int j = 0; j < m; ++j) {
      const float s = scores[j];
      out[size_t(j0 - lo + j)] = {std::isnan(s) ? -INFINITY : s, int32_t(j0 + j)};  // NaN: never ahead
    }
  }
}

}  // namespace

void index_topk(const float* q, int64_t ldq, int H, int64_t D, const float* w, int64_t ldw, const KvLayer& kv,
                const int32_t* seq, const int64_t* count, int64_t T, int k, int32_t* idx, ThreadPool& pool,
                const VecOps& ops) {
  if (T <= 0 || k <= 0) return;
  TF_CHECK(kv.pool && H >= 1 && D >= 1, "index_topk: bad sizes");
  const KvSpec& s = kv.pool->spec();
  TF_CHECK(s.n_heads == 1 && s.k_dim == D, "index_topk: the layer's rows (", s.describe(), ") are not one head of ",
           D);
  for (int64_t t = 0; t < T; ++t) TF_CHECK(count[t] >= 0 && count[t] < (int64_t(1) << 31), "index_topk: bad count");
  // Ranges per token: enough for every thread when tokens are few, none smaller than kMinRange.
  const int threads = pool.size();
  const int64_t parts = std::max<int64_t>(1, (2 * int64_t(threads) + T - 1) / T);
  auto ranges = [&](int64_t t) { return std::min<int64_t>(parts, std::max<int64_t>(1, count[t] / kMinRange)); };
  std::vector<int64_t> first(size_t(T) + 1, 0);  // item index of token t's first range
  for (int64_t t = 0; t < T; ++t) first[size_t(t) + 1] = first[size_t(t)] + ranges(t);
  const int64_t items = first[size_t(T)];
  // Ranges of split tokens keep their k best here: k slots per item (unused when one range).
  std::vector<Scored> picks(items > T ? size_t(items) * size_t(k) : 0);
  std::vector<int64_t> n_picks(items > T ? size_t(items) : 0);
  pool.run_chunks(items, [&](int64_t it, int) {
    const int64_t t = int64_t(std::upper_bound(first.begin(), first.end(), it) - first.begin()) - 1;
    const int64_t nr = first[size_t(t) + 1] - first[size_t(t)], r = it - first[size_t(t)];
    const int64_t lo = count[t] * r / nr, hi = count[t] * (r + 1) / nr;
    thread_local std::vector<Scored> scored;
    score_range(q + t * ldq, H, D, w + t * ldw, kv, seq[t], lo, hi, scored, ops);
    const int64_t kept = keep_best(scored, hi - lo, k);
    if (nr == 1) {
      int32_t* o = idx + t * k;
      for (int64_t j = 0; j < kept; ++j) o[j] = scored[size_t(j)].second;
      std::fill(o + kept, o + k, -1);
    } else {
      std::copy(scored.begin(), scored.begin() + kept, picks.begin() + it * k);
      n_picks[size_t(it)] = kept;
    }
  });
  if (items == T) return;
  std::vector<Scored> merged;
  for (int64_t t = 0; t < T; ++t) {
    if (first[size_t(t) + 1] - first[size_t(t)] == 1) continue;
    merged.clear();
    for (int64_t it = first[size_t(t)]; it < first[size_t(t) + 1]; ++it)
      merged.insert(merged.end(), picks.begin() + it * k, picks.begin() + it * k + n_picks[size_t(it)]);
    const int64_t kept = keep_best(merged, int64_t(merged.size()), k);
    int32_t* o = idx + t * k;
    for (int64_t j = 0; j < kept; ++j) o[j] = merged[size_t(j)].second;
    std::fill(o + kept, o + k, -1);
  }
}

}  // namespace tf::cpu
