// AVX-512 (F/BW/VL/DQ + VNNI) matmul kernels. Same arithmetic as kernels_scalar.cpp, only
// the float summation order differs.
//
// 32-value block formats: two weight blocks (64 values) are unpacked into one zmm of
// unsigned q, dotted with the int8 activations by vpdpbusd; offset formats (Q4_0 -8, Q5_0
// -16, Q8_0 +128 bias) seed the integer accumulator with -off * sum(x) so the integer dot is
// exact, and the per-block scale product is applied with one FMA per 16 lanes.
// K-quants: each 256-block is unpacked once per row tile into unsigned q + int16 scales
// expanded per maddubs lane (vpmaddubsw + vpdpwssd accumulate with the sub-block scales in
// the integer domain), then reused across the column tile.
#include <immintrin.h>
#include <limits>

#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/panel_avx512.h"
#include "backend/cpu/r8_gemv.h"
#include "core/error.h"
#include "quant/blocks.h"

namespace tf::cpu::detail {

namespace {

using T_ = GgmlType;

// GEMV streams the weights once: software prefetch this many bytes ahead of the read
// position (the hardware prefetchers alone reach only ~1/3 of the bandwidth here).
#ifndef TF_PREFETCH_BYTES
#define TF_PREFETCH_BYTES 2048
#endif
constexpr int kPfDist = TF_PREFETCH_BYTES;
inline void pf(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kPfDist, _MM_HINT_T0); }

inline uint32_t ld32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

alignas(64) const int32_t kIdxLo2[16] = {0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2};
alignas(64) const int32_t kIdxHi2[16] = {1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3};
alignas(64) const int32_t kIdx01[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
alignas(64) const int32_t kIdx23[16] = {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};

inline __m512i ld_idx(const int32_t* p) { return _mm512_load_si512(p); }

// ---------------------------------------------------------------------------------------
// 32-value block formats.

template <T_ T> struct G32;
template <> struct G32<T_::Q4_0> { static constexpr int bytes = 18, qs = 2, qh = -1, off = 8; static constexpr bool min = false; };
template <> struct G32<T_::Q4_1> { static constexpr int bytes = 20, qs = 4, qh = -1, off = 0; static constexpr bool min = true; };
template <> struct G32<T_::Q5_0> { static constexpr int bytes = 22, qs = 6, qh = 2, off = 16; static constexpr bool min = false; };
template <> struct G32<T_::Q5_1> { static constexpr int bytes = 24, qs = 8, qh = 4, off = 0; static constexpr bool min = true; };
template <> struct G32<T_::Q8_0> { static constexpr int bytes = 34, qs = 2, qh = -1, off = 128; static constexpr bool min = false; };

struct WReg {
  __m512i q;
  __m512 dw, mw;
};
struct XReg {
  __m512i q, seed;
  __m512 dx, sx;
};

template <T_ T, bool TWO>
inline void unpack_w(const uint8_t* b0, WReg& u) {
  using F = G32<T>;
  const uint8_t* b1 = b0 + F::bytes;
  if constexpr (T == T_::Q8_0) {
    const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + F::qs));
    const __m256i y1 =
        TWO ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + F::qs)) : _mm256_setzero_si256();
    u.q = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(y0), y1, 1),
                           _mm512_set1_epi8(char(0x80)));
  } else {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + F::qs));
    const __m128i q1 =
        TWO ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + F::qs)) : _mm_setzero_si128();
    __m512i z = _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1));
    z = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(1, 1, 0, 0));  // [b0, b0, b1, b1]
    z = _mm512_mask_srli_epi16(z, 0xFF00FF00u, z, 4);           // high nibbles in lanes 1, 3
    z = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
    if constexpr (F::qh >= 0) {
      const uint64_t h = uint64_t(ld32(b0 + F::qh)) | (TWO ? uint64_t(ld32(b1 + F::qh)) << 32 : 0);
      z = _mm512_mask_add_epi8(z, __mmask64(h), z, _mm512_set1_epi8(16));
    }
    u.q = z;
  }
  const uint32_t h0 = ld32(b0), h1 = TWO ? ld32(b1) : 0u;
  const __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_set_epi32(0, 0, int(h1), int(h0))));
  u.dw = _mm512_permutexvar_ps(ld_idx(kIdxLo2), f);  // d0 x8, d1 x8
  if constexpr (F::min)
    u.mw = _mm512_mul_ps(_mm512_permutexvar_ps(ld_idx(kIdxHi2), f), _mm512_set1_ps(0.125f));
}

template <T_ T>
inline void load_x(const int8_t* qs, const float* sc, int64_t g, XReg& x) {
  using F = G32<T>;
  x.q = _mm512_loadu_si512(qs + 64 * g);
  const __m512 f = _mm512_castps128_ps512(_mm_loadu_ps(sc + 4 * g));  // d0 d1 s0 s1
  x.dx = _mm512_permutexvar_ps(ld_idx(kIdx01), f);
  if constexpr (F::min) x.sx = _mm512_permutexvar_ps(ld_idx(kIdx23), f);
  if constexpr (F::off != 0)
    x.seed = _mm512_sub_epi32(_mm512_setzero_si512(),
                              _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                  _mm512_set1_epi8(char(F::off)), x.q));
}

template <T_ T>
inline __m512 pair(const WReg& w, const XReg& x, __m512 acc) {
  using F = G32<T>;
  const __m512i s = F::off != 0 ? x.seed : _mm512_setzero_si512();
  const __m512i d = _mm512_dpbusd_epi32(s, w.q, x.q);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(w.dw, x.dx), acc);
  if constexpr (F::min) acc = _mm512_fmadd_ps(w.mw, x.sx, acc);
  return acc;
}

template <T_ T, int NR, int NC>
void g32_tile(int64_t k, const uint8_t* w, size_t ws, const uint8_t* xq, size_t xs, float* y,
              int64_t ldy) {
  using F = G32<T>;
  const int64_t nb = k / 32, ng = g32_groups(k), nfull = nb / 2;
  const int8_t* xqs[NC];
  const float* xsc[NC];
  for (int c = 0; c < NC; ++c) {
    xqs[c] = reinterpret_cast<const int8_t*>(xq + size_t(c) * xs);
    xsc[c] = reinterpret_cast<const float*>(xqs[c] + ng * 64);
  }
  __m512 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < nfull; ++g) {
    WReg wr[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = w + size_t(r) * ws + size_t(2 * g) * F::bytes;
      pf(p);  // every tile: small column counts stream the weights as GEMV does
      unpack_w<T, true>(p, wr[r]);
    }
    for (int c = 0; c < NC; ++c) {
      XReg x;
      load_x<T>(xqs[c], xsc[c], g, x);
      for (int r = 0; r < NR; ++r) acc[r][c] = pair<T>(wr[r], x, acc[r][c]);
    }
  }
  if (nb & 1) {
    const int64_t g = nfull;
    WReg wr[NR];
    for (int r = 0; r < NR; ++r) unpack_w<T, false>(w + size_t(r) * ws + size_t(2 * g) * F::bytes, wr[r]);
    for (int c = 0; c < NC; ++c) {
      XReg x;
      load_x<T>(xqs[c], xsc[c], g, x);
      for (int r = 0; r < NR; ++r) acc[r][c] = pair<T>(wr[r], x, acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) y[c * ldy + r] = _mm512_reduce_add_ps(acc[r][c]);
}

template <T_ T, int NR>
void g32_cols(int64_t k, const uint8_t* w, size_t ws, const uint8_t* xq, size_t xs, int64_t ncols,
              float* y, int64_t ldy) {
  constexpr int NCMAX = 8;
  int64_t c = 0;
  for (; c + NCMAX <= ncols; c += NCMAX) g32_tile<T, NR, NCMAX>(k, w, ws, xq + c * xs, xs, y + c * ldy, ldy);
  const int64_t rem = ncols - c;
  const uint8_t* x = xq + c * xs;
  float* yy = y + c * ldy;
  switch (rem) {
    case 1: g32_tile<T, NR, 1>(k, w, ws, x, xs, yy, ldy); break;
    case 2: g32_tile<T, NR, 2>(k, w, ws, x, xs, yy, ldy); break;
    case 3: g32_tile<T, NR, 3>(k, w, ws, x, xs, yy, ldy); break;
    case 4: g32_tile<T, NR, 4>(k, w, ws, x, xs, yy, ldy); break;
    case 5: g32_tile<T, NR, 5>(k, w, ws, x, xs, yy, ldy); break;
    case 6: g32_tile<T, NR, 6>(k, w, ws, x, xs, yy, ldy); break;
    case 7: g32_tile<T, NR, 7>(k, w, ws, x, xs, yy, ldy); break;
    default: break;
  }
}

// Prefill (many columns): 16-row VNNI panels of block pairs (panel_avx512.h,
// matmul_g32_panels_avx512), the codes unpacked by unpack_w.

template <T_ T>
struct G32PanelSource {
  static constexpr int off = G32<T>::off;
  static constexpr bool has_min = G32<T>::min;
  static void unpack(const uint8_t* row, int64_t b, bool two, __m512i& q, float d[2], float m[2]) {
    using F = G32<T>;
    const uint8_t* p = row + size_t(b) * F::bytes;
    WReg u;
    if (two) unpack_w<T, true>(p, u);
    else unpack_w<T, false>(p, u);
    q = u.q;
    d[0] = _cvtsh_ss(ld16(p));
    d[1] = two ? _cvtsh_ss(ld16(p + F::bytes)) : 0.f;
    if constexpr (F::min) {
      m[0] = _cvtsh_ss(ld16(p + 2));
      m[1] = two ? _cvtsh_ss(ld16(p + F::bytes + 2)) : 0.f;
    }
  }
};

// The panels as a kernel-table entry (CpuKernels::avx512_panels).
template <T_ T>
void matmul_g32_panel_entry(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                            int64_t ncols, float* y, int64_t ldy) {
  matmul_g32_panels_avx512<G32PanelSource<T>>(k, static_cast<const uint8_t*>(w), ws, r0, r1,
                                              static_cast<const uint8_t*>(xq), xs, ncols, y, ldy);
}

template <T_ T>
void matmul_g32(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1, const void* xv,
                size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  int64_t r = r0;
  if (ncols == 1) {  // GEMV: one row at a time, so the weights are read as one sequential stream
    for (; r < r1; ++r) g32_tile<T, 1, 1>(k, w + r * ws, ws, xq, xs, y + r, ldy);
    return;
  }
  // Column blocks keep the activations of one block (~64 rows x k) in L2 while all the
  // row pairs stream past them.
  constexpr int64_t CB = 64;
  for (int64_t c0 = 0; c0 < ncols; c0 += CB) {
    const int64_t nc = std::min(CB, ncols - c0);
    const uint8_t* x = xq + c0 * xs;
    float* yc = y + c0 * ldy;
    int64_t rr = r0;
    for (; rr + 2 <= r1; rr += 2) g32_cols<T, 2>(k, w + rr * ws, ws, x, xs, nc, yc + rr, ldy);
    for (; rr < r1; ++rr) g32_cols<T, 1>(k, w + rr * ws, ws, x, xs, nc, yc + rr, ldy);
  }
}

// ---------------------------------------------------------------------------------------
// K-quants.

struct alignas(64) KW {
  __m512i q[4];   // unsigned values, element order
  __m512i sc[4];  // int16 scale per maddubs output lane
  __m256i mn;     // int16 min multiplier per 16 values
  float d, ndmin;
};

alignas(64) const int16_t kPerm16Idx[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};
alignas(64) const int16_t kPerm32Idx[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}};
// mins of Q4_K/Q5_K: [sc0..7, m0..7] -> m[j/2] for j in 0..15
alignas(32) const int16_t kMinDupIdx[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
// per-16-bit-lane right shifts: lower 256 bits by a, upper by b
alignas(64) const int16_t kShift02[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
alignas(64) const int16_t kShift46[32] = {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
                                         6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6};

inline __m512i bcast256(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// byte mask selecting bit a in the lower 32 bytes and bit b in the upper 32 bytes
inline __m512i bitsel(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi8(char(1 << a)), _mm256_set1_epi8(char(1 << b)), 1);
}

// Expand 16 int16 per-16-value scales (in a zmm's low half) to the 4 maddubs-lane vectors.
inline void expand_sc16(__m512i s16, KW& o) {
  for (int i = 0; i < 4; ++i)
    o.sc[i] = _mm512_permutexvar_epi16(_mm512_load_si512(kPerm16Idx[i]), s16);
}

template <T_ T>
inline void unpack_k(const uint8_t* p, KW& o) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (T == T_::Q4_K || T == T_::Q5_K) {
    const uint8_t* sc = p + 4;
    const uint8_t* qs = p + (T == T_::Q4_K ? 16 : 48);
    o.d = _cvtsh_ss(uint16_t(ld32(p)));
    o.ndmin = -_cvtsh_ss(uint16_t(ld32(p) >> 16));
    const uint32_t a0 = ld32(sc), a1 = ld32(sc + 4), a2 = ld32(sc + 8);
    const uint32_t s_lo = a0 & 0x3f3f3f3fu, m_lo = a1 & 0x3f3f3f3fu;
    const uint32_t s_hi = (a2 & 0x0f0f0f0fu) | ((a0 >> 2) & 0x30303030u);
    const uint32_t m_hi = ((a2 >> 4) & 0x0f0f0f0fu) | ((a1 >> 2) & 0x30303030u);
    const __m128i b = _mm_set_epi32(int(m_hi), int(m_lo), int(s_hi), int(s_lo));
    const __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(b));  // sc0..7, m0..7
    for (int i = 0; i < 4; ++i)
      o.sc[i] = _mm512_permutexvar_epi16(_mm512_load_si512(kPerm32Idx[i]), s16);
    o.mn = _mm256_permutexvar_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(kMinDupIdx)),
                                    _mm512_castsi512_si256(s16));
    __m512i hq;
    if constexpr (T == T_::Q5_K) hq = bcast256(p + 16);
    for (int i = 0; i < 4; ++i) {
      __m512i z = bcast256(qs + 32 * i);
      z = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xFFFF0000u, z, 4), m4);
      if constexpr (T == T_::Q5_K)
        z = _mm512_mask_add_epi8(z, _mm512_test_epi8_mask(hq, bitsel(2 * i, 2 * i + 1)), z,
                                 _mm512_set1_epi8(16));
      o.q[i] = z;
    }
  } else if constexpr (T == T_::Q6_K) {
    const auto* b = reinterpret_cast<const block_q6_K*>(p);
    o.d = _cvtsh_ss(b->d);
    o.ndmin = -o.d;
    const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
    expand_sc16(_mm512_castsi256_si512(s), o);
    o.mn = _mm256_slli_epi16(s, 5);
    const __m512i m3 = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m512i l = _mm512_loadu_si512(b->ql + 64 * h);
      const __m512i hq = bcast256(b->qh + 32 * h);
      const __m512i h0 = _mm512_and_si512(_mm512_srlv_epi16(hq, _mm512_load_si512(kShift02)), m3);
      const __m512i h1 = _mm512_and_si512(_mm512_srlv_epi16(hq, _mm512_load_si512(kShift46)), m3);
      o.q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_slli_epi16(h0, 4));
      o.q[2 * h + 1] =
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), _mm512_slli_epi16(h1, 4));
    }
  } else if constexpr (T == T_::Q2_K) {
    const auto* b = reinterpret_cast<const block_q2_K*>(p);
    o.d = _cvtsh_ss(b->d);
    o.ndmin = -_cvtsh_ss(b->dmin);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
    const __m256i w = _mm256_cvtepu8_epi16(raw);
    expand_sc16(_mm512_castsi256_si512(_mm256_and_si256(w, _mm256_set1_epi16(0xF))), o);
    o.mn = _mm256_srli_epi16(w, 4);
    const __m512i m3 = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m512i z = bcast256(b->qs + 32 * h);
      o.q[2 * h] = _mm512_and_si512(_mm512_srlv_epi16(z, _mm512_load_si512(kShift02)), m3);
      o.q[2 * h + 1] = _mm512_and_si512(_mm512_srlv_epi16(z, _mm512_load_si512(kShift46)), m3);
    }
  } else {  // Q3_K
    const auto* b = reinterpret_cast<const block_q3_K*>(p);
    o.d = _cvtsh_ss(b->d);
    o.ndmin = -o.d;
    uint32_t aux[4];
    std::memcpy(aux, b->scales, 12);
    const uint32_t tmp = aux[2];
    const uint32_t k1 = 0x03030303u, k2 = 0x0f0f0f0fu;
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
    aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
    // In registers: the four 4-byte stores read back as one 16-byte load would miss store
    // forwarding and stall every block.
    const __m128i raw = _mm_setr_epi32(int(aux[0]), int(aux[1]), int(aux[2]), int(aux[3]));
    const __m256i s = _mm256_sub_epi16(_mm256_cvtepu8_epi16(raw), _mm256_set1_epi16(32));
    expand_sc16(_mm512_castsi256_si512(s), o);
    o.mn = _mm256_slli_epi16(s, 2);
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m512i hm = bcast256(b->hmask);
    for (int h = 0; h < 2; ++h) {
      const __m512i z = bcast256(b->qs + 32 * h);
      for (int t = 0; t < 2; ++t) {
        const int i = 2 * h + t;
        __m512i v = _mm512_and_si512(
            _mm512_srlv_epi16(z, _mm512_load_si512(t == 0 ? kShift02 : kShift46)), m3);
        v = _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(hm, bitsel(2 * i, 2 * i + 1)), v,
                                 _mm512_set1_epi8(4));
        o.q[i] = v;
      }
    }
  }
}


constexpr int KC = 8;  // blocks per k chunk (unpacked once per row tile)

template <int NR, int NC>
inline void k_tile(const KW* kw /*[NR][kcb]*/, int kcb, const uint8_t* xq, size_t xs, int64_t b0,
                   float* y, int64_t ldy, bool first) {
  __m512 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int b = 0; b < kcb; ++b) {
    for (int c = 0; c < NC; ++c) {
      const ActK* a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b0 + b;
      const __m512i x0 = _mm512_loadu_si512(a->qs), x1 = _mm512_loadu_si512(a->qs + 64);
      const __m512i x2 = _mm512_loadu_si512(a->qs + 128), x3 = _mm512_loadu_si512(a->qs + 192);
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->bsums));
      const __m512 dx = _mm512_set1_ps(a->d);
      for (int r = 0; r < NR; ++r) {
        const KW& u = kw[r * kcb + b];
        __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(u.q[0], x0), u.sc[0]);
        s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(u.q[1], x1), u.sc[1]);
        s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(u.q[2], x2), u.sc[2]);
        s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(u.q[3], x3), u.sc[3]);
        const __m512i m = _mm512_zextsi256_si512(_mm256_madd_epi16(u.mn, bs));
        __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(u.d));
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(u.ndmin), t);
        acc[r][c] = _mm512_fmadd_ps(t, dx, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) {
      const float v = _mm512_reduce_add_ps(acc[r][c]);
      float& dst = y[c * ldy + r];
      dst = first ? v : dst + v;
    }
}

template <int NR>
void k_cols(const KW* kw, int kcb, const uint8_t* xq, size_t xs, int64_t ncols, int64_t b0,
            float* y, int64_t ldy, bool first) {
  int64_t c = 0;
  for (; c + 4 <= ncols; c += 4) k_tile<NR, 4>(kw, kcb, xq + c * xs, xs, b0, y + c * ldy, ldy, first);
  switch (ncols - c) {
    case 1: k_tile<NR, 1>(kw, kcb, xq + c * xs, xs, b0, y + c * ldy, ldy, first); break;
    case 2: k_tile<NR, 2>(kw, kcb, xq + c * xs, xs, b0, y + c * ldy, ldy, first); break;
    case 3: k_tile<NR, 3>(kw, kcb, xq + c * xs, xs, b0, y + c * ldy, ldy, first); break;
    default: break;
  }
}

// Prefill panels of the K-quants: the 16-row VNNI panels of panel_avx512.h, with each
// format's generic decomposition w = d * sc[s] * q - dmin * mn[s] (q unsigned, s: 16-value
// sub-block; kernels_internal.h's KUnpacked). Per 16 rows and block the panel holds the codes
// in vpdpbusd's layout (no bias: they are unsigned already), d * sc and dmin * mn per sub-block;
// per column and block, each sub-block costs four vpdpbusd for 16 rows, its scale one FMA and
// its min one FMA with the activation's 16-value sum.
constexpr int kKPanelSlab = 4;       // 256-value blocks per slab (~20 KB: stays in L1)
constexpr int kKPanelCols = 8;

struct alignas(64) KPanelBlock {
  __m512i q[64];  // q[g]: rows' values 4g..4g+3
  __m512 f[16];   // f[s]: rows' d * sc[s]
  __m512 m[16];   // m[s]: rows' dmin * mn[s]
};

template <T_ T>
inline void build_k_panels(const uint8_t* w, size_t ws, int64_t r, int n, int64_t b0, int nbs, KPanelBlock* out) {
  constexpr size_t BB = block_bytes<T>();
  alignas(64) float f[16][16], m[16][16];
  for (int b = 0; b < nbs; ++b) {
    KW kw[16];
    for (int i = 0; i < 16; ++i) {
      if (i >= n) {
        for (int j = 0; j < 4; ++j) kw[i].q[j] = _mm512_setzero_si512();
        for (int s = 0; s < 16; ++s) f[i][s] = m[i][s] = 0.f;
        continue;
      }
      const uint8_t* blk = w + size_t(r + i) * ws + size_t(b0 + b) * BB;
      unpack_k<T>(blk, kw[i]);
      KUnpacked u;
      k_scales(T, blk, &u);
      for (int s = 0; s < 16; ++s) {
        f[i][s] = u.d * float(u.sc[s]);
        m[i][s] = u.dmin * float(u.mn[s]);
      }
    }
    for (int j = 0; j < 4; ++j) {  // values 64j..64j+63: groups 16j..16j+15
      __m512i t[16];
      for (int i = 0; i < 16; ++i) t[i] = kw[i].q[j];
      transpose16x16_epi32(t);
      for (int g = 0; g < 16; ++g) out[b].q[16 * j + g] = t[g];
    }
    __m512i fs[16], ms[16];
    for (int i = 0; i < 16; ++i) {
      fs[i] = _mm512_castps_si512(_mm512_load_ps(f[i]));
      ms[i] = _mm512_castps_si512(_mm512_load_ps(m[i]));
    }
    transpose16x16_epi32(fs);
    transpose16x16_epi32(ms);
    for (int s = 0; s < 16; ++s) {
      out[b].f[s] = _mm512_castsi512_ps(fs[s]);
      out[b].m[s] = _mm512_castsi512_ps(ms[s]);
    }
  }
}

// SUB: values per scale (16; Q4_K / Q5_K: 32, their scales come in equal pairs). sums: the
// columns' activation sums per scale, as floats ([column][block][256 / SUB], `sums_stride` apart).
template <int NC, int SUB>
inline void k_panel_tile(const KPanelBlock* p, int nbs, int64_t b0, const uint8_t* xq, size_t xs, const float* sums,
                         int64_t sums_stride, float* y, int64_t ldy, __mmask16 rows, bool first) {
  constexpr int NS = 256 / SUB, NG = SUB / 4;
  __m512 tot[NC];
  for (int c = 0; c < NC; ++c) tot[c] = _mm512_setzero_ps();
  for (int b = 0; b < nbs; ++b) {
    const KPanelBlock& pb = p[b];
    const ActK* a[NC];
    for (int c = 0; c < NC; ++c) a[c] = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b0 + b;
    __m512 blk[NC];
    for (int c = 0; c < NC; ++c) blk[c] = _mm512_setzero_ps();
    for (int s = 0; s < NS; ++s) {
      __m512i acc[NC];
      for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_si512();
      for (int g = 0; g < NG; ++g) {
        const __m512i wq = pb.q[NG * s + g];
        for (int c = 0; c < NC; ++c) {
          int32_t xv;
          std::memcpy(&xv, a[c]->qs + SUB * s + 4 * g, 4);
          acc[c] = _mm512_dpbusd_epi32(acc[c], wq, _mm512_set1_epi32(xv));
        }
      }
      const __m512 f = pb.f[s * (SUB / 16)], m = pb.m[s * (SUB / 16)];
      for (int c = 0; c < NC; ++c) {
        blk[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[c]), f, blk[c]);
        blk[c] = _mm512_fnmadd_ps(m, _mm512_set1_ps(sums[c * sums_stride + (b0 + b) * NS + s]), blk[c]);
      }
    }
    for (int c = 0; c < NC; ++c) tot[c] = _mm512_fmadd_ps(blk[c], _mm512_set1_ps(a[c]->d), tot[c]);
  }
  for (int c = 0; c < NC; ++c) {
    float* dst = y + c * ldy;
    if (!first) tot[c] = _mm512_add_ps(tot[c], _mm512_maskz_loadu_ps(rows, dst));
    _mm512_mask_storeu_ps(dst, rows, tot[c]);
  }
}

// The same panels from R8 super-blocks (repack.h): rows 0-7 of a panel from one group, 8-15
// from the next (zeros where there is none). Lane r of an R8 vector is already row r's four
// values, so a panel group is two extractions side by side — no transposes.
template <T_ T>
inline void build_k_panels_r8(const uint8_t* ga, const uint8_t* gb, int64_t b0, int nbs, KPanelBlock* out) {
  constexpr size_t SBB = r8::simd::sb_bytes<T>();
  for (int b = 0; b < nbs; ++b) {
    const uint8_t* sa = ga + size_t(b0 + b) * SBB;
    const uint8_t* sb = gb ? gb + size_t(b0 + b) * SBB : nullptr;
#pragma GCC unroll 4
    for (int g = 0; g < 64; ++g) {
      const __m256i lo = r8::simd::group_values<T>(sa, g);
      const __m256i hi = sb ? r8::simd::group_values<T>(sb, g) : _mm256_setzero_si256();
      out[b].q[g] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    for (int s = 0; s < 16; ++s) {
      __m256 fa, ma, fb = _mm256_setzero_ps(), mb = _mm256_setzero_ps();
      r8::simd::sub_factors<T>(sa, s, &fa, &ma);
      if (sb) r8::simd::sub_factors<T>(sb, s, &fb, &mb);
      out[b].f[s] = _mm512_insertf32x8(_mm512_castps256_ps512(fa), fb, 1);
      out[b].m[s] = _mm512_insertf32x8(_mm512_castps256_ps512(ma), mb, 1);
    }
  }
}

// Rows [r0, r1) in 16-row panels; build(r, n, b0, nbs, panel) fills the slab of blocks
// [b0, b0 + nbs) of rows r .. r + n - 1.
template <T_ T, typename Build>
void k_panels_run(int64_t k, int64_t r0, int64_t r1, const uint8_t* xq, size_t xs, int64_t ncols, float* y,
                  int64_t ldy, Build build) {
  constexpr int SUB = T == T_::Q4_K || T == T_::Q5_K ? 32 : 16, NS = 256 / SUB;
  const int64_t nb = k / 256;
  // The activation sums per scale of every column and block, as floats (the min term's factor).
  thread_local std::vector<float> sums;
  sums.resize(size_t(ncols * nb * NS));
  for (int64_t c = 0; c < ncols; ++c)
    for (int64_t b = 0; b < nb; ++b) {
      const ActK& a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs)[b];
      for (int j = 0; j < NS; ++j) {
        int v = 0;
        for (int h = 0; h < SUB / 16; ++h) v += a.bsums[j * (SUB / 16) + h];
        sums[size_t((c * nb + b) * NS + j)] = float(v);
      }
    }
  alignas(64) KPanelBlock panel[kKPanelSlab];
  for (int64_t r = r0; r < r1; r += 16) {
    const int n = int(std::min<int64_t>(16, r1 - r));
    const __mmask16 rows = __mmask16((1u << n) - 1);
    for (int64_t b0 = 0; b0 < nb; b0 += kKPanelSlab) {
      const int nbs = int(std::min<int64_t>(kKPanelSlab, nb - b0));
      build(r, n, b0, nbs, panel);
      const bool first = b0 == 0;
      int64_t c = 0;
      for (; c + kKPanelCols <= ncols; c += kKPanelCols)
        k_panel_tile<kKPanelCols, SUB>(panel, nbs, b0, xq + size_t(c) * xs, xs, sums.data() + c * nb * NS, nb * NS,
                                       y + c * ldy + r, ldy, rows, first);
      switch (ncols - c) {
#define TF_K_PANEL_REST(N)                                                                                   \
  case N:                                                                                                    \
    k_panel_tile<N, SUB>(panel, nbs, b0, xq + size_t(c) * xs, xs, sums.data() + c * nb * NS, nb * NS,        \
                         y + c * ldy + r, ldy, rows, first);                                                 \
    break;
        TF_K_PANEL_REST(1)
        TF_K_PANEL_REST(2)
        TF_K_PANEL_REST(3)
        TF_K_PANEL_REST(4)
        TF_K_PANEL_REST(5)
        TF_K_PANEL_REST(6)
        TF_K_PANEL_REST(7)
#undef TF_K_PANEL_REST
        default: break;
      }
    }
  }
}

template <T_ T>
void matmul_k_panels(int64_t k, const uint8_t* w, size_t ws, int64_t r0, int64_t r1, const uint8_t* xq, size_t xs,
                     int64_t ncols, float* y, int64_t ldy) {
  k_panels_run<T>(k, r0, r1, xq, xs, ncols, y, ldy, [&](int64_t r, int n, int64_t b0, int nbs, KPanelBlock* panel) {
    build_k_panels<T>(w, ws, r, n, b0, nbs, panel);
  });
}

// R8 groups: rows [r0, r1) (multiples of 8) of a weight whose group g starts at sb0 + g * gs.
template <T_ T>
void matmul_k_panels_r8(int64_t k, const uint8_t* sb0, size_t gs, int64_t r0, int64_t r1, const uint8_t* xq,
                        size_t xs, int64_t ncols, float* y, int64_t ldy) {
  k_panels_run<T>(k, r0, r1, xq, xs, ncols, y, ldy, [&](int64_t r, int n, int64_t b0, int nbs, KPanelBlock* panel) {
    const uint8_t* ga = sb0 + size_t(r / 8) * gs;
    build_k_panels_r8<T>(ga, n > 8 ? ga + gs : nullptr, b0, nbs, panel);
  });
}

template <T_ T>
void matmul_k_panel_entry(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                          int64_t ncols, float* y, int64_t ldy) {
  matmul_k_panels<T>(k, static_cast<const uint8_t*>(w), ws, r0, r1, static_cast<const uint8_t*>(xq), xs, ncols, y, ldy);
}

template <T_ T>
void matmul_k(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1, const void* xv,
              size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  const int64_t nb = k / 256;
  constexpr size_t BB = block_bytes<T>();
  KW kw[4 * KC];
  // GEMV: one row at a time (one sequential weight stream); GEMM: 4-row tiles.
  const int64_t rt = ncols == 1 ? 1 : 4;
  constexpr int64_t CB = 64;  // column block: its activation chunk stays in L2
  for (int64_t c0 = 0; c0 < ncols; c0 += CB) {
  const int64_t nc = std::min(CB, ncols - c0);
  const uint8_t* xc = xq + c0 * xs;
  float* yc = y + c0 * ldy;
  for (int64_t r = r0; r < r1; r += rt) {
    const int nr = int(std::min<int64_t>(rt, r1 - r));
    for (int64_t b0 = 0; b0 < nb; b0 += KC) {
      const int kcb = int(std::min<int64_t>(KC, nb - b0));
      for (int i = 0; i < nr; ++i) {
        const uint8_t* row = w + size_t(r + i) * ws + size_t(b0) * BB;
        for (int b = 0; b < kcb; ++b) {
          if (ncols == 1) {
            pf(row + b * BB);
            if (BB > 64) pf(row + b * BB + 64);
            if (BB > 128) pf(row + b * BB + 128);
            if (BB > 192) pf(row + b * BB + 192);
          }
          unpack_k<T>(row + b * BB, kw[i * kcb + b]);
        }
      }
      const bool first = b0 == 0;
      switch (nr) {
        case 4: k_cols<4>(kw, kcb, xc, xs, nc, b0, yc + r, ldy, first); break;
        case 3: k_cols<3>(kw, kcb, xc, xs, nc, b0, yc + r, ldy, first); break;
        case 2: k_cols<2>(kw, kcb, xc, xs, nc, b0, yc + r, ldy, first); break;
        default: k_cols<1>(kw, kcb, xc, xs, nc, b0, yc + r, ldy, first); break;
      }
    }
  }
  }
}

// ---------------------------------------------------------------------------------------
// Float weights (F32 / F16 / BF16) x F32 activations.

template <T_ T>
inline __m512 load_w16(const uint8_t* row, int64_t i) {
  if constexpr (T == T_::F32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * i));
    if constexpr (T == T_::F16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
template <T_ T>
inline __m512 load_w_tail(const uint8_t* row, int64_t i, __mmask16 m) {
  if constexpr (T == T_::F32) {
    return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(row) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, row + 2 * i);
    if constexpr (T == T_::F16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <T_ T, int NR, int NC>
void f_tile(int64_t k, const uint8_t* w, size_t ws, const uint8_t* xq, size_t xs, float* y,
            int64_t ldy) {
  __m512 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    __m512 wr[NR];
    for (int r = 0; r < NR; ++r) {
      if (NC == 1) pf(w + size_t(r) * ws + i * (T == T_::F32 ? 4 : 2));
      wr[r] = load_w16<T>(w + size_t(r) * ws, i);
    }
    for (int c = 0; c < NC; ++c) {
      const __m512 x = _mm512_loadu_ps(reinterpret_cast<const float*>(xq + size_t(c) * xs) + i);
      for (int r = 0; r < NR; ++r) acc[r][c] = _mm512_fmadd_ps(wr[r], x, acc[r][c]);
    }
  }
  if (i < k) {
    const __mmask16 m = __mmask16((1u << (k - i)) - 1);
    __m512 wr[NR];
    for (int r = 0; r < NR; ++r) wr[r] = load_w_tail<T>(w + size_t(r) * ws, i, m);
    for (int c = 0; c < NC; ++c) {
      const __m512 x = _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(xq + size_t(c) * xs) + i);
      for (int r = 0; r < NR; ++r) acc[r][c] = _mm512_fmadd_ps(wr[r], x, acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) y[c * ldy + r] = _mm512_reduce_add_ps(acc[r][c]);
}

template <T_ T, int NR>
void f_cols(int64_t k, const uint8_t* w, size_t ws, const uint8_t* xq, size_t xs, int64_t ncols,
            float* y, int64_t ldy) {
  int64_t c = 0;
  for (; c + 4 <= ncols; c += 4) f_tile<T, NR, 4>(k, w, ws, xq + c * xs, xs, y + c * ldy, ldy);
  switch (ncols - c) {
    case 1: f_tile<T, NR, 1>(k, w, ws, xq + c * xs, xs, y + c * ldy, ldy); break;
    case 2: f_tile<T, NR, 2>(k, w, ws, xq + c * xs, xs, y + c * ldy, ldy); break;
    case 3: f_tile<T, NR, 3>(k, w, ws, xq + c * xs, xs, y + c * ldy, ldy); break;
    default: break;
  }
}

template <T_ T>
void matmul_f(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1, const void* xv,
              size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) f_cols<T, 4>(k, w + r * ws, ws, xq, xs, ncols, y + r, ldy);
  for (; r < r1; ++r) f_cols<T, 1>(k, w + r * ws, ws, xq, xs, ncols, y + r, ldy);
}

// ---------------------------------------------------------------------------------------
// Activation quantization (bit-identical to quantize_scalar).

inline void quant_block(const float* x, int n, int8_t* q, float* d_out, int* sum_out) {
  __m512 amax = _mm512_setzero_ps();
  __m512 poison = _mm512_setzero_ps();  // x * 0 is NaN exactly where x is NaN or inf
  for (int i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    poison = _mm512_add_ps(poison, _mm512_mul_ps(v, _mm512_setzero_ps()));
  }
  if (_mm512_cmp_ps_mask(poison, poison, _CMP_UNORD_Q)) {
    std::memset(q, 0, size_t(n));  // as the scalar reference: a NaN scale, no integers
    *d_out = std::numeric_limits<float>::quiet_NaN();
    *sum_out = 0;
    return;
  }
  const float am = _mm512_reduce_max_ps(amax);
  const float d = am / 127.f;
  const float id = am != 0.f ? 127.f / am : 0.f;
  const __m512 vid = _mm512_set1_ps(id);
  __m512i sum = _mm512_setzero_si512();
  for (int i = 0; i < n; i += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vid));
    sum = _mm512_add_epi32(sum, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(v));
  }
  *d_out = d;
  // |q| <= 127 per value, so the horizontal sum fits easily; summed with wrapping vector
  // adds rather than _mm512_reduce_add_epi32's signed scalar arithmetic.
  __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *sum_out = _mm_cvtsi128_si32(s4);
}

}  // namespace

void quantize_avx512(ActKind kind, const float* x, void* xq, int64_t k) {
  quantize_row_with(kind, x, xq, k, quant_block);
}

// The int8 dot-product peak (a compute probe for prefill's bar): `iters` rounds of 12
// independent vpdpbusd chains on registers (512 multiply-adds each); returns a checksum.
int64_t vnni_peak_avx512(int64_t iters) {
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  __m512i t = acc[0];
  for (int i = 1; i < 12; ++i) t = _mm512_add_epi32(t, acc[i]);
  return _mm512_reduce_add_epi32(t);
}

uint64_t read_bytes_avx512(const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    pf(b + i);
    pf(b + i + 64);
    pf(b + i + 128);
    pf(b + i + 192);
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(b + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(b + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(b + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(b + i + 192));
  }
  a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  uint64_t acc = uint64_t(_mm512_reduce_or_epi64(a0));
  return acc ^ read_bytes(b + i, n - i);
}


void matmul_panels_r8_avx512(GgmlType t, int64_t k, const uint8_t* sb0, size_t gs, int64_t r0, int64_t r1,
                             const void* xq, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* x = static_cast<const uint8_t*>(xq);
  switch (t) {
    case T_::Q2_K: return matmul_k_panels_r8<T_::Q2_K>(k, sb0, gs, r0, r1, x, xs, ncols, y, ldy);
    case T_::Q3_K: return matmul_k_panels_r8<T_::Q3_K>(k, sb0, gs, r0, r1, x, xs, ncols, y, ldy);
    case T_::Q4_K: return matmul_k_panels_r8<T_::Q4_K>(k, sb0, gs, r0, r1, x, xs, ncols, y, ldy);
    case T_::Q5_K: return matmul_k_panels_r8<T_::Q5_K>(k, sb0, gs, r0, r1, x, xs, ncols, y, ldy);
    case T_::Q6_K: return matmul_k_panels_r8<T_::Q6_K>(k, sb0, gs, r0, r1, x, xs, ncols, y, ldy);
    default: tf::fail(tf::ErrorKind::Unsupported, "r8 panels: no row-interleaved layout for type id ", int(t));
  }
}

}  // namespace tf::cpu::detail

// Entry points named in the traits table (quant/traits.cpp).
TF_EXPORT_KERNEL(f32, avx512, matmul_f<GgmlType::F32>)
TF_EXPORT_KERNEL(f16, avx512, matmul_f<GgmlType::F16>)
TF_EXPORT_KERNEL(bf16, avx512, matmul_f<GgmlType::BF16>)
TF_EXPORT_KERNEL(q4_0, avx512, matmul_g32<GgmlType::Q4_0>)
TF_EXPORT_KERNEL(q4_1, avx512, matmul_g32<GgmlType::Q4_1>)
TF_EXPORT_KERNEL(q5_0, avx512, matmul_g32<GgmlType::Q5_0>)
TF_EXPORT_KERNEL(q5_1, avx512, matmul_g32<GgmlType::Q5_1>)
TF_EXPORT_KERNEL(q8_0, avx512, matmul_g32<GgmlType::Q8_0>)
TF_EXPORT_KERNEL(q2_k, avx512, matmul_k<GgmlType::Q2_K>)
TF_EXPORT_KERNEL(q3_k, avx512, matmul_k<GgmlType::Q3_K>)
TF_EXPORT_KERNEL(q4_k, avx512, matmul_k<GgmlType::Q4_K>)
TF_EXPORT_KERNEL(q5_k, avx512, matmul_k<GgmlType::Q5_K>)
TF_EXPORT_KERNEL(q6_k, avx512, matmul_k<GgmlType::Q6_K>)
TF_EXPORT_KERNEL(q4_0, avx512_panels, matmul_g32_panel_entry<GgmlType::Q4_0>)
TF_EXPORT_KERNEL(q4_1, avx512_panels, matmul_g32_panel_entry<GgmlType::Q4_1>)
TF_EXPORT_KERNEL(q5_0, avx512_panels, matmul_g32_panel_entry<GgmlType::Q5_0>)
TF_EXPORT_KERNEL(q5_1, avx512_panels, matmul_g32_panel_entry<GgmlType::Q5_1>)
TF_EXPORT_KERNEL(q8_0, avx512_panels, matmul_g32_panel_entry<GgmlType::Q8_0>)
TF_EXPORT_KERNEL(q2_k, avx512_panels, matmul_k_panel_entry<GgmlType::Q2_K>)
TF_EXPORT_KERNEL(q3_k, avx512_panels, matmul_k_panel_entry<GgmlType::Q3_K>)
TF_EXPORT_KERNEL(q4_k, avx512_panels, matmul_k_panel_entry<GgmlType::Q4_K>)
TF_EXPORT_KERNEL(q5_k, avx512_panels, matmul_k_panel_entry<GgmlType::Q5_K>)
TF_EXPORT_KERNEL(q6_k, avx512_panels, matmul_k_panel_entry<GgmlType::Q6_K>)
