#include "backend/cpu/attention.h"

#include <algorithm>
#include <cmath>

#include "backend/cpu/vec_ops.h"
#include "core/error.h"
#include "core/half.h"

namespace tf::cpu {

namespace {
constexpr int kMaxHeadDim = 512;
}

void paged_attention(const float* q, int D, const PagedKv& kv, int64_t n, float scale, float* out) {
  TF_CHECK(D > 0 && D <= kMaxHeadDim && n > 0, "paged_attention: bad sizes");
  const VecOps& ops = vec_ops();
  const int bs = kv.block_size;
  float qr[kMaxHeadDim];
  for (int i = 0; i < D; ++i) qr[i] = kv.f32 ? q[i] : fp16_to_fp32(fp32_to_fp16(q[i]));
  // Online softmax over tiles of kAttentionTile positions: the running maximum `mx` and the
  // running sum of exp(s - mx) are rescaled whenever a tile raises the maximum, so scratch
  // stays one tile whatever the context length.
  float scores[kAttentionTile];
  float mx = -INFINITY;
  double sum = 0.0;
  std::fill(out, out + D, 0.f);
  int64_t b = 0;       // page index of position j0
  int64_t in_page = 0; // offset of position j0 inside its page
  for (int64_t j0 = 0; j0 < n; j0 += kAttentionTile) {
    const int64_t m = std::min<int64_t>(kAttentionTile, n - j0);
    // Scores of the tile; remember where the tile starts in the pages for the V pass.
    const int64_t b_start = b, in_start = in_page;
    float tile_max = -INFINITY;
    for (int64_t j = 0; j < m; ++j) {
      const size_t row = size_t(kv.table[b]) * kv.page_stride + size_t(in_page) * size_t(D);
      const float s = (kv.f32 ? ops.dot_f32(D, qr, static_cast<const float*>(kv.k_base) + row)
                              : ops.dot_f32_f16(D, qr, static_cast<const uint16_t*>(kv.k_base) + row)) *
                      scale;
      scores[j] = s;
      tile_max = std::max(tile_max, s);
      if (++in_page == bs) { in_page = 0; ++b; }
    }
    if (tile_max > mx) {
      if (j0 > 0) {
        const float r = std::exp(mx - tile_max);
        ops.scale(D, out, r);
        sum *= double(r);
      }
      mx = tile_max;
    }
    sum += double(ops.exp_sub_sum(m, scores, mx));
    b = b_start;
    in_page = in_start;
    for (int64_t j = 0; j < m; ++j) {
      const size_t row = size_t(kv.table[b]) * kv.page_stride + size_t(in_page) * size_t(D);
      if (kv.f32)
        ops.axpy_f32(D, scores[j], static_cast<const float*>(kv.v_base) + row, out);
      else
        ops.axpy_f16(D, fp16_to_fp32(fp32_to_fp16(scores[j])), static_cast<const uint16_t*>(kv.v_base) + row, out);
      if (++in_page == bs) { in_page = 0; ++b; }
    }
  }
  ops.scale(D, out, float(1.0 / sum));
}

}  // namespace tf::cpu
