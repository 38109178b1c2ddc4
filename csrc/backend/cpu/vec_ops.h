// Small vector primitives used by attention, norms and activations, dispatched at run time
// (AVX-512, AVX2 or portable scalar). The scalar versions in vec_ops.cpp are the reference.
#pragma once
#include <cstdint>

#include "core/cpu_features.h"

namespace tf::cpu {

struct VecOps {
  // y = half(x), round to nearest even.
  void (*f32_to_f16)(int64_t n, const float* x, uint16_t* y);
  // x[i] = exp(x[i] - max); returns the sum of the new x.
  float (*exp_sub_sum)(int64_t n, float* x, float max);
  // out[i] = silu(g[i]) * u[i]
  void (*silu_mul)(int64_t n, const float* g, const float* u, float* out);
  // y[i] *= a
  void (*scale)(int64_t n, float* y, float a);
  // y = float(x), x stored as half (exact)
  void (*f16_to_f32)(int64_t n, const uint16_t* x, float* y);
  // s[r * lds + j] = sum_i a[r * lda + i] * b[j * ldb + i] for r < rows, j < m: every query row
  // (heads of a token, or of a prefill block) against every K row of a tile (A B^T). Each sum is
  // formed the same way whatever rows and m are.
  void (*dot_block_f32)(int64_t n, const float* a, int64_t lda, int rows, const float* b, int64_t ldb, int m,
                        float* s, int64_t lds);
  // y[r * ldy + i] += sum_j p[r * ldp + j] * x[j * ldx + i] for r < rows, i < n: the
  // probabilities of a block of query rows times a tile of V rows (P X), accumulated.
  void (*axpy_block_f32)(int64_t n, const float* p, int64_t ldp, int rows, const float* x, int64_t ldx, int m,
                         float* y, int64_t ldy);
  // The lightning indexer's score of m key rows: out[j] = sum_h w[h] * max(0, sum_i qt[i * hp + h] *
  // rows[j * ldr + i]), i < n. The queries come transposed (dimension-major) and padded to hp heads,
  // a multiple of 16, with zero queries and zero weights, so one vector holds 8 or 16 heads and a
  // key value is broadcast against it: no horizontal sum per dot product. Each score is formed the
  // same way whatever m is. May be null in a table (the scalar one is then used).
  void (*index_scores)(int64_t n, const float* qt, int hp, const float* w, const float* rows, int64_t ldr, int m,
                       float* out);
};

const VecOps& vec_ops();
const VecOps& vec_ops_scalar();
// The ops of one instruction set (it must be available: detail::isa_available).
const VecOps& vec_ops_for(CpuIsa isa);

}  // namespace tf::cpu
