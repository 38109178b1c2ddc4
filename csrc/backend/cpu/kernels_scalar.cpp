// Portable scalar kernels: the reference semantics every vector path must reproduce (up to
// float summation order). Compiled without ISA flags.
#include <cmath>
#include <limits>
#include <cstring>

#include "backend/cpu/kernels_internal.h"
#include "core/half.h"
#include "quant/blocks.h"

namespace tf::cpu::detail {


// ---------------------------------------------------------------------------------------
// Activation quantization (symmetric, q in [-127, 127], ties to even like cvtps2dq).

namespace {

inline int8_t q8(float v, float id) { return int8_t(int(std::nearbyint(v * id))); }

void quant_block_f(const float* x, int n, int8_t* q, float* d_out, int* sum_out) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    amax = std::fmax(amax, std::fabs(x[i]));
    finite = finite && std::isfinite(x[i]);
  }
  if (!finite) {
    // NaN/inf activations: a NaN scale carries the poison into every dot product instead of
    // converting non-finite values to integers (undefined) or wrapping the integer sum.
    std::memset(q, 0, size_t(n));
    *d_out = std::numeric_limits<float>::quiet_NaN();
    *sum_out = 0;
    return;
  }
  const float d = amax / 127.f;
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int i = 0; i < n; ++i) {
    q[i] = q8(x[i], id);
    sum += q[i];
  }
  *d_out = d;
  *sum_out = sum;
}

}  // namespace

void quantize_scalar(ActKind kind, const float* x, void* xq, int64_t k) {
  quantize_row_with(kind, x, xq, k, quant_block_f);
}

// ---------------------------------------------------------------------------------------
// K-quant decomposition.

namespace {
inline void scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}
}  // namespace

void k_scales(GgmlType wt, const void* blk, KUnpacked* u) {
  switch (wt) {
    case GgmlType::Q2_K: {
      const auto* b = static_cast<const block_q2_K*>(blk);
      u->d = fp16_to_fp32(b->d);
      u->dmin = fp16_to_fp32(b->dmin);
      for (int j = 0; j < 16; ++j) {
        u->sc[j] = int16_t(b->scales[j] & 0xF);
        u->mn[j] = int16_t(b->scales[j] >> 4);
      }
      break;
    }
    case GgmlType::Q3_K: {
      const auto* b = static_cast<const block_q3_K*>(blk);
      uint32_t aux[4];
      std::memcpy(aux, b->scales, 12);
      const uint32_t tmp = aux[2];
      const uint32_t m1 = 0x03030303u, m2 = 0x0f0f0f0fu;
      aux[2] = ((aux[0] >> 4) & m2) | (((tmp >> 4) & m1) << 4);
      aux[3] = ((aux[1] >> 4) & m2) | (((tmp >> 6) & m1) << 4);
      aux[0] = (aux[0] & m2) | (((tmp >> 0) & m1) << 4);
      aux[1] = (aux[1] & m2) | (((tmp >> 2) & m1) << 4);
      const auto* s6 = reinterpret_cast<const uint8_t*>(aux);
      u->d = fp16_to_fp32(b->d);
      u->dmin = u->d;
      for (int j = 0; j < 16; ++j) {
        const int s = int(s6[j]) - 32;
        u->sc[j] = int16_t(s);
        u->mn[j] = int16_t(4 * s);
      }
      break;
    }
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: {
      const uint8_t* scales;
      uint16_t d, dmin;
      if (wt == GgmlType::Q4_K) {
        const auto* b = static_cast<const block_q4_K*>(blk);
        scales = b->scales; d = b->d; dmin = b->dmin;
      } else {
        const auto* b = static_cast<const block_q5_K*>(blk);
        scales = b->scales; d = b->d; dmin = b->dmin;
      }
      u->d = fp16_to_fp32(d);
      u->dmin = fp16_to_fp32(dmin);
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        scale_min_k4(j, scales, &sc, &m);
        u->sc[2 * j] = u->sc[2 * j + 1] = int16_t(sc);
        u->mn[2 * j] = u->mn[2 * j + 1] = int16_t(m);
      }
      break;
    }
    case GgmlType::Q6_K: {
      const auto* b = static_cast<const block_q6_K*>(blk);
      u->d = fp16_to_fp32(b->d);
      u->dmin = u->d;
      for (int j = 0; j < 16; ++j) {
        u->sc[j] = int16_t(b->scales[j]);
        u->mn[j] = int16_t(32 * b->scales[j]);
      }
      break;
    }
    default: break;
  }
}

void k_values(GgmlType wt, const void* blk, uint8_t* q) {
  switch (wt) {
    case GgmlType::Q2_K: {
      const auto* b = static_cast<const block_q2_K*>(blk);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, i = e % 128, j = i / 32, l = i % 32;
        q[e] = uint8_t((b->qs[32 * h + l] >> (2 * j)) & 3);
      }
      break;
    }
    case GgmlType::Q3_K: {
      const auto* b = static_cast<const block_q3_K*>(blk);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, i = e % 128, j = i / 32, l = i % 32;
        const int lo = (b->qs[32 * h + l] >> (2 * j)) & 3;
        const int hb = (b->hmask[l] >> (4 * h + j)) & 1;
        q[e] = uint8_t(lo | (hb << 2));
      }
      break;
    }
    case GgmlType::Q4_K: {
      const auto* b = static_cast<const block_q4_K*>(blk);
      for (int e = 0; e < 256; ++e) {
        const int s = e / 32, l = e % 32;
        const uint8_t byte = b->qs[32 * (s / 2) + l];
        q[e] = uint8_t((s & 1) ? (byte >> 4) : (byte & 0xF));
      }
      break;
    }
    case GgmlType::Q5_K: {
      const auto* b = static_cast<const block_q5_K*>(blk);
      for (int e = 0; e < 256; ++e) {
        const int s = e / 32, l = e % 32;
        const uint8_t byte = b->qs[32 * (s / 2) + l];
        const int lo = (s & 1) ? (byte >> 4) : (byte & 0xF);
        const int hb = (b->qh[l] >> s) & 1;
        q[e] = uint8_t(lo | (hb << 4));
      }
      break;
    }
    case GgmlType::Q6_K: {
      const auto* b = static_cast<const block_q6_K*>(blk);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, i = e % 128, t = i / 32, l = i % 32;
        const uint8_t lb = b->ql[64 * h + l + 32 * (t & 1)];
        const int lo = (t < 2) ? (lb & 0xF) : (lb >> 4);
        const int hi = (b->qh[32 * h + l] >> (2 * t)) & 3;
        q[e] = uint8_t(lo | (hi << 4));
      }
      break;
    }
    default: break;
  }
}

// ---------------------------------------------------------------------------------------
// Matmul kernels.

namespace {

// One 32-value block as unsigned q (0..255), an integer offset (value = q - off) and float
// scale dw plus an optional min (value = dw * (q - off) + m).
struct B32 {
  uint8_t q[32];
  int off;
  float dw, m;
};

template <GgmlType T>
void unpack32(const uint8_t* p, B32* u) {
  if constexpr (T == GgmlType::Q4_0 || T == GgmlType::Q4_1) {
    const uint8_t* qs;
    if constexpr (T == GgmlType::Q4_0) {
      const auto* b = reinterpret_cast<const block_q4_0*>(p);
      u->dw = fp16_to_fp32(b->d); u->m = 0.f; u->off = 8; qs = b->qs;
    } else {
      const auto* b = reinterpret_cast<const block_q4_1*>(p);
      u->dw = fp16_to_fp32(b->d); u->m = fp16_to_fp32(b->m); u->off = 0; qs = b->qs;
    }
    for (int j = 0; j < 16; ++j) {
      u->q[j] = qs[j] & 0xF;
      u->q[j + 16] = qs[j] >> 4;
    }
  } else if constexpr (T == GgmlType::Q5_0 || T == GgmlType::Q5_1) {
    const uint8_t *qs, *qhp;
    if constexpr (T == GgmlType::Q5_0) {
      const auto* b = reinterpret_cast<const block_q5_0*>(p);
      u->dw = fp16_to_fp32(b->d); u->m = 0.f; u->off = 16; qs = b->qs; qhp = b->qh;
    } else {
      const auto* b = reinterpret_cast<const block_q5_1*>(p);
      u->dw = fp16_to_fp32(b->d); u->m = fp16_to_fp32(b->m); u->off = 0; qs = b->qs; qhp = b->qh;
    }
    uint32_t qh;
    std::memcpy(&qh, qhp, 4);
    for (int j = 0; j < 16; ++j) {
      u->q[j] = uint8_t((qs[j] & 0xF) | (((qh >> j) & 1) << 4));
      u->q[j + 16] = uint8_t((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
  } else {  // Q8_0
    const auto* b = reinterpret_cast<const block_q8_0*>(p);
    u->dw = fp16_to_fp32(b->d); u->m = 0.f; u->off = 128;
    for (int j = 0; j < 32; ++j) u->q[j] = uint8_t(int(b->qs[j]) + 128);
  }
}

template <GgmlType T>
void matmul_g32(int64_t k, const void* w, size_t w_stride, int64_t r0, int64_t r1, const void* xq,
                size_t xq_stride, int64_t ncols, float* y, int64_t ldy) {
  const int64_t nb = k / 32, ng = g32_groups(k);
  constexpr size_t bb = block_bytes<T>();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(w) + size_t(r) * w_stride;
    for (int64_t c = 0; c < ncols; ++c) {
      const int8_t* qs = reinterpret_cast<const int8_t*>(static_cast<const uint8_t*>(xq) +
                                                         size_t(c) * xq_stride);
      const float* sc = reinterpret_cast<const float*>(qs + ng * 64);
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        B32 u;
        unpack32<T>(row + size_t(b) * bb, &u);
        const int8_t* x = qs + b * 32;
        int isum = 0;
        for (int j = 0; j < 32; ++j) isum += (int(u.q[j]) - u.off) * int(x[j]);
        const float dx = sc[4 * (b / 2) + (b & 1)], sx = sc[4 * (b / 2) + 2 + (b & 1)];
        acc += u.dw * dx * float(isum) + u.m * sx;
      }
      y[c * ldy + r] = acc;
    }
  }
}

template <GgmlType T>
void matmul_k(int64_t k, const void* w, size_t w_stride, int64_t r0, int64_t r1, const void* xq,
              size_t xq_stride, int64_t ncols, float* y, int64_t ldy) {
  const int64_t nb = k / 256;
  constexpr size_t bb = block_bytes<T>();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(w) + size_t(r) * w_stride;
    for (int64_t c = 0; c < ncols; ++c) {
      const ActK* a = reinterpret_cast<const ActK*>(static_cast<const uint8_t*>(xq) +
                                                    size_t(c) * xq_stride);
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        KUnpacked u;
        uint8_t q[256];
        k_scales(T, row + size_t(b) * bb, &u);
        k_values(T, row + size_t(b) * bb, q);
        int isum = 0, msum = 0;
        for (int j = 0; j < 16; ++j) {
          int s = 0;
          for (int i = 0; i < 16; ++i) s += int(q[16 * j + i]) * int(a[b].qs[16 * j + i]);
          isum += s * u.sc[j];
          msum += int(u.mn[j]) * int(a[b].bsums[j]);
        }
        acc += u.d * a[b].d * float(isum) - u.dmin * a[b].d * float(msum);
      }
      y[c * ldy + r] = acc;
    }
  }
}


template <GgmlType T>
void matmul_float(int64_t k, const void* w, size_t w_stride, int64_t r0, int64_t r1, const void* xq,
                  size_t xq_stride, int64_t ncols, float* y, int64_t ldy) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(w) + size_t(r) * w_stride;
    for (int64_t c = 0; c < ncols; ++c) {
      const float* x = reinterpret_cast<const float*>(static_cast<const uint8_t*>(xq) +
                                                      size_t(c) * xq_stride);
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc += float_weight<T>(row, i) * x[i];
      y[c * ldy + r] = acc;
    }
  }
}

}  // namespace

uint64_t read_bytes(const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  uint64_t acc = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, b + i, 8);
    acc ^= v;
  }
  for (; i < n; ++i) acc ^= b[i];
  return acc;
}

}  // namespace tf::cpu::detail

// Entry points named in the traits table (quant/traits.cpp).
TF_EXPORT_KERNEL(f32, scalar, matmul_float<GgmlType::F32>)
TF_EXPORT_KERNEL(f16, scalar, matmul_float<GgmlType::F16>)
TF_EXPORT_KERNEL(bf16, scalar, matmul_float<GgmlType::BF16>)
TF_EXPORT_KERNEL(q4_0, scalar, matmul_g32<GgmlType::Q4_0>)
TF_EXPORT_KERNEL(q4_1, scalar, matmul_g32<GgmlType::Q4_1>)
TF_EXPORT_KERNEL(q5_0, scalar, matmul_g32<GgmlType::Q5_0>)
TF_EXPORT_KERNEL(q5_1, scalar, matmul_g32<GgmlType::Q5_1>)
TF_EXPORT_KERNEL(q8_0, scalar, matmul_g32<GgmlType::Q8_0>)
TF_EXPORT_KERNEL(q2_k, scalar, matmul_k<GgmlType::Q2_K>)
TF_EXPORT_KERNEL(q3_k, scalar, matmul_k<GgmlType::Q3_K>)
TF_EXPORT_KERNEL(q4_k, scalar, matmul_k<GgmlType::Q4_K>)
TF_EXPORT_KERNEL(q5_k, scalar, matmul_k<GgmlType::Q5_K>)
TF_EXPORT_KERNEL(q6_k, scalar, matmul_k<GgmlType::Q6_K>)
