// The traits table: one row per ggml type id a GGUF file may carry.
//
// Block sizes and bytes per block are ggml's (the `gguf` package's GGML_QUANT_SIZES lists
// the same numbers, except Q8_1 where it still says 40 bytes; ggml's block_q8_1 is two
// halves + 32 int8 = 36 bytes, see blocks.h). Rows that are not weight formats are there so that
// a file using them can still be inspected (tensor byte sizes) and refused by name; Q8_1 and
// Q8_K are activation formats: they have references (tests) but are never weights.
#include "quant/traits.h"

#include <string>

#include "core/error.h"
#include "quant/blocks.h"
#include "quant/quantizers/quantizers.h"
#include "quant/reference.h"

namespace tf {
namespace {

const TypeTraits kTable[] = {
    // id, name, block_size, type_size, dequantize_ref, quantize_ref, quantize_weighted, weight_format
    {0, "F32", 1, 4, dequantize_row_f32_ref, quantize_row_f32_ref, quant::quantize_f32, true},
    {1, "F16", 1, 2, dequantize_row_f16_ref, quantize_row_f16_ref, quant::quantize_f16, true},
    {2, "Q4_0", QK4_0, sizeof(block_q4_0), dequantize_row_q4_0_ref, quantize_row_q4_0_ref, quant::quantize_q4_0, true},
    {3, "Q4_1", QK4_1, sizeof(block_q4_1), dequantize_row_q4_1_ref, quantize_row_q4_1_ref, quant::quantize_q4_1, true},
    {6, "Q5_0", QK5_0, sizeof(block_q5_0), dequantize_row_q5_0_ref, quantize_row_q5_0_ref, quant::quantize_q5_0, true},
    {7, "Q5_1", QK5_1, sizeof(block_q5_1), dequantize_row_q5_1_ref, quantize_row_q5_1_ref, quant::quantize_q5_1, true},
    {8, "Q8_0", QK8_0, sizeof(block_q8_0), dequantize_row_q8_0_ref, quantize_row_q8_0_ref, quant::quantize_q8_0, true},
    {9, "Q8_1", QK8_1, sizeof(block_q8_1), dequantize_row_q8_1_ref, quantize_row_q8_1_ref, nullptr, false},
    {10, "Q2_K", QK_K, sizeof(block_q2_K), dequantize_row_q2_K_ref, quantize_row_q2_K_ref, quant::quantize_q2_K, true},
    {11, "Q3_K", QK_K, sizeof(block_q3_K), dequantize_row_q3_K_ref, quantize_row_q3_K_ref, quant::quantize_q3_K, true},
    {12, "Q4_K", QK_K, sizeof(block_q4_K), dequantize_row_q4_K_ref, quantize_row_q4_K_ref, quant::quantize_q4_K, true},
    {13, "Q5_K", QK_K, sizeof(block_q5_K), dequantize_row_q5_K_ref, quantize_row_q5_K_ref, quant::quantize_q5_K, true},
    {14, "Q6_K", QK_K, sizeof(block_q6_K), dequantize_row_q6_K_ref, quantize_row_q6_K_ref, quant::quantize_q6_K, true},
    {15, "Q8_K", QK_K, sizeof(block_q8_K), dequantize_row_q8_K_ref, quantize_row_q8_K_ref, nullptr, false},
    {16, "IQ2_XXS", 256, 66, dequantize_row_iq2_xxs_ref, nullptr, quant::quantize_iq2_xxs, true},
    {17, "IQ2_XS", 256, 74, dequantize_row_iq2_xs_ref, nullptr, quant::quantize_iq2_xs, true},
    {18, "IQ3_XXS", 256, 98, dequantize_row_iq3_xxs_ref, nullptr, quant::quantize_iq3_xxs, true},
    {19, "IQ1_S", 256, 50, dequantize_row_iq1_s_ref, nullptr, quant::quantize_iq1_s, true},
    {20, "IQ4_NL", 32, 18, dequantize_row_iq4_nl_ref, nullptr, quant::quantize_iq4_nl, true},
    {21, "IQ3_S", 256, 110, dequantize_row_iq3_s_ref, nullptr, quant::quantize_iq3_s, true},
    {22, "IQ2_S", 256, 82, dequantize_row_iq2_s_ref, nullptr, quant::quantize_iq2_s, true},
    {23, "IQ4_XS", 256, 136, dequantize_row_iq4_xs_ref, nullptr, quant::quantize_iq4_xs, true},
    {24, "I8", 1, 1, nullptr, nullptr, nullptr, false},
    {25, "I16", 1, 2, nullptr, nullptr, nullptr, false},
    {26, "I32", 1, 4, nullptr, nullptr, nullptr, false},
    {27, "I64", 1, 8, nullptr, nullptr, nullptr, false},
    {28, "F64", 1, 8, nullptr, nullptr, nullptr, false},
    {29, "IQ1_M", 256, 56, dequantize_row_iq1_m_ref, nullptr, quant::quantize_iq1_m, true},
    {30, "BF16", 1, 2, dequantize_row_bf16_ref, quantize_row_bf16_ref, quant::quantize_bf16, true},
    {34, "TQ1_0", 256, 54, dequantize_row_tq1_0_ref, nullptr, quant::quantize_tq1_0, true},
    {35, "TQ2_0", 256, 66, dequantize_row_tq2_0_ref, nullptr, quant::quantize_tq2_0, true},
    {39, "MXFP4", 32, 17, dequantize_row_mxfp4_ref, nullptr, quant::quantize_mxfp4, true},
    {40, "NVFP4", 64, 36, nullptr, nullptr, nullptr, false},
    {41, "Q1_0", 128, 18, nullptr, nullptr, nullptr, false},
};

static_assert(sizeof(block_q8_1) == 36, "ggml's block_q8_1 is 36 bytes");

// Direct lookup by id (ids are small; kGgmlTypeIdLimit bounds them).
struct Index {
  const TypeTraits* by_id[kGgmlTypeIdLimit] = {};
  std::string computable;
  Index() {
    for (const TypeTraits& t : kTable) {
      by_id[t.id] = &t;
      if (t.computable()) computable += (computable.empty() ? "" : ", ") + std::string(t.name);
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

const std::string& computable_type_names() { return index().computable; }

const TypeTraits& type_traits(GgmlType t) {
  const uint32_t id = static_cast<uint32_t>(t);
  const TypeTraits* tr = find_type_traits(id);
  if (tr == nullptr)
    fail(ErrorKind::Unsupported, "tensor type id ", id, " is unknown to TensorFold (supported: ",
         computable_type_names(), ")");
  if (!tr->computable())
    fail(ErrorKind::Unsupported, "tensor type ", tr->name,
         " is not supported by TensorFold (supported: ", computable_type_names(), ")");
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
