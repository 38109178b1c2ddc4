// Quantization of whole matrices: rows in parallel through a format's importance-weighted
// quantizer (quant/quantizers), with the input checked first.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace tf {

class ThreadPool;

// Whether weights can be written in type t (it has a weighted quantizer).
bool can_quantize(GgmlType t);

// src: nrows rows of ncols floats (row-major, contiguous); importance: ncols non-negative
// finite per-column weights (the mean squared activation of each input channel) or nullptr
// for uniform weights; dst: nrows * row_bytes(t, ncols) bytes. Throws InvalidInput naming the
// first row with a non-finite value, or an Unsupported error for a type without a quantizer.
void quantize_rows(GgmlType t, const float* src, int64_t nrows, int64_t ncols, const float* importance,
                   uint8_t* dst, ThreadPool& pool);

}  // namespace tf
