// Importance-weighted quantizers of the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-weight
// super-blocks of 16 or 32-weight sub-blocks, each with an integer scale (and min) against
// fp16 super-scales).
//
// Symmetric formats (Q3_K, Q6_K): sym_superblock (scale_search.h).
// Offset formats (Q2_K, Q4_K, Q5_K: x ~= d * sc_j * q - dmin * mn_j):
// 1. each sub-block's best float (s_j, m_j >= 0) (fit_affine: inverse-scale sweeps anchored at
//    both ends, offset sweeps, alternating refits), with the curvatures of its error in s
//    (sum w q^2) and in m (sum w);
// 2. d and dmin from curvature-weighted sweeps over the s_j and the m_j (and, as a second
//    start, the largest s_j / m_j on the top integer);
// 3. against the fp16 (d, dmin) the decoder will use, every sub-block picks (sc, mn) by the
//    true error of its re-rounded levels: from round(s_j / d, m_j / dmin), a local search over
//    the integer lattice plus the offsets of level-shifted equivalents (x ~= e (q + k) +
//    (o - k e): with importance weights a sub-block often uses few levels, and one of these
//    offsets may sit much closer to the dmin lattice); then (d, dmin) are refitted jointly by
//    least squares over the super-block, rounded to fp16, and step 3 repeats while the error
//    drops.
#include <algorithm>
#include <cstring>

#include "quant/blocks.h"
#include "quant/quantizers/quantizers.h"
#include "quant/quantizers/scale_search.h"

namespace tf::quant {

namespace {
using namespace detail;

// ---- packing helpers (layouts: quant/blocks.h, reference.cpp) -----------------------------

void set_scale_min_k4(int j, uint8_t* q, int sc, int m) {
  if (j < 4) {
    q[j] = uint8_t((q[j] & 0xC0) | (sc & 63));
    q[j + 4] = uint8_t((q[j + 4] & 0xC0) | (m & 63));
  } else {
    q[j + 4] = uint8_t((sc & 0x0F) | ((m & 0x0F) << 4));
    q[j - 4] = uint8_t((q[j - 4] & 0x3F) | ((sc >> 4) << 6));
    q[j] = uint8_t((q[j] & 0x3F) | ((m >> 4) << 6));
  }
}

void set_scale_q3_K(int k, uint8_t* s, int v /* -32..31 */) {
  const int u = v + 32;
  if (k < 8)
    s[k] = uint8_t((s[k] & 0xF0) | (u & 0x0F));
  else
    s[k - 8] = uint8_t((s[k - 8] & 0x0F) | ((u & 0x0F) << 4));
  const int sh = 2 * (k / 4);
  uint8_t& h = s[8 + (k % 4)];
  h = uint8_t((h & ~(3 << sh)) | (((u >> 4) & 3) << sh));
}

// Local-search steps per sub-block over the (sc, mn) lattice.
constexpr int kSteps = 4;

// ---- offset super-blocks --------------------------------------------------------------------

struct AsymParams {
  int sub, qmax, scmax, mnmax;
  float below, above;  // fit_affine sweep range of the sub-blocks
};

// Error of one sub-block for integer (sc, mn) against (d, dmin); q receives its levels.
inline double sub_error(const float* x, const float* w, int sub, int qmax, float d, float dmin, int sc,
                        int mn, uint8_t* q) {
  return affine_assign(x, w, sub, qmax, d * float(sc), -dmin * float(mn), q);
}

// Quantizes one super-block; dh / dminh get the fp16 bits, sc / mn the integer scales and
// mins, q[256] the levels. Returns the weighted error.
double asym_superblock(Events& ev, const float* x, const float* w, const AsymParams& P, uint16_t* dh,
                       uint16_t* dminh, int* sc, int* mn, uint8_t* q) {
  const int sub = P.sub, nsub = QK_K / sub;
  float s[16] = {}, m[16] = {}, A[16] = {}, B[16] = {};
  for (int j = 0; j < nsub; ++j) {
    const float* xj = x + j * sub;
    const float* wj = w + j * sub;
    AffineFit f = fit_affine(ev, xj, wj, sub, P.qmax, P.below, P.above, true, q + j * sub);
    // Canonical form: when the lowest used level is k > 0, the same values are
    // s (q - k) + (m + k s); take the smallest min that stays <= 0 (the block's lowest value
    // on level 0, as ggml writes it), so that blocks from a K-quant file give back its mins.
    int qlo = P.qmax;
    for (int i = 0; i < sub; ++i)
      if (wj[i] > 0.0f) qlo = std::min(qlo, int(q[j * sub + i]));
    if (f.d > 0.0f && qlo > 0 && qlo < P.qmax) {
      int k = qlo;
      while (k > 0 && f.m + float(k) * f.d > 0.0f) --k;
      if (k > 0) {
        f.m += float(k) * f.d;
        for (int i = 0; i < sub; ++i) q[j * sub + i] = uint8_t(std::max(0, int(q[j * sub + i]) - k));
      }
    }
    s[j] = f.d;
    m[j] = -f.m;
    double a = 0, b = 0;
    for (int i = 0; i < sub; ++i) {
      a += double(wj[i]) * q[j * sub + i] * q[j * sub + i];
      b += wj[i];
    }
    A[j] = float(a);
    B[j] = float(b);
  }
  int16_t tmp_idx[16];
  const SymFit Fs = fit_sym(ev, s, A, nsub, UniformLevels{0, P.scmax}, 0.5f, 0.5f, tmp_idx);
  const SymFit Fm = fit_sym(ev, m, B, nsub, UniformLevels{0, P.mnmax}, 0.5f, 0.5f, tmp_idx);

  uint8_t tq[32], cq[QK_K];
  int csc[16], cmn[16];
  // Step 3 for one fp16 pair.
  auto choose = [&](float d, float dmin) {
    double tot = 0;
    for (int j = 0; j < nsub; ++j) {
      const float* xj = x + j * sub;
      const float* wj = w + j * sub;
      const int kmax = d > 0.0f ? P.scmax : 0, lmax = dmin > 0.0f ? P.mnmax : 0;
      int bk = round_clamp(d > 0.0f ? s[j] / d : 0.0f, 0.0f, float(kmax));
      int bl = round_clamp(dmin > 0.0f ? m[j] / dmin : 0.0f, 0.0f, float(lmax));
      double best = -1;
      auto try_kl = [&](int k, int l) {
        const double e = sub_error(xj, wj, sub, P.qmax, d, dmin, k, l, tq);
        if (best < 0 || e < best) {
          best = e;
          csc[j] = k;
          cmn[j] = l;
          std::memcpy(cq + j * sub, tq, size_t(sub));
        }
      };
      // Levels shifted by sh (x ~= e (q + sh) + (off - sh e)) give the same values with
      // another offset, whose rounding to the dmin lattice differs: when the sub-block does
      // not use every level, one of the shifts may fit the lattice much better.
      auto try_shifts = [&](int k, int l) {
        if (k == 0 || lmax == 0) return;
        const float e = d * float(k), off0 = -dmin * float(l);
        affine_assign(xj, wj, sub, P.qmax, e, off0, tq);
        int qlo = P.qmax, qhi = 0;
        for (int i = 0; i < sub; ++i)
          if (wj[i] > 0.0f) {
            qlo = std::min(qlo, int(tq[i]));
            qhi = std::max(qhi, int(tq[i]));
          }
        for (int sh = -qlo; sh <= P.qmax - qhi; ++sh) {
          const float o = off0 - float(sh) * e;
          if (sh == 0 || o > 0.5f * dmin) continue;
          try_kl(k, round_clamp(-o / dmin, 0.0f, float(lmax)));
        }
      };
      try_kl(bk, bl);
      try_shifts(bk, bl);
      // Local search over the (sc, mn) lattice from there.
      for (int step = 0; step < kSteps; ++step) {
        const int k0 = csc[j], l0 = cmn[j];
        for (int k = std::max(0, k0 - 1); k <= std::min(kmax, k0 + 1); ++k)
          for (int l = std::max(0, l0 - 1); l <= std::min(lmax, l0 + 1); ++l)
            if (k != k0 || l != l0) try_kl(k, l);
        if (csc[j] == k0 && cmn[j] == l0) break;
        if (csc[j] != k0) try_shifts(csc[j], cmn[j]);
      }
      tot += best;
    }
    return tot;
  };

  // Starting points: the curvature-weighted sweeps, and the largest scale / min on the top
  // integer (which finds the lattice back when the block was dequantized from this format and
  // sub-blocks with few distinct values make the sub-block scales ambiguous).
  float smax = 0, mmax = 0;
  for (int j = 0; j < nsub; ++j) {
    smax = std::max(smax, s[j]);
    mmax = std::max(mmax, m[j]);
  }
  const uint16_t start_d[2] = {half_bits(Fs.d), half_bits(smax / float(P.scmax))};
  const uint16_t start_m[2] = {half_bits(Fm.d), half_bits(mmax / float(P.mnmax))};
  double best = -1;
  uint16_t hd = start_d[0], hm = start_m[0];
  for (int it = 0; it < 4; ++it) {
    bool improved = false;
    for (int c = 0; c < (it == 0 ? 2 : 1); ++c) {
      const uint16_t cd = it == 0 ? start_d[c] : hd, cm = it == 0 ? start_m[c] : hm;
      if (c == 1 && cd == start_d[0] && cm == start_m[0]) continue;
      const float d = half_val(cd), dmin = half_val(cm);
      if (d < 0.0f || dmin < 0.0f) continue;
      const double e = choose(d, dmin);
      if (best < 0 || e < best) {
        best = e;
        improved = true;
        *dh = cd;
        *dminh = cm;
        std::memcpy(sc, csc, sizeof(int) * size_t(nsub));
        std::memcpy(mn, cmn, sizeof(int) * size_t(nsub));
        std::memcpy(q, cq, QK_K);
      }
    }
    if (!improved && it > 0) break;
    // Joint least squares of (d, dmin) for x ~= d * (sc q) - dmin * mn, dmin >= 0.
    double saa = 0, sab = 0, sbb = 0, sxa = 0, sxb = 0;
    for (int j = 0; j < nsub; ++j)
      for (int i = 0; i < sub; ++i) {
        const double wi = w[j * sub + i], xi = x[j * sub + i];
        const double av = double(sc[j]) * q[j * sub + i], bv = -double(mn[j]);
        saa += wi * av * av;
        sab += wi * av * bv;
        sbb += wi * bv * bv;
        sxa += wi * xi * av;
        sxb += wi * xi * bv;
      }
    const double det = saa * sbb - sab * sab;
    double nd, nm;
    if (det > 1e-12 * saa * sbb) {
      nd = (sxa * sbb - sxb * sab) / det;
      nm = (saa * sxb - sab * sxa) / det;
    } else {
      nd = saa > 0 ? sxa / saa : 0;
      nm = 0;
    }
    if (nm < 0) {
      nm = 0;
      nd = saa > 0 ? sxa / saa : 0;
    }
    if (nd < 0) break;
    const uint16_t nhd = half_bits(float(nd)), nhm = half_bits(float(nm));
    if (nhd == *dh && nhm == *dminh) break;
    hd = nhd;
    hm = nhm;
  }
  return best;
}

// Sub-block sweep ranges ([t_end (1 - below), t_end (1 + above)], see legacy.cpp), tuned on
// Gaussian / Student-t / outlier rows for error against speed.
constexpr AsymParams kQ2{16, 3, 15, 15, 0.5f, 1.0f};
constexpr AsymParams kQ4{32, 15, 63, 63, 0.2f, 0.5f};
constexpr AsymParams kQ5{32, 31, 63, 63, 0.2f, 0.3f};
constexpr float kQ3Below = 1.0f, kQ3Above = 4.0f;
constexpr float kQ6Below = 0.4f, kQ6Above = 0.7f;

}  // namespace

void quantize_q2_K(const float* x, const float* w, void* dst, int64_t n) {
  block_q2_K* b = static_cast<block_q2_K*>(dst);
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / QK_K; ++ib) {
    const float* xb = x + ib * QK_K;
    const Weights W(w ? w + ib * QK_K : nullptr, QK_K);
    int sc[16], mn[16];
    uint8_t q[QK_K];
    asym_superblock(ev, xb, W.p, kQ2, &b[ib].d, &b[ib].dmin, sc, mn, q);
    for (int j = 0; j < 16; ++j) b[ib].scales[j] = uint8_t(sc[j] | (mn[j] << 4));
    std::memset(b[ib].qs, 0, sizeof(b[ib].qs));
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      b[ib].qs[h * 32 + l] |= uint8_t(q[e] << (2 * s));
    }
  }
}

void quantize_q3_K(const float* x, const float* w, void* dst, int64_t n) {
  block_q3_K* b = static_cast<block_q3_K*>(dst);
  const UniformLevels L{-4, 3};
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / QK_K; ++ib) {
    const float* xb = x + ib * QK_K;
    const Weights W(w ? w + ib * QK_K : nullptr, QK_K);
    int sc[16];
    int16_t idx[QK_K];
    sym_superblock(ev, xb, W.p, 16, 16, L, kQ3Below, kQ3Above, -32, 31, &b[ib].d, sc, idx);
    std::memset(b[ib].scales, 0, sizeof(b[ib].scales));
    for (int k = 0; k < 16; ++k) set_scale_q3_K(k, b[ib].scales, sc[k]);
    std::memset(b[ib].qs, 0, sizeof(b[ib].qs));
    std::memset(b[ib].hmask, 0, sizeof(b[ib].hmask));
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      const int u = idx[e];  // level + 4, 0..7; the high bit set means "no -4 offset"
      b[ib].qs[h * 32 + l] |= uint8_t((u & 3) << (2 * s));
      b[ib].hmask[l] |= uint8_t(((u >> 2) & 1) << (h * 4 + s));
    }
  }
}

void quantize_q4_K(const float* x, const float* w, void* dst, int64_t n) {
  block_q4_K* b = static_cast<block_q4_K*>(dst);
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / QK_K; ++ib) {
    const float* xb = x + ib * QK_K;
    const Weights W(w ? w + ib * QK_K : nullptr, QK_K);
    int sc[8], mn[8];
    uint8_t q[QK_K];
    asym_superblock(ev, xb, W.p, kQ4, &b[ib].d, &b[ib].dmin, sc, mn, q);
    std::memset(b[ib].scales, 0, sizeof(b[ib].scales));
    for (int j = 0; j < 8; ++j) set_scale_min_k4(j, b[ib].scales, sc[j], mn[j]);
    std::memset(b[ib].qs, 0, sizeof(b[ib].qs));
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) b[ib].qs[(j / 2) * 32 + l] |= uint8_t(q[j * 32 + l] << (4 * (j % 2)));
  }
}

void quantize_q5_K(const float* x, const float* w, void* dst, int64_t n) {
  block_q5_K* b = static_cast<block_q5_K*>(dst);
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / QK_K; ++ib) {
    const float* xb = x + ib * QK_K;
    const Weights W(w ? w + ib * QK_K : nullptr, QK_K);
    int sc[8], mn[8];
    uint8_t q[QK_K];
    asym_superblock(ev, xb, W.p, kQ5, &b[ib].d, &b[ib].dmin, sc, mn, q);
    std::memset(b[ib].scales, 0, sizeof(b[ib].scales));
    for (int j = 0; j < 8; ++j) set_scale_min_k4(j, b[ib].scales, sc[j], mn[j]);
    std::memset(b[ib].qs, 0, sizeof(b[ib].qs));
    std::memset(b[ib].qh, 0, sizeof(b[ib].qh));
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) {
        const int v = q[j * 32 + l];
        b[ib].qs[(j / 2) * 32 + l] |= uint8_t((v & 0x0F) << (4 * (j % 2)));
        b[ib].qh[l] |= uint8_t(((v >> 4) & 1) << j);
      }
  }
}

void quantize_q6_K(const float* x, const float* w, void* dst, int64_t n) {
  block_q6_K* b = static_cast<block_q6_K*>(dst);
  const UniformLevels L{-32, 31};
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / QK_K; ++ib) {
    const float* xb = x + ib * QK_K;
    const Weights W(w ? w + ib * QK_K : nullptr, QK_K);
    int sc[16];
    int16_t idx[QK_K];
    // One sign of the sub-block scales only (the largest value on level -32): the 64 levels are
    // nearly symmetric, and the second sweep doubled the time for <1% of error.
    sym_superblock(ev, xb, W.p, 16, 16, L, kQ6Below, kQ6Above, -128, 127, &b[ib].d, sc, idx, true);
    for (int k = 0; k < 16; ++k) b[ib].scales[k] = int8_t(sc[k]);
    std::memset(b[ib].ql, 0, sizeof(b[ib].ql));
    std::memset(b[ib].qh, 0, sizeof(b[ib].qh));
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, r = e % 128;
      const int u = idx[e];  // level + 32, 0..63
      b[ib].ql[h * 64 + r % 64] |= uint8_t((u & 0x0F) << (4 * (r / 64)));
      b[ib].qh[h * 32 + r % 32] |= uint8_t(((u >> 4) & 3) << (2 * (r / 32)));
    }
  }
}

}  // namespace tf::quant
