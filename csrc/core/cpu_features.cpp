#include "core/cpu_features.h"

#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace tf {

namespace {
CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  unsigned long long xcr0 = 0;
  if (osxsave) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (unsigned long long)hi << 32 | lo;
  }
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  const bool os_avx512 = (xcr0 & 0xe6) == 0xe6;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = os_avx && (b & (1u << 5));
    f.avx512f = os_avx512 && (b & (1u << 16));
    f.avx512dq = os_avx512 && (b & (1u << 17));
    f.avx512bw = os_avx512 && (b & (1u << 30));
    f.avx512vl = os_avx512 && (b & (1u << 31));
    f.avx512vnni = os_avx512 && (c & (1u << 11));
  }
  f.fma = f.fma && os_avx;
  f.f16c = f.f16c && os_avx;
#endif
  return f;
}
}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

CpuIsa best_isa() {
  static const CpuIsa isa = [] {
    const CpuFeatures& f = cpu_features();
    CpuIsa best = CpuIsa::Scalar;
#if defined(TF_HAVE_X86_KERNELS)
    if (f.avx2 && f.fma && f.f16c) best = CpuIsa::Avx2;
    if (best == CpuIsa::Avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni)
      best = CpuIsa::Avx512;
#else
    (void)f;
#endif
    if (const char* cap = std::getenv("TENSORFOLD_ISA")) {
      CpuIsa want = best;
      if (!std::strcmp(cap, "scalar")) want = CpuIsa::Scalar;
      else if (!std::strcmp(cap, "avx2")) want = CpuIsa::Avx2;
      else if (!std::strcmp(cap, "avx512")) want = CpuIsa::Avx512;
      if (int(want) < int(best)) best = want;
    }
    return best;
  }();
  return isa;
}

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx512: return "avx512";
    case CpuIsa::Avx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace tf
