// aarch64 kernels of the K-quants (Q2_K .. Q6_K), one build per ISA level (neon_common.h).
// Q4_K and Q6_K have fused single-column kernels (token generation: the block is never
// stored) and NEON block decoders for the multi-column drivers; Q2_K, Q3_K and Q5_K have NEON
// block decoders for the shared drivers. The scalar reference is kernels_scalar.cpp's matmul_k.
#pragma once
#include "backend/cpu/arm/drivers.h"
#include "core/half.h"
#include "quant/blocks.h"

namespace tf::cpu::detail {
namespace {

// ---- Q4_K -------------------------------------------------------------------------------

// The eight 6-bit scales and mins of a Q4_K / Q5_K block (12 packed bytes): bytes 0..3 hold
// scales 0..3 (low 6 bits) and the top 2 bits of scales 4..7, bytes 4..7 the same for the
// mins, bytes 8..11 the low nibbles (scales 4..7) and high nibbles (mins 4..7).
inline void q4k_scales_mins(const uint8_t* s12, uint8x8_t* sc, uint8x8_t* mn) {
  uint32_t a0, a1, a2;
  std::memcpy(&a0, s12, 4);
  std::memcpy(&a1, s12 + 4, 4);
  std::memcpy(&a2, s12 + 8, 4);
  const uint32_t sc_lo = a0 & 0x3f3f3f3fu, mn_lo = a1 & 0x3f3f3f3fu;
  const uint32_t sc_hi = (a2 & 0x0f0f0f0fu) | (((a0 >> 6) & 0x03030303u) << 4);
  const uint32_t mn_hi = ((a2 >> 4) & 0x0f0f0f0fu) | (((a1 >> 6) & 0x03030303u) << 4);
  *sc = vcreate_u8(uint64_t(sc_lo) | uint64_t(sc_hi) << 32);
  *mn = vcreate_u8(uint64_t(mn_lo) | uint64_t(mn_hi) << 32);
}

void decode_q4k(const uint8_t* p, ArmBlock256* u) {
  const auto* b = reinterpret_cast<const block_q4_K*>(p);
  const uint8x16_t m4 = vdupq_n_u8(0x0F);
  for (int i = 0; i < 4; ++i) {  // sub-blocks 2i (low nibbles) and 2i+1 (high nibbles)
    const uint8x16_t v0 = vld1q_u8(b->qs + 32 * i), v1 = vld1q_u8(b->qs + 32 * i + 16);
    vst1q_u8(reinterpret_cast<uint8_t*>(u->v.q) + 64 * i, vandq_u8(v0, m4));
    vst1q_u8(reinterpret_cast<uint8_t*>(u->v.q) + 64 * i + 16, vandq_u8(v1, m4));
    vst1q_u8(reinterpret_cast<uint8_t*>(u->v.q) + 64 * i + 32, vshrq_n_u8(v0, 4));
    vst1q_u8(reinterpret_cast<uint8_t*>(u->v.q) + 64 * i + 48, vshrq_n_u8(v1, 4));
  }
  uint8x8_t sc, mn;
  q4k_scales_mins(b->scales, &sc, &mn);
  const uint8x8x2_t s2 = vzip_u8(sc, sc), m2 = vzip_u8(mn, mn);  // one per 16 values
  vst1q_s16(u->v.sc, vreinterpretq_s16_u16(vmovl_u8(s2.val[0])));
  vst1q_s16(u->v.sc + 8, vreinterpretq_s16_u16(vmovl_u8(s2.val[1])));
  vst1q_s16(u->mn, vreinterpretq_s16_u16(vmovl_u8(m2.val[0])));
  vst1q_s16(u->mn + 8, vreinterpretq_s16_u16(vmovl_u8(m2.val[1])));
  u->v.d = h2f(b->d);
  u->dmin = h2f(b->dmin);
}

// The 2-bit fields of a Q2_K / Q3_K block's qs: value 128h + 32j + l is bits 2j..2j+1 of
// qs[32h + l]; out[8h + 2j + t] holds values 128h + 32j + 16t .. + 15.
inline void k2_fields(const uint8_t* qs, uint8x16_t out[16]) {
  const uint8x16_t m3 = vdupq_n_u8(3);
  for (int h = 0; h < 2; ++h) {
    const uint8x16_t v0 = vld1q_u8(qs + 32 * h), v1 = vld1q_u8(qs + 32 * h + 16);
    out[8 * h + 0] = vandq_u8(v0, m3);
    out[8 * h + 1] = vandq_u8(v1, m3);
    out[8 * h + 2] = vandq_u8(vshrq_n_u8(v0, 2), m3);
    out[8 * h + 3] = vandq_u8(vshrq_n_u8(v1, 2), m3);
    out[8 * h + 4] = vandq_u8(vshrq_n_u8(v0, 4), m3);
    out[8 * h + 5] = vandq_u8(vshrq_n_u8(v1, 4), m3);
    out[8 * h + 6] = vshrq_n_u8(v0, 6);
    out[8 * h + 7] = vshrq_n_u8(v1, 6);
  }
}

// Q2_K: q in 0..3 with a 4-bit scale and a 4-bit min per 16 values.
void decode_q2k(const uint8_t* p, ArmBlock256* u) {
  const auto* b = reinterpret_cast<const block_q2_K*>(p);
  uint8x16_t f[16];
  k2_fields(b->qs, f);
  for (int i = 0; i < 16; ++i) vst1q_u8(reinterpret_cast<uint8_t*>(u->v.q) + 16 * i, f[i]);
  const uint8x16_t s = vld1q_u8(b->scales);
  const uint8x16_t sc = vandq_u8(s, vdupq_n_u8(0x0F)), mn = vshrq_n_u8(s, 4);
  vst1q_s16(u->v.sc, vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(sc))));
  vst1q_s16(u->v.sc + 8, vreinterpretq_s16_u16(vmovl_high_u8(sc)));
  vst1q_s16(u->mn, vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(mn))));
  vst1q_s16(u->mn + 8, vreinterpretq_s16_u16(vmovl_high_u8(mn)));
  u->v.d = h2f(b->d);
  u->dmin = h2f(b->dmin);
}

// Q3_K: the 2-bit field plus a third bit from hmask (bit 4h + j of hmask[l] for value
// 128h + 32j + l), stored signed (q - 4) with the 6-bit signed scales: no min term.
void decode_q3k(const uint8_t* p, ArmBlock256* u) {
  const auto* b = reinterpret_cast<const block_q3_K*>(p);
  uint8x16_t f[16];
  k2_fields(b->qs, f);
  const uint8x16_t h0 = vld1q_u8(b->hmask), h1 = vld1q_u8(b->hmask + 16);
  const uint8x16_t b2 = vdupq_n_u8(4);
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j) {
      const uint8x16_t bit = vdupq_n_u8(uint8_t(1u << (4 * h + j)));
      for (int t = 0; t < 2; ++t) {
        const uint8x16_t hb = vandq_u8(vtstq_u8(t ? h1 : h0, bit), b2);
        const int i = 8 * h + 2 * j + t;
        vst1q_s8(u->v.q + 16 * i, vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(f[i], hb)), vdupq_n_s8(4)));
      }
    }
  KUnpacked k;
  k_scales(GgmlType::Q3_K, p, &k);  // the 12-byte 6-bit scale packing: scalar, once per block
  std::memcpy(u->v.sc, k.sc, sizeof(k.sc));
  u->v.d = k.d;
}

// Q5_K: Q4_K's nibbles and scales plus a fifth bit per value (qh[l] bit s for value l of
// sub-block s, l < 32).
void decode_q5k(const uint8_t* p, ArmBlock256* u) {
  const auto* b = reinterpret_cast<const block_q5_K*>(p);
  const uint8x16_t m4 = vdupq_n_u8(0x0F), b4 = vdupq_n_u8(0x10);
  const uint8x16_t h0 = vld1q_u8(b->qh), h1 = vld1q_u8(b->qh + 16);
  uint8_t* q = reinterpret_cast<uint8_t*>(u->v.q);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // sub-blocks 2i (low nibbles) and 2i+1 (high nibbles)
    const uint8x16_t v0 = vld1q_u8(b->qs + 32 * i), v1 = vld1q_u8(b->qs + 32 * i + 16);
    const uint8x16_t lo_bit = vdupq_n_u8(uint8_t(1u << (2 * i))), hi_bit = vdupq_n_u8(uint8_t(2u << (2 * i)));
    vst1q_u8(q + 64 * i, vorrq_u8(vandq_u8(v0, m4), vandq_u8(vtstq_u8(h0, lo_bit), b4)));
    vst1q_u8(q + 64 * i + 16, vorrq_u8(vandq_u8(v1, m4), vandq_u8(vtstq_u8(h1, lo_bit), b4)));
    vst1q_u8(q + 64 * i + 32, vorrq_u8(vshrq_n_u8(v0, 4), vandq_u8(vtstq_u8(h0, hi_bit), b4)));
    vst1q_u8(q + 64 * i + 48, vorrq_u8(vshrq_n_u8(v1, 4), vandq_u8(vtstq_u8(h1, hi_bit), b4)));
  }
  uint8x8_t sc, mn;
  q4k_scales_mins(b->scales, &sc, &mn);
  const uint8x8x2_t s2 = vzip_u8(sc, sc), m2 = vzip_u8(mn, mn);
  vst1q_s16(u->v.sc, vreinterpretq_s16_u16(vmovl_u8(s2.val[0])));
  vst1q_s16(u->v.sc + 8, vreinterpretq_s16_u16(vmovl_u8(s2.val[1])));
  vst1q_s16(u->mn, vreinterpretq_s16_u16(vmovl_u8(m2.val[0])));
  vst1q_s16(u->mn + 8, vreinterpretq_s16_u16(vmovl_u8(m2.val[1])));
  u->v.d = h2f(b->d);
  u->dmin = h2f(b->dmin);
}

// One Q4_K block against one activation block, the integer part of the fused single-column
// loop: tot lanes sum to sum(scale * q * x), msum lanes to sum(min * activation sums).
inline void q4k_block_int(const uint8_t* blk, const ActK& a, int32x4_t* tot_out, int32x4_t* msum_out) {
  const auto* b = reinterpret_cast<const block_q4_K*>(blk);
  uint8x8_t sc8, mn8;
  q4k_scales_mins(b->scales, &sc8, &mn8);
  const int16x8_t bs = vpaddq_s16(vld1q_s16(a.bsums), vld1q_s16(a.bsums + 8));  // 32-value sums
  const int16x8_t mn = vreinterpretq_s16_u16(vmovl_u8(mn8));
  *msum_out = vmlal_high_s16(vmull_s16(vget_low_s16(bs), vget_low_s16(mn)), bs, mn);
  const int16x8_t sc = vreinterpretq_s16_u16(vmovl_u8(sc8));
  const uint8x16_t m4 = vdupq_n_u8(0x0F);
  const int32x4_t z = vdupq_n_s32(0);
  int32x4_t p[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const uint8x16_t v0 = vld1q_u8(b->qs + 32 * i), v1 = vld1q_u8(b->qs + 32 * i + 16);
    const int8_t* x = a.qs + 64 * i;
    p[2 * i] = dot16(dot16(z, vreinterpretq_s8_u8(vandq_u8(v0, m4)), vld1q_s8(x)),
                     vreinterpretq_s8_u8(vandq_u8(v1, m4)), vld1q_s8(x + 16));
    p[2 * i + 1] = dot16(dot16(z, vreinterpretq_s8_u8(vshrq_n_u8(v0, 4)), vld1q_s8(x + 32)),
                         vreinterpretq_s8_u8(vshrq_n_u8(v1, 4)), vld1q_s8(x + 48));
  }
  const int32x4_t tot = vmulq_s32(sum4(p[0], p[1], p[2], p[3]), vmovl_s16(vget_low_s16(sc)));
  *tot_out = vmlaq_s32(tot, sum4(p[4], p[5], p[6], p[7]), vmovl_high_s16(sc));
}

void matmul_q4k(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                int64_t ncols, float* y, int64_t ldy) {
  if (ncols == 1) return gemv256x4<sizeof(block_q4_K), q4k_block_int, true, 0, 0, 2>(k, w, ws, r0, r1, xq, y);
  matmul_a256<decode_q4k, sizeof(block_q4_K), true, true>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

// ---- Q6_K -------------------------------------------------------------------------------

// The eight 16-byte vectors of 6-bit values (0..63) of one 128-value half: ql 64 bytes, qh 32.
inline void q6k_half(const uint8_t* ql, const uint8_t* qh, uint8x16_t v[8]) {
  const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(0x30);
  const uint8x16_t h0 = vld1q_u8(qh), h1 = vld1q_u8(qh + 16);
  const uint8x16_t l0 = vld1q_u8(ql), l1 = vld1q_u8(ql + 16), l2 = vld1q_u8(ql + 32), l3 = vld1q_u8(ql + 48);
  v[0] = vorrq_u8(vandq_u8(l0, m4), vandq_u8(vshlq_n_u8(h0, 4), m3));
  v[1] = vorrq_u8(vandq_u8(l1, m4), vandq_u8(vshlq_n_u8(h1, 4), m3));
  v[2] = vorrq_u8(vandq_u8(l2, m4), vandq_u8(vshlq_n_u8(h0, 2), m3));
  v[3] = vorrq_u8(vandq_u8(l3, m4), vandq_u8(vshlq_n_u8(h1, 2), m3));
  v[4] = vorrq_u8(vshrq_n_u8(l0, 4), vandq_u8(h0, m3));
  v[5] = vorrq_u8(vshrq_n_u8(l1, 4), vandq_u8(h1, m3));
  v[6] = vorrq_u8(vshrq_n_u8(l2, 4), vandq_u8(vshrq_n_u8(h0, 2), m3));
  v[7] = vorrq_u8(vshrq_n_u8(l3, 4), vandq_u8(vshrq_n_u8(h1, 2), m3));
}

// Signed values q - 32 and the int8 scales: no min term.
void decode_q6k(const uint8_t* p, ArmBlock256* u) {
  const auto* b = reinterpret_cast<const block_q6_K*>(p);
  const int8x16_t off = vdupq_n_s8(32);
  for (int h = 0; h < 2; ++h) {
    uint8x16_t v[8];
    q6k_half(b->ql + 64 * h, b->qh + 32 * h, v);
    for (int i = 0; i < 8; ++i) vst1q_s8(u->v.q + 128 * h + 16 * i, vsubq_s8(vreinterpretq_s8_u8(v[i]), off));
  }
  const int8x16_t sc = vld1q_s8(b->scales);
  vst1q_s16(u->v.sc, vmovl_s8(vget_low_s8(sc)));
  vst1q_s16(u->v.sc + 8, vmovl_high_s8(sc));
  u->v.d = h2f(b->d);
}

// Unsigned values (0..63) in the dot products; the -32 offset comes back through the
// activation sums: sum sc * (q - 32) * x = sum sc * q * x - 32 * sum sc * bsum.
inline float q6k_block_dot(const uint8_t* blk, const ActK& a) {
  const auto* b = reinterpret_cast<const block_q6_K*>(blk);
  const int8x16_t sc8 = vld1q_s8(b->scales);
  const int16x8_t sc_lo = vmovl_s8(vget_low_s8(sc8)), sc_hi = vmovl_high_s8(sc8);
  const int16x8_t bs0 = vld1q_s16(a.bsums), bs1 = vld1q_s16(a.bsums + 8);
  int32x4_t off = vmull_s16(vget_low_s16(sc_lo), vget_low_s16(bs0));
  off = vmlal_high_s16(off, sc_lo, bs0);
  off = vmlal_s16(off, vget_low_s16(sc_hi), vget_low_s16(bs1));
  off = vmlal_high_s16(off, sc_hi, bs1);
  const int32x4_t z = vdupq_n_s32(0);
  int32x4_t tot = z;
  for (int h = 0; h < 2; ++h) {
    uint8x16_t v[8];
    q6k_half(b->ql + 64 * h, b->qh + 32 * h, v);
    const int8_t* x = a.qs + 128 * h;
    int32x4_t p[8];
    for (int i = 0; i < 8; ++i) p[i] = dot16(z, vreinterpretq_s8_u8(v[i]), vld1q_s8(x + 16 * i));
    const int16x8_t sc = h ? sc_hi : sc_lo;
    tot = vmlaq_s32(tot, sum4(p[0], p[1], p[2], p[3]), vmovl_s16(vget_low_s16(sc)));
    tot = vmlaq_s32(tot, sum4(p[4], p[5], p[6], p[7]), vmovl_high_s16(sc));
  }
  tot = vsubq_s32(tot, vshlq_n_s32(off, 5));
  return h2f(b->d) * a.d * float(vaddvq_s32(tot));
}

void matmul_q6k(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                int64_t ncols, float* y, int64_t ldy) {
  if (ncols == 1) return gemv256<sizeof(block_q6_K), q6k_block_dot>(k, w, ws, r0, r1, xq, y);
  matmul_a256<decode_q6k, sizeof(block_q6_K), false>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

void matmul_q2k(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                int64_t ncols, float* y, int64_t ldy) {
  matmul_a256<decode_q2k, sizeof(block_q2_K), true>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

void matmul_q3k(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                int64_t ncols, float* y, int64_t ldy) {
  matmul_a256<decode_q3k, sizeof(block_q3_K), false>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

void matmul_q5k(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                int64_t ncols, float* y, int64_t ldy) {
  matmul_a256<decode_q5k, sizeof(block_q5_K), true, true>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}


}  // namespace
}  // namespace tf::cpu::detail
