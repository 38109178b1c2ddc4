// The CUDA backend's format arithmetic run on the host (format_decode.h compiled by the C++
// compiler): checked on every machine against the reference dequantization and a float64
// product, so the decode and the int8 product scheme the kernels use are tested without a GPU.
#pragma once
#include <cstdint>
#include <string>

#include "backend/backend.h"

namespace tf::cuda {

// Whether the CUDA backend has a product kernel for this GGUF type.
bool has_kernel(uint32_t type_id);
// Names of those types, comma separated.
std::string kernel_type_names();
// Dequantizes n values (a whole number of blocks) through the kernels' chunk decoder.
void emulate_dequantize(uint32_t type_id, const uint8_t* src, int64_t n, float* dst);
// y[t * rows + r] = W[r] . x[t] computed as the kernels do: int8 formats with x quantized to
// int8 per 32 values and integer dot products per 16; float formats in float.
void emulate_matmul(uint32_t type_id, const uint8_t* w, int64_t rows, int64_t k, const float* x, int64_t T,
                    float* y);

// One row: W row . x (k values), as the kernels compute it.
float emulate_dot(uint32_t type_id, const uint8_t* wrow, int64_t k, const float* x);
// A grouped product (Backend::matmul_stack) through the CUDA backend's packing plan
// (grouping.h) and its arithmetic: matrices mat_stride bytes apart, rows row_stride apart.
void emulate_matmul_stack(uint32_t type_id, const uint8_t* w, size_t mat_stride, size_t row_stride, int64_t rows,
                          int64_t k, const float* x, int64_t ldx, const Grouping& g, float* y, int64_t ldy);

}  // namespace tf::cuda
