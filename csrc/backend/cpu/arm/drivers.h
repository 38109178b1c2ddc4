// Generic aarch64 matmul drivers for formats that decode block by block into signed int8
// values (the arm counterpart of decoded.h). A format supplies a block decoder; the integer
// dot products, the 2x2 i8mm tiles and the activation repacking are shared here.
//
//   ArmBlock256 (256-value blocks, Q8_256 activations): w[i] = d*sc[i/16]*q[i] - dmin*mn[i/16]
//   ArmBlock32  (32-value blocks, Q8_32 activations):   w[i] = d*q[i] + m
//
// Integer sums are exact (|q|, |x| <= 127 and |sc| <= 127 keep every sum inside int32), so a
// result differs from the scalar reference only by float rounding order.
#pragma once
#include "backend/cpu/arm/neon_common.h"
#include "quant/iq_layout.h"

namespace tf::cpu::detail {
namespace {

struct alignas(64) ArmBlock256 {
  Decoded256 v;      // q, sc, d
  int16_t mn[16];    // min multipliers (K-quants with a min); unused otherwise
  float dmin;
};
using ArmDecode256 = void (*)(const uint8_t* blk, ArmBlock256* u);

struct alignas(32) ArmBlock32 {
  int8_t q[32];
  float d, m;
};
using ArmDecode32 = void (*)(const uint8_t* blk, ArmBlock32* u);

// Adapter for the formats' reference decoders (formats/*.cpp decode_ref): no min.
template <void (*Ref)(const uint8_t*, Decoded256*)>
void decode_ref256(const uint8_t* blk, ArmBlock256* u) { Ref(blk, &u->v); }

// Sum over sub-blocks j of sc[j] * (q . x over sub-block j), for one block and one column.
inline int32_t isum256(const int8_t* q, const int16_t* sc, const int8_t* x) {
  int32x4_t tot = vdupq_n_s32(0);
  const int32x4_t z = vdupq_n_s32(0);
  for (int g = 0; g < 4; ++g) {
    const int8_t* qg = q + 64 * g;
    const int8_t* xg = x + 64 * g;
    const int32x4_t p0 = dot16(z, vld1q_s8(qg), vld1q_s8(xg));
    const int32x4_t p1 = dot16(z, vld1q_s8(qg + 16), vld1q_s8(xg + 16));
    const int32x4_t p2 = dot16(z, vld1q_s8(qg + 32), vld1q_s8(xg + 32));
    const int32x4_t p3 = dot16(z, vld1q_s8(qg + 48), vld1q_s8(xg + 48));
    tot = vmlaq_s32(tot, sum4(p0, p1, p2, p3), vmovl_s16(vld1_s16(sc + 4 * g)));
  }
  return vaddvq_s32(tot);
}

template <bool kMin>
inline float dot256(const ArmBlock256& u, const ActK& a) {
  float r = u.v.d * a.d * float(isum256(u.v.q, u.v.sc, a.qs));
  if (kMin) r -= u.dmin * a.d * float(dot_i16x16(u.mn, a.bsums));
  return r;
}

inline float dot32(const ArmBlock32& u, const int8_t* x, float dx, float sx) {
  const int32x4_t p = dot16(dot16(vdupq_n_s32(0), vld1q_s8(u.q), vld1q_s8(x)), vld1q_s8(u.q + 16), vld1q_s8(x + 16));
  return u.d * dx * float(vaddvq_s32(p)) + u.m * sx;
}

// Q8_32 activation rows: int8 qs[ngroups * 64], then per group floats d0, d1, s0, s1.
struct ActG32 {
  const int8_t* qs;
  const float* sc;
  float d(int64_t b) const { return sc[4 * (b / 2) + (b & 1)]; }
  float s(int64_t b) const { return sc[4 * (b / 2) + 2 + (b & 1)]; }
};
inline ActG32 act_g32(const void* xq, size_t xs, int64_t c, int64_t ng) {
  const int8_t* qs = reinterpret_cast<const int8_t*>(static_cast<const uint8_t*>(xq) + size_t(c) * xs);
  return {qs, reinterpret_cast<const float*>(qs + ng * 64)};
}

// Single-column products (token generation), kRows rows at a time: kRows independent
// accumulation chains per step and the activation loads shared by the inlined block products
// (more rows help short kernels, and cost registers in long ones: chosen per format by
// bench/arm_mca.py). BlockDot(block, activation block) is a format's fused block product.
template <size_t kBytes, float (*BlockDot)(const uint8_t*, const ActK&), int kRows = 1>
void gemv256(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, float* y) {
  const int64_t nb = k / 256;
  const ActK* a = static_cast<const ActK*>(xq);
  const uint8_t* W = static_cast<const uint8_t*>(w);
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) {
    const uint8_t* w0 = W + size_t(r) * ws;
    float s[kRows] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w0 + size_t(b) * kBytes;
      for (int i = 0; i < kRows; ++i) {
        __builtin_prefetch(p + size_t(i) * ws + 1024);
        s[i] += BlockDot(p + size_t(i) * ws, a[b]);
      }
    }
    for (int i = 0; i < kRows; ++i) y[r + i] = s[i];
  }
  for (; r < r1; ++r) {
    const uint8_t* w0 = W + size_t(r) * ws;
    float s0 = 0.f;
    for (int64_t b = 0; b < nb; ++b) s0 += BlockDot(w0 + size_t(b) * kBytes, a[b]);
    y[r] = s0;
  }
}

// fp16 fields at byte offset kOff of the blocks of four rows (ws bytes apart), as floats.
template <int kOff>
inline float32x4_t h4(const uint8_t* p, size_t ws) {
  uint16x4_t h = vld1_dup_u16(reinterpret_cast<const uint16_t*>(p + kOff));
  h = vld1_lane_u16(reinterpret_cast<const uint16_t*>(p + ws + kOff), h, 1);
  h = vld1_lane_u16(reinterpret_cast<const uint16_t*>(p + 2 * ws + kOff), h, 2);
  h = vld1_lane_u16(reinterpret_cast<const uint16_t*>(p + 3 * ws + kOff), h, 3);
  return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

// Single-column product of 256-value blocks, four rows with their results in the lanes of one
// vector: BlockInt(block, activation) gives a row's integer product lanes (tot: sum of
// scale * q * x; msum: sum of min * activation sums, when kMin), reduced across the four rows
// before one conversion; the block scales d (fp16 at kDOff, times 2^-kDShift) and dmin (fp16
// at kDminOff) are loaded for the four rows at once. No horizontal sum per row and block.
template <size_t kBytes, void (*BlockInt)(const uint8_t*, const ActK&, int32x4_t*, int32x4_t*), bool kMin,
          int kDOff, int kDShift, int kDminOff = 0>
void gemv256x4(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, float* y) {
  const int64_t nb = k / 256;
  const ActK* a = static_cast<const ActK*>(xq);
  const uint8_t* W = static_cast<const uint8_t*>(w);
  const float dscale = 1.0f / float(1 << kDShift);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const uint8_t* w0 = W + size_t(r) * ws;
    float32x4_t acc = vdupq_n_f32(0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w0 + size_t(b) * kBytes;
      int32x4_t t[4], m[4];
      for (int i = 0; i < 4; ++i) {
        __builtin_prefetch(p + size_t(i) * ws + 1024);
        BlockInt(p + size_t(i) * ws, a[b], &t[i], &m[i]);
      }
      const float32x4_t d = vmulq_n_f32(h4<kDOff>(p, ws), a[b].d * dscale);
      acc = vfmaq_f32(acc, vcvtq_f32_s32(sum4(t[0], t[1], t[2], t[3])), d);
      if (kMin) {
        const float32x4_t dm = vmulq_n_f32(h4<kDminOff>(p, ws), a[b].d);
        acc = vfmsq_f32(acc, vcvtq_f32_s32(sum4(m[0], m[1], m[2], m[3])), dm);
      }
    }
    vst1q_f32(y + r, acc);
  }
  for (; r < r1; ++r) {
    const uint8_t* w0 = W + size_t(r) * ws;
    float s0 = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w0 + size_t(b) * kBytes;
      int32x4_t t, m;
      BlockInt(p, a[b], &t, &m);
      s0 += h2f(quant::ld16(p + kDOff)) * dscale * a[b].d * float(vaddvq_s32(t));
      if (kMin) s0 -= h2f(quant::ld16(p + kDminOff)) * a[b].d * float(vaddvq_s32(m));
    }
    y[r] = s0;
  }
}

// The same for 32-value blocks (Q8_32 activations), four rows at a time: Dot32 gives a block's
// integer product lanes, Scale4(block, row stride) the four rows' block scales as one vector.
// The four rows' sums are reduced into the four lanes of one vector before the conversion to
// float, so a block costs one int->float conversion for four rows (SCVTF is a narrow port).
template <size_t kBytes, int32x4_t (*Dot32)(const uint8_t*, const int8_t*), float32x4_t (*Scale4)(const uint8_t*, size_t)>
void gemv32(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, float* y) {
  const int64_t nb = k / 32, ng = g32_groups(k);
  const ActG32 a = act_g32(xq, 0, 0, ng);
  const uint8_t* W = static_cast<const uint8_t*>(w);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const uint8_t* w0 = W + size_t(r) * ws;
    float32x4_t e = vdupq_n_f32(0.f), o = e;  // lanes: rows r..r+3; even / odd blocks
    int64_t b = 0;
    const auto block = [&](int64_t bb, float32x4_t acc) {
      const uint8_t* p = w0 + size_t(bb) * kBytes;
      const int8_t* x = a.qs + 32 * bb;
      // No software prefetch: four sequential row streams are what hardware prefetchers follow,
      // and a PRFM per 17- or 34-byte block costs issue slots in this short loop.
      const int32x4_t s = sum4(Dot32(p, x), Dot32(p + ws, x), Dot32(p + 2 * ws, x), Dot32(p + 3 * ws, x));
      return vfmaq_f32(acc, vcvtq_f32_s32(s), vmulq_n_f32(Scale4(p, ws), a.d(bb)));
    };
    for (; b + 2 <= nb; b += 2) {
      e = block(b, e);
      o = block(b + 1, o);
    }
    if (b < nb) e = block(b, e);
    vst1q_f32(y + r, vaddq_f32(e, o));
  }
  for (; r < r1; ++r) {
    const uint8_t* w0 = W + size_t(r) * ws;
    float s = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w0 + size_t(b) * kBytes;
      s += vgetq_lane_f32(Scale4(p, 0), 0) * a.d(b) * float(vaddvq_s32(Dot32(p, a.qs + 32 * b)));
    }
    y[r] = s;
  }
}

#if TF_ARM_LEVEL >= 2
// 16 bytes of row/column 0 and 16 of row/column 1 as the two SMMLA operands covering them:
// {0[0..7], 1[0..7]} and {0[8..15], 1[8..15]}.
inline void zip_pair(int8x16_t a, int8x16_t b, int8x16_t* lo, int8x16_t* hi) {
  const int64x2_t a64 = vreinterpretq_s64_s8(a), b64 = vreinterpretq_s64_s8(b);
  *lo = vreinterpretq_s8_s64(vzip1q_s64(a64, b64));
  *hi = vreinterpretq_s8_s64(vzip2q_s64(a64, b64));
}

// Two decoded rows as SMMLA operands, with per-sub-block scales laid out like the 2x2 result
// lanes [r0c0, r0c1, r1c0, r1c1].
struct Pair256 {
  int8x16_t A[32];
  int32x4_t S[16];
  float32x4_t dd, dm;  // [d0, d0, d1, d1], [dmin0, dmin0, dmin1, dmin1]
};

inline void make_pair256(const ArmBlock256& u0, const ArmBlock256& u1, Pair256& p) {
  for (int j = 0; j < 16; ++j) zip_pair(vld1q_s8(u0.v.q + 16 * j), vld1q_s8(u1.v.q + 16 * j), &p.A[2 * j], &p.A[2 * j + 1]);
  for (int g = 0; g < 4; ++g) {
    const int32x4_t s0 = vmovl_s16(vld1_s16(u0.v.sc + 4 * g)), s1 = vmovl_s16(vld1_s16(u1.v.sc + 4 * g));
    const int64x2_t a01 = vreinterpretq_s64_s32(vzip1q_s32(s0, s0)), b01 = vreinterpretq_s64_s32(vzip1q_s32(s1, s1));
    const int64x2_t a23 = vreinterpretq_s64_s32(vzip2q_s32(s0, s0)), b23 = vreinterpretq_s64_s32(vzip2q_s32(s1, s1));
    p.S[4 * g + 0] = vreinterpretq_s32_s64(vzip1q_s64(a01, b01));
    p.S[4 * g + 1] = vreinterpretq_s32_s64(vzip2q_s64(a01, b01));
    p.S[4 * g + 2] = vreinterpretq_s32_s64(vzip1q_s64(a23, b23));
    p.S[4 * g + 3] = vreinterpretq_s32_s64(vzip2q_s64(a23, b23));
  }
  p.dd = vcombine_f32(vdup_n_f32(u0.v.d), vdup_n_f32(u1.v.d));
  p.dm = vcombine_f32(vdup_n_f32(u0.dmin), vdup_n_f32(u1.dmin));
}

// One column pair's activations of one 256-value block, zipped for SMMLA: the values, the
// 32-value sums (min terms of the per-32 formats) and the scales as [d0, d1, d0, d1].
struct PackK256 {
  int8x16_t B[32];
  int16x8_t bs8[2];
  float32x4_t xd;
};

// Sum over sub-blocks j of S[j] * (2x2 tile of sub-block j), for N column pairs at once (the
// row operands are loaded once for all N). kScale32: the scales come in equal pairs (one per 32
// values: Q4_K, the IQ formats), so 32 values share one multiply-add.
template <bool kScale32, int N>
inline void tile256xn(const Pair256& p, const PackK256* const* X, int32x4_t* out) {
  const int32x4_t z = vdupq_n_s32(0);
  int32x4_t acc[N];
  for (int c = 0; c < N; ++c) acc[c] = z;
  constexpr int step = kScale32 ? 2 : 1;
#pragma GCC unroll 16
  for (int j = 0; j < 16; j += step) {
    int32x4_t t[N];
    for (int c = 0; c < N; ++c) t[c] = vmmlaq_s32(z, p.A[2 * j], X[c]->B[2 * j]);
    for (int i = 1; i < 2 * step; ++i)
      for (int c = 0; c < N; ++c) t[c] = vmmlaq_s32(t[c], p.A[2 * j + i], X[c]->B[2 * j + i]);
    for (int c = 0; c < N; ++c) acc[c] = vmlaq_s32(acc[c], t[c], p.S[j]);
  }
  for (int c = 0; c < N; ++c) out[c] = acc[c];
}

// Columns 2cp, 2cp+1 of every block packed for SMMLA: X[cp * nb + b].
inline const PackK256* repack_act256(const void* xq, size_t xs, int64_t npair, int64_t nb) {
  auto* X = reinterpret_cast<PackK256*>(scratch(size_t(npair * nb) * sizeof(PackK256), 0));
  for (int64_t cp = 0; cp < npair; ++cp) {
    const ActK* a0 = act_k(xq, xs, 2 * cp);
    const ActK* a1 = act_k(xq, xs, 2 * cp + 1);
    for (int64_t b = 0; b < nb; ++b) {
      PackK256& o = X[cp * nb + b];
      for (int j = 0; j < 16; ++j) zip_pair(vld1q_s8(a0[b].qs + 16 * j), vld1q_s8(a1[b].qs + 16 * j), &o.B[2 * j], &o.B[2 * j + 1]);
      o.bs8[0] = vpaddq_s16(vld1q_s16(a0[b].bsums), vld1q_s16(a0[b].bsums + 8));
      o.bs8[1] = vpaddq_s16(vld1q_s16(a1[b].bsums), vld1q_s16(a1[b].bsums + 8));
      const float32x2_t d2 = {a0[b].d, a1[b].d};
      o.xd = vcombine_f32(d2, d2);
    }
  }
  return X;
}

// Min terms of one 2x2 tile, lanes [r0c0, r0c1, r1c0, r1c1]: per-32 mins (8 per row) against
// the packed 32-value sums.
inline int32x4_t min_tile32(int16x8_t mn0, int16x8_t mn1, const PackK256& x) {
  const int32x4_t m00 = vmlal_high_s16(vmull_s16(vget_low_s16(mn0), vget_low_s16(x.bs8[0])), mn0, x.bs8[0]);
  const int32x4_t m01 = vmlal_high_s16(vmull_s16(vget_low_s16(mn0), vget_low_s16(x.bs8[1])), mn0, x.bs8[1]);
  const int32x4_t m10 = vmlal_high_s16(vmull_s16(vget_low_s16(mn1), vget_low_s16(x.bs8[0])), mn1, x.bs8[0]);
  const int32x4_t m11 = vmlal_high_s16(vmull_s16(vget_low_s16(mn1), vget_low_s16(x.bs8[1])), mn1, x.bs8[1]);
  return sum4(m00, m01, m10, m11);
}
#endif

template <ArmDecode256 Decode, size_t kBytes, bool kMin, bool kScale32 = false>
void matmul_a256(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                 int64_t ncols, float* y, int64_t ldy) {
  const int64_t nb = k / 256;
  const uint8_t* W = static_cast<const uint8_t*>(w);
  int64_t r = r0;
#if TF_ARM_LEVEL >= 2
  if (ncols >= 2 && r1 - r0 >= 2) {
    const int64_t npair = ncols / 2;
    const PackK256* X = repack_act256(xq, xs, npair, nb);
    auto* acc = reinterpret_cast<float32x4_t*>(scratch(size_t(npair) * 16, 1));
    const ActK* last = (ncols & 1) ? act_k(xq, xs, ncols - 1) : nullptr;
    // One 2x2 tile's float contribution of block b (column pair cp, integer sums tot).
    const auto finish = [&](const Pair256& p, const ArmBlock256& u0, const ArmBlock256& u1, int16x8_t mn0,
                            int16x8_t mn1, int64_t cp, int64_t b, int32x4_t tot) {
      const PackK256& x = X[cp * nb + b];
      float32x4_t v = vmulq_f32(vcvtq_f32_s32(tot), vmulq_f32(p.dd, x.xd));
      if (kMin) {
        int32x4_t ms;
        if (kScale32) {
          ms = min_tile32(mn0, mn1, x);
        } else {
          const ActK& a0 = act_k(xq, xs, 2 * cp)[b];
          const ActK& a1 = act_k(xq, xs, 2 * cp + 1)[b];
          ms = int32x4_t{dot_i16x16(u0.mn, a0.bsums), dot_i16x16(u0.mn, a1.bsums), dot_i16x16(u1.mn, a0.bsums),
                         dot_i16x16(u1.mn, a1.bsums)};
        }
        v = vmlsq_f32(v, vcvtq_f32_s32(ms), vmulq_f32(p.dm, x.xd));
      }
      acc[cp] = vaddq_f32(acc[cp], v);
    };
    for (; r + 2 <= r1; r += 2) {
      for (int64_t cp = 0; cp < npair; ++cp) acc[cp] = vdupq_n_f32(0.f);
      float odd0 = 0.f, odd1 = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        ArmBlock256 u0, u1;
        Decode(W + size_t(r) * ws + size_t(b) * kBytes, &u0);
        Decode(W + size_t(r + 1) * ws + size_t(b) * kBytes, &u1);
        Pair256 p;
        make_pair256(u0, u1, p);
        int16x8_t mn0 = vdupq_n_s16(0), mn1 = mn0;
        if (kMin && kScale32) {  // per-32 mins: the even entries
          mn0 = vuzp1q_s16(vld1q_s16(u0.mn), vld1q_s16(u0.mn + 8));
          mn1 = vuzp1q_s16(vld1q_s16(u1.mn), vld1q_s16(u1.mn + 8));
        }
        int64_t cp = 0;
        for (; cp + 2 <= npair; cp += 2) {  // two column pairs per load of the row operands
          const PackK256* x2[2] = {&X[cp * nb + b], &X[(cp + 1) * nb + b]};
          int32x4_t t[2];
          tile256xn<kScale32, 2>(p, x2, t);
          finish(p, u0, u1, mn0, mn1, cp, b, t[0]);
          finish(p, u0, u1, mn0, mn1, cp + 1, b, t[1]);
        }
        for (; cp < npair; ++cp) {
          const PackK256* x1[1] = {&X[cp * nb + b]};
          int32x4_t t[1];
          tile256xn<kScale32, 1>(p, x1, t);
          finish(p, u0, u1, mn0, mn1, cp, b, t[0]);
        }
        if (last) {
          odd0 += dot256<kMin>(u0, last[b]);
          odd1 += dot256<kMin>(u1, last[b]);
        }
      }
      for (int64_t cp = 0; cp < npair; ++cp) {
        y[(2 * cp) * ldy + r] = vgetq_lane_f32(acc[cp], 0);
        y[(2 * cp + 1) * ldy + r] = vgetq_lane_f32(acc[cp], 1);
        y[(2 * cp) * ldy + r + 1] = vgetq_lane_f32(acc[cp], 2);
        y[(2 * cp + 1) * ldy + r + 1] = vgetq_lane_f32(acc[cp], 3);
      }
      if (last) {
        y[(ncols - 1) * ldy + r] = odd0;
        y[(ncols - 1) * ldy + r + 1] = odd1;
      }
    }
  }
#endif
  for (; r < r1; ++r) {
    for (int64_t c = 0; c < ncols; ++c) y[c * ldy + r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      ArmBlock256 u;
      Decode(W + size_t(r) * ws + size_t(b) * kBytes, &u);
      for (int64_t c = 0; c < ncols; ++c) y[c * ldy + r] += dot256<kMin>(u, act_k(xq, xs, c)[b]);
    }
  }
}

// One column pair's activations of one 32-value block, zipped for SMMLA, with their scales
// laid out like the 2x2 result lanes.
struct PackG32 {
  int8x16_t B[4];
  float32x4_t xd, xs;  // [d0, d1, d0, d1], [s0, s1, s0, s1]
};

// kMin: the format has a per-block min (w = d*q + m: Q4_1, Q5_1).
template <ArmDecode32 Decode, size_t kBytes, bool kMin>
void matmul_a32(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                int64_t ncols, float* y, int64_t ldy) {
  const int64_t nb = k / 32, ng = g32_groups(k);
  const uint8_t* W = static_cast<const uint8_t*>(w);
  int64_t r = r0;
#if TF_ARM_LEVEL >= 2
  if (ncols >= 2 && r1 - r0 >= 2) {
    const int64_t npair = ncols / 2;
    auto* X = reinterpret_cast<PackG32*>(scratch(size_t(npair * nb) * sizeof(PackG32), 0));
    for (int64_t cp = 0; cp < npair; ++cp) {
      const ActG32 a0 = act_g32(xq, xs, 2 * cp, ng), a1 = act_g32(xq, xs, 2 * cp + 1, ng);
      for (int64_t b = 0; b < nb; ++b) {
        PackG32& o = X[cp * nb + b];
        zip_pair(vld1q_s8(a0.qs + 32 * b), vld1q_s8(a1.qs + 32 * b), &o.B[0], &o.B[1]);
        zip_pair(vld1q_s8(a0.qs + 32 * b + 16), vld1q_s8(a1.qs + 32 * b + 16), &o.B[2], &o.B[3]);
        const float32x2_t d2 = {a0.d(b), a1.d(b)}, s2 = {a0.s(b), a1.s(b)};
        o.xd = vcombine_f32(d2, d2);
        o.xs = vcombine_f32(s2, s2);
      }
    }
    // Each row pair is zipped once for all its blocks; then column pairs two at a time run
    // over the blocks with their accumulators in registers.
    struct PackW32 {
      int8x16_t A[4];
      float32x4_t dd, mm;  // [d0, d0, d1, d1], [m0, m0, m1, m1]
    };
    auto* P = reinterpret_cast<PackW32*>(scratch(size_t(nb) * sizeof(PackW32), 1));
    const ActG32 last = act_g32(xq, xs, ncols - 1, ng);
    const int32x4_t z = vdupq_n_s32(0);
    const auto tile = [&](const PackW32& pw, const PackG32& x, float32x4_t acc) {
      int32x4_t t = vmmlaq_s32(z, pw.A[0], x.B[0]);
      t = vmmlaq_s32(t, pw.A[1], x.B[1]);
      t = vmmlaq_s32(t, pw.A[2], x.B[2]);
      t = vmmlaq_s32(t, pw.A[3], x.B[3]);
      acc = vfmaq_f32(acc, vcvtq_f32_s32(t), vmulq_f32(pw.dd, x.xd));
      if (kMin) acc = vfmaq_f32(acc, pw.mm, x.xs);
      return acc;
    };
    const auto store = [&](int64_t cp, float32x4_t v) {
      y[(2 * cp) * ldy + r] = vgetq_lane_f32(v, 0);
      y[(2 * cp + 1) * ldy + r] = vgetq_lane_f32(v, 1);
      y[(2 * cp) * ldy + r + 1] = vgetq_lane_f32(v, 2);
      y[(2 * cp + 1) * ldy + r + 1] = vgetq_lane_f32(v, 3);
    };
    for (; r + 2 <= r1; r += 2) {
      float odd0 = 0.f, odd1 = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        ArmBlock32 u0, u1;
        Decode(W + size_t(r) * ws + size_t(b) * kBytes, &u0);
        Decode(W + size_t(r + 1) * ws + size_t(b) * kBytes, &u1);
        PackW32& pw = P[b];
        zip_pair(vld1q_s8(u0.q), vld1q_s8(u1.q), &pw.A[0], &pw.A[1]);
        zip_pair(vld1q_s8(u0.q + 16), vld1q_s8(u1.q + 16), &pw.A[2], &pw.A[3]);
        pw.dd = vcombine_f32(vdup_n_f32(u0.d), vdup_n_f32(u1.d));
        pw.mm = vcombine_f32(vdup_n_f32(u0.m), vdup_n_f32(u1.m));
        if (ncols & 1) {
          odd0 += dot32(u0, last.qs + 32 * b, last.d(b), last.s(b));
          odd1 += dot32(u1, last.qs + 32 * b, last.d(b), last.s(b));
        }
      }
      int64_t cp = 0;
      for (; cp + 4 <= npair; cp += 4) {  // four column pairs per load of the row operands
        const PackG32* x0 = X + cp * nb;
        const PackG32* x1 = X + (cp + 1) * nb;
        const PackG32* x2 = X + (cp + 2) * nb;
        const PackG32* x3 = X + (cp + 3) * nb;
        float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t b = 0; b < nb; ++b) {
          a0 = tile(P[b], x0[b], a0);
          a1 = tile(P[b], x1[b], a1);
          a2 = tile(P[b], x2[b], a2);
          a3 = tile(P[b], x3[b], a3);
        }
        store(cp, a0);
        store(cp + 1, a1);
        store(cp + 2, a2);
        store(cp + 3, a3);
      }
      for (; cp + 2 <= npair; cp += 2) {
        const PackG32* x0 = X + cp * nb;
        const PackG32* x1 = X + (cp + 1) * nb;
        float32x4_t e0 = vdupq_n_f32(0.f), e1 = e0;
        for (int64_t b = 0; b < nb; ++b) {
          e0 = tile(P[b], x0[b], e0);
          e1 = tile(P[b], x1[b], e1);
        }
        store(cp, e0);
        store(cp + 1, e1);
      }
      if (cp < npair) {
        float32x4_t e0 = vdupq_n_f32(0.f);
        for (int64_t b = 0; b < nb; ++b) e0 = tile(P[b], X[cp * nb + b], e0);
        store(cp, e0);
      }
      if (ncols & 1) {
        y[(ncols - 1) * ldy + r] = odd0;
        y[(ncols - 1) * ldy + r + 1] = odd1;
      }
    }
  }
#endif
  for (; r < r1; ++r) {
    for (int64_t c = 0; c < ncols; ++c) y[c * ldy + r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      ArmBlock32 u;
      Decode(W + size_t(r) * ws + size_t(b) * kBytes, &u);
      for (int64_t c = 0; c < ncols; ++c) {
        const ActG32 a = act_g32(xq, xs, c, ng);
        y[c * ldy + r] += dot32(u, a.qs + 32 * b, a.d(b), a.s(b));
      }
    }
  }
}

}  // namespace
}  // namespace tf::cpu::detail
