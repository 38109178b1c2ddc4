// IQ2_XXS and IQ3_XXS on aarch64 share their frame: eight sub-blocks of 32 values, each with a
// 4-bit scale (2u + 1) in the top of its sign/scale word, and d = fp16 * 1/div. Only the
// sub-block decoder (Sub) differs.
#pragma once
#include "backend/cpu/arm/drivers.h"
#include "core/half.h"
#include "quant/iq_layout.h"

namespace tf::cpu::detail {
namespace {

using XxsSub = void (*)(const uint8_t* b, int s, int8x16_t* v0, int8x16_t* v1, uint32_t* aux);

template <XxsSub Sub, int Div>
void decode_xxs(const uint8_t* b, ArmBlock256* u) {
  for (int s = 0; s < 8; ++s) {
    int8x16_t v0, v1;
    uint32_t aux;
    Sub(b, s, &v0, &v1, &aux);
    vst1q_s8(u->v.q + 32 * s, v0);
    vst1q_s8(u->v.q + 32 * s + 16, v1);
    u->v.sc[2 * s] = u->v.sc[2 * s + 1] = int16_t(2 * (aux >> 28) + 1);
  }
  u->v.d = h2f(quant::ld16(b)) * (1.0f / Div);
}

template <XxsSub Sub, int Div>
inline float xxs_block_dot(const uint8_t* b, const ActK& a) {
  const int32x4_t z = vdupq_n_s32(0);
  int32x4_t p[8];
  int32_t sc[8];
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
    int8x16_t v0, v1;
    uint32_t aux;
    Sub(b, s, &v0, &v1, &aux);
    p[s] = dot16(dot16(z, v0, vld1q_s8(a.qs + 32 * s)), v1, vld1q_s8(a.qs + 32 * s + 16));
    sc[s] = int32_t(2 * (aux >> 28) + 1);
  }
  int32x4_t tot = vmulq_s32(sum4(p[0], p[1], p[2], p[3]), vld1q_s32(sc));
  tot = vmlaq_s32(tot, sum4(p[4], p[5], p[6], p[7]), vld1q_s32(sc + 4));
  return h2f(quant::ld16(b)) * (1.0f / Div) * a.d * float(vaddvq_s32(tot));
}

}  // namespace
}  // namespace tf::cpu::detail
