// The AVX2 int8 GEMM used for wide products (prefill) by every 256-value block format — the
// K-quants (kernels_avx2.cpp) and the decoded IQ / ternary formats (decoded.h). A format only
// says how to prepare one block (Prep256); the tiling is here, once.
//
// Tile: two weight rows against four activation columns. The activations of a column block
// sit in L2, and with one row per tile every maddubs needed its own activation load, which
// L2 could not feed; two rows halve those loads. The eight (row, column) partial sums of a
// block are reduced together with a horizontal-add tree into one vector of eight lanes, so
// the float accumulator is one register instead of eight — that is what leaves room in the
// sixteen ymm registers for eight integer accumulators.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/cpu/kernels_internal.h"

#if defined(TF_HAVE_X86_KERNELS)
#include <immintrin.h>
#ifndef TF_TARGET_AVX2
#define TF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace tf::cpu::detail {

// How a format's prepared blocks meet the activations (see Prep256).
enum class TileMode {
  Signed,    // aq = |q|; q's signs go onto the activations; no correction term
  MinInt,    // aq = q + 64 (|q| <= 63); corr = 64 * scale taken off S in integers
  MinFloat,  // aq = unsigned K-quant codes; corr = mins, scaled by their own dmin
};

// One 256-value weight block prepared for the tile. Its dot with an activation block
// (ActK: qs, bsums, d) is
//   d_x * (d * S + dcorr * M),  S = sum_i madd(maddubs(aq[i], x_i'), sc[i]),  M = madd(corr, bsums)
// where x_i' is the i-th 32-value chunk of qs, or — Signed — that chunk with the signs of
// q[i] (maddubs needs one unsigned operand). MinInt: dcorr = -d, so d * (S - M). MinFloat:
// dcorr = -dmin. Every S and M fits in int32 (|q| <= 127 with no saturating pair, |scale| <=
// 127 or a K-quant's 6 bits). d4 / dc4: d and dcorr in four lanes (the tile's row halves).
struct alignas(32) Prep256 {
  __m256i aq[8];
  __m256i q[8];   // Signed only
  __m256i sc[8];  // int16 scale of each maddubs lane (kScalePairShuffle)
  __m256i corr;   // int16 per 16-value group; Min modes only
  __m128 d4, dc4;
  void set_scales(float d, float dcorr) {
    d4 = _mm_set1_ps(d);
    dc4 = _mm_set1_ps(dcorr);
  }
};

// Eight int32 vectors to one float vector of their eight totals, v[p] -> lane p.
TF_TARGET_AVX2 inline __m256 sum8_lanes(const __m256i* v) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
  // a: totals of v0..v3 over the low 128-bit halves, then over the high halves; b: v4..v7.
  const __m256i lo = _mm256_permute2x128_si256(a, b, 0x20), hi = _mm256_permute2x128_si256(a, b, 0x31);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}

// Chunk I of a block for the full tile (two rows, four columns), in assembly: the eight
// integer accumulators, both rows' values and scales and one activation chunk are exactly
// the sixteen ymm registers, a layout the compiler does not find by itself — it spilled
// accumulators or folded every operand into a memory load, and either cost about a third.
#define TF_TILE24_COLUMN(X, A0, A1)                                   \
  "vmovdqu %c[ox](%[" #X "]), %[xv]\n\t"                              \
  TF_TILE24_SIGNS                                                     \
  "vpmaddubsw " TF_TILE24_SRC0 ", %[w0], %[t0]\n\t"                   \
  "vpmaddubsw " TF_TILE24_SRC1 ", %[w1], %[t1]\n\t"                   \
  "vpmaddwd %[c0], %[t0], %[t0]\n\t"                                  \
  "vpmaddwd %[c1], %[t1], %[t1]\n\t"                                  \
  "vpaddd %[t0], %[" #A0 "], %[" #A0 "]\n\t"                          \
  "vpaddd %[t1], %[" #A1 "], %[" #A1 "]\n\t"
#define TF_TILE24_BODY                                                \
  "vmovdqa %c[ox](%[z0]), %[w0]\n\t"                                  \
  "vmovdqa %c[ox](%[z1]), %[w1]\n\t"                                  \
  "vmovdqa 512+%c[ox](%[z0]), %[c0]\n\t"                                  \
  "vmovdqa 512+%c[ox](%[z1]), %[c1]\n\t"                                  \
  TF_TILE24_COLUMN(x0, s0, s4) TF_TILE24_COLUMN(x1, s1, s5)           \
  TF_TILE24_COLUMN(x2, s2, s6) TF_TILE24_COLUMN(x3, s3, s7)
#define TF_TILE24_OPERANDS                                                                          \
  : [s0] "+x"(s[0]), [s1] "+x"(s[1]), [s2] "+x"(s[2]), [s3] "+x"(s[3]), [s4] "+x"(s[4]),            \
    [s5] "+x"(s[5]), [s6] "+x"(s[6]), [s7] "+x"(s[7]), [w0] "=&x"(w0), [w1] "=&x"(w1),               \
    [c0] "=&x"(c0), [c1] "=&x"(c1), [xv] "=&x"(xv), [t0] "=&x"(t0), [t1] "=&x"(t1)                  \
  : [z0] "r"(z0), [z1] "r"(z1), [x0] "r"(x[0]), [x1] "r"(x[1]), [x2] "r"(x[2]), [x3] "r"(x[3]),     \
    [ox] "i"(32 * I)                                                                                \
  : "memory"

static_assert(offsetof(Prep256, aq) == 0 && offsetof(Prep256, q) == 256 && offsetof(Prep256, sc) == 512,
              "tile24_chunk's assembly addresses the Prep256 fields at these offsets");

template <int I, bool Signed>
TF_TARGET_AVX2 inline void tile24_chunk(const Prep256* z0, const Prep256* z1, const int8_t* const* x, __m256i* s) {
  __m256i w0, w1, c0, c1, xv, t0, t1;
  if constexpr (Signed) {
#define TF_TILE24_SIGNS "vpsignb 256+%c[ox](%[z0]), %[xv], %[t0]\n\tvpsignb 256+%c[ox](%[z1]), %[xv], %[t1]\n\t"
#define TF_TILE24_SRC0 "%[t0]"
#define TF_TILE24_SRC1 "%[t1]"
    asm(TF_TILE24_BODY TF_TILE24_OPERANDS);
#undef TF_TILE24_SIGNS
#undef TF_TILE24_SRC0
#undef TF_TILE24_SRC1
  } else {
#define TF_TILE24_SIGNS ""
#define TF_TILE24_SRC0 "%[xv]"
#define TF_TILE24_SRC1 "%[xv]"
    asm(TF_TILE24_BODY TF_TILE24_OPERANDS);
#undef TF_TILE24_SIGNS
#undef TF_TILE24_SRC0
#undef TF_TILE24_SRC1
  }
}
#undef TF_TILE24_COLUMN
#undef TF_TILE24_BODY
#undef TF_TILE24_OPERANDS

template <bool Signed, int... I>
TF_TARGET_AVX2 inline void tile24_block(const Prep256* z0, const Prep256* z1, const int8_t* const* x, __m256i* s,
                                        std::integer_sequence<int, I...>) {
  (tile24_chunk<I, Signed>(z0, z1, x, s), ...);
}

// NR (1, 2) rows — kcb prepared blocks each, z[r][b] — against NC (1..4) columns (xq, xs
// bytes apart), from activation block b0; dx[b * ldd + c]: column c's scale in block b0 + b
// (zero past NC). y[c * ldy + r] receives (first) or accumulates the partial dots. Lane
// r * 4 + c of the accumulator holds (row r, column c).
template <int NR, int NC, TileMode M>
TF_TARGET_AVX2 __attribute__((noinline)) void prep256_tile(const Prep256* const* z, int kcb, const uint8_t* xq, size_t xs, int64_t b0,
                                        const float* dx, int64_t ldd, float* y, int64_t ldy, bool first) {
  constexpr bool Signed = M == TileMode::Signed;
  __m256 acc = _mm256_setzero_ps();
  for (int b = 0; b < kcb; ++b) {
    const ActK* a[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) a[c] = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b0 + b;
    __m256i s[8];
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) s[p] = _mm256_setzero_si256();
    if constexpr (NR == 2 && NC == 4) {
      const int8_t* x[4] = {a[0]->qs, a[1]->qs, a[2]->qs, a[3]->qs};
      tile24_block<Signed>(&z[0][b], &z[1][b], x, s, std::make_integer_sequence<int, 8>());
    } else {
#pragma GCC unroll 1
      for (int i = 0; i < 8; ++i) {
        __m256i w[NR];
#pragma GCC unroll 2
        for (int r = 0; r < NR; ++r) w[r] = z[r][b].aq[i];
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[c]->qs + 32 * i));
#pragma GCC unroll 2
          for (int r = 0; r < NR; ++r) {
            const __m256i xr = Signed ? _mm256_sign_epi8(x, z[r][b].q[i]) : x;
            s[4 * r + c] = _mm256_add_epi32(s[4 * r + c], _mm256_madd_epi16(_mm256_maddubs_epi16(w[r], xr), z[r][b].sc[i]));
          }
        }
      }
    }
    const Prep256& z0 = z[0][b];
    const Prep256& z1 = z[NR - 1][b];
    __m256i m[8];
    if constexpr (M != TileMode::Signed) {
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const int r = p / 4, c = p % 4;
        m[p] = (r < NR && c < NC)
                   ? _mm256_madd_epi16(z[r][b].corr, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[c]->bsums)))
                   : _mm256_setzero_si256();
        if constexpr (M == TileMode::MinInt) s[p] = _mm256_sub_epi32(s[p], m[p]);
      }
    }
    __m256 t = _mm256_mul_ps(sum8_lanes(s), _mm256_setr_m128(z0.d4, z1.d4));
    if constexpr (M == TileMode::MinFloat) t = _mm256_fmadd_ps(sum8_lanes(m), _mm256_setr_m128(z0.dc4, z1.dc4), t);
    acc = _mm256_fmadd_ps(t, _mm256_broadcast_ps(reinterpret_cast<const __m128*>(dx + b * ldd)), acc);
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, acc);
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) y[c * ldy + r] = first ? out[4 * r + c] : y[c * ldy + r] + out[4 * r + c];
}

constexpr int kPrepChunk = 8;            // blocks prepared per row before the column loop
constexpr int64_t kPrepColBlock = 64;    // columns whose activations stay in L2

// y[c * ldy + r] = dot(row r, column c) for rows r0..r1 and all columns. prepare(block, &z)
// fills one Prep256 from kBytes of a row. Rows go in pairs: a pair's blocks are prepared a
// chunk at a time (they stay in L1) and met by the columns of a block four at a time. The
// column block's activation scales are gathered once into a table the tiles read four at a time.
template <TileMode M, size_t kBytes, class Prepare>
TF_TARGET_AVX2 void matmul_prep256_avx2(Prepare prepare, int64_t k, const void* wv, size_t ws, int64_t r0,
                                        int64_t r1, const void* xv, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  const int64_t nb = k / 256;
  constexpr int64_t ldd = kPrepColBlock + 4;  // the last tile reads four lanes, zeros past the columns
  thread_local std::vector<float> dx_table;
  if (dx_table.size() < size_t(nb * ldd)) dx_table.resize(size_t(nb * ldd));
  float* dx = dx_table.data();
  Prep256 z[2][kPrepChunk];
  const Prep256* zr[2] = {z[0], z[1]};
  for (int64_t c0 = 0; c0 < ncols; c0 += kPrepColBlock) {
    const int64_t ce = std::min(ncols, c0 + kPrepColBlock);
    for (int64_t b = 0; b < nb; ++b) {
      float* row = dx + b * ldd;
      for (int64_t c = c0; c < ce; ++c) row[c - c0] = (reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b)->d;
      std::fill(row + (ce - c0), row + ldd, 0.f);
    }
    for (int64_t r = r0; r < r1; r += 2) {
      const bool pair = r + 1 < r1;
      for (int64_t b0 = 0; b0 < nb; b0 += kPrepChunk) {
        const int kcb = int(std::min<int64_t>(kPrepChunk, nb - b0));
        for (int rr = 0; rr < (pair ? 2 : 1); ++rr)
          for (int b = 0; b < kcb; ++b) prepare(w + size_t(r + rr) * ws + size_t(b0 + b) * kBytes, &z[rr][b]);
        const bool first = b0 == 0;
        float* yr = y + r;
        int64_t c = c0;
        auto tile = [&](auto nr, auto nc) TF_TARGET_AVX2 {
          prep256_tile<decltype(nr)::value, decltype(nc)::value, M>(zr, kcb, xq + size_t(c) * xs, xs, b0,
                                                                    dx + b0 * ldd + (c - c0), ldd, yr + c * ldy, ldy, first);
        };
        using one = std::integral_constant<int, 1>;
        using two = std::integral_constant<int, 2>;
        const auto rows_tile = [&](auto nr) TF_TARGET_AVX2 {
          for (; c + 4 <= ce; c += 4) tile(nr, std::integral_constant<int, 4>());
          switch (ce - c) {
            case 1: tile(nr, one()); break;
            case 2: tile(nr, two()); break;
            case 3: tile(nr, std::integral_constant<int, 3>()); break;
            default: break;
          }
        };
        if (pair) rows_tile(two());
        else rows_tile(one());
      }
    }
  }
}

}  // namespace tf::cpu::detail

#endif  // TF_HAVE_X86_KERNELS
