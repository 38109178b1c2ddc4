// Public CPU kernel entry points: validate cheaply, then dispatch by tf::best_isa().
#include "backend/cpu/kernels.h"

#include "backend/cpu/kernels_internal.h"
#include "core/error.h"

namespace tf::cpu {

using detail::ActKind;
using detail::MatmulFn;

namespace {

detail::WeightInfo checked_info(GgmlType wt, int64_t k) {
  const detail::WeightInfo info = detail::weight_info(wt);
  TF_CHECK(info.ok, "cpu kernels: unsupported weight type id ", uint32_t(wt));
  TF_CHECK(k > 0 && k % info.block == 0, "cpu kernels: k=", k,
           " must be a positive multiple of the block size ", info.block);
  return info;
}

MatmulFn fn_for(CpuIsa isa, GgmlType wt) {
  MatmulFn f = nullptr;
#if defined(TF_HAVE_X86_KERNELS)
  if (isa == CpuIsa::Avx512) f = detail::avx512_matmul_fn(wt);
  if (!f && isa >= CpuIsa::Avx2) f = detail::avx2_matmul_fn(wt);
#else
  (void)isa;
#endif
  if (!f) f = detail::scalar_matmul_fn(wt);
  return f;
}

void quant_for(CpuIsa isa, ActKind kind, const float* x, void* xq, int64_t k) {
#if defined(TF_HAVE_X86_KERNELS)
  if (isa == CpuIsa::Avx512) return detail::quantize_avx512(kind, x, xq, k);
  if (isa == CpuIsa::Avx2) return detail::quantize_avx2(kind, x, xq, k);
#else
  (void)isa;
#endif
  detail::quantize_scalar(kind, x, xq, k);
}

}  // namespace

GgmlType act_type_for(GgmlType wt) {
  switch (wt) {
    case GgmlType::Q4_0: case GgmlType::Q5_0: case GgmlType::Q8_0: return GgmlType::Q8_0;
    case GgmlType::Q4_1: case GgmlType::Q5_1: return GgmlType::Q8_1;
    case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::Q4_K: case GgmlType::Q5_K:
    case GgmlType::Q6_K: return GgmlType::Q8_K;
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: return GgmlType::F32;
    default: fail(ErrorKind::Unsupported, "cpu kernels: unsupported weight type id ", uint32_t(wt));
  }
}

ActLayout act_layout(GgmlType wt) {
  const auto info = detail::weight_info(wt);
  TF_CHECK(info.ok, "cpu kernels: unsupported weight type id ", uint32_t(wt));
  switch (info.act) {
    case ActKind::G32: return ActLayout::Q8_32;
    case ActKind::K: return ActLayout::Q8_256;
    default: return ActLayout::F32;
  }
}

size_t act_row_bytes(GgmlType wt, int64_t k) {
  const auto info = checked_info(wt, k);
  switch (info.act) {
    case ActKind::F32: return size_t(k) * 4;
    case ActKind::G32: return detail::g32_row_bytes(k);
    case ActKind::K: return size_t(k / 256) * sizeof(detail::ActK);
  }
  return 0;
}

void quantize_act_row(GgmlType wt, const float* x, void* xq, int64_t k) {
  const auto info = checked_info(wt, k);
  quant_for(best_isa(), info.act, x, xq, k);
}

void quantize_act_row_scalar(GgmlType wt, const float* x, void* xq, int64_t k) {
  const auto info = checked_info(wt, k);
  detail::quantize_scalar(info.act, x, xq, k);
}

void matmul_rows(GgmlType wt, int64_t k, const void* w, size_t w_stride, int64_t r0, int64_t r1,
                 const void* xq, size_t xq_stride, int64_t ncols, float* y, int64_t ldy) {
  checked_info(wt, k);
  if (r1 <= r0 || ncols <= 0) return;
  fn_for(best_isa(), wt)(k, w, w_stride, r0, r1, xq, xq_stride, ncols, y, ldy);
}

void matmul_rows_scalar(GgmlType wt, int64_t k, const void* w, size_t w_stride, int64_t r0,
                        int64_t r1, const void* xq, size_t xq_stride, int64_t ncols, float* y,
                        int64_t ldy) {
  checked_info(wt, k);
  if (r1 <= r0 || ncols <= 0) return;
  detail::scalar_matmul_fn(wt)(k, w, w_stride, r0, r1, xq, xq_stride, ncols, y, ldy);
}

const char* kernel_isa() { return isa_name(best_isa()); }

namespace detail {

bool isa_available(CpuIsa isa) {
  if (isa == CpuIsa::Scalar) return true;
#if defined(TF_HAVE_X86_KERNELS)
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  if (isa == CpuIsa::Avx2) return avx2;
  return avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni;
#else
  return false;
#endif
}

void quantize_act_row_isa(CpuIsa isa, GgmlType wt, const float* x, void* xq, int64_t k) {
  TF_CHECK(isa_available(isa), "cpu kernels: this CPU/build lacks ISA ", isa_name(isa));
  const auto info = checked_info(wt, k);
  quant_for(isa, info.act, x, xq, k);
}

void matmul_rows_isa(CpuIsa isa, GgmlType wt, int64_t k, const void* w, size_t w_stride,
                     int64_t r0, int64_t r1, const void* xq, size_t xq_stride, int64_t ncols,
                     float* y, int64_t ldy) {
  TF_CHECK(isa_available(isa), "cpu kernels: this CPU/build lacks ISA ", isa_name(isa));
  checked_info(wt, k);
  if (r1 <= r0 || ncols <= 0) return;
  fn_for(isa, wt)(k, w, w_stride, r0, r1, xq, xq_stride, ncols, y, ldy);
}

}  // namespace detail

}  // namespace tf::cpu
