// Products of F16 / BF16 weights, the product dispatcher, activation quantization, row gathers
// and embedding rows.
#include "backend/cuda/mm_kernel.cuh"

namespace tf::cuda::k {

namespace {

__global__ void quantize_q8_kernel(const float* src, int64_t ld, const int64_t* off, int64_t N, int64_t K, int8_t* q,
                                   float* d) {
  const int64_t row = blockIdx.y;
  const int64_t nc = K / 32;
  const int64_t c = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = int(threadIdx.x & 31);
  if (row >= N || c >= nc) return;
  const float* x = src + (off ? off[row] : row * ld);
  const float v = x[c * 32 + lane];
  const float amax = warp_max(fabsf(v));
  const float dd = q8_scale(amax);
  q[row * K + c * 32 + lane] = q8_level(v, dd);
  if (lane == 0) d[row * nc + c] = dd;
}

__global__ void gather_rows_kernel(const float* src, int64_t ld, const int64_t* off, int64_t K, float* dst) {
  const int64_t row = blockIdx.y;
  const float* x = src + (off ? off[row] : row * ld);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < K; i += int64_t(gridDim.x) * blockDim.x)
    dst[row * K + i] = x[i];
}

template <uint32_t F>
__global__ void embed_int8_kernel(const uint8_t* table, size_t row_stride, int64_t k, const int32_t* ids,
                                  float* out, int64_t ldo, const Tables tb) {
  const int64_t t = blockIdx.y;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= k / 32) return;
  Chunk ch;
  decode_chunk<F>(table + size_t(ids[t]) * row_stride, c, tb, ch);
  float* o = out + t * ldo + c * 32;
#pragma unroll
  for (int l = 0; l < 32; ++l)  // product and difference rounded apart (no FMA): bit-exact with the reference
    o[l] = __fsub_rn(__fmul_rn(ch.s[l >> 4], float(ch.q[l])), ch.m[l >> 4]);
}

__global__ void embed_float_kernel(uint32_t type, const uint8_t* table, size_t row_stride, int64_t k,
                                   const int32_t* ids, float* out, int64_t ldo) {
  const int64_t t = blockIdx.y;
  const uint8_t* row = table + size_t(ids[t]) * row_stride;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < k; i += int64_t(gridDim.x) * blockDim.x) {
    float v;
    if (type == F32) v = reinterpret_cast<const float*>(row)[i];
    else if (type == F16) v = half_f32(reinterpret_cast<const uint16_t*>(row)[i]);
    else v = bf16_f32(reinterpret_cast<const uint16_t*>(row)[i]);
    out[t * ldo + i] = v;
  }
}

unsigned blocks_for(int64_t n, int per) { return unsigned(std::min<int64_t>((n + per - 1) / per, 65535)); }

}  // namespace

void matmul(const MmArgs& a, const Tables& tb, cudaStream_t s) {
  if (a.type == F32) return launch_float<F32>(a, s);
  if (a.type == F16) return launch_float<F16>(a, s);
  if (a.type == BF16) return launch_float<BF16>(a, s);
  if (matmul_legacy(a, tb, s) || matmul_kquants(a, tb, s) || matmul_iq2(a, tb, s) || matmul_iq3_iq4(a, tb, s)) return;
  fail(ErrorKind::Unsupported, "CUDA backend: no product kernel for type id ", a.type);
}

void quantize_q8(const float* src, int64_t ld, const int64_t* off, int64_t N, int64_t K, int8_t* q, float* d,
                 cudaStream_t s) {
  if (N == 0 || K == 0) return;
  const dim3 g(unsigned((K / 32 + 7) / 8), unsigned(N));
  quantize_q8_kernel<<<g, 256, 0, s>>>(src, ld, off, N, K, q, d);
  check_launch("quantize_q8");
}

void gather_rows(const float* src, int64_t ld, const int64_t* off, int64_t N, int64_t K, float* dst, cudaStream_t s) {
  if (N == 0 || K == 0) return;
  gather_rows_kernel<<<dim3(blocks_for(K, 256), unsigned(N)), 256, 0, s>>>(src, ld, off, K, dst);
  check_launch("gather_rows");
}

void embed(uint32_t type, const uint8_t* table, size_t row_stride, int64_t k, const int32_t* ids, int64_t T,
           float* out, int64_t ldo, const Tables& tb, cudaStream_t s) {
  if (T == 0 || k == 0) return;
  if (type == 0 || type == F16 || type == BF16) {
    embed_float_kernel<<<dim3(blocks_for(k, 256), unsigned(T)), 256, 0, s>>>(type, table, row_stride, k, ids, out, ldo);
    return check_launch("embed");
  }
  const dim3 g(blocks_for(k / 32, 64), unsigned(T));
  switch (type) {
#define TF_X(F)                                                                            \
  case F:                                                                                  \
    embed_int8_kernel<F><<<g, 64, 0, s>>>(table, row_stride, k, ids, out, ldo, tb);        \
    break;
    TF_CUDA_INT8_FORMATS(TF_X)
#undef TF_X
    default: fail(ErrorKind::Unsupported, "CUDA backend: no embedding kernel for type id ", type);
  }
  check_launch("embed");
}

}  // namespace tf::cuda::k
