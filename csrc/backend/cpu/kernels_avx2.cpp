// AVX2 (+FMA, F16C) matmul kernels: the fallback for CPUs without AVX-512. Same arithmetic as
// kernels_scalar.cpp; only the float summation order differs. Less tuned than AVX-512:
// one 32-value block per ymm (vpmaddubsw + vpmaddwd), K-quants unpacked through the scalar
// decomposition into a small per-row-chunk buffer and reused across columns.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "backend/cpu/kernels_internal.h"
#include "quant/blocks.h"

namespace tf::cpu::detail {

namespace {

using T_ = GgmlType;

inline uint32_t ld32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---------------------------------------------------------------------------------------
// 32-value block formats.

template <T_ T> struct G32;
template <> struct G32<T_::Q4_0> { static constexpr int bytes = 18, qs = 2, qh = -1, off = 8; static constexpr bool min = false; };
template <> struct G32<T_::Q4_1> { static constexpr int bytes = 20, qs = 4, qh = -1, off = 0; static constexpr bool min = true; };
template <> struct G32<T_::Q5_0> { static constexpr int bytes = 22, qs = 6, qh = 2, off = 16; static constexpr bool min = false; };
template <> struct G32<T_::Q5_1> { static constexpr int bytes = 24, qs = 8, qh = 4, off = 0; static constexpr bool min = true; };
template <> struct G32<T_::Q8_0> { static constexpr int bytes = 34, qs = 2, qh = -1, off = 128; static constexpr bool min = false; };

inline __m256i expand_bits32(uint32_t h) {
  const __m256i idx = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                        0x0101010101010101LL, 0x0000000000000000LL);
  // shuffle_epi8 works per 128-bit lane; both lanes hold the 4 bytes of h.
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int(h)), idx);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
}

// Unsigned (or, for Q8_0, signed) values of one block.
template <T_ T>
inline __m256i unpack_q(const uint8_t* b) {
  using F = G32<T>;
  if constexpr (T == T_::Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + F::qs));
  } else {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + F::qs));
    __m256i z = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
    if constexpr (F::qh >= 0)
      z = _mm256_or_si256(z, _mm256_and_si256(expand_bits32(ld32(b + F::qh)), _mm256_set1_epi8(16)));
    return z;
  }
}

template <T_ T>
inline __m256i dot_block(__m256i q, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p;
  if constexpr (T == T_::Q8_0) p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
  else p = _mm256_maddubs_epi16(q, x);
  __m256i s = _mm256_madd_epi16(p, ones);
  if constexpr (G32<T>::off != 0 && T != T_::Q8_0)
    s = _mm256_sub_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(char(G32<T>::off)), x), ones));
  return s;
}

template <T_ T, int NC>
void g32_row(int64_t k, const uint8_t* row, const uint8_t* xq, size_t xs, float* y, int64_t ldy) {
  using F = G32<T>;
  const int64_t nb = k / 32, ng = g32_groups(k);
  __m256 acc[NC];
  float accm[NC];
  for (int c = 0; c < NC; ++c) {
    acc[c] = _mm256_setzero_ps();
    accm[c] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + size_t(b) * F::bytes;
    const __m256i q = unpack_q<T>(blk);
    const float dw = h2f(uint16_t(ld32(blk) & 0xFFFF));
    float m = 0.f;
    if constexpr (F::min) m = h2f(uint16_t(ld32(blk) >> 16));
    for (int c = 0; c < NC; ++c) {
      const int8_t* qs = reinterpret_cast<const int8_t*>(xq + size_t(c) * xs);
      const float* sc = reinterpret_cast<const float*>(qs + ng * 64);
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * b));
      const float dx = sc[4 * (b / 2) + (b & 1)];
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_block<T>(q, x)), _mm256_set1_ps(dw * dx), acc[c]);
      if constexpr (F::min) accm[c] += m * sc[4 * (b / 2) + 2 + (b & 1)];
    }
  }
  for (int c = 0; c < NC; ++c) y[c * ldy] = hsum8(acc[c]) + accm[c];
}

template <T_ T>
void matmul_g32(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1, const void* xv,
                size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + size_t(r) * ws;
    int64_t c = 0;
    for (; c + 4 <= ncols; c += 4) g32_row<T, 4>(k, row, xq + c * xs, xs, y + c * ldy + r, ldy);
    switch (ncols - c) {
      case 1: g32_row<T, 1>(k, row, xq + c * xs, xs, y + c * ldy + r, ldy); break;
      case 2: g32_row<T, 2>(k, row, xq + c * xs, xs, y + c * ldy + r, ldy); break;
      case 3: g32_row<T, 3>(k, row, xq + c * xs, xs, y + c * ldy + r, ldy); break;
      default: break;
    }
  }
}

// ---------------------------------------------------------------------------------------
// K-quants.

struct alignas(32) KU {
  uint8_t q[256];
  __m256i sc[8];  // int16 scales per maddubs lane, 32 values per vector
  __m256i mn;
  float d, ndmin;
};

constexpr int KC = 8;

template <T_ T>
void matmul_k(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1, const void* xv,
              size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  const int64_t nb = k / 256;
  constexpr size_t bb = block_bytes<T>();
  KU ku[KC];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b0 = 0; b0 < nb; b0 += KC) {
      const int kcb = int(std::min<int64_t>(KC, nb - b0));
      for (int b = 0; b < kcb; ++b) {
        const uint8_t* blk = w + size_t(r) * ws + size_t(b0 + b) * bb;
        KUnpacked u;
        k_scales(T, blk, &u);
        k_values(T, blk, ku[b].q);
        for (int i = 0; i < 8; ++i)
          ku[b].sc[i] = _mm256_set_m128i(_mm_set1_epi16(u.sc[2 * i + 1]), _mm_set1_epi16(u.sc[2 * i]));
        ku[b].mn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.mn));
        ku[b].d = u.d;
        ku[b].ndmin = -u.dmin;
      }
      for (int64_t c = 0; c < ncols; ++c) {
        const ActK* a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b0;
        __m256 acc = _mm256_setzero_ps();
        for (int b = 0; b < kcb; ++b) {
          __m256i s = _mm256_setzero_si256();
          for (int i = 0; i < 8; ++i) {
            const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(ku[b].q + 32 * i));
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[b].qs + 32 * i));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ku[b].sc[i]));
          }
          const __m256i m = _mm256_madd_epi16(ku[b].mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[b].bsums)));
          __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(ku[b].d));
          t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(ku[b].ndmin), t);
          acc = _mm256_fmadd_ps(t, _mm256_set1_ps(a[b].d), acc);
        }
        float& dst = y[c * ldy + r];
        const float v = hsum8(acc);
        dst = b0 == 0 ? v : dst + v;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Float weights.

template <T_ T>
inline __m256 load_w8(const uint8_t* row, int64_t i) {
  if constexpr (T == T_::F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i));
    if constexpr (T == T_::F16) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}
template <T_ T>
inline float load_w1(const uint8_t* row, int64_t i) {
  if constexpr (T == T_::F32) {
    float v;
    std::memcpy(&v, row + 4 * i, 4);
    return v;
  } else {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, 2);
    if constexpr (T == T_::F16) return _cvtsh_ss(h);
    else {
      const uint32_t u = uint32_t(h) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
  }
}

template <T_ T, int NC>
void f_row(int64_t k, const uint8_t* row, const uint8_t* xq, size_t xs, float* y, int64_t ldy) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 wv = load_w8<T>(row, i);
    for (int c = 0; c < NC; ++c)
      acc[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(reinterpret_cast<const float*>(xq + size_t(c) * xs) + i), acc[c]);
  }
  for (int c = 0; c < NC; ++c) {
    float s = hsum8(acc[c]);
    const float* x = reinterpret_cast<const float*>(xq + size_t(c) * xs);
    for (int64_t j = i; j < k; ++j) s += load_w1<T>(row, j) * x[j];
    y[c * ldy] = s;
  }
}

template <T_ T>
void matmul_f(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1, const void* xv,
              size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + size_t(r) * ws;
    int64_t c = 0;
    for (; c + 4 <= ncols; c += 4) f_row<T, 4>(k, row, xq + c * xs, xs, y + c * ldy + r, ldy);
    switch (ncols - c) {
      case 1: f_row<T, 1>(k, row, xq + c * xs, xs, y + c * ldy + r, ldy); break;
      case 2: f_row<T, 2>(k, row, xq + c * xs, xs, y + c * ldy + r, ldy); break;
      case 3: f_row<T, 3>(k, row, xq + c * xs, xs, y + c * ldy + r, ldy); break;
      default: break;
    }
  }
}

}  // namespace

void quantize_avx2(ActKind kind, const float* x, void* xq, int64_t k) {
  quantize_scalar(kind, x, xq, k);
}

}  // namespace tf::cpu::detail

// Entry points named in the traits table (quant/traits.cpp).
TF_EXPORT_KERNEL(f32, avx2, matmul_f<GgmlType::F32>)
TF_EXPORT_KERNEL(f16, avx2, matmul_f<GgmlType::F16>)
TF_EXPORT_KERNEL(bf16, avx2, matmul_f<GgmlType::BF16>)
TF_EXPORT_KERNEL(q4_0, avx2, matmul_g32<GgmlType::Q4_0>)
TF_EXPORT_KERNEL(q4_1, avx2, matmul_g32<GgmlType::Q4_1>)
TF_EXPORT_KERNEL(q5_0, avx2, matmul_g32<GgmlType::Q5_0>)
TF_EXPORT_KERNEL(q5_1, avx2, matmul_g32<GgmlType::Q5_1>)
TF_EXPORT_KERNEL(q8_0, avx2, matmul_g32<GgmlType::Q8_0>)
TF_EXPORT_KERNEL(q2_k, avx2, matmul_k<GgmlType::Q2_K>)
TF_EXPORT_KERNEL(q3_k, avx2, matmul_k<GgmlType::Q3_K>)
TF_EXPORT_KERNEL(q4_k, avx2, matmul_k<GgmlType::Q4_K>)
TF_EXPORT_KERNEL(q5_k, avx2, matmul_k<GgmlType::Q5_K>)
TF_EXPORT_KERNEL(q6_k, avx2, matmul_k<GgmlType::Q6_K>)
