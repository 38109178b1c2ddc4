// The traits table: one row per ggml type id a GGUF file may carry.
//
// Block sizes and bytes per block are ggml's (the `gguf` package's GGML_QUANT_SIZES lists
// the same numbers, except Q8_1 where it still says 40 bytes; ggml's block_q8_1 is two
// halves + 32 int8 = 36 bytes, see blocks.h). Rows with supported=false are there so that
// a file using them can still be inspected (tensor byte sizes) and rejected by name.
#include "quant/traits.h"

#include <string>

#include "core/error.h"
#include "quant/blocks.h"
#include "quant/reference.h"

namespace tf {
namespace {

constexpr TypeTraits kTable[] = {
    // id, name, block_size, type_size, supported, dequantize_ref, quantize_ref
    {0, "F32", 1, 4, true, dequantize_row_f32_ref, quantize_row_f32_ref},
    {1, "F16", 1, 2, true, dequantize_row_f16_ref, quantize_row_f16_ref},
    {2, "Q4_0", QK4_0, sizeof(block_q4_0), true, dequantize_row_q4_0_ref, quantize_row_q4_0_ref},
    {3, "Q4_1", QK4_1, sizeof(block_q4_1), true, dequantize_row_q4_1_ref, quantize_row_q4_1_ref},
    {6, "Q5_0", QK5_0, sizeof(block_q5_0), true, dequantize_row_q5_0_ref, quantize_row_q5_0_ref},
    {7, "Q5_1", QK5_1, sizeof(block_q5_1), true, dequantize_row_q5_1_ref, quantize_row_q5_1_ref},
    {8, "Q8_0", QK8_0, sizeof(block_q8_0), true, dequantize_row_q8_0_ref, quantize_row_q8_0_ref},
    {9, "Q8_1", QK8_1, sizeof(block_q8_1), true, dequantize_row_q8_1_ref, quantize_row_q8_1_ref},
    {10, "Q2_K", QK_K, sizeof(block_q2_K), true, dequantize_row_q2_K_ref, quantize_row_q2_K_ref},
    {11, "Q3_K", QK_K, sizeof(block_q3_K), true, dequantize_row_q3_K_ref, quantize_row_q3_K_ref},
    {12, "Q4_K", QK_K, sizeof(block_q4_K), true, dequantize_row_q4_K_ref, quantize_row_q4_K_ref},
    {13, "Q5_K", QK_K, sizeof(block_q5_K), true, dequantize_row_q5_K_ref, quantize_row_q5_K_ref},
    {14, "Q6_K", QK_K, sizeof(block_q6_K), true, dequantize_row_q6_K_ref, quantize_row_q6_K_ref},
    {15, "Q8_K", QK_K, sizeof(block_q8_K), true, dequantize_row_q8_K_ref, quantize_row_q8_K_ref},
    {16, "IQ2_XXS", 256, 66, false, nullptr, nullptr},
    {17, "IQ2_XS", 256, 74, false, nullptr, nullptr},
    {18, "IQ3_XXS", 256, 98, false, nullptr, nullptr},
    {19, "IQ1_S", 256, 50, false, nullptr, nullptr},
    {20, "IQ4_NL", 32, 18, false, nullptr, nullptr},
    {21, "IQ3_S", 256, 110, false, nullptr, nullptr},
    {22, "IQ2_S", 256, 82, false, nullptr, nullptr},
    {23, "IQ4_XS", 256, 136, false, nullptr, nullptr},
    {24, "I8", 1, 1, false, nullptr, nullptr},
    {25, "I16", 1, 2, false, nullptr, nullptr},
    {26, "I32", 1, 4, false, nullptr, nullptr},
    {27, "I64", 1, 8, false, nullptr, nullptr},
    {28, "F64", 1, 8, false, nullptr, nullptr},
    {29, "IQ1_M", 256, 56, false, nullptr, nullptr},
    {30, "BF16", 1, 2, true, dequantize_row_bf16_ref, quantize_row_bf16_ref},
    {34, "TQ1_0", 256, 54, false, nullptr, nullptr},
    {35, "TQ2_0", 256, 66, false, nullptr, nullptr},
    {39, "MXFP4", 32, 17, false, nullptr, nullptr},
    {40, "NVFP4", 64, 36, false, nullptr, nullptr},
    {41, "Q1_0", 128, 18, false, nullptr, nullptr},
};

static_assert(sizeof(block_q8_1) == 36, "ggml's block_q8_1 is 36 bytes");

// Direct lookup by id (ids are small; kGgmlTypeIdLimit bounds them).
struct Index {
  const TypeTraits* by_id[kGgmlTypeIdLimit] = {};
  std::string supported_list;
  Index() {
    for (const TypeTraits& t : kTable) {
      by_id[t.id] = &t;
      if (t.supported) {
        if (!supported_list.empty()) supported_list += ", ";
        supported_list += t.name;
      }
    }
  }
};

const Index& index() {
  static const Index idx;
  return idx;
}

}  // namespace

const TypeTraits* find_type_traits(uint32_t id) {
  if (id >= kGgmlTypeIdLimit) return nullptr;
  return index().by_id[id];
}

const TypeTraits& type_traits(GgmlType t) {
  const uint32_t id = static_cast<uint32_t>(t);
  const TypeTraits* tr = find_type_traits(id);
  if (tr == nullptr)
    fail(ErrorKind::Unsupported, "tensor type id ", id, " is unknown to TensorFold (supported: ",
         index().supported_list, ")");
  if (!tr->supported)
    fail(ErrorKind::Unsupported, "tensor type ", tr->name,
         " is not supported by TensorFold (supported: ", index().supported_list, ")");
  return *tr;
}

const char* type_name(uint32_t id) {
  const TypeTraits* tr = find_type_traits(id);
  return tr ? tr->name : nullptr;
}

size_t row_bytes(GgmlType t, int64_t n) {
  const uint32_t id = static_cast<uint32_t>(t);
  const TypeTraits* tr = find_type_traits(id);
  if (tr == nullptr) fail(ErrorKind::Unsupported, "tensor type id ", id, " is unknown to TensorFold");
  TF_CHECK(n >= 0, "row of ", tr->name, ": negative element count ", n);
  TF_CHECK(n % tr->block_size == 0, "row of ", tr->name, ": ", n,
           " elements is not a multiple of the block size ", tr->block_size);
  return static_cast<size_t>(n / tr->block_size) * tr->type_size;
}

}  // namespace tf
