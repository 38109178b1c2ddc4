// Small vector primitives used by attention, norms and activations, dispatched at run time
// (AVX-512, AVX2 or portable scalar). The scalar versions in vec_ops.cpp are the reference.
#pragma once
#include <cstdint>

namespace tf::cpu {

struct VecOps {
  // sum_i a[i] * b[i], b stored as IEEE half (the KV cache format).
  float (*dot_f32_f16)(int64_t n, const float* a, const uint16_t* b);
  // y[i] += alpha * x[i], x stored as half.
  void (*axpy_f16)(int64_t n, float alpha, const uint16_t* x, float* y);
  // y = half(x), round to nearest even.
  void (*f32_to_f16)(int64_t n, const float* x, uint16_t* y);
  // x[i] = exp(x[i] - max); returns the sum of the new x.
  float (*exp_sub_sum)(int64_t n, float* x, float max);
  // out[i] = silu(g[i]) * u[i]
  void (*silu_mul)(int64_t n, const float* g, const float* u, float* out);
  // y[i] *= a
  void (*scale)(int64_t n, float* y, float a);
  // f32 versions of dot / axpy (the F32 KV cache)
  float (*dot_f32)(int64_t n, const float* a, const float* b);
  void (*axpy_f32)(int64_t n, float alpha, const float* x, float* y);
  // y = float(x), x stored as half (exact)
  void (*f16_to_f32)(int64_t n, const uint16_t* x, float* y);
};

const VecOps& vec_ops();
const VecOps& vec_ops_scalar();

}  // namespace tf::cpu
