// The core format table: one row per weight format (block geometry, scalar reference
// (de)quantization, the importance-weighted quantizer). It knows no backend: each backend has
// its own kernel table for the formats it computes with (CPU: backend/cpu/kernel_table.h) and
// refuses the others by name at load. Adding a format = a row here with its reference, and a
// kernel file per backend that computes with it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace tf {

struct TypeTraits {
  uint32_t id;             // GGUF / ggml type id
  const char* name;        // ggml's name, e.g. "Q4_K"
  int64_t block_size;      // weights per block (1 for float types)
  size_t type_size;        // bytes per block
  // Scalar reference dequantization of n values (n a multiple of block_size); bit-exact with
  // the gguf package. nullptr: the layout is known (sizes) but not its values.
  void (*dequantize_ref)(const void* src, float* dst, int64_t n);
  // Scalar reference quantization (float -> format), nullptr where not implemented.
  void (*quantize_ref)(const float* src, void* dst, int64_t n);
  // Importance-weighted quantization of one row (quant/quantizers/quantizers.h): minimises
  // sum_i w[i] (x[i] - dequantized[i])^2; nullptr where the format cannot be written.
  void (*quantize_weighted)(const float* x, const float* w, void* dst, int64_t n);
  // A weight format the engine computes with (a backend may still lack it and refuse it by
  // name); false: known for its sizes only, or an activation format (Q8_1, Q8_K).
  bool weight_format;
  bool computable() const { return weight_format; }
};

// Traits for any ggml type id we know the layout of (computable or not); nullptr otherwise.
const TypeTraits* find_type_traits(uint32_t id);
// Traits of a computable type; throws tf::Error(Unsupported) naming the type and listing the
// computable ones otherwise.
const TypeTraits& type_traits(GgmlType t);
const char* type_name(uint32_t id);  // nullptr for ids without a row
// "F32, F16, ..., IQ4_XS": the computable types, for error messages.
const std::string& computable_type_names();
// Bytes of a row of n elements; throws if n is not a multiple of the block size.
size_t row_bytes(GgmlType t, int64_t n);

}  // namespace tf
