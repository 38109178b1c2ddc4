// One traits table for every weight format: the single place a format is described.
// Adding a format = a block struct in blocks.h, a reference dequant/quant in reference.cpp,
// a row in the table in traits.cpp, and (optionally) fast kernels in backend/cpu.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace tf {

struct TypeTraits {
  uint32_t id;             // GGUF / ggml type id
  const char* name;        // ggml's name, e.g. "Q4_K"
  int64_t block_size;      // weights per block (1 for float types)
  size_t type_size;        // bytes per block
  bool supported;          // false: size known (the file can be inspected) but no kernels
  // Scalar reference dequantization of n values (n a multiple of block_size).
  void (*dequantize_ref)(const void* src, float* dst, int64_t n);
  // Scalar reference quantization (float -> format), nullptr where not implemented.
  void (*quantize_ref)(const float* src, void* dst, int64_t n);
};

// Traits for any ggml type id we know the layout of (supported or not); nullptr otherwise.
const TypeTraits* find_type_traits(uint32_t id);
// Traits of a supported type; throws tf::Error(Unsupported) naming the type otherwise.
const TypeTraits& type_traits(GgmlType t);
const char* type_name(uint32_t id);  // "type#<id>" style name for unknown ids is not returned: nullptr
// Bytes of a row of n elements; throws if n is not a multiple of the block size.
size_t row_bytes(GgmlType t, int64_t n);

}  // namespace tf
