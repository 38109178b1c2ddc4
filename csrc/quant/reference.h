// Scalar reference dequantization / quantization of every supported weight format.
//
// Plain C++ (no intrinsics), float32 arithmetic in the same operation order as the `gguf`
// package's numpy dequantizers, so the results are bit-exact against them (tested in
// tests/test_quant_reference.py). n is always a multiple of the format's block size.
//
// Quantizers: F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 are bit-exact with gguf.quants.quantize
// (which follows ggml's reference quantizers); Q8_1 and Q8_K follow ggml's reference
// quantizers; the K-quants Q2_K..Q6_K use TensorFold's own round-to-nearest quantizer with a
// per-sub-block scale (and min) search, valid but not byte-identical to llama.cpp's.
#pragma once
#include <cstdint>

namespace tf {

void dequantize_row_f32_ref(const void* src, float* dst, int64_t n);
void dequantize_row_f16_ref(const void* src, float* dst, int64_t n);
void dequantize_row_bf16_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q4_0_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q4_1_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q5_0_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q5_1_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q8_0_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q8_1_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q2_K_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q3_K_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q4_K_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q5_K_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q6_K_ref(const void* src, float* dst, int64_t n);
void dequantize_row_q8_K_ref(const void* src, float* dst, int64_t n);
// quant/reference_iq.cpp
void dequantize_row_iq1_s_ref(const void* src, float* dst, int64_t n);
void dequantize_row_iq1_m_ref(const void* src, float* dst, int64_t n);
void dequantize_row_iq2_xxs_ref(const void* src, float* dst, int64_t n);
void dequantize_row_iq2_xs_ref(const void* src, float* dst, int64_t n);
void dequantize_row_iq2_s_ref(const void* src, float* dst, int64_t n);
void dequantize_row_iq3_xxs_ref(const void* src, float* dst, int64_t n);
void dequantize_row_iq3_s_ref(const void* src, float* dst, int64_t n);
void dequantize_row_iq4_nl_ref(const void* src, float* dst, int64_t n);
void dequantize_row_iq4_xs_ref(const void* src, float* dst, int64_t n);
void dequantize_row_mxfp4_ref(const void* src, float* dst, int64_t n);
void dequantize_row_tq1_0_ref(const void* src, float* dst, int64_t n);
void dequantize_row_tq2_0_ref(const void* src, float* dst, int64_t n);

void quantize_row_f32_ref(const float* src, void* dst, int64_t n);
void quantize_row_f16_ref(const float* src, void* dst, int64_t n);
void quantize_row_bf16_ref(const float* src, void* dst, int64_t n);
void quantize_row_q4_0_ref(const float* src, void* dst, int64_t n);
void quantize_row_q4_1_ref(const float* src, void* dst, int64_t n);
void quantize_row_q5_0_ref(const float* src, void* dst, int64_t n);
void quantize_row_q5_1_ref(const float* src, void* dst, int64_t n);
void quantize_row_q8_0_ref(const float* src, void* dst, int64_t n);
void quantize_row_q8_1_ref(const float* src, void* dst, int64_t n);  // s = fp16(d * sum(q))
void quantize_row_q8_K_ref(const float* src, void* dst, int64_t n);  // float d, bsums
void quantize_row_q2_K_ref(const float* src, void* dst, int64_t n);
void quantize_row_q3_K_ref(const float* src, void* dst, int64_t n);
void quantize_row_q4_K_ref(const float* src, void* dst, int64_t n);
void quantize_row_q5_K_ref(const float* src, void* dst, int64_t n);
void quantize_row_q6_K_ref(const float* src, void* dst, int64_t n);

}  // namespace tf
