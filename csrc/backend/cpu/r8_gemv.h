// The R8 product (repack.h) for 256-bit vectors, included by the AVX2 and the AVX-512 files:
// lane r of every vector is row r of the group, so a super-block's values meet activation
// bytes broadcast to all lanes and the accumulators end as the eight rows' results. With VNNI
// four values per lane take one vpdpbusd; without, maddubs pairs summed in int16 over the
// groups whose sums stay in range, then one madd. Integer sums per super-block are exact, and
// the float steps after them are gemv_ref's, in its order: every ISA gives the same bits.
#pragma once
#include <immintrin.h>

#include <cstring>

#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/repack.h"

// Internal linkage: each including file compiles its own copy with its own ISA flags (a shared
// inline definition could let the linker hand an AVX-512 body to the AVX2 caller).
namespace tf::cpu::r8::simd {
namespace {

using T_ = GgmlType;

inline __m256i ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i ld64(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256i bytes(int v) { return _mm256_set1_epi8(char(v)); }

// One column's dot products over a scale sub-block, `groups` groups of four values per lane:
// with VNNI one vpdpbusd each; without, maddubs pairs summed in int16 for `run` groups at a
// time (as many as keep the sums in range), then one madd.
template <bool VNNI>
inline __m256i dot_add(__m256i s32, __m256i& s16, int g, int run, __m256i q, __m256i x, bool last) {
  if constexpr (VNNI) {
    (void)s16, (void)g, (void)run, (void)last;
    return _mm256_dpbusd_epi32(s32, q, x);
  } else {
    const __m256i p = _mm256_maddubs_epi16(q, x);
    s16 = g % run == 0 ? p : _mm256_add_epi16(s16, p);
    if (g % run == run - 1 || last) s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
    return s32;
  }
}

// The 128 six-bit fields of a super-block (repack.h) as four vectors of bytes: vector v holds
// fields 32v .. 32v + 31.
inline void six_bit_fields(const uint8_t* area, __m256i f[4]) {
  const __m256i l0 = ld(area), l1 = ld(area + 32), h = ld(area + 64);
  for (int v = 0; v < 4; ++v) {
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v & 1 ? l1 : l0, 4 * (v >> 1)), bytes(0xF));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * v), bytes(3));
    f[v] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
}
// Fields 8i .. 8i + 7 of one of those vectors (one sub-block's eight rows) as int32 lanes.
inline __m256i fields8(__m256i v, int i) {
  __m128i h = i < 2 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
  if (i % 2) h = _mm_srli_si128(h, 8);
  return _mm256_cvtepu8_epi32(h);
}

// Activation sums of sub-block s broadcast to every lane; bs: the 16 bsums as two int32 vectors.
inline __m256i bsum_at(const __m256i bs[2], int s) {
  return _mm256_permutevar8x32_epi32(bs[s / 8], _mm256_set1_epi32(s % 8));
}

// Super-block bytes of a type.
template <T_ T>
constexpr size_t sb_bytes() {
  return kRows * (T == T_::Q2_K ? 84 : T == T_::Q3_K ? 110 : T == T_::Q4_K ? 144 : T == T_::Q5_K ? 176 : 210);
}

// Q5_K's fifth bit of group w (0..7) of 32-value sub-block s, moved to bit 4 of each byte.
inline __m256i q5_high(const uint8_t* sb, int s, int w) {
  const __m256i H = ld(sb + 1152 + 32 * s);
  const __m256i h = w <= 4 ? _mm256_slli_epi32(H, 4 - w) : _mm256_srli_epi32(H, w - 4);
  return _mm256_and_si256(h, bytes(0x10));
}

// Values 4G .. 4G + 3 of the eight rows (lane r: row r's four bytes), G in [0, 64); G a constant
// after unrolling. The same extraction as superblock() below, for builders of other layouts.
template <T_ T>
inline __m256i group_values(const uint8_t* sb, int G) {
  if constexpr (T == T_::Q2_K || T == T_::Q3_K) {
    const int s = G / 4, j = G % 4;
    __m256i q = _mm256_and_si256(_mm256_srli_epi32(ld(sb + (T == T_::Q2_K ? 160 : 112) + 32 * s), 2 * j), bytes(3));
    if constexpr (T == T_::Q3_K) {
      const __m256i H = ld(sb + 624 + 32 * (s / 2));
      const int sh = j + 4 * (s & 1);
      const __m256i hb = sh >= 2 ? _mm256_srli_epi32(H, sh - 2) : _mm256_slli_epi32(H, 2 - sh);
      q = _mm256_or_si256(q, _mm256_and_si256(hb, bytes(4)));
    }
    return q;
  } else if constexpr (T == T_::Q4_K || T == T_::Q5_K) {
    const int s = G / 8, w = G % 8;
    const __m256i L = ld(sb + 128 + 128 * s + 32 * (w / 2));
    __m256i q = _mm256_and_si256(w % 2 ? _mm256_srli_epi32(L, 4) : L, bytes(0xF));
    if constexpr (T == T_::Q5_K) q = _mm256_or_si256(q, q5_high(sb, s, w));
    return q;
  } else {
    static_assert(T == T_::Q6_K);
    const int s = G / 4, j = G % 4;
    const uint8_t* p = sb + 144 + 96 * s;
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(ld(p + 32 * (j / 2)), 4 * (j & 1)), bytes(0xF));
    const __m256i H = ld(p + 64);
    const __m256i hs = j < 2 ? _mm256_slli_epi32(H, 4 - 2 * j) : (j == 2 ? H : _mm256_srli_epi32(H, 2));
    return _mm256_or_si256(lo, _mm256_and_si256(hs, bytes(0x30)));
  }
}

// The generic decomposition's float factors of 16-value sub-block s for the eight rows:
// f = d * sc, m = dmin * mn (k_scales' sc, mn, d, dmin; each product one rounding, as there).
template <T_ T>
inline void sub_factors(const uint8_t* sb, int s, __m256* f, __m256* m) {
  const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
  __m256i sc, mn;
  __m256 dmin8 = d8;
  if constexpr (T == T_::Q2_K) {
    const __m256i raw = _mm256_cvtepu8_epi32(ld64(sb + 32 + 8 * s));
    sc = _mm256_and_si256(raw, _mm256_set1_epi32(0xF));
    mn = _mm256_srli_epi32(raw, 4);
    dmin8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16)));
  } else if constexpr (T == T_::Q3_K || T == T_::Q4_K || T == T_::Q5_K) {
    // one 6-bit field per lane: n = base + 8s' + r
    auto field = [&](int n0) {
      const __m256i lo = _mm256_cvtepu8_epi32(ld64(sb + (T == T_::Q3_K ? 16 : 32) + n0 % 64));
      const __m256i hi = _mm256_cvtepu8_epi32(ld64(sb + (T == T_::Q3_K ? 16 : 32) + 64 + n0 % 32));
      return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lo, 4 * (n0 / 64)), _mm256_set1_epi32(0xF)),
                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 2 * (n0 / 32)), _mm256_set1_epi32(3)), 4));
    };
    if constexpr (T == T_::Q3_K) {
      sc = _mm256_sub_epi32(field(8 * s), _mm256_set1_epi32(32));
      mn = _mm256_slli_epi32(sc, 2);
    } else {
      sc = field(8 * (s / 2));
      mn = field(64 + 8 * (s / 2));
      dmin8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16)));
    }
  } else {
    sc = _mm256_cvtepi8_epi32(ld64(sb + 16 + 8 * s));
    mn = _mm256_slli_epi32(sc, 5);
  }
  *f = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(sc));
  *m = _mm256_mul_ps(dmin8, _mm256_cvtepi32_ps(mn));
}

template <bool VNNI, T_ T, int NC>
inline void superblock(const uint8_t* sb, const detail::ActK* const a[NC], __m256 acc[NC]) {
  constexpr bool fold = T == T_::Q3_K || T == T_::Q6_K;
  __m256i isum[NC], msum[NC], bs[NC][2];
  for (int c = 0; c < NC; ++c) {
    isum[c] = msum[c] = _mm256_setzero_si256();
    const __m128i* p = reinterpret_cast<const __m128i*>(a[c]->bsums);
    bs[c][0] = _mm256_cvtepi16_epi32(_mm_loadu_si128(p));
    bs[c][1] = _mm256_cvtepi16_epi32(_mm_loadu_si128(p + 1));
    if constexpr (fold) {
      constexpr int sh = T == T_::Q3_K ? 2 : 5;  // offsets 4 and 32
      bs[c][0] = _mm256_slli_epi32(bs[c][0], sh);
      bs[c][1] = _mm256_slli_epi32(bs[c][1], sh);
    }
  }
  __m256 d8, dmin8 = _mm256_setzero_ps();
  d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb)));
  if constexpr (!fold) dmin8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16)));

  if constexpr (T == T_::Q2_K || T == T_::Q3_K) {
    __m256i f6[4];
    if constexpr (T == T_::Q3_K) six_bit_fields(sb + 16, f6);
    const uint8_t* vals = sb + (T == T_::Q2_K ? 160 : 112);
    // Sub-blocks four at a time: the index within the four (shift counts, lanes) is a
    // constant, and the loop over the four quads keeps the live values within the registers.
#pragma GCC unroll 1
    for (int quad = 0; quad < 4; ++quad)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const int s = 4 * quad + i;
      const __m256i L = ld(vals + 32 * s);
      __m256i H = _mm256_setzero_si256();
      if constexpr (T == T_::Q3_K) H = ld(sb + 624 + 32 * (s / 2));
      __m256i dot[NC], d16[NC];
      for (int c = 0; c < NC; ++c) dot[c] = d16[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m256i q = _mm256_and_si256(_mm256_srli_epi32(L, 2 * j), bytes(3));
        if constexpr (T == T_::Q3_K) {
          const int sh = j + 4 * (i & 1);
          const __m256i hb = sh >= 2 ? _mm256_srli_epi32(H, sh - 2) : _mm256_slli_epi32(H, 2 - sh);
          q = _mm256_or_si256(q, _mm256_and_si256(hb, bytes(4)));
        }
        for (int c = 0; c < NC; ++c) dot[c] = dot_add<VNNI>(dot[c], d16[c], j, 4, q, bcast4(a[c]->qs + 16 * s + 4 * j), j == 3);
      }
      if constexpr (T == T_::Q2_K) {
        const __m256i raw = _mm256_cvtepu8_epi32(ld64(sb + 32 + 8 * s));
        const __m256i sc = _mm256_and_si256(raw, _mm256_set1_epi32(0xF)), mn = _mm256_srli_epi32(raw, 4);
        for (int c = 0; c < NC; ++c) {
          isum[c] = _mm256_add_epi32(isum[c], _mm256_mullo_epi32(dot[c], sc));
          msum[c] = _mm256_add_epi32(msum[c], _mm256_mullo_epi32(mn, bsum_at(bs[c], s)));
        }
      } else {
        const __m256i sc = _mm256_sub_epi32(fields8(f6[quad], i), _mm256_set1_epi32(32));
        for (int c = 0; c < NC; ++c)
          isum[c] = _mm256_add_epi32(isum[c], _mm256_mullo_epi32(_mm256_sub_epi32(dot[c], bsum_at(bs[c], s)), sc));
      }
    }
  } else if constexpr (T == T_::Q4_K || T == T_::Q5_K) {
    // int16 sums of maddubs pairs stay in range for 8 groups of 4-bit values, 4 of 5-bit ones
    constexpr int run = T == T_::Q4_K ? 8 : 4;
    __m256i f6[4];
    six_bit_fields(sb + 32, f6);
#pragma GCC unroll 1
    for (int quad = 0; quad < 2; ++quad)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const int s = 4 * quad + i;
      __m256i dot[NC], d16[NC];
      for (int c = 0; c < NC; ++c) dot[c] = d16[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m256i L = ld(sb + 128 + 128 * s + 32 * t);
        __m256i q0 = _mm256_and_si256(L, bytes(0xF)), q1 = _mm256_and_si256(_mm256_srli_epi32(L, 4), bytes(0xF));
        if constexpr (T == T_::Q5_K) {
          q0 = _mm256_or_si256(q0, q5_high(sb, s, 2 * t));
          q1 = _mm256_or_si256(q1, q5_high(sb, s, 2 * t + 1));
        }
        for (int c = 0; c < NC; ++c) {
          dot[c] = dot_add<VNNI>(dot[c], d16[c], 2 * t, run, q0, bcast4(a[c]->qs + 32 * s + 8 * t), false);
          dot[c] = dot_add<VNNI>(dot[c], d16[c], 2 * t + 1, run, q1, bcast4(a[c]->qs + 32 * s + 8 * t + 4), t == 3);
        }
      }
      const __m256i sc = fields8(f6[quad], i), mn = fields8(f6[2 + quad], i);
      for (int c = 0; c < NC; ++c) {
        isum[c] = _mm256_add_epi32(isum[c], _mm256_mullo_epi32(dot[c], sc));
        // the two 16-value sums of the sub-block: the mins' products summed as gemv_ref sums them
        const __m256i m2 = _mm256_add_epi32(_mm256_mullo_epi32(mn, bsum_at(bs[c], 2 * s)),
                                            _mm256_mullo_epi32(mn, bsum_at(bs[c], 2 * s + 1)));
        msum[c] = _mm256_add_epi32(msum[c], m2);
      }
    }
  } else {
    static_assert(T == T_::Q6_K);
#pragma GCC unroll 1
    for (int quad = 0; quad < 4; ++quad)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const int s = 4 * quad + i;
      const uint8_t* p = sb + 144 + 96 * s;
      const __m256i L0 = ld(p), L1 = ld(p + 32), H = ld(p + 64);
      __m256i dot[NC], d16[NC];
      for (int c = 0; c < NC; ++c) dot[c] = d16[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(j < 2 ? L0 : L1, 4 * (j & 1)), bytes(0xF));
        const __m256i hs = j < 2 ? _mm256_slli_epi32(H, 4 - 2 * j) : (j == 2 ? H : _mm256_srli_epi32(H, 2));
        const __m256i q = _mm256_or_si256(lo, _mm256_and_si256(hs, bytes(0x30)));
        for (int c = 0; c < NC; ++c) dot[c] = dot_add<VNNI>(dot[c], d16[c], j, 2, q, bcast4(a[c]->qs + 16 * s + 4 * j), j == 3);
      }
      const __m256i sc = _mm256_cvtepi8_epi32(ld64(sb + 16 + 8 * s));
      for (int c = 0; c < NC; ++c)
        isum[c] = _mm256_add_epi32(isum[c], _mm256_mullo_epi32(_mm256_sub_epi32(dot[c], bsum_at(bs[c], s)), sc));
    }
  }
  const __m256 ndmin8 = _mm256_sub_ps(_mm256_setzero_ps(), dmin8);
  for (int c = 0; c < NC; ++c) {
    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[c]), d8);
    if constexpr (!fold) t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum[c]), ndmin8, t);
    acc[c] = _mm256_fmadd_ps(t, _mm256_set1_ps(a[c]->d), acc[c]);
  }
}

template <bool VNNI, T_ T, int NC>
void gemv_cols(int64_t nb, const uint8_t* sb0, const uint8_t* xq, size_t xs, float* y, int64_t ldy) {
  constexpr size_t sbb = sizeof(typename std::conditional_t<T == T_::Q2_K, block_q2_K,
                                std::conditional_t<T == T_::Q3_K, block_q3_K,
                                std::conditional_t<T == T_::Q4_K, block_q4_K,
                                std::conditional_t<T == T_::Q5_K, block_q5_K, block_q6_K>>>>) * kRows;
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const detail::ActK* a[NC];
    for (int c = 0; c < NC; ++c) a[c] = reinterpret_cast<const detail::ActK*>(xq + size_t(c) * xs) + b;
    superblock<VNNI, T, NC>(sb0 + size_t(b) * sbb, a, acc);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(y + c * ldy, acc[c]);
}

template <bool VNNI, T_ T>
void gemv_type(int64_t nb, const uint8_t* sb0, const uint8_t* xq, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  // Columns two at a time (their accumulators and the unpacked values fit the registers).
  int64_t c = 0;
  for (; c + 2 <= ncols; c += 2) gemv_cols<VNNI, T, 2>(nb, sb0, xq + size_t(c) * xs, xs, y + c * ldy, ldy);
  if (c < ncols) gemv_cols<VNNI, T, 1>(nb, sb0, xq + size_t(c) * xs, xs, y + c * ldy, ldy);
}

template <bool VNNI>
void gemv(GgmlType t, int64_t nb, const uint8_t* sb0, const void* xq, size_t xs, int64_t ncols, float* y,
          int64_t ldy) {
  const uint8_t* x = static_cast<const uint8_t*>(xq);
  switch (t) {
    case T_::Q2_K: return gemv_type<VNNI, T_::Q2_K>(nb, sb0, x, xs, ncols, y, ldy);
    case T_::Q3_K: return gemv_type<VNNI, T_::Q3_K>(nb, sb0, x, xs, ncols, y, ldy);
    case T_::Q4_K: return gemv_type<VNNI, T_::Q4_K>(nb, sb0, x, xs, ncols, y, ldy);
    case T_::Q5_K: return gemv_type<VNNI, T_::Q5_K>(nb, sb0, x, xs, ncols, y, ldy);
    case T_::Q6_K: return gemv_type<VNNI, T_::Q6_K>(nb, sb0, x, xs, ncols, y, ldy);
    default: return gemv_ref(t, nb, sb0, xq, xs, ncols, y, ldy);
  }
}

}  // namespace
}  // namespace tf::cpu::r8::simd
