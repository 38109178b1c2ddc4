// Products of the formats IQ3_XXS IQ3_S IQ4_XS IQ4_NL MXFP4 (see mm_kernel.cuh).
#include "backend/cuda/mm_kernel.cuh"

namespace tf::cuda::k {

bool matmul_iq3_iq4(const MmArgs& a, const Tables& tb, cudaStream_t s) {
  switch (a.type) {
    case IQ3_XXS: launch_int8<IQ3_XXS>(a, tb, s); return true;
    case IQ3_S: launch_int8<IQ3_S>(a, tb, s); return true;
    case IQ4_XS: launch_int8<IQ4_XS>(a, tb, s); return true;
    case IQ4_NL: launch_int8<IQ4_NL>(a, tb, s); return true;
    case MXFP4: launch_int8<MXFP4>(a, tb, s); return true;
    default: return false;
  }
}

}  // namespace tf::cuda::k
