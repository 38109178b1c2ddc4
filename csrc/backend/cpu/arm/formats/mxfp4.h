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
// e8m0_half of every exponent byte (initialised once per process, from the reference formula).
struct E8m0Table {
  float v[256];
  E8m0Table() {
    for (int e = 0; e < 256; ++e) v[e] = quant::mxfp4::e8m0_half(uint8_t(e));
  }
};
const E8m0Table kE8m0;

// Single column, four rows with their sums in the lanes of one vector. Each row's SDOT chain
// runs on across blocks (its lanes hold the running total of all blocks so far), and a block's
// four row sums are this step's reduced totals minus the previous step's: one subtraction per
// block for the four rows instead of re-zeroing four accumulators (the vector pipes are this
// loop's limit). Running totals stay far inside int32: |q| <= 12, |x| <= 127, 32 per block.
void gemv_mxfp4(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, float* y) {
  constexpr size_t kBytes = quant::mxfp4::kBytes;
  const int64_t nb = k / 32, ng = g32_groups(k);
  const ActG32 a = act_g32(xq, 0, 0, ng);
  const uint8_t* W = static_cast<const uint8_t*>(w);
  const int8x16_t levels = vld1q_s8(iq::kValuesMxfp4);
  const uint8x16_t m4 = vdupq_n_u8(0x0F);
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const uint8_t* w0 = W + size_t(r) * ws;
    int32x4_t run[4];
    for (int i = 0; i < 4; ++i) run[i] = vdupq_n_s32(0);
    int32x4_t prev = vdupq_n_s32(0);  // reduced running totals after the previous block
    float32x4_t acc = vdupq_n_f32(0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w0 + size_t(b) * kBytes;
      const int8x16_t x0 = vld1q_s8(a.qs + 32 * b), x1 = vld1q_s8(a.qs + 32 * b + 16);
      float32x4_t sc = vld1q_dup_f32(&kE8m0.v[p[0]]);
      sc = vld1q_lane_f32(&kE8m0.v[p[ws]], sc, 1);
      sc = vld1q_lane_f32(&kE8m0.v[p[2 * ws]], sc, 2);
      sc = vld1q_lane_f32(&kE8m0.v[p[3 * ws]], sc, 3);
      for (int i = 0; i < 4; ++i) {
        const uint8x16_t v = vld1q_u8(p + size_t(i) * ws + 1);
        run[i] = dot16(dot16(run[i], vqtbl1q_s8(levels, vandq_u8(v, m4)), x0), vqtbl1q_s8(levels, vshrq_n_u8(v, 4)), x1);
      }
      const int32x4_t tot = sum4(run[0], run[1], run[2], run[3]);
      acc = vfmaq_f32(acc, vcvtq_f32_s32(vsubq_s32(tot, prev)), vmulq_n_f32(sc, a.d(b)));
      prev = tot;
    }
    vst1q_f32(y + r, acc);
  }
  for (; r < r1; ++r) {
    const uint8_t* w0 = W + size_t(r) * ws;
    float s0 = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w0 + size_t(b) * kBytes;
      s0 += kE8m0.v[p[0]] * a.d(b) * float(vaddvq_s32(mxfp4_dot(p, a.qs + 32 * b)));
    }
    y[r] = s0;
  }
}

void matmul_mxfp4(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                  int64_t ncols, float* y, int64_t ldy) {
  constexpr size_t kBytes = quant::mxfp4::kBytes;
  if (ncols == 1) return gemv_mxfp4(k, w, ws, r0, r1, xq, y);
  matmul_a32<decode_mxfp4, kBytes, false>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

}  // namespace
}  // namespace tf::cpu::detail
