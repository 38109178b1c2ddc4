// Products of the formats Q2_K Q3_K Q4_K Q5_K Q6_K (see mm_kernel.cuh).
#include "backend/cuda/mm_kernel.cuh"

namespace tf::cuda::k {

bool matmul_kquants(const MmArgs& a, const Tables& tb, cudaStream_t s) {
  switch (a.type) {
    case Q2_K: launch_int8<Q2_K>(a, tb, s); return true;
    case Q3_K: launch_int8<Q3_K>(a, tb, s); return true;
    case Q4_K: launch_int8<Q4_K>(a, tb, s); return true;
    case Q5_K: launch_int8<Q5_K>(a, tb, s); return true;
    case Q6_K: launch_int8<Q6_K>(a, tb, s); return true;
    default: return false;
  }
}

}  // namespace tf::cuda::k
