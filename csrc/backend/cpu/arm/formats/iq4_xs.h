// IQ4_XS on aarch64 (block layout: formats/iq4_xs.cpp). The 16 non-linear levels sit in one
// register and TBL maps 16 nibbles at a time; the fused single-column kernel never stores
// the block, the multi-column drivers get a NEON decoder.
#pragma once
#include "backend/cpu/arm/drivers.h"
#include "core/half.h"
#include "quant/iq_layout.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::detail {
namespace {

// The eight sub-block scales ls - 32 (|s| <= 32).
inline void iq4xs_scales(const uint8_t* b, int32_t s[8]) {
  const uint32_t sl = quant::ld32(b + 4), sh = quant::ld16(b + 2);
  for (int ib = 0; ib < 8; ++ib) s[ib] = int32_t(((sl >> (4 * ib)) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)) - 32;
}

void decode_iq4xs(const uint8_t* b, ArmBlock256* u) {
  const int8x16_t levels = vld1q_s8(iq::kValuesIq4nl);
  int32_t s[8];
  iq4xs_scales(b, s);
  for (int ib = 0; ib < 8; ++ib) {
    const uint8x16_t v = vld1q_u8(b + 8 + 16 * ib);
    vst1q_s8(u->v.q + 32 * ib, vqtbl1q_s8(levels, vandq_u8(v, vdupq_n_u8(0x0F))));
    vst1q_s8(u->v.q + 32 * ib + 16, vqtbl1q_s8(levels, vshrq_n_u8(v, 4)));
    u->v.sc[2 * ib] = u->v.sc[2 * ib + 1] = int16_t(s[ib]);
  }
  u->v.d = h2f(quant::ld16(b));
}

// The eight scales as int32 lanes (0..3, 4..7) without scalar work: low nibbles of scales_l
// interleaved, scales_h's 2-bit fields by per-lane shifts.
inline void iq4xs_scales_v(const uint8_t* b, int32x4_t* s03, int32x4_t* s47) {
  const uint8x8_t sl = vreinterpret_u8_u32(vdup_n_u32(quant::ld32(b + 4)));
  const uint8x8_t lo = vzip1_u8(vand_u8(sl, vdup_n_u8(0x0F)), vshr_n_u8(sl, 4));
  const int16x8_t shifts = {0, -2, -4, -6, -8, -10, -12, -14};
  const uint16x8_t h = vandq_u16(vshlq_u16(vdupq_n_u16(quant::ld16(b + 2)), shifts), vdupq_n_u16(3));
  const int16x8_t v = vsubq_s16(vreinterpretq_s16_u16(vorrq_u16(vmovl_u8(lo), vshlq_n_u16(h, 4))), vdupq_n_s16(32));
  *s03 = vmovl_s16(vget_low_s16(v));
  *s47 = vmovl_high_s16(v);
}

inline float iq4xs_block_dot(const uint8_t* b, const ActK& a) {
  const int8x16_t levels = vld1q_s8(iq::kValuesIq4nl);
  int32x4_t s03, s47;
  iq4xs_scales_v(b, &s03, &s47);
  const int32x4_t z = vdupq_n_s32(0);
  int32x4_t p[8];
#pragma GCC unroll 8
  for (int ib = 0; ib < 8; ++ib) {
    const uint8x16_t v = vld1q_u8(b + 8 + 16 * ib);
    const int8_t* x = a.qs + 32 * ib;
    p[ib] = dot16(dot16(z, vqtbl1q_s8(levels, vandq_u8(v, vdupq_n_u8(0x0F))), vld1q_s8(x)),
                  vqtbl1q_s8(levels, vshrq_n_u8(v, 4)), vld1q_s8(x + 16));
  }
  int32x4_t tot = vmulq_s32(sum4(p[0], p[1], p[2], p[3]), s03);
  tot = vmlaq_s32(tot, sum4(p[4], p[5], p[6], p[7]), s47);
  return h2f(quant::ld16(b)) * a.d * float(vaddvq_s32(tot));
}

void matmul_iq4xs(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                   int64_t ncols, float* y, int64_t ldy) {
  constexpr size_t kBytes = quant::iq4_xs::kBytes;
  if (ncols == 1) return gemv256<kBytes, iq4xs_block_dot>(k, w, ws, r0, r1, xq, y);
  matmul_a256<decode_iq4xs, kBytes, false, true>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

}  // namespace
}  // namespace tf::cpu::detail
