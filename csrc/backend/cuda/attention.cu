// Paged attention: one thread block per (token, query head), four warps splitting the token's
// cache entries; each warp keeps an online softmax (running max, sum, and its share of the
// output, lane l holding channels l, l + 32, ...), the warps are merged at the end. GQA and MLA
// latent rows alike (latent: V is the first v_dim values of the K row). Scores in float32 from
// half or float cache rows.
#include <cuda_fp16.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_kernels.h"

namespace tf::cuda::k {

namespace {

constexpr int kWarps = 4;

template <bool HALF>
__device__ __forceinline__ float ld(const void* base, int64_t i) {
  if constexpr (HALF) return __half2float(static_cast<const __half*>(base)[i]);
  else return static_cast<const float*>(base)[i];
}

// PER: channels per lane (head_dim and v_dim <= 32 * PER).
template <int PER, bool HALF>
__global__ void __launch_bounds__(32 * kWarps) attention_kernel(const AttnArgs a) {
  const int64_t t = blockIdx.x;
  const int qh = int(blockIdx.y);
  const int g = qh / a.group;  // cache head
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  const float* q = a.q + t * a.q_stride + int64_t(qh) * a.head_dim;
  float qv[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < a.head_dim ? q[d] * a.scale : 0.f;
  }
  const int32_t* table = a.tables + int64_t(a.tab_of[t]) * a.max_blocks;
  const int64_t begin = a.begin[t], end = a.end[t];
  const int64_t spec_heads = a.n_cache_heads;
  const int64_t v_off = a.spec_v_dim > 0 ? spec_heads * a.k_dim * a.block_size : 0;
  const int64_t v_row = a.spec_v_dim > 0 ? a.spec_v_dim : a.k_dim;
  float m = -INFINITY, l = 0.f, acc[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) acc[i] = 0.f;
  for (int64_t e = begin + warp; e < end; e += kWarps) {
    const int32_t blk = table[e / a.block_size];
    const int64_t pos = e % a.block_size;
    const int64_t page = (int64_t(a.layer) * a.n_blocks + blk) * a.page_stride;
    const int64_t kbase = page + int64_t(g) * a.block_size * a.k_dim + pos * a.k_dim;
    const int64_t vbase = a.spec_v_dim > 0 ? page + v_off + int64_t(g) * a.block_size * v_row + pos * v_row : kbase;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int d = lane + 32 * i;
      if (d < a.head_dim) s += qv[i] * ld<HALF>(a.base, kbase + d);
    }
    s = warp_sum(s);
    const float mn = fmaxf(m, s);
    const float corr = __expf(m - mn), p = __expf(s - mn);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * corr + (d < a.v_dim ? p * ld<HALF>(a.base, vbase + d) : 0.f);
    }
    m = mn;
  }
  // Merge the warps: each writes (m, l, acc) to shared memory; warp 0 combines.
  __shared__ float sm[kWarps], sl[kWarps];
  __shared__ float sacc[kWarps][32 * PER];
  if (lane == 0) {
    sm[warp] = m;
    sl[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) sacc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  float M = -INFINITY;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm[w]);
  const float sink = a.sinks ? a.sinks[qh] : -INFINITY;
  M = fmaxf(M, sink);
  float L = a.sinks ? __expf(sink - M) : 0.f;
  float c[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    c[w] = sm[w] == -INFINITY ? 0.f : __expf(sm[w] - M);
    L += sl[w] * c[w];
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  float* out = a.out + t * a.out_stride + int64_t(qh) * a.v_dim;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int d = lane + 32 * i;
    if (d >= a.v_dim) continue;
    float v = 0.f;
    for (int w = 0; w < kWarps; ++w) v += sacc[w][d] * c[w];
    out[d] = v * inv;
  }
}

template <int PER>
void launch(const AttnArgs& a, cudaStream_t s) {
  const dim3 g(unsigned(a.T), unsigned(a.n_cache_heads * a.group));
  if (a.half) attention_kernel<PER, true><<<g, 32 * kWarps, 0, s>>>(a);
  else attention_kernel<PER, false><<<g, 32 * kWarps, 0, s>>>(a);
}

}  // namespace

void attention(const AttnArgs& a, cudaStream_t s) {
  if (a.T == 0) return;
  const int w = std::max(a.head_dim, a.v_dim);
  if (w <= 64) launch<2>(a, s);
  else if (w <= 128) launch<4>(a, s);
  else if (w <= 256) launch<8>(a, s);
  else if (w <= 640) launch<20>(a, s);
  else fail(ErrorKind::Unsupported, "CUDA attention: rows of ", w, " values (at most 640)");
  check_launch("attention");
}

}  // namespace tf::cuda::k
