// One row per format the CPU computes with; the kernels live in backend/cpu/formats/*.cpp
// (IQ/TQ/MXFP4) and kernels_{scalar,avx2,avx512}.cpp (float, legacy, K-quants); the aarch64
// kernels in backend/cpu/arm (one header per format, built once per ISA level).
#include "backend/cpu/kernel_table.h"

#include "core/dtype.h"

#include <utility>

#define TF_KERNEL_PARAMS int64_t, const void*, size_t, int64_t, int64_t, const void*, size_t, int64_t, float*, int64_t
#define TF_DECLARE_KERNELS(ns)    \
  namespace tf::cpu::ns {         \
  void scalar(TF_KERNEL_PARAMS);  \
  void avx2(TF_KERNEL_PARAMS);    \
  void avx512(TF_KERNEL_PARAMS);  \
  void neon(TF_KERNEL_PARAMS);    \
  void dotprod(TF_KERNEL_PARAMS); \
  void i8mm(TF_KERNEL_PARAMS);    \
  }

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
TF_DECLARE_KERNELS(iq4_nl)
TF_DECLARE_KERNELS(iq4_xs)
TF_DECLARE_KERNELS(tq1_0)
TF_DECLARE_KERNELS(mxfp4)
TF_DECLARE_KERNELS(iq2_xxs)
TF_DECLARE_KERNELS(iq2_xs)
TF_DECLARE_KERNELS(iq2_s)
TF_DECLARE_KERNELS(iq3_xxs)
TF_DECLARE_KERNELS(iq3_s)
TF_DECLARE_KERNELS(tq2_0)
TF_DECLARE_KERNELS(iq1_s)
TF_DECLARE_KERNELS(iq1_m)

#define TF_DECLARE_PANELS(ns) \
  namespace tf::cpu::ns {       \
  void avx512_panels(TF_KERNEL_PARAMS); \
  }
#if defined(TF_HAVE_X86_KERNELS)
TF_DECLARE_PANELS(q4_0)
TF_DECLARE_PANELS(q4_1)
TF_DECLARE_PANELS(q5_0)
TF_DECLARE_PANELS(q5_1)
TF_DECLARE_PANELS(q8_0)
TF_DECLARE_PANELS(q2_k)
TF_DECLARE_PANELS(q3_k)
TF_DECLARE_PANELS(q4_k)
TF_DECLARE_PANELS(q5_k)
TF_DECLARE_PANELS(q6_k)
TF_DECLARE_PANELS(iq4_nl)
TF_DECLARE_PANELS(mxfp4)
#endif

namespace tf::cpu {
namespace {

#if defined(TF_HAVE_X86_KERNELS)
#define TF_ROW(type, layout, ns) {GgmlType::type, {ActLayout::layout, ns::scalar, ns::avx2, ns::avx512}}
#elif defined(TF_HAVE_ARM_KERNELS)
#define TF_ROW(type, layout, ns) \
  {GgmlType::type, {ActLayout::layout, ns::scalar, nullptr, nullptr, ns::neon, ns::dotprod, ns::i8mm}}
#else
#define TF_ROW(type, layout, ns) {GgmlType::type, {ActLayout::layout, ns::scalar, nullptr, nullptr}}
#endif

struct Row {
  GgmlType type;
  CpuKernels k;
};

const Row kRows[] = {
    TF_ROW(F32, F32, f32),         TF_ROW(F16, F32, f16),         TF_ROW(BF16, F32, bf16),
    TF_ROW(Q4_0, Q8_32, q4_0),     TF_ROW(Q4_1, Q8_32, q4_1),     TF_ROW(Q5_0, Q8_32, q5_0),
    TF_ROW(Q5_1, Q8_32, q5_1),     TF_ROW(Q8_0, Q8_32, q8_0),     TF_ROW(IQ4_NL, Q8_32, iq4_nl),
    TF_ROW(MXFP4, Q8_32, mxfp4),    TF_ROW(Q2_K, Q8_256, q2_k),    TF_ROW(Q3_K, Q8_256, q3_k),
    TF_ROW(Q4_K, Q8_256, q4_k),    TF_ROW(Q5_K, Q8_256, q5_k),    TF_ROW(Q6_K, Q8_256, q6_k),
    TF_ROW(IQ2_XXS, Q8_256, iq2_xxs), TF_ROW(IQ2_XS, Q8_256, iq2_xs), TF_ROW(IQ2_S, Q8_256, iq2_s),
    TF_ROW(IQ3_XXS, Q8_256, iq3_xxs), TF_ROW(IQ3_S, Q8_256, iq3_s), TF_ROW(IQ1_S, Q8_256, iq1_s),
    TF_ROW(IQ1_M, Q8_256, iq1_m),  TF_ROW(IQ4_XS, Q8_256, iq4_xs), TF_ROW(TQ1_0, Q8_256, tq1_0),
    TF_ROW(TQ2_0, Q8_256, tq2_0),
};

struct Index {
  CpuKernels by_id_k[kGgmlTypeIdLimit] = {};
  const CpuKernels* by_id[kGgmlTypeIdLimit] = {};
  Index() {
    for (const Row& r : kRows) {
      by_id_k[uint32_t(r.type)] = r.k;
      by_id[uint32_t(r.type)] = &by_id_k[uint32_t(r.type)];
    }
#if defined(TF_HAVE_X86_KERNELS)
    // The formats with AVX-512 prefill panels (kernels_avx512.cpp).
    const std::pair<GgmlType, MatmulFn> panels[] = {
        {GgmlType::Q4_0, q4_0::avx512_panels}, {GgmlType::Q4_1, q4_1::avx512_panels},
        {GgmlType::Q5_0, q5_0::avx512_panels}, {GgmlType::Q5_1, q5_1::avx512_panels},
        {GgmlType::Q8_0, q8_0::avx512_panels}, {GgmlType::Q2_K, q2_k::avx512_panels},
        {GgmlType::Q3_K, q3_k::avx512_panels}, {GgmlType::Q4_K, q4_k::avx512_panels},
        {GgmlType::Q5_K, q5_k::avx512_panels}, {GgmlType::Q6_K, q6_k::avx512_panels},
        {GgmlType::IQ4_NL, iq4_nl::avx512_panels}, {GgmlType::MXFP4, mxfp4::avx512_panels}};
    for (const auto& [t, fn] : panels) by_id_k[uint32_t(t)].avx512_panels = fn;
#endif
  }
};

}  // namespace

const CpuKernels* find_kernels(GgmlType t) {
  static const Index idx;
  const uint32_t id = uint32_t(t);
  return id < kGgmlTypeIdLimit ? idx.by_id[id] : nullptr;
}

}  // namespace tf::cpu
