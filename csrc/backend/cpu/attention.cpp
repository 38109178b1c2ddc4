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

void paged_attention(const float* q, int D, const PagedKv& kv, int64_t n, float scale, float* scores,
                     float* out) {
  TF_CHECK(D > 0 && D <= kMaxHeadDim && n > 0, "paged_attention: bad sizes");
  const VecOps& ops = vec_ops();
  const int bs = kv.block_size;
  float qr[kMaxHeadDim];
  for (int i = 0; i < D; ++i) qr[i] = kv.f32 ? q[i] : fp16_to_fp32(fp32_to_fp16(q[i]));
  float mx = -INFINITY;
  for (int64_t j0 = 0, b = 0; j0 < n; j0 += bs, ++b) {
    const size_t page = size_t(kv.table[b]) * kv.page_stride;
    const int64_t m = std::min<int64_t>(bs, n - j0);
    for (int64_t j = 0; j < m; ++j) {
      const float s = (kv.f32 ? ops.dot_f32(D, qr, static_cast<const float*>(kv.k_base) + page + j * D)
                              : ops.dot_f32_f16(D, qr, static_cast<const uint16_t*>(kv.k_base) + page + j * D)) *
                      scale;
      scores[j0 + j] = s;
      mx = std::max(mx, s);
    }
  }
  const float inv_sum = 1.0f / ops.exp_sub_sum(n, scores, mx);
  std::fill(out, out + D, 0.f);
  for (int64_t j0 = 0, b = 0; j0 < n; j0 += bs, ++b) {
    const size_t page = size_t(kv.table[b]) * kv.page_stride;
    const int64_t m = std::min<int64_t>(bs, n - j0);
    for (int64_t j = 0; j < m; ++j) {
      const float p = scores[j0 + j] * inv_sum;
      if (kv.f32)
        ops.axpy_f32(D, p, static_cast<const float*>(kv.v_base) + page + j * D, out);
      else
        ops.axpy_f16(D, fp16_to_fp32(fp32_to_fp16(p)), static_cast<const uint16_t*>(kv.v_base) + page + j * D, out);
    }
  }
}

}  // namespace tf::cpu
