// MXFP4 on aarch64 (block layout: formats/mxfp4.cpp): TBL maps the E2M1 codes to their doubled
// integer values; the E8M0 exponent becomes the float block scale.
#pragma once
#include "backend/cpu/arm/drivers.h"
#include "quant/iq_layout.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::detail {
namespace {

void decode_mxfp4(const uint8_t* b, ArmBlock32* u) {
  const int8x16_t levels = vld1q_s8(iq::kValuesMxfp4);
  const uint8x16_t v = vld1q_u8(b + 1);
  vst1q_s8(u->q, vqtbl1q_s8(levels, vandq_u8(v, vdupq_n_u8(0x0F))));
  vst1q_s8(u->q + 16, vqtbl1q_s8(levels, vshrq_n_u8(v, 4)));
  u->d = quant::mxfp4::e8m0_half(b[0]);
  u->m = 0.f;
}

inline int32x4_t mxfp4_dot(const uint8_t* b, const int8_t* x, int8x16_t levels) {
  const uint8x16_t v = vld1q_u8(b + 1);
  return dot16(dot16(vdupq_n_s32(0), vqtbl1q_s8(levels, vandq_u8(v, vdupq_n_u8(0x0F))), vld1q_s8(x)),
               vqtbl1q_s8(levels, vshrq_n_u8(v, 4)), vld1q_s8(x + 16));
}

void matmul_mxfp4(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                  int64_t ncols, float* y, int64_t ldy) {
  constexpr size_t kBytes = quant::mxfp4::kBytes;
  if (ncols > 1) return matmul_a32<decode_mxfp4, kBytes>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
  const int8x16_t levels = vld1q_s8(iq::kValuesMxfp4);
  const int64_t nb = k / 32, ng = g32_groups(k);
  const ActG32 a = act_g32(xq, 0, 0, ng);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(w) + size_t(r) * ws;
    float32x4_t acc0 = vdupq_n_f32(0.f), acc1 = acc0;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {  // one activation group (two blocks) per step
      const uint8_t* w0 = row + size_t(b) * kBytes;
      __builtin_prefetch(w0 + 1024);
      const float* xd = a.sc + 4 * (b / 2);
      acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(mxfp4_dot(w0, a.qs + 32 * b, levels)), quant::mxfp4::e8m0_half(w0[0]) * xd[0]);
      acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(mxfp4_dot(w0 + kBytes, a.qs + 32 * b + 32, levels)),
                         quant::mxfp4::e8m0_half(w0[kBytes]) * xd[1]);
    }
    float acc = vaddvq_f32(vaddq_f32(acc0, acc1));
    if (b < nb) {
      const uint8_t* w0 = row + size_t(b) * kBytes;
      acc += quant::mxfp4::e8m0_half(w0[0]) * a.d(b) * float(vaddvq_s32(mxfp4_dot(w0, a.qs + 32 * b, levels)));
    }
    y[r] = acc;
  }
}

}  // namespace
}  // namespace tf::cpu::detail
