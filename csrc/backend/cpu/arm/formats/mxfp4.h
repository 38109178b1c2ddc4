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

inline int32x4_t mxfp4_dot(const uint8_t* b, const int8_t* x) {
  const int8x16_t levels = vld1q_s8(iq::kValuesMxfp4);
  const uint8x16_t v = vld1q_u8(b + 1);
  return dot16(dot16(vdupq_n_s32(0), vqtbl1q_s8(levels, vandq_u8(v, vdupq_n_u8(0x0F))), vld1q_s8(x)),
               vqtbl1q_s8(levels, vshrq_n_u8(v, 4)), vld1q_s8(x + 16));
}
// The four rows' E8M0 scales (halved, as e8m0_half) as floats: (e - 1) << 23 as the float's
// bits, or the subnormals 2^-128 and 2^-127 (0x00200000 << e) for e = 0, 1.
inline float32x4_t mxfp4_scale4(const uint8_t* b, size_t ws) {
  const uint32x4_t e = {b[0], b[ws], b[2 * ws], b[3 * ws]};
  const uint32x4_t normal = vshlq_n_u32(vsubq_u32(e, vdupq_n_u32(1)), 23);
  const uint32x4_t sub = vshlq_u32(vdupq_n_u32(0x00200000u), vreinterpretq_s32_u32(e));
  return vreinterpretq_f32_u32(vbslq_u32(vcltq_u32(e, vdupq_n_u32(2)), sub, normal));
}

void matmul_mxfp4(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                  int64_t ncols, float* y, int64_t ldy) {
  constexpr size_t kBytes = quant::mxfp4::kBytes;
  if (ncols == 1) return gemv32<kBytes, mxfp4_dot, mxfp4_scale4>(k, w, ws, r0, r1, xq, y);
  matmul_a32<decode_mxfp4, kBytes, false>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

}  // namespace
}  // namespace tf::cpu::detail
