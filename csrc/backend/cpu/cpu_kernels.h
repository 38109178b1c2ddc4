// What the CPU kernel table (backend/cpu/kernel_table.h) records about a format: the layout of
// the activation rows it multiplies with and one matmul entry point per ISA.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tf::cpu {

// Quantized activation rows: F32 (float weights), Q8_32 (8-bit, one scale per 32 values;
// the 32-value block formats), Q8_256 (8-bit per 256 values with 16-value sums; the K-quants
// and the 256-value IQ/TQ formats). Weights of one layout can share one activation row.
enum class ActLayout { F32, Q8_32, Q8_256 };

// y[c * ldy + r] = dot(W row r, activation row c) for r in [r0, r1), c in [0, ncols).
using MatmulFn = void (*)(int64_t k, const void* w, size_t w_stride, int64_t r0, int64_t r1,
                          const void* xq, size_t xq_stride, int64_t ncols, float* y, int64_t ldy);

struct CpuKernels {
  ActLayout act = ActLayout::F32;
  MatmulFn scalar = nullptr;  // nullptr: no kernels, the format cannot be computed with
  MatmulFn avx2 = nullptr;    // nullptr: falls back to scalar
  MatmulFn avx512 = nullptr;  // nullptr: falls back to avx2
  MatmulFn neon = nullptr;    // aarch64 levels; nullptr: falls back to the level below
  MatmulFn dotprod = nullptr;
  MatmulFn i8mm = nullptr;
  // Prefill panels (16-row VNNI panels, panel_avx512.h) for products of many columns: faster,
  // but a column's rounding differs from the row kernels', so the backend never runs them for
  // exact rows (Backend::set_exact_rows). nullptr: none. Last: the rows of kernel_table.cpp
  // initialise the members above by position.
  MatmulFn avx512_panels = nullptr;
};

}  // namespace tf::cpu
