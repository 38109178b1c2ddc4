// AVX-512 VNNI prefill driver for the 256-value formats that decode into Decoded256
// (decoded.h): w = d * sc[i / 16] * q[i]. For products of many columns (prefill, MoE experts
// with tens of tokens each) the weights are decoded once per 16-row panel into vpdpbusd's
// layout and every column then costs one vpdpbusd per 64 multiply-adds:
//
//   panel[g] (64 bytes) = q + 128 of rows r0..r0+15 at values 4g..4g+3 (4 bytes per row)
//   acc[c] += panel[g] . broadcast(x_c[4g..4g+3])       (u8 x s8, 4 products per int32 lane)
//
// so lane r of acc[c] is row r's dot with column c over one 16-value sub-block, plus
// 128 * sum(x) of the sub-block (the bias that keeps the weights unsigned), which the
// activation's bsums take off exactly. Each sub-block's integer sum is then scaled by its
// row's d * sc (float) and each block's by the column's d. Integer sums are exact; the
// result differs from the reference only in float summation order.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/cpu/decoded_block.h"
#include "backend/cpu/kernels_internal.h"

#if defined(TF_HAVE_X86_KERNELS)
namespace tf::cpu::detail {

constexpr int kPanelRows = 16;
constexpr int kPanelSlab = 8;      // 256-value blocks per panel slab (its bytes stay in L1/L2)
constexpr int kPanelCols = 8;      // columns per register tile
constexpr int64_t kPanelMinCols = 5;  // narrower products keep the row-at-a-time tile

// One 16-row panel of one 256-value block: the biased codes in vpdpbusd's layout and each
// sub-block's float scale per row.
struct alignas(64) PanelBlock {
  __m512i q[64];      // q[g]: rows' values 4g..4g+3, + 128
  __m512 f[16];       // f[s]: rows' d * sc[s]
};

// 16 x 16 transpose of 32-bit cells: out[j] lane i = in[i] lane j.
TF_TARGET_AVX512 inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Now r[4a + b] lane 4m + n (m: 128-bit lane) = in[4a + n] cell 4m + b... regroup the
  // 128-bit lanes across rows 4 apart.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// Decodes rows [r, r + n) (n <= 16; the others zero) of blocks [b0, b0 + nbs) into panels.
template <Decode256Fn Decode, size_t kBytes>
TF_TARGET_AVX512 inline void build_panels(const uint8_t* w, size_t ws, int64_t r, int n, int64_t b0, int nbs,
                                          PanelBlock* out) {
  alignas(64) Decoded256 u[kPanelRows];
  alignas(64) float f[kPanelRows][16];
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  for (int b = 0; b < nbs; ++b) {
    for (int i = 0; i < kPanelRows; ++i) {
      if (i < n) {
        Decode(w + size_t(r + i) * ws + size_t(b0 + b) * kBytes, &u[i]);
        for (int s = 0; s < 16; ++s) f[i][s] = u[i].d * float(u[i].sc[s]);
      } else {
        std::memset(u[i].q, 0, sizeof u[i].q);
        for (int s = 0; s < 16; ++s) f[i][s] = 0.f;
      }
    }
    for (int j = 0; j < 4; ++j) {  // values 64j..64j+63: groups 16j..16j+15
      __m512i t[16];
      for (int i = 0; i < kPanelRows; ++i) t[i] = _mm512_load_si512(u[i].q + 64 * j);
      transpose16x16_epi32(t);
      for (int g = 0; g < 16; ++g) out[b].q[16 * j + g] = _mm512_xor_si512(t[g], bias);
    }
    __m512i fs[16];
    for (int i = 0; i < kPanelRows; ++i) fs[i] = _mm512_castps_si512(_mm512_load_ps(f[i]));
    transpose16x16_epi32(fs);
    for (int s = 0; s < 16; ++s) out[b].f[s] = _mm512_castsi512_ps(fs[s]);
  }
}

// y[c * ldy + r .. + n) for NC columns over blocks [b0, b0 + nbs) of the panels (first slab:
// stores, later ones add). corr: 128 * bsums as int32, [column][block][16].
template <int NC>
TF_TARGET_AVX512 inline void panel_tile(const PanelBlock* p, int nbs, int64_t b0, const uint8_t* xq, size_t xs,
                                        const int32_t* corr, int64_t corr_stride, float* y, int64_t ldy,
                                        __mmask16 rows, bool first) {
  __m512 tot[NC];
  for (int c = 0; c < NC; ++c) tot[c] = _mm512_setzero_ps();
  for (int b = 0; b < nbs; ++b) {
    const PanelBlock& pb = p[b];
    const ActK* a[NC];
    for (int c = 0; c < NC; ++c) a[c] = reinterpret_cast<const ActK*>(xq + size_t(c) * xs) + b0 + b;
    __m512 blk[NC];
    for (int c = 0; c < NC; ++c) blk[c] = _mm512_setzero_ps();
    for (int s = 0; s < 16; ++s) {
      __m512i acc[NC];
      for (int c = 0; c < NC; ++c)
        acc[c] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(corr[c * corr_stride + (b0 + b) * 16 + s]));
      for (int g = 0; g < 4; ++g) {
        const __m512i wq = pb.q[4 * s + g];
        for (int c = 0; c < NC; ++c) {
          int32_t xv;
          std::memcpy(&xv, a[c]->qs + 16 * s + 4 * g, 4);
          acc[c] = _mm512_dpbusd_epi32(acc[c], wq, _mm512_set1_epi32(xv));
        }
      }
      for (int c = 0; c < NC; ++c) blk[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[c]), pb.f[s], blk[c]);
    }
    for (int c = 0; c < NC; ++c) tot[c] = _mm512_fmadd_ps(blk[c], _mm512_set1_ps(a[c]->d), tot[c]);
  }
  for (int c = 0; c < NC; ++c) {
    float* dst = y + c * ldy;
    if (!first) tot[c] = _mm512_add_ps(tot[c], _mm512_maskz_loadu_ps(rows, dst));
    _mm512_mask_storeu_ps(dst, rows, tot[c]);
  }
}

template <Decode256Fn Decode, size_t kBytes>
TF_TARGET_AVX512 void matmul_d256_panels_avx512(int64_t k, const void* wv, size_t ws, int64_t r0, int64_t r1,
                                                const void* xv, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const uint8_t* w = static_cast<const uint8_t*>(wv);
  const uint8_t* xq = static_cast<const uint8_t*>(xv);
  const int64_t nb = k / 256;
  // 128 * bsums of every column and block, for the bias of the codes (int32, ready to broadcast).
  thread_local std::vector<int32_t> corr;
  corr.resize(size_t(ncols * nb * 16));
  for (int64_t c = 0; c < ncols; ++c)
    for (int64_t b = 0; b < nb; ++b) {
      const ActK& a = reinterpret_cast<const ActK*>(xq + size_t(c) * xs)[b];
      for (int s = 0; s < 16; ++s) corr[size_t((c * nb + b) * 16 + s)] = 128 * int32_t(a.bsums[s]);
    }
  alignas(64) PanelBlock panel[kPanelSlab];
  for (int64_t r = r0; r < r1; r += kPanelRows) {
    const int n = int(std::min<int64_t>(kPanelRows, r1 - r));
    const __mmask16 rows = __mmask16((1u << n) - 1);
    for (int64_t b0 = 0; b0 < nb; b0 += kPanelSlab) {
      const int nbs = int(std::min<int64_t>(kPanelSlab, nb - b0));
      build_panels<Decode, kBytes>(w, ws, r, n, b0, nbs, panel);
      const bool first = b0 == 0;
      int64_t c = 0;
      for (; c + kPanelCols <= ncols; c += kPanelCols)
        panel_tile<kPanelCols>(panel, nbs, b0, xq + size_t(c) * xs, xs, corr.data() + c * nb * 16, nb * 16,
                               y + c * ldy + r, ldy, rows, first);
      switch (ncols - c) {
#define TF_PANEL_REST(N)                                                                                          \
  case N:                                                                                                         \
    panel_tile<N>(panel, nbs, b0, xq + size_t(c) * xs, xs, corr.data() + c * nb * 16, nb * 16, y + c * ldy + r, ldy, \
                  rows, first);                                                                                   \
    break;
        TF_PANEL_REST(1)
        TF_PANEL_REST(2)
        TF_PANEL_REST(3)
        TF_PANEL_REST(4)
        TF_PANEL_REST(5)
        TF_PANEL_REST(6)
        TF_PANEL_REST(7)
#undef TF_PANEL_REST
        default: break;
      }
    }
  }
}

// ---- 32-value blocks (Q8_32 activations: pairs of blocks, per block d and s = d * sum(q)) ----
// The same panels for the 32-value block formats. A 16-row panel holds, per group of two
// blocks, the unsigned codes in vpdpbusd's layout (q[g] lane r = row r's values 4g..4g+3) and
// each row's scale (and min):
//
//   acc_c = sum_g dpbusd(q[g], broadcast(x_c[4g..4g+3]))    (lane r: row r's integer dot)
//   y_c  += d_w * (d_x * acc_c - off * s_x)  [+ m_w * s_x]   (per block)
//
// off: the bias that keeps the codes unsigned (Q4_0 8, Q5_0 16, Q8_0 128); m_w: the
// min of Q4_1 / Q5_1. Every column costs one vpdpbusd per 64 multiply-adds and two or three
// float ops per block for 16 rows. Src supplies off, has_min and
// unpack(row, block, two, q64, d[2], m[2]): the codes of blocks b and b + 1 (two: b + 1 exists;
// else its half of q64 is ignored) with their scales and mins.
constexpr int kPanel32Groups = 16;  // block pairs per slab (~20 KB: stays in L1)
constexpr int kPanel32Cols = 8;

struct alignas(64) Panel32Group {
  __m512i q[16];
  __m512 d[2], m[2];  // per block: the 16 rows' scale and min
};

template <typename Src>
TF_TARGET_AVX512 inline void build_panels32(const uint8_t* w, size_t ws, int64_t r, int n, int64_t g0, int ngs,
                                            int64_t nb, Panel32Group* out) {
  alignas(64) float d[2][16], m[2][16] = {};
  for (int gi = 0; gi < ngs; ++gi) {
    const int64_t b = 2 * (g0 + gi);
    const bool two = b + 1 < nb;
    __m512i t[16];
    for (int i = 0; i < 16; ++i) {
      float dd[2] = {0.f, 0.f}, mm[2] = {0.f, 0.f};
      if (i < n) {
        Src::unpack(w + size_t(r + i) * ws, b, two, t[i], dd, mm);
        if (!two) t[i] = _mm512_maskz_mov_epi8(0x00000000FFFFFFFFull, t[i]);  // no pad codes
      } else {
        t[i] = _mm512_setzero_si512();
      }
      d[0][i] = dd[0];
      d[1][i] = dd[1];
      m[0][i] = mm[0];
      m[1][i] = mm[1];
    }
    transpose16x16_epi32(t);
    for (int g = 0; g < 16; ++g) out[gi].q[g] = t[g];
    for (int h = 0; h < 2; ++h) {
      out[gi].d[h] = _mm512_load_ps(d[h]);
      out[gi].m[h] = _mm512_load_ps(m[h]);
    }
  }
}

template <typename Src, int NC>
TF_TARGET_AVX512 inline void panel32_tile(const Panel32Group* p, int ngs, int64_t g0, const uint8_t* xq, size_t xs,
                                          int64_t ng, float* y, int64_t ldy, __mmask16 rows, bool first) {
  __m512 tot[NC];
  for (int c = 0; c < NC; ++c) tot[c] = _mm512_setzero_ps();
  for (int gi = 0; gi < ngs; ++gi) {
    const Panel32Group& pg = p[gi];
    const int64_t g = g0 + gi;
    for (int h = 0; h < 2; ++h) {
      __m512i acc[NC];
      for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        const __m512i wq = pg.q[8 * h + j];
        for (int c = 0; c < NC; ++c) {
          int32_t xv;
          std::memcpy(&xv, xq + size_t(c) * xs + size_t(64 * g + 32 * h + 4 * j), 4);
          acc[c] = _mm512_dpbusd_epi32(acc[c], wq, _mm512_set1_epi32(xv));
        }
      }
      for (int c = 0; c < NC; ++c) {
        const float* sc = reinterpret_cast<const float*>(xq + size_t(c) * xs + size_t(ng) * 64) + 4 * g;
        const float dx = sc[h], sx = sc[2 + h];
        const __m512 t =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[c]), _mm512_set1_ps(dx), _mm512_set1_ps(-float(Src::off) * sx));
        tot[c] = _mm512_fmadd_ps(t, pg.d[h], tot[c]);
        if constexpr (Src::has_min) tot[c] = _mm512_fmadd_ps(pg.m[h], _mm512_set1_ps(sx), tot[c]);
      }
    }
  }
  for (int c = 0; c < NC; ++c) {
    float* dst = y + c * ldy;
    if (!first) tot[c] = _mm512_add_ps(tot[c], _mm512_maskz_loadu_ps(rows, dst));
    _mm512_mask_storeu_ps(dst, rows, tot[c]);
  }
}

template <typename Src>
TF_TARGET_AVX512 void matmul_g32_panels_avx512(int64_t k, const uint8_t* w, size_t ws, int64_t r0, int64_t r1,
                                               const uint8_t* xq, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  const int64_t nb = k / 32, ng = g32_groups(k);
  alignas(64) Panel32Group panel[kPanel32Groups];
  for (int64_t r = r0; r < r1; r += kPanelRows) {
    const int n = int(std::min<int64_t>(kPanelRows, r1 - r));
    const __mmask16 rows = __mmask16((1u << n) - 1);
    for (int64_t g0 = 0; g0 < ng; g0 += kPanel32Groups) {
      const int ngs = int(std::min<int64_t>(kPanel32Groups, ng - g0));
      build_panels32<Src>(w, ws, r, n, g0, ngs, nb, panel);
      const bool first = g0 == 0;
      int64_t c = 0;
      for (; c + kPanel32Cols <= ncols; c += kPanel32Cols)
        panel32_tile<Src, kPanel32Cols>(panel, ngs, g0, xq + size_t(c) * xs, xs, ng, y + c * ldy + r, ldy, rows,
                                        first);
      switch (ncols - c) {
#define TF_PANEL32_REST(N)                                                                                     \
  case N:                                                                                                      \
    panel32_tile<Src, N>(panel, ngs, g0, xq + size_t(c) * xs, xs, ng, y + c * ldy + r, ldy, rows, first); \
    break;
        TF_PANEL32_REST(1)
        TF_PANEL32_REST(2)
        TF_PANEL32_REST(3)
        TF_PANEL32_REST(4)
        TF_PANEL32_REST(5)
        TF_PANEL32_REST(6)
        TF_PANEL32_REST(7)
#undef TF_PANEL32_REST
        default: break;
      }
    }
  }
}

// A Decode32Fn format (IQ4_NL, MXFP4: signed codes, w = d * q) as a panel source: the codes + 128.
template <Decode32Fn Decode, size_t kBytes>
struct Decoded32PanelSource {
  static constexpr int off = 128;
  static constexpr bool has_min = false;
  TF_TARGET_AVX512 static void unpack(const uint8_t* row, int64_t b, bool two, __m512i& q, float d[2], float m[2]) {
    (void)m;
    alignas(32) Decoded32 u0, u1;
    Decode(row + size_t(b) * kBytes, &u0);
    __m256i q1 = _mm256_setzero_si256();
    d[0] = u0.d;
    d[1] = 0.f;
    if (two) {
      Decode(row + size_t(b + 1) * kBytes, &u1);
      q1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(u1.q));
      d[1] = u1.d;
    }
    const __m256i q0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(u0.q));
    q = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1), _mm512_set1_epi8(char(0x80)));
  }
};

// The panels of a Decode32Fn format, with the kernel-table signature (CpuKernels::avx512_panels).
template <Decode32Fn Decode, size_t kBytes>
TF_TARGET_AVX512 void matmul_d32_panels_avx512(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1,
                                               const void* xq, size_t xs, int64_t ncols, float* y, int64_t ldy) {
  matmul_g32_panels_avx512<Decoded32PanelSource<Decode, kBytes>>(
      k, static_cast<const uint8_t*>(w), ws, r0, r1, static_cast<const uint8_t*>(xq), xs, ncols, y, ldy);
}

}  // namespace tf::cpu::detail

#endif  // TF_HAVE_X86_KERNELS
