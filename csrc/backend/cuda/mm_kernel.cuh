// The product kernels, included by the mm_*.cu files (one file per group of formats, so nvcc
// compiles them in parallel). One warp per weight row, kRowsPerBlock rows per block; a block
// takes one tile of activation rows (1 in decode, kTile in prefill), so a weight chunk is decoded
// once per tile and its int8 levels meet every row of the tile through __dp4a.
#pragma once
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_kernels.h"

namespace tf::cuda::k {

using namespace tf::cudafmt;

__device__ __forceinline__ void item_of(const MmArgs& a, int tile, int& mat, int64_t& row0, int& n) {
  if (a.items) {
    const MmItem it = a.items[blockIdx.y];
    mat = it.mat;
    row0 = it.row0;
    n = it.n;
  } else {
    mat = 0;
    row0 = int64_t(blockIdx.y) * tile;
    const int64_t left = a.n_rows - row0;
    n = int(left < tile ? left : tile);
  }
}

template <uint32_t F, int NT>
__global__ void __launch_bounds__(32 * kRowsPerBlock) mm_int8_kernel(const MmArgs a, const Tables tb) {
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + warp;
  if (r >= a.rows) return;
  int mat, n;
  int64_t row0;
  item_of(a, NT, mat, row0, n);
  const uint8_t* wrow = a.w + size_t(mat) * a.mat_stride + size_t(r) * a.row_stride;
  const int64_t nc = a.k / 32;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  for (int64_t c = lane; c < nc; c += 32) {
    Chunk ch;
    decode_chunk<F>(wrow, c, tb, ch);
    int wq[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) wq[i] = pack4(ch.q + 4 * i);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < n) {
        const int64_t row = row0 + t;
        const int4* xp = reinterpret_cast<const int4*>(a.xq + row * a.k + c * 32);
        const int4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
        int s0 = __dp4a(wq[0], x0.x, 0);
        s0 = __dp4a(wq[1], x0.y, s0);
        s0 = __dp4a(wq[2], x0.z, s0);
        s0 = __dp4a(wq[3], x0.w, s0);
        int s1 = __dp4a(wq[4], x1.x, 0);
        s1 = __dp4a(wq[5], x1.y, s1);
        s1 = __dp4a(wq[6], x1.z, s1);
        s1 = __dp4a(wq[7], x1.w, s1);
        float v = ch.s[0] * float(s0) + ch.s[1] * float(s1);
        if (has_min(F)) {
          const int ones = 0x01010101;
          int m0 = __dp4a(ones, x0.x, 0);
          m0 = __dp4a(ones, x0.y, m0);
          m0 = __dp4a(ones, x0.z, m0);
          m0 = __dp4a(ones, x0.w, m0);
          int m1 = __dp4a(ones, x1.x, 0);
          m1 = __dp4a(ones, x1.y, m1);
          m1 = __dp4a(ones, x1.z, m1);
          m1 = __dp4a(ones, x1.w, m1);
          v -= ch.m[0] * float(m0) + ch.m[1] * float(m1);
        }
        acc[t] += __ldg(a.xd + row * nc + c) * v;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float s = warp_sum(acc[t]);
    if (lane == 0 && t < n) {
      const int64_t row = row0 + t;
      a.y[a.y_off ? a.y_off[row] + r : row * a.ldy + r] = s;
    }
  }
}

template <uint32_t F, int NT>
__global__ void __launch_bounds__(32 * kRowsPerBlock) mm_float_kernel(const MmArgs a) {
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + warp;
  if (r >= a.rows) return;
  int mat, n;
  int64_t row0;
  item_of(a, NT, mat, row0, n);
  const uint8_t* wrow = a.w + size_t(mat) * a.mat_stride + size_t(r) * a.row_stride;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  for (int64_t i = lane; i < a.k; i += 32) {
    float w;
    if constexpr (F == F32) w = __ldg(reinterpret_cast<const float*>(wrow) + i);
    else {
      const uint32_t h = __ldg(reinterpret_cast<const uint16_t*>(wrow) + i);
      w = F == F16 ? half_f32(h) : bf16_f32(h);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < n) acc[t] += w * __ldg(a.xf + (row0 + t) * a.ldxf + i);
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float s = warp_sum(acc[t]);
    if (lane == 0 && t < n) {
      const int64_t row = row0 + t;
      a.y[a.y_off ? a.y_off[row] + r : row * a.ldy + r] = s;
    }
  }
}

inline dim3 mm_grid(const MmArgs& a) {
  const int64_t tiles = a.items ? a.n_items : (a.n_rows + a.tile - 1) / a.tile;
  return dim3(unsigned((a.rows + kRowsPerBlock - 1) / kRowsPerBlock), unsigned(tiles));
}

template <uint32_t F>
void launch_int8(const MmArgs& a, const Tables& tb, cudaStream_t s) {
  const dim3 g = mm_grid(a);
  if (g.x == 0 || g.y == 0) return;
  if (a.tile == 1) mm_int8_kernel<F, 1><<<g, 32 * kRowsPerBlock, 0, s>>>(a, tb);
  else mm_int8_kernel<F, kTile><<<g, 32 * kRowsPerBlock, 0, s>>>(a, tb);
  check_launch("product kernel");
}

template <uint32_t F>
void launch_float(const MmArgs& a, cudaStream_t s) {
  const dim3 g = mm_grid(a);
  if (g.x == 0 || g.y == 0) return;
  if (a.tile == 1) mm_float_kernel<F, 1><<<g, 32 * kRowsPerBlock, 0, s>>>(a);
  else mm_float_kernel<F, kTile><<<g, 32 * kRowsPerBlock, 0, s>>>(a);
  check_launch("product kernel");
}

// Per-file dispatchers (mm_*.cu): true when the type is theirs.
bool matmul_legacy(const MmArgs& a, const Tables& tb, cudaStream_t s);
bool matmul_kquants(const MmArgs& a, const Tables& tb, cudaStream_t s);
bool matmul_iq2(const MmArgs& a, const Tables& tb, cudaStream_t s);
bool matmul_iq3_iq4(const MmArgs& a, const Tables& tb, cudaStream_t s);

}  // namespace tf::cuda::k
