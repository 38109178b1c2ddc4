// Public CPU kernel entry points: validate cheaply, then dispatch through the format's row
// of the CPU kernel table to the best ISA this CPU has.
#include "backend/cpu/kernels.h"

#include "backend/cpu/kernel_table.h"
#include "backend/cpu/kernels_internal.h"
#include "core/error.h"
#include "quant/traits.h"

namespace tf::cpu {

using detail::ActKind;

namespace {

const CpuKernels& checked(GgmlType wt, int64_t k) {
  const TypeTraits* tr = find_type_traits(uint32_t(wt));
  const CpuKernels* kern = find_kernels(wt);
  if (tr == nullptr || kern == nullptr)
    fail(ErrorKind::Unsupported, "cpu kernels: no kernel for weight type ",
         tr ? tr->name : ("id " + std::to_string(uint32_t(wt))).c_str(), " (supported: ", computable_type_names(), ")");
  TF_CHECK(k > 0 && k % tr->block_size == 0, "cpu kernels: k=", k,
           " must be a positive multiple of the block size ", tr->block_size, " of ", tr->name);
  return *kern;
}

MatmulFn fn_for(CpuIsa isa, const CpuKernels& kern) {
  if (isa == CpuIsa::Avx512 && kern.avx512) return kern.avx512;
  if ((isa == CpuIsa::Avx512 || isa == CpuIsa::Avx2) && kern.avx2) return kern.avx2;
  if (isa == CpuIsa::I8mm && kern.i8mm) return kern.i8mm;
  if ((isa == CpuIsa::I8mm || isa == CpuIsa::Dotprod) && kern.dotprod) return kern.dotprod;
  if (isa >= CpuIsa::Neon && kern.neon) return kern.neon;
  return kern.scalar;
}

void quant_for(CpuIsa isa, ActKind kind, const float* x, void* xq, int64_t k) {
#if defined(TF_HAVE_X86_KERNELS)
  if (isa == CpuIsa::Avx512) return detail::quantize_avx512(kind, x, xq, k);
  if (isa == CpuIsa::Avx2) return detail::quantize_avx2(kind, x, xq, k);
#elif defined(TF_HAVE_ARM_KERNELS)
  if (isa >= CpuIsa::Neon) return detail::quantize_neon(kind, x, xq, k);
#else
  (void)isa;
#endif
  detail::quantize_scalar(kind, x, xq, k);
}

}  // namespace

ActLayout act_layout(GgmlType wt) {
  const CpuKernels* kern = find_kernels(wt);
  if (kern == nullptr) checked(wt, 1);  // throws the message
  return kern->act;
}

size_t act_row_bytes(GgmlType wt, int64_t k) {
  switch (checked(wt, k).act) {
    case ActKind::F32: return size_t(k) * 4;
    case ActKind::Q8_32: return detail::g32_row_bytes(k);
    case ActKind::Q8_256: return size_t(k / 256) * sizeof(detail::ActK);
  }
  return 0;
}

void quantize_act_row(GgmlType wt, const float* x, void* xq, int64_t k) {
  quant_for(best_isa(), checked(wt, k).act, x, xq, k);
}

void quantize_act_row_scalar(GgmlType wt, const float* x, void* xq, int64_t k) {
  detail::quantize_scalar(checked(wt, k).act, x, xq, k);
}

void matmul_rows(GgmlType wt, int64_t k, const void* w, size_t w_stride, int64_t r0, int64_t r1,
                 const void* xq, size_t xq_stride, int64_t ncols, float* y, int64_t ldy) {
  const CpuKernels& tr = checked(wt, k);
  if (r1 <= r0 || ncols <= 0) return;
  fn_for(best_isa(), tr)(k, w, w_stride, r0, r1, xq, xq_stride, ncols, y, ldy);
}

void matmul_rows_scalar(GgmlType wt, int64_t k, const void* w, size_t w_stride, int64_t r0,
                        int64_t r1, const void* xq, size_t xq_stride, int64_t ncols, float* y,
                        int64_t ldy) {
  const CpuKernels& tr = checked(wt, k);
  if (r1 <= r0 || ncols <= 0) return;
  tr.scalar(k, w, w_stride, r0, r1, xq, xq_stride, ncols, y, ldy);
}

const char* kernel_isa() { return isa_name(best_isa()); }

namespace detail {

bool isa_available(CpuIsa isa) {
  if (isa == CpuIsa::Scalar) return true;
#if defined(TF_HAVE_X86_KERNELS)
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  if (isa == CpuIsa::Avx2) return avx2;
  if (isa == CpuIsa::Avx512) return avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni;
  return false;
#elif defined(TF_HAVE_ARM_KERNELS)
  const CpuFeatures& f = cpu_features();
  if (isa == CpuIsa::Neon) return f.asimd;
  if (isa == CpuIsa::Dotprod) return f.asimddp;
  if (isa == CpuIsa::I8mm) return f.i8mm;
  return false;
#else
  return false;
#endif
}

void quantize_act_row_isa(CpuIsa isa, GgmlType wt, const float* x, void* xq, int64_t k) {
  TF_CHECK(isa_available(isa), "cpu kernels: this CPU/build lacks ISA ", isa_name(isa));
  quant_for(isa, checked(wt, k).act, x, xq, k);
}

void matmul_rows_isa(CpuIsa isa, GgmlType wt, int64_t k, const void* w, size_t w_stride,
                     int64_t r0, int64_t r1, const void* xq, size_t xq_stride, int64_t ncols,
                     float* y, int64_t ldy) {
  TF_CHECK(isa_available(isa), "cpu kernels: this CPU/build lacks ISA ", isa_name(isa));
  const CpuKernels& tr = checked(wt, k);
  if (r1 <= r0 || ncols <= 0) return;
  fn_for(isa, tr)(k, w, w_stride, r0, r1, xq, xq_stride, ncols, y, ldy);
}

bool matmul_rows_panels(CpuIsa isa, GgmlType wt, int64_t k, const void* w, size_t w_stride, int64_t r0, int64_t r1,
                        const void* xq, size_t xq_stride, int64_t ncols, float* y, int64_t ldy) {
  const CpuKernels& tr = checked(wt, k);
  if (isa != CpuIsa::Avx512 || !tr.avx512_panels || !isa_available(isa)) return false;
  if (r1 > r0 && ncols > 0) tr.avx512_panels(k, w, w_stride, r0, r1, xq, xq_stride, ncols, y, ldy);
  return true;
}

}  // namespace detail

}  // namespace tf::cpu
