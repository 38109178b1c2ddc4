// Shared by the CUDA backend's .cu files: error checks, warp reductions, int8 packing.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/format_decode.h"
#include "core/error.h"

namespace tf::cuda {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(ErrorKind::Runtime, "CUDA ", what, ": ", cudaGetErrorString(e));
}
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* smem32) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) smem32[warp] = v;
  __syncthreads();
  float s = lane < nw ? smem32[lane] : 0.f;
  return warp_sum(s);
}

// Four int8 levels in one int (little-endian), for __dp4a.
__device__ __forceinline__ int pack4(const int8_t* q) {
  return int(uint32_t(uint8_t(q[0])) | uint32_t(uint8_t(q[1])) << 8 | uint32_t(uint8_t(q[2])) << 16 |
             uint32_t(uint8_t(q[3])) << 24);
}

}  // namespace tf::cuda
