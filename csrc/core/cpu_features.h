// Runtime CPU feature detection, so one binary picks AVX-512, AVX2 or scalar kernels.
#pragma once
#include <string>

namespace tf {

enum class CpuIsa { Scalar = 0, Avx2 = 1, Avx512 = 2 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512vnni = false;
};

const CpuFeatures& cpu_features();
// Best ISA the kernels may use; TENSORFOLD_ISA=scalar|avx2|avx512 caps it (for tests).
CpuIsa best_isa();
const char* isa_name(CpuIsa isa);

}  // namespace tf
