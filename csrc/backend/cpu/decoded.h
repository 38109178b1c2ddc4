// Generic CPU matmul drivers for weight formats that decode, block by block, into signed
// 8-bit values with integer sub-block scales. A format file (backend/cpu/formats/*.cpp)
// supplies only the block decoders — a scalar one (the reference) and a vectorised one —
// and instantiates these drivers; the integer dot products, the row/column tiling, the
// prefetching and the activation layouts are shared here.
//
//   Decoded256 (256-value blocks, Q8_256 activations):  w[i] = d * sc[i / 16] * q[i]
//   Decoded32  (32-value blocks, Q8_32 activations):    w[i] = d * q[i]
//
// with q in [-127, 127] and |sc| <= 127, so every integer sum below fits in int32 and the
// result differs from the float reference only by float summation order (and by the 8-bit
// activation quantization every quantized path has).
//
// The vector drivers are compiled through function target attributes, so a format file is
// built without ISA flags and its scalar code runs on any CPU; the AVX2 / AVX-512 entry
// points are only called after runtime detection (core/cpu_features).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "backend/cpu/decoded_block.h"
#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/panel_avx2.h"
#include "backend/cpu/panel_avx512.h"
#include "backend/cpu/tile8_avx2.h"
#include "backend/cpu/tile_avx2.h"

namespace tf::cpu::detail {

// ---------------------------------------------------------------------------------------
// Scalar drivers (the reference for the vector ones).

template <Decode256Fn Decode, size_t kBytes>
void matmul_d256_scalar(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq,
                        size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const int64_t nb = k / 256;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(w) + size_t(r) * ws;
    for (int64_t c = 0; c < ncols; ++c) y[c * ldy + r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      Decoded256 u;
      Decode(row + size_t(b) * kBytes, &u);
      for (int64_t c = 0; c < ncols; ++c) {
        const ActK& a = reinterpret_cast<const ActK*>(static_cast<const uint8_t*>(xq) + size_t(c) * xs)[b];
        int isum = 0;
        for (int j = 0; j < 16; ++j) {
          int s = 0;
          for (int i = 0; i < 16; ++i) s += int(u.q[16 * j + i]) * int(a.qs[16 * j + i]);
          isum += s * u.sc[j];
        }
        y[c * ldy + r] += u.d * a.d * float(isum);
      }
    }
  }
}

template <Decode32Fn Decode, size_t kBytes>
void matmul_d32_scalar(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq,
                       size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const int64_t nb = k / 32, ng = g32_groups(k);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(w) + size_t(r) * ws;
    for (int64_t c = 0; c < ncols; ++c) y[c * ldy + r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      Decoded32 u;
      Decode(row + size_t(b) * kBytes, &u);
      for (int64_t c = 0; c < ncols; ++c) {
        const int8_t* qs = reinterpret_cast<const int8_t*>(static_cast<const uint8_t*>(xq) + size_t(c) * xs);
        const float* sc = reinterpret_cast<const float*>(qs + ng * 64);
        int isum = 0;
        for (int i = 0; i < 32; ++i) isum += int(u.q[i]) * int(qs[32 * b + i]);
        y[c * ldy + r] += u.d * sc[4 * (b / 2) + (b & 1)] * float(isum);
      }
    }
  }
}

#if defined(TF_HAVE_X86_KERNELS)

// GEMV streams the weights once: prefetch this far ahead of the decoder.
constexpr int kDecodedPrefetch = 1024;
constexpr int kDecodedChunk = 8;    // blocks decoded per row before the column loop
constexpr int64_t kDecodedColBlock = 64;  // columns whose activations stay in L2

TF_TARGET_AVX2 inline float hsum8_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

TF_TARGET_AVX2 inline void prefetch_block(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o + kDecodedPrefetch), _MM_HINT_T0);
}

// ---- AVX2, 256-value blocks -----------------------------------------------------------

// One decoded block as a Prep256 (tile_avx2.h). Signed formats: aq = |q|, and q's signs go
// onto the activations (maddubs(|q|, sign(x, q)) = q*x pairs without saturation, |q|, |x| <= 127).
// Small-value formats (every |q| <= 63: the IQ2/IQ3 grids, ternary) skip the per-column sign:
// aq holds q + 64 (1..127, unsigned), so maddubs(q + 64, x) = q*x + 64*x pairs stay below
// 2 * 127 * 127, and the 64 * sum(x) surplus of each 16-value group is taken off with the
// activation's bsums (corr = 64 * sc, TileMode::MinInt).
template <bool Offset>
TF_TARGET_AVX2 inline void d256_to_prep(const Decoded256& u, Prep256& z) {
  const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.sc));
  const __m256i lo = _mm256_permute2x128_si256(s, s, 0x00), hi = _mm256_permute2x128_si256(s, s, 0x11);
  if (Offset) z.corr = _mm256_slli_epi16(s, 6);
  for (int i = 0; i < 8; ++i) {
    const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.q + 32 * i));
    if (Offset) {
      z.aq[i] = _mm256_add_epi8(q, _mm256_set1_epi8(64));
    } else {
      z.q[i] = q;
      z.aq[i] = _mm256_sign_epi8(q, q);
    }
    z.sc[i] = _mm256_shuffle_epi8(i < 4 ? lo : hi, _mm256_load_si256(reinterpret_cast<const __m256i*>(kScalePairShuffle[i % 4])));
  }
  z.set_scales(u.d, -u.d);
}

// kMaxAbsQ: the largest |q| the decoder produces. Eight rows at a time go through the
// interleaved tile (tile8_avx2.h) in signed mode, summing as many steps in int16 as |q|
// allows (one for the IQ4 values: no int16 sums, but no horizontal ones either); the rows
// left over take the two-row tile — in offset mode when |q| <= 63 (see d256_to_prep).
template <Decode256Fn Decode, size_t kBytes, int kMaxAbsQ = 127>
TF_TARGET_AVX2 void matmul_d256_avx2(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1,
                                     const void* xq, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  constexpr bool kOffset = kMaxAbsQ <= 63;
  if constexpr (kOffset) {
    if (ncols >= kPanel2MinCols) return matmul_d256_panels_avx2<Decode, kBytes>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
  }
  const auto prepare = [](const uint8_t* blk, Prep256* z) TF_TARGET_AVX2 {
    Decoded256 u;
    Decode(blk, &u);
    d256_to_prep<kOffset>(u, *z);
  };
  constexpr TileMode two_row_mode = kOffset ? TileMode::MinInt : TileMode::Signed;
  // maddubs pairs reach 2 * |q| * 127; kSteps of them must fit in int16
  constexpr int kPair = 2 * kMaxAbsQ * 127;
  constexpr int kSteps = 4 * kPair <= 32767 ? 4 : 2 * kPair <= 32767 ? 2 : 1;
  const auto prepare8 = [](const uint8_t* row0, size_t row_stride, size_t b, Inter8* z) TF_TARGET_AVX2 {
    __m256i q[8][8], sc[8];
    alignas(32) float d[8];
    for (int r = 0; r < 8; ++r) {
      Decoded256 u;
      Decode(row0 + r * row_stride + b * kBytes, &u);
      for (int j = 0; j < 8; ++j) q[r][j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.q + 32 * j));
      sc[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.sc));
      d[r] = u.d;
    }
    interleave8<true>(q, sc, nullptr, d, nullptr, *z);
  };
  const auto rest = [&](int64_t ra, int64_t rb) TF_TARGET_AVX2 {
    matmul_prep256_avx2<two_row_mode, kBytes>(prepare, k, w, ws, ra, rb, xq, xs, ncols, y, ldy);
  };
  matmul_inter8_avx2<kSteps, TileMode::Signed>(prepare8, rest, k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

// ---- AVX2, fused narrow products (decode) ------------------------------------------------

// One 32-weight sub-block decoded in registers: magnitudes (unsigned bytes), a sign operand
// for _mm256_sign_epi8 (negative byte: the weight is negative; never 0) and the int16 scale of
// each maddubs lane.
struct SubBlock32 {
  __m256i mag, sign, scale;
};

// y[c * ldy + r] for NC = 1..4 columns without storing decoded blocks (for a GEMV the decoding,
// not the dot, is the cost). Block is the format's view of one block:
//   TF_TARGET_AVX2 explicit Block(const uint8_t* blk);   // block-wide fields, once
//   TF_TARGET_AVX2 SubBlock32 sub(int s) const;           // sub-block s = 0..7 (a constant)
//   TF_TARGET_AVX2 float d() const;                        // the block scale
// and out_scale is the power of two the format's integer scales leave out.
template <class Block, size_t kBytes, int NC>
TF_TARGET_AVX2 inline void fused_rows_avx2(int64_t nb, const uint8_t* w, size_t ws, int64_t r0, int64_t r1,
                                           const uint8_t* xq, size_t xs, float* y, int64_t ldy, float out_scale) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* blk = w + size_t(r) * ws;
    __m256 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, blk += kBytes) {
      if (NC == 1) prefetch_block(blk, kBytes < 128 ? kBytes : 128);
      const Block block(blk);
      __m256i sum[NC];
      for (int c = 0; c < NC; ++c) sum[c] = _mm256_setzero_si256();
#pragma GCC unroll 8  // constant s: the formats' shuffle patterns resolve at compile time
      for (int s = 0; s < 8; ++s) {
        const SubBlock32 u = block.sub(s);
        for (int c = 0; c < NC; ++c) {
          const ActK* a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b;
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a->qs + 32 * s));
          sum[c] = _mm256_add_epi32(sum[c], _mm256_madd_epi16(_mm256_maddubs_epi16(u.mag, _mm256_sign_epi8(x, u.sign)), u.scale));
        }
      }
      const float d = block.d();
      for (int c = 0; c < NC; ++c) {
        const ActK* a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b;
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[c]), _mm256_set1_ps(d * a->d), acc[c]);
      }
    }
    for (int c = 0; c < NC; ++c) y[c * ldy + r] = out_scale * hsum8_avx2(acc[c]);
  }
}

// For formats whose fused kernel handles one row against NC = 1..4 columns
// (Row::template run<NC>(row, nb, xq, xs, y, ldy), y at that row's first column): all rows
// and columns, in column blocks whose activations stay in L2 — a weight row stays in L1
// while it meets every column of the block, four at a time.
template <class Row>
TF_TARGET_AVX2 inline void fused_row_tiles_avx2(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1,
                                                const void* xq, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* xb = static_cast<const uint8_t*>(xq);
  const int64_t nb = k / 256;
  for (int64_t c0 = 0; c0 < ncols; c0 += kDecodedColBlock) {
    const int64_t nc = std::min(kDecodedColBlock, ncols - c0);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = wb + size_t(r) * ws;
      int64_t c = c0;
      for (; c + 4 <= c0 + nc; c += 4) Row::template run<4>(row, nb, xb + size_t(c) * xs, xs, y + c * ldy + r, ldy);
      switch (c0 + nc - c) {
        case 1: Row::template run<1>(row, nb, xb + size_t(c) * xs, xs, y + c * ldy + r, ldy); break;
        case 2: Row::template run<2>(row, nb, xb + size_t(c) * xs, xs, y + c * ldy + r, ldy); break;
        case 3: Row::template run<3>(row, nb, xb + size_t(c) * xs, xs, y + c * ldy + r, ldy); break;
        default: break;
      }
    }
  }
}

// A 0xFF/0x00 negative mask as a sign operand.
TF_TARGET_AVX2 inline __m256i sign_of_mask(__m256i neg) { return _mm256_or_si256(neg, _mm256_set1_epi8(1)); }

// ---- AVX2, 32-value blocks --------------------------------------------------------------

template <Decode32Fn Decode, size_t kBytes, int kMaxAbsQ = 127>  // kMaxAbsQ: unused (32-value blocks)
TF_TARGET_AVX2 void matmul_d32_avx2(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1,
                                    const void* xv, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  const int64_t nb = k / 32, ng = g32_groups(k);
  constexpr int kChunk = 4 * kDecodedChunk;
  Decoded32 u[kChunk];
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t c0 = 0; c0 < ncols; c0 += kDecodedColBlock) {
    const int64_t nc = std::min(kDecodedColBlock, ncols - c0);
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = w + size_t(r) * ws;
      for (int64_t b0 = 0; b0 < nb; b0 += kChunk) {
        const int kcb = int(std::min<int64_t>(kChunk, nb - b0));
        if (ncols == 1) prefetch_block(row + size_t(b0) * kBytes, size_t(kcb) * kBytes);
        for (int b = 0; b < kcb; ++b) Decode(row + size_t(b0 + b) * kBytes, &u[b]);
        for (int64_t c = c0; c < c0 + nc; ++c) {
          const int8_t* qs = reinterpret_cast<const int8_t*>(xq + size_t(c) * xs);
          const float* sc = reinterpret_cast<const float*>(qs + ng * 64);
          __m256 acc = _mm256_setzero_ps();
          for (int b = 0; b < kcb; ++b) {
            const int64_t bb = b0 + b;
            const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(u[b].q));
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * bb));
            const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), ones);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(u[b].d * sc[4 * (bb / 2) + (bb & 1)]), acc);
          }
          float& dst = y[c * ldy + r];
          const float v = hsum8_avx2(acc);
          dst = b0 == 0 ? v : dst + v;
        }
      }
    }
  }
}

// ---- AVX-512 (BW + VNNI), 256-value blocks ----------------------------------------------

// One decoded block as four 64-value vectors: |q|, the lanes where q < 0, and the sub-block
// scales laid out per maddubs lane (lanes 8m..8m+7 of vector i belong to sub-block 4i + m).
struct alignas(64) D256Zmm {
  __m512i aq[4];
  __m512i sc[4];
  __mmask64 neg[4];
  float d;
};

alignas(64) inline const int16_t kD256ScIdx[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15},
};

TF_TARGET_AVX512 inline void d256_to_zmm(const Decoded256& u, D256Zmm& z) {
  const __m512i sc = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u.sc)));
  for (int i = 0; i < 4; ++i) {
    const __m512i q = _mm512_load_si512(u.q + 64 * i);
    z.aq[i] = _mm512_abs_epi8(q);
    z.neg[i] = _mm512_movepi8_mask(q);
    z.sc[i] = _mm512_permutexvar_epi16(_mm512_load_si512(kD256ScIdx[i]), sc);
  }
  z.d = u.d;
}

template <int NC>
TF_TARGET_AVX512 inline void d256_tile_avx512(const D256Zmm* z, int kcb, const uint8_t* xq, size_t xs,
                                              int64_t b0, float* y, int64_t ldy, bool first) {
  __m512 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
  for (int b = 0; b < kcb; ++b) {
    const D256Zmm& u = z[b];
    for (int c = 0; c < NC; ++c) {
      const ActK* a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b0 + b;
      __m512i s = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i) {
        const __m512i x = _mm512_loadu_si512(a->qs + 64 * i);
        const __m512i sx = _mm512_mask_sub_epi8(x, u.neg[i], _mm512_setzero_si512(), x);
        s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(u.aq[i], sx), u.sc[i]);
      }
      acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(u.d * a->d), acc[c]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    const float v = _mm512_reduce_add_ps(acc[c]);
    float& dst = y[c * ldy];
    dst = first ? v : dst + v;
  }
}

template <Decode256Fn Decode, size_t kBytes>
TF_TARGET_AVX512 void matmul_d256_avx512(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1,
                                         const void* xv, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  if (ncols >= kPanelMinCols) return matmul_d256_panels_avx512<Decode, kBytes>(k, wv, ws, r0, r1, xv, xs, ncols, y, ldy);
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  const int64_t nb = k / 256;
  Decoded256 u;
  D256Zmm z[kDecodedChunk];
  for (int64_t c0 = 0; c0 < ncols; c0 += kDecodedColBlock) {
    const int64_t nc = std::min(kDecodedColBlock, ncols - c0);
    const uint8_t* xc = xq + size_t(c0) * xs;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = w + size_t(r) * ws;
      float* yr = y + c0 * ldy + r;
      for (int64_t b0 = 0; b0 < nb; b0 += kDecodedChunk) {
        const int kcb = int(std::min<int64_t>(kDecodedChunk, nb - b0));
        for (int b = 0; b < kcb; ++b) {
          const uint8_t* blk = row + size_t(b0 + b) * kBytes;
          if (ncols == 1) prefetch_block(blk, kBytes);
          Decode(blk, &u);
          d256_to_zmm(u, z[b]);
        }
        const bool first = b0 == 0;
        int64_t c = 0;
        for (; c + 4 <= nc; c += 4) d256_tile_avx512<4>(z, kcb, xc + size_t(c) * xs, xs, b0, yr + c * ldy, ldy, first);
        switch (nc - c) {
          case 1: d256_tile_avx512<1>(z, kcb, xc + size_t(c) * xs, xs, b0, yr + c * ldy, ldy, first); break;
          case 2: d256_tile_avx512<2>(z, kcb, xc + size_t(c) * xs, xs, b0, yr + c * ldy, ldy, first); break;
          case 3: d256_tile_avx512<3>(z, kcb, xc + size_t(c) * xs, xs, b0, yr + c * ldy, ldy, first); break;
          default: break;
        }
      }
    }
  }
}

// The 32-value path on AVX-512 CPUs: the AVX2 driver compiled for the wider target (the
// blocks are too small for 512-bit decoding to pay off).
template <Decode32Fn Decode, size_t kBytes>
TF_TARGET_AVX512 void matmul_d32_avx512(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1,
                                        const void* xq, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  matmul_d32_avx2<Decode, kBytes>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

#endif  // TF_HAVE_X86_KERNELS

}  // namespace tf::cpu::detail

// Defines a format's three CPU entry points (namespace tf::cpu::<ns>: scalar, avx2, avx512)
// from its decoders; the traits table (quant/traits.cpp) points at them. max_abs_q: the
// largest |q| its decoder produces (it sets how the AVX2 prefill tiles sum: matmul_d256_avx2).
#define TF_MATMUL_PARAMS \
  int64_t k, const void *w, size_t ws, int64_t r0, int64_t r1, const void *xq, size_t xs, int64_t ncols, float *y, int64_t ldy
#define TF_MATMUL_ARGS k, w, ws, r0, r1, xq, xs, ncols, y, ldy
#if defined(TF_HAVE_X86_KERNELS)
#define TF_DECODED_KERNELS(ns, width, bytes, decode_scalar, decode_fast, max_abs_q)                                 \
  namespace tf::cpu::ns {                                                                                \
  void scalar(TF_MATMUL_PARAMS) { detail::matmul_d##width##_scalar<decode_scalar, bytes>(TF_MATMUL_ARGS); } \
  TF_TARGET_AVX2 void avx2(TF_MATMUL_PARAMS) {                                                           \
    detail::matmul_d##width##_avx2<decode_fast, bytes, (max_abs_q)>(TF_MATMUL_ARGS);                         \
  }                                                                                                      \
  TF_TARGET_AVX512 void avx512(TF_MATMUL_PARAMS) {                                                       \
    detail::matmul_d##width##_avx512<decode_fast, bytes>(TF_MATMUL_ARGS);                                \
  }                                                                                                      \
  }
// The same for 256-value formats with a fused kernel for narrow products (decode: up to four
// columns, fused_rows_avx2 over the format's Block view, see there). Wider products go to
// the decoded-block drivers.
#define TF_FUSED_DECODED_KERNELS(ns, bytes, decode_scalar, decode_fast, Block, out_scale, max_abs_q)                           \
  namespace tf::cpu::ns {                                                                                \
  void scalar(TF_MATMUL_PARAMS) { detail::matmul_d256_scalar<decode_scalar, bytes>(TF_MATMUL_ARGS); }    \
  TF_TARGET_AVX2 void avx2(TF_MATMUL_PARAMS) {                                                           \
    const auto* wb = static_cast<const uint8_t*>(w);                                                     \
    const auto* xb = static_cast<const uint8_t*>(xq);                                                    \
    switch (ncols) {                                                                                     \
      case 1: return detail::fused_rows_avx2<Block, bytes, 1>(k / 256, wb, ws, r0, r1, xb, xs, y, ldy, out_scale); \
      case 2: return detail::fused_rows_avx2<Block, bytes, 2>(k / 256, wb, ws, r0, r1, xb, xs, y, ldy, out_scale); \
      case 3: return detail::fused_rows_avx2<Block, bytes, 3>(k / 256, wb, ws, r0, r1, xb, xs, y, ldy, out_scale); \
      case 4: return detail::fused_rows_avx2<Block, bytes, 4>(k / 256, wb, ws, r0, r1, xb, xs, y, ldy, out_scale); \
      default: return detail::matmul_d256_avx2<decode_fast, bytes, (max_abs_q)>(TF_MATMUL_ARGS);            \
    }                                                                                                    \
  }                                                                                                      \
  /* AVX-512: the fused AVX2 loop for narrow products (512-bit registers do not shorten the */          \
  /* decoding that dominates them), the AVX-512 driver over the AVX2 decoder for wide ones.  */          \
  TF_TARGET_AVX512 void avx512(TF_MATMUL_PARAMS) {                                                       \
    if (ncols <= 4) return avx2(TF_MATMUL_ARGS);                                                         \
    detail::matmul_d256_avx512<decode_fast, bytes>(TF_MATMUL_ARGS);                                      \
  }                                                                                                      \
  }
#else
#define TF_DECODED_KERNELS(ns, width, bytes, decode_scalar, decode_fast, max_abs_q)                                 \
  namespace tf::cpu::ns {                                                                                \
  void scalar(TF_MATMUL_PARAMS) { detail::matmul_d##width##_scalar<decode_scalar, bytes>(TF_MATMUL_ARGS); } \
  }
#define TF_FUSED_DECODED_KERNELS(ns, bytes, decode_scalar, decode_fast, Block, out_scale, max_abs_q) \
  TF_DECODED_KERNELS(ns, 256, bytes, decode_scalar, decode_fast, max_abs_q)
#endif
