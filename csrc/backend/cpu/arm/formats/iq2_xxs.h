// IQ2_XXS on aarch64 (block layout: formats/iq2_xxs.cpp): per group of 8 weights one grid
// word (magnitudes) and one sign mask; w = (d/8) * (2u + 1) * (±grid).
#pragma once
#include "backend/cpu/arm/drivers.h"
#include "backend/cpu/arm/formats/iq_signs.h"
#include "backend/cpu/arm/formats/iq_xxs.h"
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

void matmul_iq2xxs(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                   int64_t ncols, float* y, int64_t ldy) {
  constexpr size_t kBytes = quant::iq2_xxs::kBytes;
  if (ncols == 1) return gemv256<kBytes, xxs_block_dot<iq2xxs_sub, 8>>(k, w, ws, r0, r1, xq, y);
  matmul_a256<decode_xxs<iq2xxs_sub, 8>, kBytes, false, true>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

}  // namespace
}  // namespace tf::cpu::detail
