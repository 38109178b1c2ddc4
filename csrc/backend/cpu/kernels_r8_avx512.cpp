// The R8 product with AVX-512 VNNI on 256-bit vectors (vpdpbusd; r8_gemv.h): eight rows fill a
// ymm's lanes, and wider vectors would only add shuffles.
#include "backend/cpu/r8_gemv.h"

namespace tf::cpu::r8 {

void gemv_avx512(GgmlType t, int64_t nb, const uint8_t* sb0, const void* xq, size_t xs, int64_t ncols, float* y,
                 int64_t ldy) {
  simd::gemv<true>(t, nb, sb0, xq, xs, ncols, y, ldy);
}

}  // namespace tf::cpu::r8
