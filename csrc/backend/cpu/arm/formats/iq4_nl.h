// IQ4_NL on aarch64 (block layout: formats/iq4_nl.cpp): 32 weights per 18-byte block, fp16 d
// and 16 bytes of 4-bit indices into the non-linear levels, mapped by TBL.
#pragma once
#include "backend/cpu/arm/drivers.h"
#include "quant/iq_layout.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::detail {
namespace {

void decode_iq4nl(const uint8_t* b, ArmBlock32* u) {
  const int8x16_t levels = vld1q_s8(iq::kValuesIq4nl);
  const uint8x16_t v = vld1q_u8(b + 2);
  vst1q_s8(u->q, vqtbl1q_s8(levels, vandq_u8(v, vdupq_n_u8(0x0F))));
  vst1q_s8(u->q + 16, vqtbl1q_s8(levels, vshrq_n_u8(v, 4)));
  u->d = h2f(quant::ld16(b));
  u->m = 0.f;
}

inline int32x4_t iq4nl_dot(const uint8_t* b, const int8_t* x) {
  const int8x16_t levels = vld1q_s8(iq::kValuesIq4nl);
  const uint8x16_t v = vld1q_u8(b + 2);
  return dot16(dot16(vdupq_n_s32(0), vqtbl1q_s8(levels, vandq_u8(v, vdupq_n_u8(0x0F))), vld1q_s8(x)),
               vqtbl1q_s8(levels, vshrq_n_u8(v, 4)), vld1q_s8(x + 16));
}

void matmul_iq4nl(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                  int64_t ncols, float* y, int64_t ldy) {
  constexpr size_t kBytes = quant::iq4_nl::kBytes;
  if (ncols == 1) return gemv32<kBytes, iq4nl_dot, h4<0>>(k, w, ws, r0, r1, xq, y);
  matmul_a32<decode_iq4nl, kBytes, false>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

}  // namespace
}  // namespace tf::cpu::detail
