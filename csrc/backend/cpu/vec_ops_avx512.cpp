// AVX-512 versions of the vec_ops primitives. Compiled with AVX-512 flags; only reached
// through vec_ops() after runtime detection.
#include <immintrin.h>

#include <cmath>

#include "backend/cpu/vec_ops.h"
#include "core/half.h"

namespace tf::cpu {

namespace {

// exp(x) for x <= ~88: range reduction x = k ln2 + r, |r| <= ln2/2, degree-6 polynomial
// (relative error ~2e-7), then scale by 2^k through the exponent bits.
inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.3f);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  __m512 r = _mm512_fnmadd_ps(k, ln2_hi, x);
  r = _mm512_fnmadd_ps(k, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}

void f32_to_f16(int64_t n, const float* x, uint16_t* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256((__m256i*)(y + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

float exp_sub_sum(int64_t n, float* x, float max) {
  const __m512 vm = _mm512_set1_ps(max);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), vm));
    _mm512_mask_storeu_ps(x + i, m, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
  }
  return _mm512_reduce_add_ps(acc);
}

void silu_mul(int64_t n, const float* g, const float* u, float* out) {
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

void scale(int64_t n, float* y, float a) {
  const __m512 va = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(y + i), va));
  for (; i < n; ++i) y[i] *= a;
}

void f16_to_f32(int64_t n, const uint16_t* x, float* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(x + i))));
  for (; i < n; ++i) y[i] = fp16_to_fp32(x[i]);
}

// The indexer's scores (VecOps::index_scores): JB key rows against GB vectors of 16 heads at a
// time, each key value broadcast from memory against a vector of heads, so each dot product is
// one FMA chain over i in order; then per row sum over groups of w * relu, reduced once per row.
// A row's score is formed the same way in every JB variant.
template <int JB, int GB>
inline void index_rows(int64_t n, const float* qt, int hp, const float* w, const float* rows, int64_t ldr,
                       float* out) {
  __m512 total[JB];
  #pragma GCC unroll 8
  for (int j = 0; j < JB; ++j) total[j] = _mm512_setzero_ps();
  for (int g0 = 0; g0 < hp; g0 += 16 * GB) {
    __m512 acc[JB][GB];
    #pragma GCC unroll 8
    for (int j = 0; j < JB; ++j)
      #pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) acc[j][g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      __m512 qv[GB];
      #pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) qv[g] = _mm512_loadu_ps(qt + i * hp + g0 + 16 * g);
      #pragma GCC unroll 8
      for (int j = 0; j < JB; ++j) {
        const __m512 kv = _mm512_set1_ps(rows[j * ldr + i]);
        #pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) acc[j][g] = _mm512_fmadd_ps(qv[g], kv, acc[j][g]);
      }
    }
    #pragma GCC unroll 8
    for (int j = 0; j < JB; ++j)
      #pragma GCC unroll 4
      for (int g = 0; g < GB; ++g)
        total[j] = _mm512_fmadd_ps(_mm512_max_ps(acc[j][g], _mm512_setzero_ps()),
                                   _mm512_loadu_ps(w + g0 + 16 * g), total[j]);
  }
  #pragma GCC unroll 8
  for (int j = 0; j < JB; ++j) out[j] = _mm512_reduce_add_ps(total[j]);
}

template <int GB>
inline void index_scores_groups(int64_t n, const float* qt, int hp, const float* w, const float* rows, int64_t ldr,
                                int m, float* out) {
  constexpr int JB = GB == 1 ? 8 : 16 / GB;  // 8 to 16 accumulators: enough FMA chains in flight
  int j = 0;
  for (; j + JB <= m; j += JB) index_rows<JB, GB>(n, qt, hp, w, rows + j * ldr, ldr, out + j);
  for (; j < m; ++j) index_rows<1, GB>(n, qt, hp, w, rows + j * ldr, ldr, out + j);
}

void index_scores(int64_t n, const float* qt, int hp, const float* w, const float* rows, int64_t ldr, int m,
                  float* out) {
  // Groups of heads per pass: the whole of hp when it is 16, 32 or 64, else 16 at a time.
  if (hp == 32)
    index_scores_groups<2>(n, qt, hp, w, rows, ldr, m, out);
  else if (hp % 64 == 0)
    index_scores_groups<4>(n, qt, hp, w, rows, ldr, m, out);
  else
    index_scores_groups<1>(n, qt, hp, w, rows, ldr, m, out);
}

// The attention products come from the AVX2 table (vec_ops()): single-query and block
// attention must agree bit for bit, and they do by sharing one implementation.
const VecOps kAvx512 = {f32_to_f16, exp_sub_sum, silu_mul, scale, f16_to_f32, nullptr, nullptr, index_scores};

}  // namespace

const VecOps* vec_ops_avx512_table() { return &kAvx512; }

}  // namespace tf::cpu
