// AVX2 prefill driver for the 256-value formats whose decoded values are small (|q| <= 63:
// the IQ2/IQ3/IQ1 grids, ternary), the AVX2 counterpart of panel_avx512.h. The weights of 8
// rows are decoded once per panel into 4-value cells, one row per 32-bit lane, and each
// column's activations, biased to unsigned (x + 128), are broadcast four at a time:
//
//   pairs  = maddubs(x + 128, q)      two products per int16: |pair| <= 2 * 255 * 63 < 2^15
//   acc[c] += madd(pairs, sc)         the sub-block scale applied as the pairs widen to int32
//
// so acc's lane r sums sc * q * (x + 128) over a whole block in int32 (256 * 63 * 255 * 127
// < 2^31); the bias's share, 128 * sum over the block of sc * q, depends on the row alone and
// is taken off once per block. Then d_row * d_column scales the block. Integer sums are exact.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/cpu/decoded_block.h"
#include "backend/cpu/kernels_internal.h"

#if defined(TF_HAVE_X86_KERNELS)
namespace tf::cpu::detail {

constexpr int kPanel2Rows = 8;
constexpr int kPanel2Slab = 8;        // 256-value blocks per panel slab
constexpr int kPanel2Cols = 4;        // columns per register tile
constexpr int64_t kPanel2MinCols = 8;

struct alignas(32) Panel2Block {
  __m256i q[64];      // q[g]: rows' values 4g..4g+3 (signed)
  __m256i sc[16];     // sc[s]: each row's sub-block scale in both int16 halves of its lane
  __m256i corr;       // 128 * sum over the block of sc * q, per row
  __m256 d;           // the rows' block scales
};

// 8 x 8 transpose of 32-bit cells: out[j] lane i = in[i] lane j.
TF_TARGET_AVX2 inline void transpose8x8_epi32(__m256i r[8]) {
  __m256i t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m256i u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // u[4a + b] 128-bit lane m: rows 4a..4a+3 at cell 4m + b
  for (int b = 0; b < 4; ++b) {
    r[b] = _mm256_permute2x128_si256(u[b], u[4 + b], 0x20);
    r[4 + b] = _mm256_permute2x128_si256(u[b], u[4 + b], 0x31);
  }
}

template <Decode256Fn Decode, size_t kBytes>
TF_TARGET_AVX2 inline void build_panels2(const uint8_t* w, size_t ws, int64_t r, int n, int64_t b0, int nbs,
                                         Panel2Block* out) {
  alignas(64) Decoded256 u[kPanel2Rows];
  alignas(32) int32_t sc32[16][kPanel2Rows];
  alignas(32) float d[kPanel2Rows];
  const __m256i ones = _mm256_set1_epi8(1);
  for (int b = 0; b < nbs; ++b) {
    for (int i = 0; i < kPanel2Rows; ++i) {
      if (i < n) {
        Decode(w + size_t(r + i) * ws + size_t(b0 + b) * kBytes, &u[i]);
        for (int s = 0; s < 16; ++s) sc32[s][i] = int32_t(uint16_t(u[i].sc[s])) * 0x10001;
        d[i] = u[i].d;
      } else {
        std::memset(u[i].q, 0, sizeof u[i].q);
        for (int s = 0; s < 16; ++s) sc32[s][i] = 0;
        d[i] = 0.f;
      }
    }
    for (int j = 0; j < 8; ++j) {  // values 32j..32j+31: groups 8j..8j+7
      __m256i t[8];
      for (int i = 0; i < kPanel2Rows; ++i) t[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(u[i].q + 32 * j));
      transpose8x8_epi32(t);
      for (int g = 0; g < 8; ++g) out[b].q[8 * j + g] = t[g];
    }
    // The bias's share: the products with x = 1 (the same sums as panel2_tile's), times 128.
    __m256i corr = _mm256_setzero_si256();
    for (int s = 0; s < 16; ++s) {
      out[b].sc[s] = _mm256_load_si256(reinterpret_cast<const __m256i*>(sc32[s]));
      for (int g = 0; g < 4; ++g)
        corr = _mm256_add_epi32(corr, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, out[b].q[4 * s + g]), out[b].sc[s]));
    }
    out[b].corr = _mm256_slli_epi32(corr, 7);
    out[b].d = _mm256_load_ps(d);
  }
}

// y[c * ldy + r .. + n) for NC columns over blocks [b0, b0 + nbs); xb: the biased
// activation bytes of the first column (k bytes per column, xb_stride apart).
template <int NC>
TF_TARGET_AVX2 inline void panel2_tile(const Panel2Block* p, int nbs, int64_t b0, const uint8_t* xq, size_t xs,
                                       const uint8_t* xb, size_t xb_stride, float* y, int64_t ldy, int n, bool first) {
  __m256 tot[NC];
  for (int c = 0; c < NC; ++c) tot[c] = _mm256_setzero_ps();
  for (int b = 0; b < nbs; ++b) {
    const Panel2Block& pb = p[b];
    __m256i acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_si256();
    const uint8_t* xbb = xb + size_t(b0 + b) * 256;
    for (int s = 0; s < 16; ++s) {
      const __m256i sc = pb.sc[s];
      for (int g = 0; g < 4; ++g) {
        const __m256i wq = pb.q[4 * s + g];
        for (int c = 0; c < NC; ++c) {
          int32_t xv;
          std::memcpy(&xv, xbb + size_t(c) * xb_stride + 16 * s + 4 * g, 4);
          acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(xv), wq), sc));
        }
      }
    }
    for (int c = 0; c < NC; ++c) {
      const ActK* a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b0 + b;
      const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[c], pb.corr));
      tot[c] = _mm256_fmadd_ps(v, _mm256_mul_ps(pb.d, _mm256_set1_ps(a->d)), tot[c]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    float* dst = y + c * ldy;
    alignas(32) float v[8];
    _mm256_store_ps(v, tot[c]);
    for (int i = 0; i < n; ++i) dst[i] = first ? v[i] : dst[i] + v[i];
  }
}

template <Decode256Fn Decode, size_t kBytes>
TF_TARGET_AVX2 void matmul_d256_panels_avx2(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1,
                                            const void* xv, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  const int64_t nb = k / 256;
  // Every column's activation codes + 128 (unsigned), contiguous per column.
  thread_local std::vector<uint8_t> biased;
  biased.resize(size_t(ncols * k));
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (int64_t c = 0; c < ncols; ++c)
    for (int64_t b = 0; b < nb; ++b) {
      const ActK& a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs)[b];
      for (int h = 0; h < 8; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs + 32 * h));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(biased.data() + size_t(c * k + b * 256 + 32 * h)),
                            _mm256_xor_si256(v, flip));
      }
    }
  alignas(32) Panel2Block panel[kPanel2Slab];
  for (int64_t r = r0; r < r1; r += kPanel2Rows) {
    const int n = int(std::min<int64_t>(kPanel2Rows, r1 - r));
    for (int64_t b0 = 0; b0 < nb; b0 += kPanel2Slab) {
      const int nbs = int(std::min<int64_t>(kPanel2Slab, nb - b0));
      build_panels2<Decode, kBytes>(w, ws, r, n, b0, nbs, panel);
      const bool first = b0 == 0;
      int64_t c = 0;
      for (; c + kPanel2Cols <= ncols; c += kPanel2Cols)
        panel2_tile<kPanel2Cols>(panel, nbs, b0, xq + size_t(c) * xs, xs, biased.data() + size_t(c * k), size_t(k),
                                 y + c * ldy + r, ldy, n, first);
      switch (ncols - c) {
        case 1: panel2_tile<1>(panel, nbs, b0, xq + size_t(c) * xs, xs, biased.data() + size_t(c * k), size_t(k), y + c * ldy + r, ldy, n, first); break;
        case 2: panel2_tile<2>(panel, nbs, b0, xq + size_t(c) * xs, xs, biased.data() + size_t(c * k), size_t(k), y + c * ldy + r, ldy, n, first); break;
        case 3: panel2_tile<3>(panel, nbs, b0, xq + size_t(c) * xs, xs, biased.data() + size_t(c * k), size_t(k), y + c * ldy + r, ldy, n, first); break;
        default: break;
      }
    }
  }
}

}  // namespace tf::cpu::detail

#endif  // TF_HAVE_X86_KERNELS
