// The float formats as "quantizers": a plain conversion (rounding to nearest even), the weights
// play no part.
#include "quant/quantizers/quantizers.h"
#include "quant/reference.h"

namespace tf::quant {

void quantize_f32(const float* x, const float*, void* dst, int64_t n) { quantize_row_f32_ref(x, dst, n); }
void quantize_f16(const float* x, const float*, void* dst, int64_t n) { quantize_row_f16_ref(x, dst, n); }
void quantize_bf16(const float* x, const float*, void* dst, int64_t n) { quantize_row_bf16_ref(x, dst, n); }

}  // namespace tf::quant
