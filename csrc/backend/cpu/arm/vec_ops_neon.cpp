// NEON vector primitives (vec_ops.h) for aarch64: conversions, scaling and the attention
// block products. exp-based ops keep the scalar code (std::exp), so softmax and SiLU give the
// reference's bits; vec_ops.cpp fills the empty entries from the scalar table.
#include <arm_neon.h>

#include "backend/cpu/vec_ops.h"

namespace tf::cpu {

namespace {

void f32_to_f16_neon(int64_t n, const float* x, uint16_t* y) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) vst1_u16(y + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));  // FPCR: ties to even
  if (i < n) {
    float t[4] = {0.f, 0.f, 0.f, 0.f};
    uint16_t h[4];
    for (int64_t j = i; j < n; ++j) t[j - i] = x[j];
    vst1_u16(h, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(t))));
    for (int64_t j = i; j < n; ++j) y[j] = h[j - i];
  }
}

void f16_to_f32_neon(int64_t n, const uint16_t* x, float* y) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(x + i))));
  for (; i < n; ++i) {
    uint16_t h[4] = {x[i], 0, 0, 0};
    y[i] = vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h))), 0);
  }
}

void scale_neon(int64_t n, float* y, float a) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vmulq_n_f32(vld1q_f32(y + i), a));
  for (; i < n; ++i) y[i] *= a;
}

inline float dot_f32_neon(int64_t n, const float* a, const float* b) {
  float32x4_t s0 = vdupq_n_f32(0.f), s1 = s0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
    s1 = vfmaq_f32(s1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
  }
  for (; i + 4 <= n; i += 4) s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
  float s = vaddvq_f32(vaddq_f32(s0, s1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void dot_block_f32_neon(int64_t n, const float* a, int64_t lda, int rows, const float* b, int64_t ldb, int m,
                        float* s, int64_t lds) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < m; ++j) s[r * lds + j] = dot_f32_neon(n, a + r * lda, b + j * ldb);
}

void axpy_block_f32_neon(int64_t n, const float* p, int64_t ldp, int rows, const float* x, int64_t ldx, int m,
                         float* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r) {
    float* yr = y + r * ldy;
    for (int j = 0; j < m; ++j) {
      const float a = p[r * ldp + j];
      const float* xj = x + j * ldx;
      int64_t i = 0;
      for (; i + 4 <= n; i += 4) vst1q_f32(yr + i, vfmaq_n_f32(vld1q_f32(yr + i), vld1q_f32(xj + i), a));
      for (; i < n; ++i) yr[i] += a * xj[i];
    }
  }
}

const VecOps kNeon = {f32_to_f16_neon, nullptr, nullptr, scale_neon, f16_to_f32_neon,
                      dot_block_f32_neon, axpy_block_f32_neon};

}  // namespace

const VecOps* vec_ops_neon_table() { return &kNeon; }

}  // namespace tf::cpu
