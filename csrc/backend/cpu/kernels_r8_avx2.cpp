// The R8 product with AVX2: maddubs + madd in place of VNNI's vpdpbusd (r8_gemv.h).
#include "backend/cpu/r8_gemv.h"

namespace tf::cpu::r8 {

void gemv_avx2(GgmlType t, int64_t nb, const uint8_t* sb0, const void* xq, size_t xs, int64_t ncols, float* y,
               int64_t ldy) {
  simd::gemv<false>(t, nb, sb0, xq, xs, ncols, y, ldy);
}

}  // namespace tf::cpu::r8
