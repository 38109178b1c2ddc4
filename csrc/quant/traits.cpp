// The traits table: one row per ggml type id a GGUF file may carry.
//
// Block sizes and bytes per block are ggml's (the `gguf` package's GGML_QUANT_SIZES lists
// the same numbers, except Q8_1 where it still says 40 bytes; ggml's block_q8_1 is two
// halves + 32 int8 = 36 bytes, see blocks.h). Rows without kernels are there so that a file
// using them can still be inspected (tensor byte sizes) and refused by name; Q8_1 and Q8_K
// are activation formats: they have references (tests) but no weight kernels.
#include "quant/traits.h"

#include <string>

#include "core/error.h"
#include "quant/blocks.h"
#include "quant/quantizers/quantizers.h"
#include "quant/reference.h"

#define TF_KERNEL_PARAMS int64_t, const void*, size_t, int64_t, int64_t, const void*, size_t, int64_t, float*, int64_t

// A format's kernel entry points and (for formats whose kernel file carries it) its
// reference dequantization, all defined in its kernel file(s).
#define TF_DECLARE_KERNELS(ns)                                                            \
  namespace tf::cpu::ns {                                                                 \
  void scalar(TF_KERNEL_PARAMS);                                                          \
  void avx2(TF_KERNEL_PARAMS);                                                            \
  void avx512(TF_KERNEL_PARAMS);                                                          \
  }
#define TF_DECLARE_FORMAT(ns)                                                             \
  TF_DECLARE_KERNELS(ns)                                                                  \
  namespace tf::cpu::ns {                                                                 \
  void dequantize_ref(const void* src, float* dst, int64_t n);                            \
  }

#if defined(TF_HAVE_X86_KERNELS)
#define TF_CPU(layout, ns) {cpu::ActLayout::layout, cpu::ns::scalar, cpu::ns::avx2, cpu::ns::avx512}
#else
#define TF_CPU(layout, ns) {cpu::ActLayout::layout, cpu::ns::scalar, nullptr, nullptr}
#endif
#define TF_NO_CPU {}

TF_DECLARE_KERNELS(f32)
TF_DECLARE_KERNELS(f16)
TF_DECLARE_KERNELS(bf16)
TF_DECLARE_KERNELS(q4_0)
TF_DECLARE_KERNELS(q4_1)
TF_DECLARE_KERNELS(q5_0)
TF_DECLARE_KERNELS(q5_1)
TF_DECLARE_KERNELS(q8_0)
TF_DECLARE_KERNELS(q2_k)
TF_DECLARE_KERNELS(q3_k)
TF_DECLARE_KERNELS(q4_k)
TF_DECLARE_KERNELS(q5_k)
TF_DECLARE_KERNELS(q6_k)
TF_DECLARE_FORMAT(iq4_nl)
TF_DECLARE_FORMAT(iq4_xs)
TF_DECLARE_FORMAT(tq1_0)
TF_DECLARE_FORMAT(mxfp4)
TF_DECLARE_FORMAT(iq2_xxs)
TF_DECLARE_FORMAT(iq2_xs)
TF_DECLARE_FORMAT(iq2_s)
TF_DECLARE_FORMAT(iq3_xxs)
TF_DECLARE_FORMAT(iq3_s)
TF_DECLARE_FORMAT(tq2_0)
TF_DECLARE_FORMAT(iq1_s)
TF_DECLARE_FORMAT(iq1_m)

namespace tf {
namespace {

const TypeTraits kTable[] = {
    // id, name, block_size, type_size, dequantize_ref, quantize_ref, quantize_weighted, cpu kernels
    {0, "F32", 1, 4, dequantize_row_f32_ref, quantize_row_f32_ref, quant::quantize_f32, TF_CPU(F32, f32)},
    {1, "F16", 1, 2, dequantize_row_f16_ref, quantize_row_f16_ref, quant::quantize_f16, TF_CPU(F32, f16)},
    {2, "Q4_0", QK4_0, sizeof(block_q4_0), dequantize_row_q4_0_ref, quantize_row_q4_0_ref, quant::quantize_q4_0, TF_CPU(Q8_32, q4_0)},
    {3, "Q4_1", QK4_1, sizeof(block_q4_1), dequantize_row_q4_1_ref, quantize_row_q4_1_ref, quant::quantize_q4_1, TF_CPU(Q8_32, q4_1)},
    {6, "Q5_0", QK5_0, sizeof(block_q5_0), dequantize_row_q5_0_ref, quantize_row_q5_0_ref, quant::quantize_q5_0, TF_CPU(Q8_32, q5_0)},
    {7, "Q5_1", QK5_1, sizeof(block_q5_1), dequantize_row_q5_1_ref, quantize_row_q5_1_ref, quant::quantize_q5_1, TF_CPU(Q8_32, q5_1)},
    {8, "Q8_0", QK8_0, sizeof(block_q8_0), dequantize_row_q8_0_ref, quantize_row_q8_0_ref, quant::quantize_q8_0, TF_CPU(Q8_32, q8_0)},
    {9, "Q8_1", QK8_1, sizeof(block_q8_1), dequantize_row_q8_1_ref, quantize_row_q8_1_ref, nullptr, TF_NO_CPU},
    {10, "Q2_K", QK_K, sizeof(block_q2_K), dequantize_row_q2_K_ref, quantize_row_q2_K_ref, quant::quantize_q2_K, TF_CPU(Q8_256, q2_k)},
    {11, "Q3_K", QK_K, sizeof(block_q3_K), dequantize_row_q3_K_ref, quantize_row_q3_K_ref, quant::quantize_q3_K, TF_CPU(Q8_256, q3_k)},
    {12, "Q4_K", QK_K, sizeof(block_q4_K), dequantize_row_q4_K_ref, quantize_row_q4_K_ref, quant::quantize_q4_K, TF_CPU(Q8_256, q4_k)},
    {13, "Q5_K", QK_K, sizeof(block_q5_K), dequantize_row_q5_K_ref, quantize_row_q5_K_ref, quant::quantize_q5_K, TF_CPU(Q8_256, q5_k)},
    {14, "Q6_K", QK_K, sizeof(block_q6_K), dequantize_row_q6_K_ref, quantize_row_q6_K_ref, quant::quantize_q6_K, TF_CPU(Q8_256, q6_k)},
    {15, "Q8_K", QK_K, sizeof(block_q8_K), dequantize_row_q8_K_ref, quantize_row_q8_K_ref, nullptr, TF_NO_CPU},
    {16, "IQ2_XXS", 256, 66, cpu::iq2_xxs::dequantize_ref, nullptr, quant::quantize_iq2_xxs, TF_CPU(Q8_256, iq2_xxs)},
    {17, "IQ2_XS", 256, 74, cpu::iq2_xs::dequantize_ref, nullptr, quant::quantize_iq2_xs, TF_CPU(Q8_256, iq2_xs)},
    {18, "IQ3_XXS", 256, 98, cpu::iq3_xxs::dequantize_ref, nullptr, quant::quantize_iq3_xxs, TF_CPU(Q8_256, iq3_xxs)},
    {19, "IQ1_S", 256, 50, cpu::iq1_s::dequantize_ref, nullptr, quant::quantize_iq1_s, TF_CPU(Q8_256, iq1_s)},
    {20, "IQ4_NL", 32, 18, cpu::iq4_nl::dequantize_ref, nullptr, quant::quantize_iq4_nl, TF_CPU(Q8_32, iq4_nl)},
    {21, "IQ3_S", 256, 110, cpu::iq3_s::dequantize_ref, nullptr, quant::quantize_iq3_s, TF_CPU(Q8_256, iq3_s)},
    {22, "IQ2_S", 256, 82, cpu::iq2_s::dequantize_ref, nullptr, quant::quantize_iq2_s, TF_CPU(Q8_256, iq2_s)},
    {23, "IQ4_XS", 256, 136, cpu::iq4_xs::dequantize_ref, nullptr, quant::quantize_iq4_xs, TF_CPU(Q8_256, iq4_xs)},
    {24, "I8", 1, 1, nullptr, nullptr, nullptr, TF_NO_CPU},
    {25, "I16", 1, 2, nullptr, nullptr, nullptr, TF_NO_CPU},
    {26, "I32", 1, 4, nullptr, nullptr, nullptr, TF_NO_CPU},
    {27, "I64", 1, 8, nullptr, nullptr, nullptr, TF_NO_CPU},
    {28, "F64", 1, 8, nullptr, nullptr, nullptr, TF_NO_CPU},
    {29, "IQ1_M", 256, 56, cpu::iq1_m::dequantize_ref, nullptr, quant::quantize_iq1_m, TF_CPU(Q8_256, iq1_m)},
    {30, "BF16", 1, 2, dequantize_row_bf16_ref, quantize_row_bf16_ref, quant::quantize_bf16, TF_CPU(F32, bf16)},
    {34, "TQ1_0", 256, 54, cpu::tq1_0::dequantize_ref, nullptr, quant::quantize_tq1_0, TF_CPU(Q8_256, tq1_0)},
    {35, "TQ2_0", 256, 66, cpu::tq2_0::dequantize_ref, nullptr, quant::quantize_tq2_0, TF_CPU(Q8_256, tq2_0)},
    {39, "MXFP4", 32, 17, cpu::mxfp4::dequantize_ref, nullptr, quant::quantize_mxfp4, TF_CPU(Q8_32, mxfp4)},
    {40, "NVFP4", 64, 36, nullptr, nullptr, nullptr, TF_NO_CPU},
    {41, "Q1_0", 128, 18, nullptr, nullptr, nullptr, TF_NO_CPU},
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
