// AVX2 (+FMA, F16C) matmul kernels: the fallback for CPUs without AVX-512. Same arithmetic as
// kernels_scalar.cpp; only the float summation order differs. Less tuned than AVX-512:
// one 32-value block per ymm (vpmaddubsw + vpmaddwd), K-quants unpacked through the scalar
// decomposition into a small per-row-chunk buffer and reused across columns.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/tile8_avx2.h"
#include "backend/cpu/tile_avx2.h"
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


// k_scales() (kernels_scalar.cpp) for one type, without its per-block type switch and with
// the 6-bit fields of Q3_K/Q4_K/Q5_K unpacked a word at a time.
template <T_ T>
inline void k_scales_avx2(const uint8_t* blk, KUnpacked* u) {
  auto store16 = [](int16_t* dst, __m128i bytes, bool is_signed) {
    const __m256i v = is_signed ? _mm256_cvtepi8_epi16(bytes) : _mm256_cvtepu8_epi16(bytes);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
  };
  if constexpr (T == T_::Q2_K) {
    const auto* b = reinterpret_cast<const block_q2_K*>(blk);
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)), m4 = _mm_set1_epi8(0xF);
    store16(u->sc, _mm_and_si128(s, m4), false);
    store16(u->mn, _mm_and_si128(_mm_srli_epi16(s, 4), m4), false);
    u->d = h2f(b->d);
    u->dmin = h2f(b->dmin);
  } else if constexpr (T == T_::Q3_K) {
    // 16 six-bit scales: low nibbles in bytes 0..7, high 2-bit pairs in bytes 8..11.
    const auto* b = reinterpret_cast<const block_q3_K*>(blk);
    uint32_t a[3], out[4];
    std::memcpy(a, b->scales, 12);
    const uint32_t m2 = 0x03030303u, m4 = 0x0f0f0f0fu;
    out[0] = (a[0] & m4) | ((a[2] & m2) << 4);
    out[1] = (a[1] & m4) | (((a[2] >> 2) & m2) << 4);
    out[2] = ((a[0] >> 4) & m4) | (((a[2] >> 4) & m2) << 4);
    out[3] = ((a[1] >> 4) & m4) | (((a[2] >> 6) & m2) << 4);
    // Built in registers: four 4-byte stores read back as one 16-byte load would miss store
    // forwarding and stall every block (it halved Q3_K's decode speed).
    const __m128i packed = _mm_setr_epi32(int(out[0]), int(out[1]), int(out[2]), int(out[3]));
    const __m256i sc = _mm256_sub_epi16(_mm256_cvtepu8_epi16(packed), _mm256_set1_epi16(32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->sc), sc);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->mn), _mm256_slli_epi16(sc, 2));
    u->d = u->dmin = h2f(b->d);
  } else if constexpr (T == T_::Q4_K || T == T_::Q5_K) {
    // Eight 6-bit scales and eight 6-bit mins in 12 bytes (scale_min_k4's layout): words
    // w0, w1 hold the low 6 bits of scales/mins 0..3 and their top 2 bits for 4..7; w2 holds
    // the low nibbles of scales 4..7 (low) and mins 4..7 (high).
    const auto* b = reinterpret_cast<const std::conditional_t<T == T_::Q4_K, block_q4_K, block_q5_K>*>(blk);
    uint32_t w[3], sm[4];
    std::memcpy(w, b->scales, 12);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    sm[0] = w[0] & m6;                                        // scales 0..3
    sm[1] = (w[2] & m4) | (((w[0] >> 6) & m2) << 4);          // scales 4..7
    sm[2] = w[1] & m6;                                        // mins 0..3
    sm[3] = ((w[2] >> 4) & m4) | (((w[1] >> 6) & m2) << 4);   // mins 4..7
    const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m128i v = _mm_setr_epi32(int(sm[0]), int(sm[1]), int(sm[2]), int(sm[3]));  // in registers (see Q3_K)
    store16(u->sc, _mm_shuffle_epi8(v, pairs), false);
    store16(u->mn, _mm_shuffle_epi8(_mm_srli_si128(v, 8), pairs), false);
    u->d = h2f(b->d);
    u->dmin = h2f(b->dmin);
  } else {
    static_assert(T == T_::Q6_K);
    const auto* b = reinterpret_cast<const block_q6_K*>(blk);
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->sc), sc);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->mn), _mm256_slli_epi16(sc, 5));
    u->d = u->dmin = h2f(b->d);
  }
}

// The 256 unsigned quant values of a K-quant block, as k_values() (kernels_scalar.cpp) lays
// them out, unpacked 32 at a time into q[0..7]. 16-bit shifts followed by a byte mask never
// mix bits of neighbouring bytes here: every field read is shift + width <= 8 bits in its byte.
template <T_ T>
inline void k_unpack_avx2(const uint8_t* blk, __m256i* q) {
  auto ld = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  auto st = [q](int at, __m256i v) { q[at / 32] = v; };
  auto field = [](__m256i v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(char(mask)));
  };
  if constexpr (T == T_::Q2_K) {
    const auto* b = reinterpret_cast<const block_q2_K*>(blk);
    for (int h = 0; h < 2; ++h) {
      const __m256i x = ld(b->qs + 32 * h);
      for (int j = 0; j < 4; ++j) st(128 * h + 32 * j, field(x, 2 * j, 3));
    }
  } else if constexpr (T == T_::Q3_K) {
    const auto* b = reinterpret_cast<const block_q3_K*>(blk);
    const __m256i hm = ld(b->hmask);
    for (int h = 0; h < 2; ++h) {
      const __m256i x = ld(b->qs + 32 * h);
      for (int j = 0; j < 4; ++j)
        st(128 * h + 32 * j, _mm256_or_si256(field(x, 2 * j, 3), _mm256_slli_epi16(field(hm, 4 * h + j, 1), 2)));
    }
  } else if constexpr (T == T_::Q4_K) {
    const auto* b = reinterpret_cast<const block_q4_K*>(blk);
    for (int c = 0; c < 4; ++c) {
      const __m256i x = ld(b->qs + 32 * c);
      st(64 * c, field(x, 0, 0xF));
      st(64 * c + 32, field(x, 4, 0xF));
    }
  } else if constexpr (T == T_::Q5_K) {
    const auto* b = reinterpret_cast<const block_q5_K*>(blk);
    const __m256i qh = ld(b->qh);
    for (int c = 0; c < 4; ++c) {
      const __m256i x = ld(b->qs + 32 * c);
      st(64 * c, _mm256_or_si256(field(x, 0, 0xF), _mm256_slli_epi16(field(qh, 2 * c, 1), 4)));
      st(64 * c + 32, _mm256_or_si256(field(x, 4, 0xF), _mm256_slli_epi16(field(qh, 2 * c + 1, 1), 4)));
    }
  } else {
    static_assert(T == T_::Q6_K);
    const auto* b = reinterpret_cast<const block_q6_K*>(blk);
    for (int h = 0; h < 2; ++h) {
      const __m256i lo = ld(b->ql + 64 * h), hi = ld(b->ql + 64 * h + 32), qh = ld(b->qh + 32 * h);
      for (int t = 0; t < 4; ++t) {
        const __m256i low = field(t & 1 ? hi : lo, t < 2 ? 0 : 4, 0xF);
        st(128 * h + 32 * t, _mm256_or_si256(low, _mm256_slli_epi16(field(qh, 2 * t, 3), 4)));
      }
    }
  }
}

// Chunk i (values 32i .. 32i+31) of k_unpack_avx2, on its own: with i a constant after
// unrolling, the decode kernel keeps one chunk in a register at a time.
template <T_ T>
inline __m256i k_chunk(const uint8_t* blk, int i) {
  auto ld = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  auto field = [](__m256i v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(char(mask)));
  };
  const int h = i / 4, j = i % 4;
  if constexpr (T == T_::Q2_K) {
    return field(ld(reinterpret_cast<const block_q2_K*>(blk)->qs + 32 * h), 2 * j, 3);
  } else if constexpr (T == T_::Q3_K) {
    const auto* b = reinterpret_cast<const block_q3_K*>(blk);
    // The high bit (bit 4h + j of each hmask byte) moved straight to bit 2: one shift, one mask.
    const int s = 4 * h + j;
    const __m256i hm = ld(b->hmask);
    const __m256i hi = s >= 2 ? _mm256_srli_epi16(hm, s - 2) : _mm256_slli_epi16(hm, 2 - s);
    return _mm256_or_si256(field(ld(b->qs + 32 * h), 2 * j, 3), _mm256_and_si256(hi, _mm256_set1_epi8(4)));
  } else if constexpr (T == T_::Q4_K) {
    return field(ld(reinterpret_cast<const block_q4_K*>(blk)->qs + 32 * (i / 2)), 4 * (i & 1), 0xF);
  } else if constexpr (T == T_::Q5_K) {
    const auto* b = reinterpret_cast<const block_q5_K*>(blk);
    return _mm256_or_si256(field(ld(b->qs + 32 * (i / 2)), 4 * (i & 1), 0xF), _mm256_slli_epi16(field(ld(b->qh), i, 1), 4));
  } else {
    const auto* b = reinterpret_cast<const block_q6_K*>(blk);
    const __m256i low = field(ld(b->ql + 64 * h + 32 * (j & 1)), j < 2 ? 0 : 4, 0xF);
    return _mm256_or_si256(low, _mm256_slli_epi16(field(ld(b->qh + 32 * h), 2 * j, 3), 4));
  }
}

// The scale of each maddubs lane of the eight 32-value chunks (kScalePairShuffle).
inline void k_scale_vectors(const KUnpacked& u, __m256i* sc) {
  const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.sc));
  const __m256i lo = _mm256_permute2x128_si256(s, s, 0x00), hi = _mm256_permute2x128_si256(s, s, 0x11);
  for (int i = 0; i < 4; ++i) {
    const __m256i pick = _mm256_load_si256(reinterpret_cast<const __m256i*>(kScalePairShuffle[i]));
    sc[i] = _mm256_shuffle_epi8(lo, pick);
    sc[4 + i] = _mm256_shuffle_epi8(hi, pick);
  }
}

// Up to four columns (decode): each block unpacked into registers and used at once, nothing
// stored — for a GEMV the unpacking, not the dot product, is the cost.
template <T_ T, int NC>
void matmul_k_narrow(int64_t nb, const uint8_t* w, size_t ws, int64_t r0, int64_t r1, const uint8_t* xq,
                     size_t xs, float* y, int64_t ldy) {
  constexpr size_t bb = block_bytes<T>();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* blk = w + size_t(r) * ws;
    __m256 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, blk += bb) {
      KUnpacked u;
      k_scales_avx2<T>(blk, &u);
      const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.sc));
      const __m256i sc_lo = _mm256_permute2x128_si256(s16, s16, 0x00), sc_hi = _mm256_permute2x128_si256(s16, s16, 0x11);
      __m256i isum[NC];
      for (int c = 0; c < NC; ++c) isum[c] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256i q = k_chunk<T>(blk, i);
        const __m256i sc = _mm256_shuffle_epi8(i < 4 ? sc_lo : sc_hi,
                                               _mm256_load_si256(reinterpret_cast<const __m256i*>(kScalePairShuffle[i % 4])));
        for (int c = 0; c < NC; ++c) {
          const ActK* a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b;
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->qs + 32 * i));
          isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), sc));
        }
      }
      const __m256i mn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.mn));
      for (int c = 0; c < NC; ++c) {
        const ActK* a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b;
        const __m256i s = isum[c];
        const __m256i m = _mm256_madd_epi16(mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->bsums)));
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(u.d));
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(-u.dmin), t);
        acc[c] = _mm256_fmadd_ps(t, _mm256_set1_ps(a->d), acc[c]);
      }
    }
    for (int c = 0; c < NC; ++c) y[c * ldy + r] = hsum8(acc[c]);
  }
}

template <T_ T>
void matmul_k(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1, const void* xv,
              size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  const int64_t nb = k / 256;
  switch (ncols) {
    case 1: return matmul_k_narrow<T, 1>(nb, w, ws, r0, r1, xq, xs, y, ldy);
    case 2: return matmul_k_narrow<T, 2>(nb, w, ws, r0, r1, xq, xs, y, ldy);
    case 3: return matmul_k_narrow<T, 3>(nb, w, ws, r0, r1, xq, xs, y, ldy);
    case 4: return matmul_k_narrow<T, 4>(nb, w, ws, r0, r1, xq, xs, y, ldy);
    case 5: return matmul_k_narrow<T, 5>(nb, w, ws, r0, r1, xq, xs, y, ldy);
    case 6: return matmul_k_narrow<T, 6>(nb, w, ws, r0, r1, xq, xs, y, ldy);
    case 7: return matmul_k_narrow<T, 7>(nb, w, ws, r0, r1, xq, xs, y, ldy);
    case 8: return matmul_k_narrow<T, 8>(nb, w, ws, r0, r1, xq, xs, y, ldy);
    default: break;
  }
  // Wider (prefill): eight rows interleaved (tile8_avx2.h); rows left over by the groups of
  // eight take the two-row tile (tile_avx2.h) over blocks unpacked into Prep256.
  // Q3_K and Q6_K's offsets (4, 32) are scaled by d itself: taken off in integers.
  constexpr TileMode mode = (T == T_::Q3_K || T == T_::Q6_K) ? TileMode::MinInt : TileMode::MinFloat;
  constexpr size_t bb = block_bytes<T>();
  const auto prepare = [](const uint8_t* blk, Prep256* z) {
    KUnpacked u;
    k_scales_avx2<T>(blk, &u);
    k_unpack_avx2<T>(blk, z->aq);
    k_scale_vectors(u, z->sc);
    z->corr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.mn));
    z->set_scales(u.d, -u.dmin);
  };
  const auto prepare8 = [](const uint8_t* row0, size_t row_stride, size_t b, Inter8* z) {
    __m256i q[8][8], sc[8], corr[8];
    alignas(32) float d[8], dc[8];
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = row0 + r * row_stride + b * bb;
      KUnpacked u;
      k_scales_avx2<T>(blk, &u);
      k_unpack_avx2<T>(blk, q[r]);
      sc[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.sc));
      corr[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.mn));
      d[r] = u.d;
      dc[r] = -u.dmin;
    }
    interleave8(q, sc, corr, d, dc, *z);
  };
  const auto rest = [&](int64_t ra, int64_t rb) {
    matmul_prep256_avx2<mode, bb>(prepare, k, w, ws, ra, rb, xq, xs, ncols, y, ldy);
  };
  // int16 sums of four maddubs stay in range for codes up to 31; Q6_K's 63 allow two.
  constexpr int steps = T == T_::Q6_K ? 2 : 4;
  matmul_inter8_avx2<steps, mode>(prepare8, rest, k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
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
    for (int64_t j = i; j < k; ++j) s += float_weight<T>(row, j) * x[j];
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

// ---------------------------------------------------------------------------------------
// Activation quantization (bit-identical to quantize_scalar: the same scale, cvtps2dq rounds
// to nearest even as nearbyint does; n is 32 or 256).

inline void quant_block(const float* x, int n, int8_t* q, float* d_out, int* sum_out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  __m256 poison = _mm256_setzero_ps();  // x * 0 is NaN exactly where x is NaN or inf
  for (int i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v, abs_mask));
    poison = _mm256_add_ps(poison, _mm256_mul_ps(v, _mm256_setzero_ps()));
  }
  if (_mm256_movemask_ps(_mm256_cmp_ps(poison, poison, _CMP_UNORD_Q))) {
    std::memset(q, 0, size_t(n));  // as the scalar reference: a NaN scale, no integers
    *d_out = std::numeric_limits<float>::quiet_NaN();
    *sum_out = 0;
    return;
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float am = _mm_cvtss_f32(m4);
  const float d = am / 127.f;
  const float id = am != 0.f ? 127.f / am : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < n; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), vid));
      sum = _mm256_add_epi32(sum, v[j]);
    }
    // packs interleave the 128-bit lanes; the final permute restores element order
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  *d_out = d;
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *sum_out = _mm_cvtsi128_si32(s4);
}

}  // namespace

void quantize_avx2(ActKind kind, const float* x, void* xq, int64_t k) {
  quantize_row_with(kind, x, xq, k, quant_block);
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
