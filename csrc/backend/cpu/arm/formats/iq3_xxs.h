// IQ3_XXS on aarch64 (block layout: formats/iq3_xxs.cpp): per group of 4 weights one grid
// word (magnitudes 4..62), per 8 one sign mask; w = (d/4) * (2u + 1) * (±grid).
#pragma once
#include "backend/cpu/arm/drivers.h"
#include "backend/cpu/arm/formats/iq_signs.h"
#include "backend/cpu/arm/formats/iq_xxs.h"
#include "core/half.h"
#include "quant/iq_layout.h"

namespace tf::cpu::detail {
namespace {

// Four grid words (indices: the four bytes of idx) and two sign masks as 16 signed values.
inline int8x16_t iq3_grid16(uint32_t idx, uint32_t s0, uint32_t s1) {
  const uint32_t* grid = iq::kIq3xxsGrid;
  const uint32x4_t g = {grid[idx & 255], grid[(idx >> 8) & 255], grid[(idx >> 16) & 255], grid[idx >> 24]};
  const uint8x16_t m = vcombine_u8(vcreate_u8(kSignMask.m[s0]), vcreate_u8(kSignMask.m[s1]));
  return vreinterpretq_s8_u8(vmulq_u8(vreinterpretq_u8_u32(g), m));
}

inline void iq3xxs_sub(const uint8_t* b, int s, int8x16_t* v0, int8x16_t* v1, uint32_t* aux) {
  const uint64_t qs = quant::ld64(b + 2 + 8 * s);  // eight grid indices in one load
  const uint32_t a = quant::ld32(b + 66 + 4 * s);
  *v0 = iq3_grid16(uint32_t(qs), a & 127, (a >> 7) & 127);
  *v1 = iq3_grid16(uint32_t(qs >> 32), (a >> 14) & 127, (a >> 21) & 127);
  *aux = a;
}

void matmul_iq3xxs(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                   int64_t ncols, float* y, int64_t ldy) {
  constexpr size_t kBytes = quant::iq3_xxs::kBytes;
  if (ncols == 1) return gemv256<kBytes, xxs_block_dot<iq3xxs_sub, 4>>(k, w, ws, r0, r1, xq, y);
  matmul_a256<decode_xxs<iq3xxs_sub, 4>, kBytes, false, true>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

}  // namespace
}  // namespace tf::cpu::detail
