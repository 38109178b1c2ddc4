// IQ2_XXS on aarch64 (block layout: formats/iq2_xxs.cpp): per group of 8 weights one grid
// word (magnitudes) and one sign mask; w = (d/8) * (2u + 1) * (±grid).
#pragma once
#include "backend/cpu/arm/drivers.h"
#include "backend/cpu/arm/formats/iq_signs.h"
#include "core/half.h"
#include "quant/iq_layout.h"

namespace tf::cpu::detail {
namespace {

// Sub-block s's 32 signed values as two vectors; its scale word in *aux.
inline void iq2xxs_sub(const uint8_t* b, int s, int8x16_t* v0, int8x16_t* v1, uint32_t* aux) {
  const uint64_t rec = quant::ld64(b + 2 + 8 * s);  // one load; the fields by shifts (ALU, not load ports)
  const uint32_t a = uint32_t(rec >> 32);
  const uint64_t* grid = iq::kIq2xxsGrid;
  *v0 = signed16(grid[rec & 255], grid[(rec >> 8) & 255], a & 127, (a >> 7) & 127);
  *v1 = signed16(grid[(rec >> 16) & 255], grid[(rec >> 24) & 255], (a >> 14) & 127, (a >> 21) & 127);
  *aux = a;
}

void decode_iq2xxs(const uint8_t* b, ArmBlock256* u) {
  for (int s = 0; s < 8; ++s) {
    int8x16_t v0, v1;
    uint32_t aux;
    iq2xxs_sub(b, s, &v0, &v1, &aux);
    vst1q_s8(u->v.q + 32 * s, v0);
    vst1q_s8(u->v.q + 32 * s + 16, v1);
    u->v.sc[2 * s] = u->v.sc[2 * s + 1] = int16_t(2 * (aux >> 28) + 1);
  }
  u->v.d = h2f(quant::ld16(b)) * 0.125f;
}

inline float iq2xxs_block_dot(const uint8_t* b, const ActK& a) {
  const int32x4_t z = vdupq_n_s32(0);
  int32x4_t p[8];
  int32_t sc[8];
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
    int8x16_t v0, v1;
    uint32_t aux;
    iq2xxs_sub(b, s, &v0, &v1, &aux);
    p[s] = dot16(dot16(z, v0, vld1q_s8(a.qs + 32 * s)), v1, vld1q_s8(a.qs + 32 * s + 16));
    sc[s] = int32_t(2 * (aux >> 28) + 1);
  }
  int32x4_t tot = vmulq_s32(sum4(p[0], p[1], p[2], p[3]), vld1q_s32(sc));
  tot = vmlaq_s32(tot, sum4(p[4], p[5], p[6], p[7]), vld1q_s32(sc + 4));
  return h2f(quant::ld16(b)) * 0.125f * a.d * float(vaddvq_s32(tot));
}

void matmul_iq2xxs(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                   int64_t ncols, float* y, int64_t ldy) {
  constexpr size_t kBytes = quant::iq2_xxs::kBytes;
  if (ncols == 1) return gemv256<kBytes, iq2xxs_block_dot>(k, w, ws, r0, r1, xq, y);
  matmul_a256<decode_iq2xxs, kBytes, false, true>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

}  // namespace
}  // namespace tf::cpu::detail
