// Products of the formats IQ2_XXS IQ2_XS IQ2_S (see mm_kernel.cuh).
#include "backend/cuda/mm_kernel.cuh"

namespace tf::cuda::k {

bool matmul_iq2(const MmArgs& a, const Tables& tb, cudaStream_t s) {
  switch (a.type) {
    case IQ2_XXS: launch_int8<IQ2_XXS>(a, tb, s); return true;
    case IQ2_XS: launch_int8<IQ2_XS>(a, tb, s); return true;
    case IQ2_S: launch_int8<IQ2_S>(a, tb, s); return true;
    default: return false;
  }
}

}  // namespace tf::cuda::k
