// The AVX2 prefill GEMM for formats whose unsigned codes are small (the K-quants): eight
// weight rows interleaved into one register, each 32-bit lane one row's four consecutive
// values, met by four activation bytes broadcast to every lane. The lanes of an
// accumulator are then eight rows of one column — no horizontal sums — and the maddubs
// results of a 16-value group, all under one scale per lane, add up in int16 before a
// single madd applies the scales: 1.25 multiplies per 32 products instead of 2 (maddubs +
// madd every 32), which is what bounds tile_avx2.h's layout on these formats.
//
// The interleaving is done per call, a chunk of blocks at a time, and used by every column
// of a column block (its cost is spread over them).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/cpu/tile_avx2.h"

#if defined(TF_HAVE_X86_KERNELS)

namespace tf::cpu::detail {

// Eight rows of one 256-value block. v[s]: values 4s .. 4s+3 of row r in bytes 4r .. 4r+3
// (unsigned codes, or — TileMode::Signed — magnitudes whose signs q[s] puts on the activations).
// sc[g]: row r's scale of 16-value group g in int16 lanes 2r and 2r+1. corr[h]: row r's
// correction factors of groups 2h, 2h+1 in lanes 2r, 2r+1. d, dc: per row lane (TileMode as
// in tile_avx2.h: MinInt takes the correction off in integers, MinFloat scales it by dc).
struct alignas(32) Inter8 {
  __m256i v[64];
  __m256i q[64];  // TileMode::Signed: the signed values (v holds their magnitudes)
  __m256i sc[16];
  __m256i corr[8];
  __m256 d, dc;
};

// out[t] = word t of each of rows in[0..7] (an 8 x 8 transpose of 32-bit words).
TF_TARGET_AVX2 inline void transpose8_words(const __m256i* in, __m256i* out) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
    out[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
  }
}

// Builds an Inter8 from eight rows given as: q[r][0..7] (256 unsigned codes, 32 per vector
// in value order), sc[r] / corr[r] (16 int16 per row), d[r], dc[r].
// Signed: q holds signed values; v gets their magnitudes, z.q the values themselves.
template <bool Signed = false>
TF_TARGET_AVX2 inline void interleave8(const __m256i (*q)[8], const __m256i* sc, const __m256i* corr, const float* d,
                                       const float* dc, Inter8& z) {
  __m256i rows[8];
  for (int j = 0; j < 8; ++j) {
    for (int r = 0; r < 8; ++r) rows[r] = Signed ? _mm256_sign_epi8(q[r][j], q[r][j]) : q[r][j];
    transpose8_words(rows, z.v + 8 * j);
    if (Signed) {
      for (int r = 0; r < 8; ++r) rows[r] = q[r][j];
      transpose8_words(rows, z.q + 8 * j);
    }
  }
  // Scales doubled into int16 pairs: word t of lo holds groups 0..3, 8..11; of hi 4..7, 12..15.
  __m256i lo[8], hi[8], tl[8], th[8];
  for (int r = 0; r < 8; ++r) {
    lo[r] = _mm256_unpacklo_epi16(sc[r], sc[r]);
    hi[r] = _mm256_unpackhi_epi16(sc[r], sc[r]);
  }
  transpose8_words(lo, tl);
  transpose8_words(hi, th);
  for (int t = 0; t < 4; ++t) {
    z.sc[t] = tl[t];
    z.sc[8 + t] = tl[4 + t];
    z.sc[4 + t] = th[t];
    z.sc[12 + t] = th[4 + t];
  }
  if (!Signed) transpose8_words(corr, z.corr);
  z.d = _mm256_loadu_ps(d);
  z.dc = Signed ? _mm256_setzero_ps() : _mm256_loadu_ps(dc);
}

// One 16-value group of the four-column tile in assembly (the compiler reassociated the int16
// sums into a tree and spilled them): acc[c] += madd(sum over the group's four steps of
// maddubs(w, broadcast x_c), scale). kSteps == 2 applies the scales after two steps.
// Signed formats also load the step's signed values (2048 bytes after the magnitudes) and
// put their signs on the broadcast activations.
#define TF_I8_LOADW(OFF) "vmovdqa " #OFF "(%[w]), %[wv]\n\t" TF_I8_LOADQ(OFF)
#define TF_I8_FIRST(X, A, OFF) \
  "vpbroadcastd " #OFF "(%[" #X "]), %[xb]\n\t" TF_I8_SIGN "vpmaddubsw %[xb], %[wv], %[" #A "]\n\t"
#define TF_I8_NEXT(X, A, OFF)                                   \
  "vpbroadcastd " #OFF "(%[" #X "]), %[xb]\n\t" TF_I8_SIGN      \
  "vpmaddubsw %[xb], %[wv], %[t]\n\tvpaddw %[t], %[" #A "], %[" #A "]\n\t"
#define TF_I8_FLUSH(A, ACC) "vpmaddwd (%[sc]), %[" #A "], %[" #A "]\n\tvpaddd %[" #A "], %[" #ACC "], %[" #ACC "]\n\t"
#define TF_I8_STEP(KIND, WOFF, XOFF) \
  TF_I8_LOADW(WOFF) KIND(x0, a0, XOFF) KIND(x1, a1, XOFF) KIND(x2, a2, XOFF) KIND(x3, a3, XOFF)
#define TF_I8_FLUSH4 TF_I8_FLUSH(a0, acc0) TF_I8_FLUSH(a1, acc1) TF_I8_FLUSH(a2, acc2) TF_I8_FLUSH(a3, acc3)
#define TF_I8_OPERANDS                                                                                    \
  : [acc0] "+x"(acc[0]), [acc1] "+x"(acc[1]), [acc2] "+x"(acc[2]), [acc3] "+x"(acc[3]), [a0] "=&x"(a0),    \
    [a1] "=&x"(a1), [a2] "=&x"(a2), [a3] "=&x"(a3), [wv] "=&x"(wv), [xb] "=&x"(xb), [t] "=&x"(t),         \
    [qv] "=&x"(qv)                                                                                        \
  : [w] "r"(wp), [sc] "r"(scp), [x0] "r"(x[0]), [x1] "r"(x[1]), [x2] "r"(x[2]), [x3] "r"(x[3])           \
  : "memory"

static_assert(offsetof(Inter8, q) == 2048, "inter8_group4's assembly reads the signs 2048 bytes on");

template <int kSteps, bool Signed>
TF_TARGET_AVX2 inline void inter8_group4(const __m256i* wp, const __m256i* scp, const int8_t* const* x, __m256i* acc) {
  __m256i a0, a1, a2, a3, wv, xb, t, qv;
#define TF_I8_GROUP                                                                                              \
  if constexpr (kSteps == 4) {                                                                                   \
    asm(TF_I8_STEP(TF_I8_FIRST, 0, 0) TF_I8_STEP(TF_I8_NEXT, 32, 4) TF_I8_STEP(TF_I8_NEXT, 64, 8)                \
            TF_I8_STEP(TF_I8_NEXT, 96, 12) TF_I8_FLUSH4 TF_I8_OPERANDS);                                         \
  } else if constexpr (kSteps == 2) {                                                                            \
    asm(TF_I8_STEP(TF_I8_FIRST, 0, 0) TF_I8_STEP(TF_I8_NEXT, 32, 4) TF_I8_FLUSH4 TF_I8_STEP(TF_I8_FIRST, 64, 8) \
            TF_I8_STEP(TF_I8_NEXT, 96, 12) TF_I8_FLUSH4 TF_I8_OPERANDS);                                         \
  } else {                                                                                                       \
    static_assert(kSteps == 1, "one, two or four steps per scale");                                              \
    asm(TF_I8_STEP(TF_I8_FIRST, 0, 0) TF_I8_FLUSH4 TF_I8_STEP(TF_I8_FIRST, 32, 4) TF_I8_FLUSH4                  \
            TF_I8_STEP(TF_I8_FIRST, 64, 8) TF_I8_FLUSH4 TF_I8_STEP(TF_I8_FIRST, 96, 12) TF_I8_FLUSH4 TF_I8_OPERANDS); \
  }
  if constexpr (Signed) {
#define TF_I8_LOADQ(OFF) "vmovdqa 2048+" #OFF "(%[w]), %[qv]\n\t"
#define TF_I8_SIGN "vpsignb %[qv], %[xb], %[xb]\n\t"
    TF_I8_GROUP
#undef TF_I8_LOADQ
#undef TF_I8_SIGN
  } else {
#define TF_I8_LOADQ(OFF) ""
#define TF_I8_SIGN ""
    TF_I8_GROUP
#undef TF_I8_LOADQ
#undef TF_I8_SIGN
  }
#undef TF_I8_GROUP
}
#undef TF_I8_LOADW
#undef TF_I8_FIRST
#undef TF_I8_NEXT
#undef TF_I8_FLUSH
#undef TF_I8_STEP
#undef TF_I8_FLUSH4
#undef TF_I8_OPERANDS

// Rows r .. r+7 (z[b], kcb blocks from b0) against NC (1..4) columns: y[c * ldy + r + i].
// kSteps: 4-value steps summed in int16 before the scales are applied — every code times
// every activation, summed over kSteps maddubs, must stay within int16.
template <int NC, int kSteps, TileMode M>
TF_TARGET_AVX2 __attribute__((noinline)) void inter8_tile(const Inter8* z, int kcb, const uint8_t* xq, size_t xs,
                                                          int64_t b0, float* y, int64_t ldy, bool first) {
  constexpr bool Signed = M == TileMode::Signed;
  __m256 accf[NC];
  for (int c = 0; c < NC; ++c) accf[c] = _mm256_setzero_ps();
  for (int b = 0; b < kcb; ++b) {
    const Inter8& w = z[b];
    const ActK* a[NC];
    for (int c = 0; c < NC; ++c) a[c] = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b0 + b;
    __m256i acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int g = 0; g < 16; ++g) {
      if constexpr (NC == 4) {
        const int8_t* x[4] = {a[0]->qs + 16 * g, a[1]->qs + 16 * g, a[2]->qs + 16 * g, a[3]->qs + 16 * g};
        inter8_group4<kSteps, Signed>(&w.v[4 * g], &w.sc[g], x, acc);
        continue;
      }
      __m256i a16[NC];
      for (int c = 0; c < NC; ++c) a16[c] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m256i wv = _mm256_load_si256(&w.v[4 * g + s]);
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) {
          int32_t word;
          std::memcpy(&word, a[c]->qs + 16 * g + 4 * s, 4);
          __m256i xb = _mm256_set1_epi32(word);
          if (Signed) xb = _mm256_sign_epi8(xb, w.q[4 * g + s]);
          a16[c] = _mm256_add_epi16(a16[c], _mm256_maddubs_epi16(wv, xb));
        }
        if ((kSteps == 2 && s % 2 == 1) || kSteps == 1) {
          for (int c = 0; c < NC; ++c) {
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(a16[c], w.sc[g]));
            a16[c] = _mm256_setzero_si256();
          }
        }
      }
      for (int c = 0; c < NC; ++c) acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(a16[c], w.sc[g]));
    }
    for (int c = 0; c < NC; ++c) {
      if constexpr (Signed) {
        accf[c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[c]), w.d), _mm256_set1_ps(a[c]->d), accf[c]);
        continue;
      }
      __m256i m = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int h = 0; h < 8; ++h) {
        int32_t pair;
        std::memcpy(&pair, a[c]->bsums + 2 * h, 4);
        m = _mm256_add_epi32(m, _mm256_madd_epi16(w.corr[h], _mm256_set1_epi32(pair)));
      }
      __m256 t;
      if constexpr (M == TileMode::MinInt) {
        t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[c], m)), w.d);
      } else {
        t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), w.dc, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[c]), w.d));
      }
      accf[c] = _mm256_fmadd_ps(t, _mm256_set1_ps(a[c]->d), accf[c]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    float* yc = y + c * ldy;
    _mm256_storeu_ps(yc, first ? accf[c] : _mm256_add_ps(_mm256_loadu_ps(yc), accf[c]));
  }
}

constexpr int kInter8Chunk = 4;  // blocks interleaved per row group before the column loop

// y[c * ldy + r] for rows r0 .. r1 (groups of eight; the rest through fallback(r_begin,
// r_end)) and all columns. prepare8(row pointers, block offset, &z) fills one Inter8.
template <int kSteps, TileMode M, class Prepare8, class Fallback>
TF_TARGET_AVX2 void matmul_inter8_avx2(Prepare8 prepare8, Fallback fallback, int64_t k, const void* wv, size_t ws,
                                       int64_t r0, int64_t r1, const void* xv, size_t xs, int64_t ncols, float* y,
                                       int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  const int64_t nb = k / 256;
  const int64_t r8 = r0 + (r1 - r0) / 8 * 8;
  thread_local std::vector<Inter8> zbuf;
  if (zbuf.size() < size_t(kInter8Chunk)) zbuf.resize(kInter8Chunk);
  Inter8* z = zbuf.data();
  for (int64_t c0 = 0; c0 < ncols; c0 += kPrepColBlock) {
    const int64_t ce = std::min(ncols, c0 + kPrepColBlock);
    for (int64_t r = r0; r < r8; r += 8) {
      for (int64_t b0 = 0; b0 < nb; b0 += kInter8Chunk) {
        const int kcb = int(std::min<int64_t>(kInter8Chunk, nb - b0));
        for (int b = 0; b < kcb; ++b) prepare8(w + size_t(r) * ws, ws, size_t(b0 + b), &z[b]);
        const bool first = b0 == 0;
        int64_t c = c0;
        for (; c + 4 <= ce; c += 4) inter8_tile<4, kSteps, M>(z, kcb, xq + size_t(c) * xs, xs, b0, y + c * ldy + r, ldy, first);
        switch (ce - c) {
          case 1: inter8_tile<1, kSteps, M>(z, kcb, xq + size_t(c) * xs, xs, b0, y + c * ldy + r, ldy, first); break;
          case 2: inter8_tile<2, kSteps, M>(z, kcb, xq + size_t(c) * xs, xs, b0, y + c * ldy + r, ldy, first); break;
          case 3: inter8_tile<3, kSteps, M>(z, kcb, xq + size_t(c) * xs, xs, b0, y + c * ldy + r, ldy, first); break;
          default: break;
        }
      }
    }
  }
  if (r8 < r1) fallback(r8, r1);
}

}  // namespace tf::cpu::detail

#endif  // TF_HAVE_X86_KERNELS
