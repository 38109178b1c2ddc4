// Products of the formats Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 (see mm_kernel.cuh).
#include "backend/cuda/mm_kernel.cuh"

namespace tf::cuda::k {

bool matmul_legacy(const MmArgs& a, const Tables& tb, cudaStream_t s) {
  switch (a.type) {
    case Q4_0: launch_int8<Q4_0>(a, tb, s); return true;
    case Q4_1: launch_int8<Q4_1>(a, tb, s); return true;
    case Q5_0: launch_int8<Q5_0>(a, tb, s); return true;
    case Q5_1: launch_int8<Q5_1>(a, tb, s); return true;
    case Q8_0: launch_int8<Q8_0>(a, tb, s); return true;
    default: return false;
  }
}

}  // namespace tf::cuda::k
