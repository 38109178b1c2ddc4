// CPU low-bit matrix kernels. Activations are quantized once per row into the format the
// weight type multiplies fastest with (Q8_0 / Q8_1 / Q8_K, or F32 for float weights), then
// each weight row is dotted with each activation row. Runtime dispatch picks the AVX-512,
// AVX2 or scalar implementation (core/cpu_features); kernels_scalar.cpp is the reference.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend/cpu/cpu_kernels.h"
#include "core/dtype.h"

namespace tf::cpu {

// Layout of quantized activation rows a weight type multiplies with (cpu_kernels.h).
// Weights of different types that share a layout (e.g. Q4_K and Q6_K, or Q4_0 and Q8_0) can
// share one quantized activation row.
ActLayout act_layout(GgmlType wt);
// Bytes of one quantized activation row of length k.
size_t act_row_bytes(GgmlType wt, int64_t k);
// Quantize one activation row of length k (a multiple of wt's block size).
void quantize_act_row(GgmlType wt, const float* x, void* xq, int64_t k);

// y[c * ldy + r] = dot(W row r, activation row c) for r in [r0, r1), c in [0, ncols).
// W rows are w_stride bytes apart, quantized activation rows xq_stride bytes apart.
void matmul_rows(GgmlType wt, int64_t k, const void* w, size_t w_stride, int64_t r0, int64_t r1,
                 const void* xq, size_t xq_stride, int64_t ncols, float* y, int64_t ldy);

// The same, always the portable scalar implementation (reference for tests).
void matmul_rows_scalar(GgmlType wt, int64_t k, const void* w, size_t w_stride, int64_t r0,
                        int64_t r1, const void* xq, size_t xq_stride, int64_t ncols, float* y,
                        int64_t ldy);
void quantize_act_row_scalar(GgmlType wt, const float* x, void* xq, int64_t k);

// Name of the ISA the fast path uses ("avx512", "avx2", "scalar").
const char* kernel_isa();

}  // namespace tf::cpu
