// AVX2 (+FMA, F16C) versions of the vec_ops primitives, for CPUs without AVX-512: the
// scalar fallback converts each half in software, which made attention over an F16 KV cache
// the largest cost of a decode step at a few hundred tokens of context. Compiled with AVX2
// flags; only reached through vec_ops() after runtime detection.
#include <immintrin.h>

#include <cmath>

#include "backend/cpu/vec_ops.h"
#include "core/half.h"

namespace tf::cpu {

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load_h8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// exp(x) as in vec_ops_avx512.cpp: x clamped to [-87.3, 88.3], x = k ln2 + r, degree-6
// polynomial in r, times 2^k built in the exponent field (k is in [-126, 127] after the clamp,
// so 2^k is a normal float).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
}

void f32_to_f16(int64_t n, const float* x, uint16_t* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

float exp_sub_sum(int64_t n, float* x, float max) {
  const __m256 vm = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float s = hsum(acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    s += x[i];
  }
  return s;
}

void silu_mul(int64_t n, const float* g, const float* u, float* out) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

void scale(int64_t n, float* y, float a) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), va));
  for (; i < n; ++i) y[i] *= a;
}

void f16_to_f32(int64_t n, const uint16_t* x, float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, load_h8(x + i));
  for (; i < n; ++i) y[i] = fp16_to_fp32(x[i]);
}

// ---- attention products --------------------------------------------------------------
// Both attention kernels (single-query and prefill block) compute every output through
// dot_block_f32 / axpy_block_f32, which form each element with the same operations in the
// same order whatever the block shape, so a token's attention is bit for bit the same
// whichever kernel served it — a prompt prefilled in chunks of any size, or decoded in a
// batch, gives exactly the tokens it gives alone. A dot: one 8-lane FMA chain over i, the lanes summed as ((0+1)+(2+3))+((4+5)+(6+7)),
// then the scalar tail. A V row: y = fma(p, x, y) in row order, the tail as y += p * x.

// Eight 8-lane accumulators to their eight totals (v[p] -> lane p), in that lane order.
inline __m256 lane_totals8(const __m256* v) {
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}

// RB rows of a (RB <= 2) against JB rows of b (JB <= 4): one accumulator per pair, each load
// of a or b shared by the pairs that use it; s[rr * lds + jj].
template <int RB, int JB>
inline void dot_tile(int64_t n, const float* a, int64_t lda, const float* b, int64_t ldb, float* s, int64_t lds) {
  const int64_t n8 = n / 8 * 8;
  __m256 acc[8];
  #pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) acc[p] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n8; i += 8) {
    __m256 av[RB];
    #pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) av[rr] = _mm256_loadu_ps(a + rr * lda + i);
    #pragma GCC unroll 4
    for (int jj = 0; jj < JB; ++jj) {
      const __m256 bv = _mm256_loadu_ps(b + jj * ldb + i);
      #pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) acc[4 * rr + jj] = _mm256_fmadd_ps(av[rr], bv, acc[4 * rr + jj]);
    }
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, lane_totals8(acc));
  #pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
    #pragma GCC unroll 4
    for (int jj = 0; jj < JB; ++jj) {
      float t = out[4 * rr + jj];
      for (int64_t i = n8; i < n; ++i) t += a[rr * lda + i] * b[jj * ldb + i];
      s[rr * lds + jj] = t;
    }
}

template <int RB>
inline void dot_block_rows(int64_t n, const float* a, int64_t lda, const float* b, int64_t ldb, int m, float* s,
                           int64_t lds) {
  int j = 0;
  for (; j + 4 <= m; j += 4) dot_tile<RB, 4>(n, a, lda, b + j * ldb, ldb, s + j, lds);
  switch (m - j) {
    case 1: dot_tile<RB, 1>(n, a, lda, b + j * ldb, ldb, s + j, lds); break;
    case 2: dot_tile<RB, 2>(n, a, lda, b + j * ldb, ldb, s + j, lds); break;
    case 3: dot_tile<RB, 3>(n, a, lda, b + j * ldb, ldb, s + j, lds); break;
    default: break;
  }
}

void dot_block_f32(int64_t n, const float* a, int64_t lda, int rows, const float* b, int64_t ldb, int m, float* s,
                   int64_t lds) {
  int r = 0;
  for (; r + 2 <= rows; r += 2) dot_block_rows<2>(n, a + r * lda, lda, b, ldb, m, s + r * lds, lds);
  if (r < rows) dot_block_rows<1>(n, a + r * lda, lda, b, ldb, m, s + r * lds, lds);
}

// RB rows of y, W vectors wide, over m rows of x: the accumulators start from y and end in it.
template <int RB, int W>
inline void axpy_tile(const float* p, int64_t ldp, const float* x, int64_t ldx, int m, float* y, int64_t ldy) {
  __m256 acc[RB][W];
  #pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
    #pragma GCC unroll 2
    for (int w = 0; w < W; ++w) acc[rr][w] = _mm256_loadu_ps(y + rr * ldy + 8 * w);
  for (int j = 0; j < m; ++j) {
    __m256 xv[W];
    #pragma GCC unroll 2
    for (int w = 0; w < W; ++w) xv[w] = _mm256_loadu_ps(x + j * ldx + 8 * w);
    #pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) {
      const __m256 pv = _mm256_broadcast_ss(p + rr * ldp + j);
      #pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[rr][w] = _mm256_fmadd_ps(pv, xv[w], acc[rr][w]);
    }
  }
  #pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
    #pragma GCC unroll 2
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(y + rr * ldy + 8 * w, acc[rr][w]);
}

template <int RB>
inline void axpy_rows_block(int64_t n, const float* p, int64_t ldp, const float* x, int64_t ldx, int m, float* y,
                            int64_t ldy) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) axpy_tile<RB, 2>(p, ldp, x + i, ldx, m, y + i, ldy);
  for (; i + 8 <= n; i += 8) axpy_tile<RB, 1>(p, ldp, x + i, ldx, m, y + i, ldy);
  for (; i < n; ++i)
    #pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr)
      for (int j = 0; j < m; ++j) y[rr * ldy + i] += p[rr * ldp + j] * x[j * ldx + i];
}

void axpy_block_f32(int64_t n, const float* p, int64_t ldp, int rows, const float* x, int64_t ldx, int m, float* y,
                    int64_t ldy) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) axpy_rows_block<4>(n, p + r * ldp, ldp, x, ldx, m, y + r * ldy, ldy);
  switch (rows - r) {
    case 1: axpy_rows_block<1>(n, p + r * ldp, ldp, x, ldx, m, y + r * ldy, ldy); break;
    case 2: axpy_rows_block<2>(n, p + r * ldp, ldp, x, ldx, m, y + r * ldy, ldy); break;
    case 3: axpy_rows_block<3>(n, p + r * ldp, ldp, x, ldx, m, y + r * ldy, ldy); break;
    default: break;
  }
}

// The indexer's scores (VecOps::index_scores), as in the AVX-512 table with 8 heads a vector:
// JB key rows against GB vectors of heads, one FMA chain per dot product, reduced once per row.
template <int JB, int GB>
inline void index_rows(int64_t n, const float* qt, int hp, const float* w, const float* rows, int64_t ldr,
                       float* out) {
  __m256 total[JB];
  #pragma GCC unroll 4
  for (int j = 0; j < JB; ++j) total[j] = _mm256_setzero_ps();
  for (int g0 = 0; g0 < hp; g0 += 8 * GB) {
    __m256 acc[JB][GB];
    #pragma GCC unroll 4
    for (int j = 0; j < JB; ++j)
      #pragma GCC unroll 2
      for (int g = 0; g < GB; ++g) acc[j][g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      __m256 qv[GB];
      #pragma GCC unroll 2
      for (int g = 0; g < GB; ++g) qv[g] = _mm256_loadu_ps(qt + i * hp + g0 + 8 * g);
      #pragma GCC unroll 4
      for (int j = 0; j < JB; ++j) {
        const __m256 kv = _mm256_broadcast_ss(rows + j * ldr + i);
        #pragma GCC unroll 2
        for (int g = 0; g < GB; ++g) acc[j][g] = _mm256_fmadd_ps(qv[g], kv, acc[j][g]);
      }
    }
    #pragma GCC unroll 4
    for (int j = 0; j < JB; ++j)
      #pragma GCC unroll 2
      for (int g = 0; g < GB; ++g)
        total[j] = _mm256_fmadd_ps(_mm256_max_ps(acc[j][g], _mm256_setzero_ps()),
                                   _mm256_loadu_ps(w + g0 + 8 * g), total[j]);
  }
  #pragma GCC unroll 4
  for (int j = 0; j < JB; ++j) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(total[j]), _mm256_extractf128_ps(total[j], 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    out[j] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
  }
}

void index_scores(int64_t n, const float* qt, int hp, const float* w, const float* rows, int64_t ldr, int m,
                  float* out) {
  // hp is a multiple of 16: two vectors of heads a pass, four key rows (8 accumulators).
  int j = 0;
  for (; j + 4 <= m; j += 4) index_rows<4, 2>(n, qt, hp, w, rows + j * ldr, ldr, out + j);
  for (; j < m; ++j) index_rows<1, 2>(n, qt, hp, w, rows + j * ldr, ldr, out + j);
}

const VecOps kAvx2 = {f32_to_f16,     exp_sub_sum,    silu_mul,    scale,
                      f16_to_f32,     dot_block_f32,  axpy_block_f32, index_scores};

}  // namespace

const VecOps* vec_ops_avx2_table() { return &kAvx2; }

}  // namespace tf::cpu
