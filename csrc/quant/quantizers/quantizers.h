// Importance-weighted quantizers: float rows -> ggml blocks that the gguf package and
// llama.cpp dequantize exactly as TensorFold's reference does.
//
// Every function quantizes one row of n values (n a multiple of the format's block size)
// into n / block_size consecutive blocks at dst, choosing the block's scales (and mins, grid
// points, signs) to minimise the weighted squared error
//     sum_i w[i] * (x[i] - dequantized[i])^2 .
// w has n entries, all >= 0 (the caller folds the importance matrix — per input channel
// second moments of the layer's activations — into it); w == nullptr means w[i] = 1.
// A row of zeros (or all-zero weights) gives blocks that dequantize to zeros. Inputs are
// finite (the caller checks). Functions are thread-safe: callers run rows in parallel.
#pragma once
#include <cstdint>

namespace tf::quant {

// Float formats: a conversion, w unused.                     float.cpp
void quantize_f32(const float* x, const float* w, void* dst, int64_t n);
void quantize_f16(const float* x, const float* w, void* dst, int64_t n);
void quantize_bf16(const float* x, const float* w, void* dst, int64_t n);

// 32-weight blocks (legacy formats, IQ4_NL, MXFP4)          file
void quantize_q4_0(const float* x, const float* w, void* dst, int64_t n);     // legacy.cpp
void quantize_q4_1(const float* x, const float* w, void* dst, int64_t n);     // legacy.cpp
void quantize_q5_0(const float* x, const float* w, void* dst, int64_t n);     // legacy.cpp
void quantize_q5_1(const float* x, const float* w, void* dst, int64_t n);     // legacy.cpp
void quantize_q8_0(const float* x, const float* w, void* dst, int64_t n);     // legacy.cpp
void quantize_iq4_nl(const float* x, const float* w, void* dst, int64_t n);   // iq4.cpp
void quantize_mxfp4(const float* x, const float* w, void* dst, int64_t n);    // iq4.cpp

// 256-weight super-blocks
void quantize_q2_K(const float* x, const float* w, void* dst, int64_t n);     // kquants.cpp
void quantize_q3_K(const float* x, const float* w, void* dst, int64_t n);     // kquants.cpp
void quantize_q4_K(const float* x, const float* w, void* dst, int64_t n);     // kquants.cpp
void quantize_q5_K(const float* x, const float* w, void* dst, int64_t n);     // kquants.cpp
void quantize_q6_K(const float* x, const float* w, void* dst, int64_t n);     // kquants.cpp
void quantize_iq4_xs(const float* x, const float* w, void* dst, int64_t n);   // iq4.cpp
void quantize_iq3_xxs(const float* x, const float* w, void* dst, int64_t n);  // iq3.cpp
void quantize_iq3_s(const float* x, const float* w, void* dst, int64_t n);    // iq3.cpp
void quantize_iq2_xxs(const float* x, const float* w, void* dst, int64_t n);  // iq2.cpp
void quantize_iq2_xs(const float* x, const float* w, void* dst, int64_t n);   // iq2.cpp
void quantize_iq2_s(const float* x, const float* w, void* dst, int64_t n);    // iq2.cpp
void quantize_iq1_s(const float* x, const float* w, void* dst, int64_t n);    // iq1_tq.cpp
void quantize_iq1_m(const float* x, const float* w, void* dst, int64_t n);    // iq1_tq.cpp
void quantize_tq1_0(const float* x, const float* w, void* dst, int64_t n);    // iq1_tq.cpp
void quantize_tq2_0(const float* x, const float* w, void* dst, int64_t n);    // iq1_tq.cpp

}  // namespace tf::quant
