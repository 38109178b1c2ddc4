// aarch64 kernels of the float formats (F32, F16, BF16) and the 32-value legacy formats
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), one build per ISA level (neon_common.h). Q8_0 has a fused
// single-column kernel; the rest decode into ArmBlock32 for the shared drivers.
#pragma once
#include "backend/cpu/arm/drivers.h"
#include "core/half.h"
#include "quant/blocks.h"
#include "quant/iq_layout.h"

namespace tf::cpu::detail {
namespace {

// ---- float weights ----------------------------------------------------------------------

template <GgmlType T>
inline float32x4_t load_w4(const uint8_t* row, int64_t i) {
  if constexpr (T == GgmlType::F32) {
    return vld1q_f32(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (T == GgmlType::F16) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(row) + i)));
  } else {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(row) + i), 16));
  }
}


template <GgmlType T>
void matmul_float(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                  int64_t ncols, float* y, int64_t ldy) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(w) + size_t(r) * ws;
    for (int64_t c = 0; c < ncols; ++c) {
      const float* x = reinterpret_cast<const float*>(static_cast<const uint8_t*>(xq) + size_t(c) * xs);
      float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0, a2 = a0, a3 = a0;
      int64_t i = 0;
      for (; i + 16 <= k; i += 16) {
        a0 = vfmaq_f32(a0, load_w4<T>(row, i), vld1q_f32(x + i));
        a1 = vfmaq_f32(a1, load_w4<T>(row, i + 4), vld1q_f32(x + i + 4));
        a2 = vfmaq_f32(a2, load_w4<T>(row, i + 8), vld1q_f32(x + i + 8));
        a3 = vfmaq_f32(a3, load_w4<T>(row, i + 12), vld1q_f32(x + i + 12));
      }
      for (; i + 4 <= k; i += 4) a0 = vfmaq_f32(a0, load_w4<T>(row, i), vld1q_f32(x + i));
      float acc = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
      for (; i < k; ++i) acc += float_weight<T>(row, i) * x[i];
      y[c * ldy + r] = acc;
    }
  }
}

// ---- 32-value legacy blocks -------------------------------------------------------------

void decode_q4_0(const uint8_t* p, ArmBlock32* u) {
  const auto* b = reinterpret_cast<const block_q4_0*>(p);
  const uint8x16_t v = vld1q_u8(b->qs);
  const int8x16_t eight = vdupq_n_s8(8);
  vst1q_s8(u->q, vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), eight));
  vst1q_s8(u->q + 16, vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), eight));
  u->d = h2f(b->d);
  u->m = 0.f;
}

void decode_q4_1(const uint8_t* p, ArmBlock32* u) {
  const auto* b = reinterpret_cast<const block_q4_1*>(p);
  const uint8x16_t v = vld1q_u8(b->qs);
  vst1q_u8(reinterpret_cast<uint8_t*>(u->q), vandq_u8(v, vdupq_n_u8(0x0F)));
  vst1q_u8(reinterpret_cast<uint8_t*>(u->q) + 16, vshrq_n_u8(v, 4));
  u->d = h2f(b->d);
  u->m = h2f(b->m);
}

// The fifth bits of a Q5 block (qh: bit j = value j) as 0x10 bytes, values 0..15 and 16..31.
inline void q5_high_bits(const uint8_t* qhp, uint8x16_t* lo, uint8x16_t* hi) {
  uint32_t qh;
  std::memcpy(&qh, qhp, 4);
  const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x8_t b0 = vdup_n_u8(uint8_t(qh)), b1 = vdup_n_u8(uint8_t(qh >> 8));
  const uint8x8_t b2 = vdup_n_u8(uint8_t(qh >> 16)), b3 = vdup_n_u8(uint8_t(qh >> 24));
  *lo = vandq_u8(vtstq_u8(vcombine_u8(b0, b1), bit), vdupq_n_u8(0x10));
  *hi = vandq_u8(vtstq_u8(vcombine_u8(b2, b3), bit), vdupq_n_u8(0x10));
}

template <bool kSigned>
inline void decode_q5(const uint8_t* qs, const uint8_t* qh, ArmBlock32* u) {
  const uint8x16_t v = vld1q_u8(qs);
  uint8x16_t h0, h1;
  q5_high_bits(qh, &h0, &h1);
  int8x16_t lo = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(v, vdupq_n_u8(0x0F)), h0));
  int8x16_t hi = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(v, 4), h1));
  if (kSigned) {
    lo = vsubq_s8(lo, vdupq_n_s8(16));
    hi = vsubq_s8(hi, vdupq_n_s8(16));
  }
  vst1q_s8(u->q, lo);
  vst1q_s8(u->q + 16, hi);
}

void decode_q5_0(const uint8_t* p, ArmBlock32* u) {
  const auto* b = reinterpret_cast<const block_q5_0*>(p);
  decode_q5<true>(b->qs, b->qh, u);
  u->d = h2f(b->d);
  u->m = 0.f;
}

void decode_q5_1(const uint8_t* p, ArmBlock32* u) {
  const auto* b = reinterpret_cast<const block_q5_1*>(p);
  decode_q5<false>(b->qs, b->qh, u);
  u->d = h2f(b->d);
  u->m = h2f(b->m);
}

void decode_q8_0(const uint8_t* p, ArmBlock32* u) {
  const auto* b = reinterpret_cast<const block_q8_0*>(p);
  vst1q_s8(u->q, vld1q_s8(b->qs));
  vst1q_s8(u->q + 16, vld1q_s8(b->qs + 16));
  u->d = h2f(b->d);
  u->m = 0.f;
}

// Q8_0 single column (gemv32): a block's integer products and its scale.
inline int32x4_t q8_0_dot(const uint8_t* p, const int8_t* x) {
  const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
  return dot16(dot16(vdupq_n_s32(0), vld1q_s8(q), vld1q_s8(x)), vld1q_s8(q + 16), vld1q_s8(x + 16));
}
// The fp16 scales of four rows' blocks (ws bytes apart) as floats.
inline float32x4_t q8_0_scale4(const uint8_t* p, size_t ws) {
  uint16x4_t h = vld1_dup_u16(reinterpret_cast<const uint16_t*>(p));
  h = vld1_lane_u16(reinterpret_cast<const uint16_t*>(p + ws), h, 1);
  h = vld1_lane_u16(reinterpret_cast<const uint16_t*>(p + 2 * ws), h, 2);
  h = vld1_lane_u16(reinterpret_cast<const uint16_t*>(p + 3 * ws), h, 3);
  return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

void matmul_q8_0(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq, size_t xs,
                 int64_t ncols, float* y, int64_t ldy) {
  if (ncols == 1) return gemv32<sizeof(block_q8_0), q8_0_dot, q8_0_scale4>(k, w, ws, r0, r1, xq, y);
  matmul_a32<decode_q8_0, sizeof(block_q8_0), false>(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);
}

}  // namespace
}  // namespace tf::cpu::detail
