// Scalar reference dequantization / quantization (see reference.h).
//
// Bit-exactness with numpy needs every float operation rounded on its own: no fused
// multiply-add contraction in this file.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "quant/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/half.h"
#include "quant/blocks.h"

namespace tf {
namespace {

inline float h2f(uint16_t h) { return fp16_to_fp32(h); }
inline uint16_t f2h(float f) { return fp32_to_fp16(f); }

// 6-bit scale and min j (0..7) of a Q4_K / Q5_K super-block.
inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = uint8_t((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
    *m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

inline void set_scale_min_k4(int j, uint8_t* q, int sc, int m) {
  if (j < 4) {
    q[j] = uint8_t((q[j] & 0xC0) | (sc & 63));
    q[j + 4] = uint8_t((q[j + 4] & 0xC0) | (m & 63));
  } else {
    q[j + 4] = uint8_t((sc & 0x0F) | ((m & 0x0F) << 4));
    q[j - 4] = uint8_t((q[j - 4] & 0x3F) | ((sc >> 4) << 6));
    q[j] = uint8_t((q[j] & 0x3F) | ((m >> 4) << 6));
  }
}

// Signed 6-bit scale k (0..15) of a Q3_K super-block, in [-32, 31].
inline int get_scale_q3_K(int k, const uint8_t* s) {
  const int lo = k < 8 ? (s[k] & 0x0F) : (s[k - 8] >> 4);
  const int hi = (s[8 + (k % 4)] >> (2 * (k / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

inline void set_scale_q3_K(int k, uint8_t* s, int v /* -32..31 */) {
  const int u = v + 32;
  if (k < 8)
    s[k] = uint8_t((s[k] & 0xF0) | (u & 0x0F));
  else
    s[k - 8] = uint8_t((s[k - 8] & 0x0F) | ((u & 0x0F) << 4));
  const int sh = 2 * (k / 4);
  uint8_t& h = s[8 + (k % 4)];
  h = uint8_t((h & ~(3 << sh)) | (((u >> 4) & 3) << sh));
}

// Round to nearest (ties to even) after clamping to [lo, hi] (|lo|, |hi| < 2^22); NaN -> lo.
inline int round_clamp(float v, int lo, int hi) {
  const float flo = float(lo), fhi = float(hi);
  v = v >= flo ? v : flo;
  v = v <= fhi ? v : fhi;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  return int((v + kMagic) - kMagic);
}

// Value of largest magnitude, the first one on ties (x[0] when all are zero, keeping its
// sign), exactly as numpy's argmax picks it in gguf.quants.
inline float signed_absmax(const float* x, int n) {
  float amax = std::fabs(x[0]), vmax = x[0];
  for (int i = 1; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (amax < a) {
      amax = a;
      vmax = x[i];
    }
  }
  return vmax;
}

// ---- K-quant scale search (TensorFold's own; round-to-nearest given the scales) ----------

// Best s for x ~= s * q with integer q in [qmin, qmax] (qmin < 0 < qmax): grid over which
// value the largest-magnitude element maps to (either end of the range), a least-squares
// refit of s for the resulting q, and the squared error of re-rounding with that s.
float fit_symmetric(const float* x, int n, int qmin, int qmax) {
  const float vmax = signed_absmax(x, n);
  if (vmax == 0.0f) return 0.0f;
  float best_s = vmax / float(qmin), best_err = std::numeric_limits<float>::infinity();
  for (int side = 0; side < 2; ++side) {
    const float end = side == 0 ? float(qmin) : float(qmax);
    for (int k = 0; k <= 16; ++k) {
      const float f = 0.75f + 0.03f * float(k);
      const float is0 = (end * f) / vmax;
      float sxq = 0, sqq = 0;
      for (int i = 0; i < n; ++i) {
        const int q = round_clamp(x[i] * is0, qmin, qmax);
        sxq += x[i] * float(q);
        sqq += float(q * q);
      }
      if (sqq <= 0) continue;
      const float s = sxq / sqq;
      if (s == 0.0f) continue;
      const float is = 1.0f / s;
      float err = 0.0f;
      for (int i = 0; i < n; ++i) {
        const float r = x[i] - s * float(round_clamp(x[i] * is, qmin, qmax));
        err += r * r;
      }
      if (err < best_err) {
        best_err = err;
        best_s = s;
      }
    }
  }
  return best_s;
}

// Best (s >= 0, m >= 0) for x ~= s * q - m with integer q in [0, qmax]: grid over the
// scale from the range (min clamped to <= 0, as the formats store a non-negative min),
// two rounds of least-squares refit of (s, m) for the resulting q.
void fit_asymmetric(const float* x, int n, int qmax, float* s_out, float* m_out) {
  float xmin = x[0], xmax = x[0];
  for (int i = 1; i < n; ++i) {
    xmin = std::min(xmin, x[i]);
    xmax = std::max(xmax, x[i]);
  }
  xmin = std::min(xmin, 0.0f);
  if (xmax <= xmin) {
    *s_out = 0.0f;
    *m_out = -xmin;
    return;
  }
  float best_s = (xmax - xmin) / float(qmax), best_b = xmin;
  float best_err = std::numeric_limits<float>::infinity();
  for (int k = 0; k <= 16; ++k) {
    const float f = 0.8f + 0.03f * float(k);
    float s = (xmax - xmin) / (float(qmax) * f), b = xmin;
    for (int it = 0; it < 2; ++it) {
      const float is = 1.0f / s;
      double sq = 0, sqq = 0, sx = 0, sxq = 0;
      for (int i = 0; i < n; ++i) {
        const int q = round_clamp((x[i] - b) * is, 0, qmax);
        sq += q;
        sqq += double(q * q);
        sx += x[i];
        sxq += double(x[i] * float(q));
      }
      const double det = n * sqq - sq * sq;
      double ns = 0, nb = 0;
      if (det > 0) {
        ns = (n * sxq - sq * sx) / det;
        nb = (sx - ns * sq) / n;
      }
      if (det <= 0 || nb > 0) {
        nb = 0;
        ns = sqq > 0 ? sxq / sqq : 0;
      }
      if (!(ns > 0)) break;
      s = float(ns);
      b = float(nb);
    }
    const float is = 1.0f / s;
    float err = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float r = x[i] - (s * float(round_clamp((x[i] - b) * is, 0, qmax)) + b);
      err += r * r;
    }
    if (err < best_err) {
      best_err = err;
      best_s = s;
      best_b = b;
    }
  }
  *s_out = best_s;
  *m_out = -best_b;
}

// Quantizes non-negative per-sub-block values v[0..cnt) to integers in [0, imax] against one
// fp16 super-scale; returns the super-scale bits.
uint16_t quantize_scales_unsigned(const float* v, int cnt, int imax, int* out) {
  float vmax = 0.0f;
  for (int j = 0; j < cnt; ++j) vmax = std::max(vmax, v[j]);
  const uint16_t dh = f2h(vmax / float(imax));
  const float d = h2f(dh);
  for (int j = 0; j < cnt; ++j) out[j] = d > 0.0f ? round_clamp(v[j] / d, 0, imax) : 0;
  return dh;
}

// Signed per-sub-block scales to integers in [lo, hi] (lo < 0): the largest-magnitude scale
// maps to lo; returns the fp16 super-scale bits.
uint16_t quantize_scales_signed(const float* v, int cnt, int lo, int hi, int* out) {
  const float vmax = signed_absmax(v, cnt);
  const uint16_t dh = f2h(vmax / float(lo));
  const float d = h2f(dh);
  for (int j = 0; j < cnt; ++j) out[j] = d != 0.0f ? round_clamp(v[j] / d, lo, hi) : 0;
  return dh;
}

// Asymmetric K-quant super-block: per sub-block (s, m), quantized scales and mins, then the
// integer q of every weight rounded against the quantized values.
void quantize_asym_superblock(const float* x, int sub, int qmax, int scale_max, uint16_t* dh,
                              uint16_t* dminh, int* sc, int* mn, uint8_t* q /* QK_K */) {
  const int nsub = QK_K / sub;
  float s[QK_K / 16], m[QK_K / 16];
  for (int j = 0; j < nsub; ++j) fit_asymmetric(x + j * sub, sub, qmax, &s[j], &m[j]);
  *dh = quantize_scales_unsigned(s, nsub, scale_max, sc);
  *dminh = quantize_scales_unsigned(m, nsub, scale_max, mn);
  const float d = h2f(*dh), dmin = h2f(*dminh);
  for (int j = 0; j < nsub; ++j) {
    const float ds = d * float(sc[j]), dm = dmin * float(mn[j]);
    for (int i = 0; i < sub; ++i)
      q[j * sub + i] = ds > 0.0f ? uint8_t(round_clamp((x[j * sub + i] + dm) / ds, 0, qmax)) : 0;
  }
}

// Symmetric K-quant super-block: q in [qmin, qmax], signed scales in [slo, shi].
uint16_t quantize_sym_superblock(const float* x, int sub, int qmin, int qmax, int slo, int shi,
                                 int* sc, int* q /* QK_K */) {
  const int nsub = QK_K / sub;
  float s[QK_K / 16];
  for (int j = 0; j < nsub; ++j) s[j] = fit_symmetric(x + j * sub, sub, qmin, qmax);
  const uint16_t dh = quantize_scales_signed(s, nsub, slo, shi, sc);
  const float d = h2f(dh);
  for (int j = 0; j < nsub; ++j) {
    const float e = d * float(sc[j]);
    for (int i = 0; i < sub; ++i)
      q[j * sub + i] = e != 0.0f ? round_clamp(x[j * sub + i] / e, qmin, qmax) : 0;
  }
  return dh;
}

}  // namespace

// ============================== dequantization ==========================================

void dequantize_row_f32_ref(const void* src, float* dst, int64_t n) {
  std::memcpy(dst, src, size_t(n) * sizeof(float));
}

void dequantize_row_f16_ref(const void* src, float* dst, int64_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    dst[i] = h2f(h);
  }
}

void dequantize_row_bf16_ref(const void* src, float* dst, int64_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    dst[i] = bf16_to_fp32(h);
  }
}

void dequantize_row_q4_0_ref(const void* src, float* dst, int64_t n) {
  const block_q4_0* b = static_cast<const block_q4_0*>(src);
  for (int64_t ib = 0; ib < n / QK4_0; ++ib, dst += QK4_0) {
    const float d = h2f(b[ib].d);
    for (int j = 0; j < QK4_0 / 2; ++j) {
      dst[j] = d * float(int(b[ib].qs[j] & 0x0F) - 8);
      dst[j + QK4_0 / 2] = d * float(int(b[ib].qs[j] >> 4) - 8);
    }
  }
}

void dequantize_row_q4_1_ref(const void* src, float* dst, int64_t n) {
  const block_q4_1* b = static_cast<const block_q4_1*>(src);
  for (int64_t ib = 0; ib < n / QK4_1; ++ib, dst += QK4_1) {
    const float d = h2f(b[ib].d), m = h2f(b[ib].m);
    for (int j = 0; j < QK4_1 / 2; ++j) {
      dst[j] = d * float(b[ib].qs[j] & 0x0F) + m;
      dst[j + QK4_1 / 2] = d * float(b[ib].qs[j] >> 4) + m;
    }
  }
}

void dequantize_row_q5_0_ref(const void* src, float* dst, int64_t n) {
  const block_q5_0* b = static_cast<const block_q5_0*>(src);
  for (int64_t ib = 0; ib < n / QK5_0; ++ib, dst += QK5_0) {
    const float d = h2f(b[ib].d);
    uint32_t qh;
    std::memcpy(&qh, b[ib].qh, 4);
    for (int j = 0; j < QK5_0 / 2; ++j) {
      const int x0 = (b[ib].qs[j] & 0x0F) | int(((qh >> j) & 1u) << 4);
      const int x1 = (b[ib].qs[j] >> 4) | int(((qh >> (j + 16)) & 1u) << 4);
      dst[j] = d * float(x0 - 16);
      dst[j + QK5_0 / 2] = d * float(x1 - 16);
    }
  }
}

void dequantize_row_q5_1_ref(const void* src, float* dst, int64_t n) {
  const block_q5_1* b = static_cast<const block_q5_1*>(src);
  for (int64_t ib = 0; ib < n / QK5_1; ++ib, dst += QK5_1) {
    const float d = h2f(b[ib].d), m = h2f(b[ib].m);
    uint32_t qh;
    std::memcpy(&qh, b[ib].qh, 4);
    for (int j = 0; j < QK5_1 / 2; ++j) {
      const int x0 = (b[ib].qs[j] & 0x0F) | int(((qh >> j) & 1u) << 4);
      const int x1 = (b[ib].qs[j] >> 4) | int(((qh >> (j + 16)) & 1u) << 4);
      dst[j] = d * float(x0) + m;
      dst[j + QK5_1 / 2] = d * float(x1) + m;
    }
  }
}

void dequantize_row_q8_0_ref(const void* src, float* dst, int64_t n) {
  const block_q8_0* b = static_cast<const block_q8_0*>(src);
  for (int64_t ib = 0; ib < n / QK8_0; ++ib, dst += QK8_0) {
    const float d = h2f(b[ib].d);
    for (int j = 0; j < QK8_0; ++j) dst[j] = float(b[ib].qs[j]) * d;
  }
}

void dequantize_row_q8_1_ref(const void* src, float* dst, int64_t n) {
  const block_q8_1* b = static_cast<const block_q8_1*>(src);
  for (int64_t ib = 0; ib < n / QK8_1; ++ib, dst += QK8_1) {
    const float d = h2f(b[ib].d);
    for (int j = 0; j < QK8_1; ++j) dst[j] = float(b[ib].qs[j]) * d;
  }
}

void dequantize_row_q2_K_ref(const void* src, float* dst, int64_t n) {
  const block_q2_K* b = static_cast<const block_q2_K*>(src);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, dst += QK_K) {
    const float d = h2f(b[ib].d), dmin = h2f(b[ib].dmin);
    // element e = h*128 + s*32 + l  <-  bits 2s of qs[h*32 + l]; sub-block e / 16.
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      const int q = (b[ib].qs[h * 32 + l] >> (2 * s)) & 3;
      const uint8_t sc = b[ib].scales[e / 16];
      const float dl = d * float(sc & 0x0F), ml = dmin * float(sc >> 4);
      dst[e] = dl * float(q) - ml;
    }
  }
}

void dequantize_row_q3_K_ref(const void* src, float* dst, int64_t n) {
  const block_q3_K* b = static_cast<const block_q3_K*>(src);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, dst += QK_K) {
    const float d = h2f(b[ib].d);
    float dl[QK_K / 16];
    for (int k = 0; k < QK_K / 16; ++k) dl[k] = d * float(get_scale_q3_K(k, b[ib].scales));
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      const int lo = (b[ib].qs[h * 32 + l] >> (2 * s)) & 3;
      const int hi = (b[ib].hmask[l] >> (h * 4 + s)) & 1;
      dst[e] = dl[e / 16] * float(lo - (hi ? 0 : 4));
    }
  }
}

void dequantize_row_q4_K_ref(const void* src, float* dst, int64_t n) {
  const block_q4_K* b = static_cast<const block_q4_K*>(src);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, dst += QK_K) {
    const float d = h2f(b[ib].d), dmin = h2f(b[ib].dmin);
    for (int j = 0; j < QK_K / 32; ++j) {
      uint8_t sc, m;
      get_scale_min_k4(j, b[ib].scales, &sc, &m);
      const float d1 = d * float(sc), m1 = dmin * float(m);
      // sub-block j = 2*p + s  <-  nibble s of qs[p*32 + l]
      const int p = j / 2, s = j % 2;
      for (int l = 0; l < 32; ++l)
        dst[j * 32 + l] = d1 * float((b[ib].qs[p * 32 + l] >> (4 * s)) & 0x0F) - m1;
    }
  }
}

void dequantize_row_q5_K_ref(const void* src, float* dst, int64_t n) {
  const block_q5_K* b = static_cast<const block_q5_K*>(src);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, dst += QK_K) {
    const float d = h2f(b[ib].d), dmin = h2f(b[ib].dmin);
    for (int j = 0; j < QK_K / 32; ++j) {
      uint8_t sc, m;
      get_scale_min_k4(j, b[ib].scales, &sc, &m);
      const float d1 = d * float(sc), m1 = dmin * float(m);
      const int p = j / 2, s = j % 2;
      for (int l = 0; l < 32; ++l) {
        const int lo = (b[ib].qs[p * 32 + l] >> (4 * s)) & 0x0F;
        const int hi = (b[ib].qh[l] >> j) & 1;
        dst[j * 32 + l] = d1 * float(lo | (hi << 4)) - m1;
      }
    }
  }
}

void dequantize_row_q6_K_ref(const void* src, float* dst, int64_t n) {
  const block_q6_K* b = static_cast<const block_q6_K*>(src);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, dst += QK_K) {
    const float d = h2f(b[ib].d);
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, r = e % 128;
      const int lo = (b[ib].ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
      const int hi = (b[ib].qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
      const float dl = d * float(b[ib].scales[e / 16]);
      dst[e] = dl * float((lo | (hi << 4)) - 32);
    }
  }
}

void dequantize_row_q8_K_ref(const void* src, float* dst, int64_t n) {
  const block_q8_K* b = static_cast<const block_q8_K*>(src);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, dst += QK_K) {
    float d;
    std::memcpy(&d, &b[ib].d, sizeof(float));
    for (int j = 0; j < QK_K; ++j) dst[j] = d * float(b[ib].qs[j]);
  }
}

// ============================== quantization ============================================

void quantize_row_f32_ref(const float* src, void* dst, int64_t n) {
  std::memcpy(dst, src, size_t(n) * sizeof(float));
}

void quantize_row_f16_ref(const float* src, void* dst, int64_t n) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = f2h(src[i]);
    std::memcpy(p + 2 * i, &h, 2);
  }
}

void quantize_row_bf16_ref(const float* src, void* dst, int64_t n) {
  uint8_t* p = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = fp32_to_bf16(src[i]);
    std::memcpy(p + 2 * i, &h, 2);
  }
}

void quantize_row_q4_0_ref(const float* src, void* dst, int64_t n) {
  block_q4_0* b = static_cast<block_q4_0*>(dst);
  for (int64_t ib = 0; ib < n / QK4_0; ++ib, src += QK4_0) {
    const float vmax = signed_absmax(src, QK4_0);
    const float d = vmax / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[ib].d = f2h(d);
    for (int j = 0; j < QK4_0 / 2; ++j) {
      const int q0 = std::min(15, int(src[j] * id + 8.5f));
      const int q1 = std::min(15, int(src[j + QK4_0 / 2] * id + 8.5f));
      b[ib].qs[j] = uint8_t(q0 | (q1 << 4));
    }
  }
}

void quantize_row_q4_1_ref(const float* src, void* dst, int64_t n) {
  block_q4_1* b = static_cast<block_q4_1*>(dst);
  for (int64_t ib = 0; ib < n / QK4_1; ++ib, src += QK4_1) {
    float vmin = src[0], vmax = src[0];
    for (int j = 1; j < QK4_1; ++j) {
      vmin = std::min(vmin, src[j]);
      vmax = std::max(vmax, src[j]);
    }
    const float d = (vmax - vmin) / 15.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[ib].d = f2h(d);
    b[ib].m = f2h(vmin);
    for (int j = 0; j < QK4_1 / 2; ++j) {
      const int q0 = std::min(15, int((src[j] - vmin) * id + 0.5f));
      const int q1 = std::min(15, int((src[j + QK4_1 / 2] - vmin) * id + 0.5f));
      b[ib].qs[j] = uint8_t(q0 | (q1 << 4));
    }
  }
}

void quantize_row_q5_0_ref(const float* src, void* dst, int64_t n) {
  block_q5_0* b = static_cast<block_q5_0*>(dst);
  for (int64_t ib = 0; ib < n / QK5_0; ++ib, src += QK5_0) {
    const float vmax = signed_absmax(src, QK5_0);
    const float d = vmax / -16.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[ib].d = f2h(d);
    uint32_t qh = 0;
    for (int j = 0; j < QK5_0 / 2; ++j) {
      const int q0 = std::min(31, int(src[j] * id + 16.5f));
      const int q1 = std::min(31, int(src[j + QK5_0 / 2] * id + 16.5f));
      b[ib].qs[j] = uint8_t((q0 & 0x0F) | ((q1 & 0x0F) << 4));
      qh |= uint32_t((q0 >> 4) & 1) << j;
      qh |= uint32_t((q1 >> 4) & 1) << (j + QK5_0 / 2);
    }
    std::memcpy(b[ib].qh, &qh, 4);
  }
}

void quantize_row_q5_1_ref(const float* src, void* dst, int64_t n) {
  block_q5_1* b = static_cast<block_q5_1*>(dst);
  for (int64_t ib = 0; ib < n / QK5_1; ++ib, src += QK5_1) {
    float vmin = src[0], vmax = src[0];
    for (int j = 1; j < QK5_1; ++j) {
      vmin = std::min(vmin, src[j]);
      vmax = std::max(vmax, src[j]);
    }
    const float d = (vmax - vmin) / 31.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[ib].d = f2h(d);
    b[ib].m = f2h(vmin);
    uint32_t qh = 0;
    for (int j = 0; j < QK5_1 / 2; ++j) {
      const int q0 = std::min(31, int((src[j] - vmin) * id + 0.5f));
      const int q1 = std::min(31, int((src[j + QK5_1 / 2] - vmin) * id + 0.5f));
      b[ib].qs[j] = uint8_t((q0 & 0x0F) | ((q1 & 0x0F) << 4));
      qh |= uint32_t((q0 >> 4) & 1) << j;
      qh |= uint32_t((q1 >> 4) & 1) << (j + QK5_1 / 2);
    }
    std::memcpy(b[ib].qh, &qh, 4);
  }
}

void quantize_row_q8_0_ref(const float* src, void* dst, int64_t n) {
  block_q8_0* b = static_cast<block_q8_0*>(dst);
  for (int64_t ib = 0; ib < n / QK8_0; ++ib, src += QK8_0) {
    float amax = 0.0f;
    for (int j = 0; j < QK8_0; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    b[ib].d = f2h(d);
    for (int j = 0; j < QK8_0; ++j) b[ib].qs[j] = int8_t(std::roundf(src[j] * id));
  }
}

void quantize_row_q8_1_ref(const float* src, void* dst, int64_t n) {
  block_q8_1* b = static_cast<block_q8_1*>(dst);
  for (int64_t ib = 0; ib < n / QK8_1; ++ib, src += QK8_1) {
    float amax = 0.0f;
    for (int j = 0; j < QK8_1; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK8_1; ++j) {
      const int q = int(std::roundf(src[j] * id));
      b[ib].qs[j] = int8_t(q);
      sum += q;
    }
    b[ib].d = f2h(d);
    b[ib].s = f2h(float(sum) * d);
  }
}

void quantize_row_q8_K_ref(const float* src, void* dst, int64_t n) {
  block_q8_K* b = static_cast<block_q8_K*>(dst);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, src += QK_K) {
    const float vmax = signed_absmax(src, QK_K);
    block_q8_K& y = b[ib];
    if (vmax == 0.0f) {
      const float zero = 0.0f;
      std::memcpy(&y.d, &zero, sizeof(float));
      std::memset(y.qs, 0, sizeof(y.qs));
      std::memset(y.bsums, 0, sizeof(y.bsums));
      continue;
    }
    const float iscale = -127.0f / vmax;
    for (int j = 0; j < QK_K; ++j) y.qs[j] = int8_t(round_clamp(iscale * src[j], -128, 127));
    for (int g = 0; g < QK_K / 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += y.qs[g * 16 + j];
      y.bsums[g] = int16_t(s);
    }
    const float d = 1.0f / iscale;
    std::memcpy(&y.d, &d, sizeof(float));
  }
}

void quantize_row_q2_K_ref(const float* src, void* dst, int64_t n) {
  block_q2_K* b = static_cast<block_q2_K*>(dst);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, src += QK_K) {
    int sc[16], mn[16];
    uint8_t q[QK_K];
    quantize_asym_superblock(src, 16, 3, 15, &b[ib].d, &b[ib].dmin, sc, mn, q);
    for (int j = 0; j < 16; ++j) b[ib].scales[j] = uint8_t(sc[j] | (mn[j] << 4));
    std::memset(b[ib].qs, 0, sizeof(b[ib].qs));
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      b[ib].qs[h * 32 + l] |= uint8_t(q[e] << (2 * s));
    }
  }
}

void quantize_row_q3_K_ref(const float* src, void* dst, int64_t n) {
  block_q3_K* b = static_cast<block_q3_K*>(dst);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, src += QK_K) {
    int sc[16], q[QK_K];
    b[ib].d = quantize_sym_superblock(src, 16, -4, 3, -32, 31, sc, q);
    std::memset(b[ib].scales, 0, sizeof(b[ib].scales));
    for (int k = 0; k < 16; ++k) set_scale_q3_K(k, b[ib].scales, sc[k]);
    std::memset(b[ib].qs, 0, sizeof(b[ib].qs));
    std::memset(b[ib].hmask, 0, sizeof(b[ib].hmask));
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, s = (e / 32) % 4, l = e % 32;
      const int u = q[e] + 4;  // 0..7; the high bit set means "no -4 offset"
      b[ib].qs[h * 32 + l] |= uint8_t((u & 3) << (2 * s));
      b[ib].hmask[l] |= uint8_t(((u >> 2) & 1) << (h * 4 + s));
    }
  }
}

void quantize_row_q4_K_ref(const float* src, void* dst, int64_t n) {
  block_q4_K* b = static_cast<block_q4_K*>(dst);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, src += QK_K) {
    int sc[8], mn[8];
    uint8_t q[QK_K];
    quantize_asym_superblock(src, 32, 15, 63, &b[ib].d, &b[ib].dmin, sc, mn, q);
    std::memset(b[ib].scales, 0, sizeof(b[ib].scales));
    for (int j = 0; j < 8; ++j) set_scale_min_k4(j, b[ib].scales, sc[j], mn[j]);
    std::memset(b[ib].qs, 0, sizeof(b[ib].qs));
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l)
        b[ib].qs[(j / 2) * 32 + l] |= uint8_t(q[j * 32 + l] << (4 * (j % 2)));
  }
}

void quantize_row_q5_K_ref(const float* src, void* dst, int64_t n) {
  block_q5_K* b = static_cast<block_q5_K*>(dst);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, src += QK_K) {
    int sc[8], mn[8];
    uint8_t q[QK_K];
    quantize_asym_superblock(src, 32, 31, 63, &b[ib].d, &b[ib].dmin, sc, mn, q);
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

void quantize_row_q6_K_ref(const float* src, void* dst, int64_t n) {
  block_q6_K* b = static_cast<block_q6_K*>(dst);
  for (int64_t ib = 0; ib < n / QK_K; ++ib, src += QK_K) {
    int sc[16], q[QK_K];
    b[ib].d = quantize_sym_superblock(src, 16, -32, 31, -128, 127, sc, q);
    for (int k = 0; k < 16; ++k) b[ib].scales[k] = int8_t(sc[k]);
    std::memset(b[ib].ql, 0, sizeof(b[ib].ql));
    std::memset(b[ib].qh, 0, sizeof(b[ib].qh));
    for (int e = 0; e < QK_K; ++e) {
      const int h = e / 128, r = e % 128;
      const int u = q[e] + 32;  // 0..63
      b[ib].ql[h * 64 + r % 64] |= uint8_t((u & 0x0F) << (4 * (r / 64)));
      b[ib].qh[h * 32 + r % 32] |= uint8_t(((u >> 4) & 3) << (2 * (r / 32)));
    }
  }
}

}  // namespace tf
