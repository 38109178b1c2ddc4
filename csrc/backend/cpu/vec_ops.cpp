#include "backend/cpu/vec_ops.h"

#include <algorithm>
#include <cmath>

#include "core/cpu_features.h"
#include "core/half.h"

namespace tf::cpu {

#if defined(TF_HAVE_X86_KERNELS)
const VecOps* vec_ops_avx512_table();  // vec_ops_avx512.cpp
const VecOps* vec_ops_avx2_table();    // vec_ops_avx2.cpp
#endif
#if defined(TF_HAVE_ARM_KERNELS)
const VecOps* vec_ops_neon_table();    // arm/vec_ops_neon.cpp
#endif

namespace {

void f32_to_f16_scalar(int64_t n, const float* x, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

float exp_sub_sum_scalar(int64_t n, float* x, float max) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    s += x[i];
  }
  return s;
}

void silu_mul_scalar(int64_t n, const float* g, const float* u, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

void scale_scalar(int64_t n, float* y, float a) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

float dot_f32_scalar(int64_t n, const float* a, const float* b) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy_f32_scalar(int64_t n, float alpha, const float* x, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void f16_to_f32_scalar(int64_t n, const uint16_t* x, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_fp32(x[i]);
}

void dot_block_f32_scalar(int64_t n, const float* a, int64_t lda, int rows, const float* b, int64_t ldb, int m,
                          float* s, int64_t lds) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < m; ++j) s[r * lds + j] = dot_f32_scalar(n, a + r * lda, b + j * ldb);
}

void axpy_block_f32_scalar(int64_t n, const float* p, int64_t ldp, int rows, const float* x, int64_t ldx, int m,
                           float* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < m; ++j) axpy_f32_scalar(n, p[r * ldp + j], x + j * ldx, y + r * ldy);
}

void index_scores_scalar(int64_t n, const float* qt, int hp, const float* w, const float* rows, int64_t ldr, int m,
                         float* out) {
  for (int j = 0; j < m; ++j) {
    float s = 0.f;
    for (int h = 0; h < hp; ++h) {
      float d = 0.f;
      for (int64_t i = 0; i < n; ++i) d += qt[i * hp + h] * rows[j * ldr + i];
      s += w[h] * std::max(0.f, d);
    }
    out[j] = s;
  }
}

const VecOps kScalar = {f32_to_f16_scalar,    exp_sub_sum_scalar,    silu_mul_scalar,    scale_scalar,
                        f16_to_f32_scalar,    dot_block_f32_scalar,  axpy_block_f32_scalar,
                        index_scores_scalar};

}  // namespace

const VecOps& vec_ops_scalar() { return kScalar; }

const VecOps& vec_ops_for(CpuIsa isa) {
#if defined(TF_HAVE_X86_KERNELS)
  // An entry an ISA's table leaves empty falls back to the next ISA down.
  if (isa == CpuIsa::Avx512) {
    static const VecOps merged = [] {
      VecOps m = *vec_ops_avx512_table();
      const VecOps& avx2 = *vec_ops_avx2_table();
      if (!m.dot_block_f32) m.dot_block_f32 = avx2.dot_block_f32;
      if (!m.axpy_block_f32) m.axpy_block_f32 = avx2.axpy_block_f32;
      if (!m.index_scores) m.index_scores = avx2.index_scores;
      return m;
    }();
    return merged;
  }
  if (isa == CpuIsa::Avx2) return *vec_ops_avx2_table();
#elif defined(TF_HAVE_ARM_KERNELS)
  // Every aarch64 level shares the NEON table; its empty entries are the scalar ones.
  if (isa >= CpuIsa::Neon) {
    static const VecOps merged = [] {
      VecOps m = *vec_ops_neon_table();
      if (!m.exp_sub_sum) m.exp_sub_sum = kScalar.exp_sub_sum;
      if (!m.silu_mul) m.silu_mul = kScalar.silu_mul;
      return m;
    }();
    return merged;
  }
#else
  (void)isa;
#endif
  return kScalar;
}

const VecOps& vec_ops() {
  static const VecOps& ops = vec_ops_for(best_isa());
  return ops;
}

}  // namespace tf::cpu
