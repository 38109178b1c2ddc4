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

float dot_f32_f16(int64_t n, const float* a, const uint16_t* b) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_h8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load_h8(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_h8(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * fp16_to_fp32(b[i]);
  return s;
}

void axpy_f16(int64_t n, float alpha, const uint16_t* x, float* y) {
  const __m256 va = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load_h8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * fp16_to_fp32(x[i]);
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

float dot_f32(int64_t n, const float* a, const float* b) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy_f32(int64_t n, float alpha, const float* x, float* y) {
  const __m256 va = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

void f16_to_f32(int64_t n, const uint16_t* x, float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, load_h8(x + i));
  for (; i < n; ++i) y[i] = fp16_to_fp32(x[i]);
}

// Four rows at a time: four independent FMA chains (a single dot of 128 values is bound by
// FMA latency), one load of b for all four. Row h's sum: one 8-lane accumulator, then the
// scalar tail, the same for any m.
void dot_rows_f32(int64_t n, const float* a, int64_t lda, int m, const float* b, float* out) {
  const int64_t n8 = n / 8 * 8;
  int h = 0;
  for (; h + 4 <= m; h += 4) {
    const float* r0 = a + h * lda;
    const float *r1 = r0 + lda, *r2 = r1 + lda, *r3 = r2 + lda;
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
      const __m256 bv = _mm256_loadu_ps(b + i);
      c0 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + i), bv, c0);
      c1 = _mm256_fmadd_ps(_mm256_loadu_ps(r1 + i), bv, c1);
      c2 = _mm256_fmadd_ps(_mm256_loadu_ps(r2 + i), bv, c2);
      c3 = _mm256_fmadd_ps(_mm256_loadu_ps(r3 + i), bv, c3);
    }
    float s0 = hsum(c0), s1 = hsum(c1), s2 = hsum(c2), s3 = hsum(c3);
    for (int64_t i = n8; i < n; ++i) {
      s0 += r0[i] * b[i];
      s1 += r1[i] * b[i];
      s2 += r2[i] * b[i];
      s3 += r3[i] * b[i];
    }
    out[h] = s0, out[h + 1] = s1, out[h + 2] = s2, out[h + 3] = s3;
  }
  for (; h < m; ++h) {
    const float* r = a + h * lda;
    __m256 c = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) c = _mm256_fmadd_ps(_mm256_loadu_ps(r + i), _mm256_loadu_ps(b + i), c);
    float s = hsum(c);
    for (int64_t i = n8; i < n; ++i) s += r[i] * b[i];
    out[h] = s;
  }
}

void axpy_rows_f32(int64_t n, const float* alpha, int m, const float* x, float* y, int64_t ldy) {
  const int64_t n8 = n / 8 * 8;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int h = 0; h < m; ++h) {
      float* yh = y + h * ldy + i;
      _mm256_storeu_ps(yh, _mm256_fmadd_ps(_mm256_set1_ps(alpha[h]), xv, _mm256_loadu_ps(yh)));
    }
  }
  for (int h = 0; h < m; ++h)
    for (int64_t i = n8; i < n; ++i) y[h * ldy + i] += alpha[h] * x[i];
}

const VecOps kAvx2 = {dot_f32_f16, axpy_f16, f32_to_f16,   exp_sub_sum,  silu_mul,
                      scale,       dot_f32,  axpy_f32,     f16_to_f32,   dot_rows_f32,
                      axpy_rows_f32};

}  // namespace

const VecOps* vec_ops_avx2_table() { return &kAvx2; }

}  // namespace tf::cpu
