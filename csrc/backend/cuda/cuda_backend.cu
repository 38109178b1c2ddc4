// First CUDA kernels: dequantization and a warp-per-row GEMV for F16, Q8_0 and Q4_1.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "quant/traits.h"
#include "quant/blocks.h"

namespace tf::cuda {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(ErrorKind::Runtime, "CUDA ", what, ": ", cudaGetErrorString(e));
}

__device__ inline float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// Value i of a row of the given format.
template <uint32_t T>
__device__ inline float load_value(const uint8_t* row, int64_t i);

template <>
__device__ inline float load_value<1>(const uint8_t* row, int64_t i) {  // F16
  return h2f(reinterpret_cast<const uint16_t*>(row)[i]);
}
template <>
__device__ inline float load_value<8>(const uint8_t* row, int64_t i) {  // Q8_0
  const block_q8_0* b = reinterpret_cast<const block_q8_0*>(row) + i / QK8_0;
  return h2f(b->d) * float(b->qs[i % QK8_0]);
}
template <>
__device__ inline float load_value<3>(const uint8_t* row, int64_t i) {  // Q4_1
  const block_q4_1* b = reinterpret_cast<const block_q4_1*>(row) + i / QK4_1;
  const int j = int(i % QK4_1);
  const int q = j < 16 ? (b->qs[j] & 0xf) : (b->qs[j - 16] >> 4);
  return float(q) * h2f(b->d) + h2f(b->m);
}

template <uint32_t T>
__global__ void dequantize_kernel(const uint8_t* src, float* dst, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = load_value<T>(src, i);
}

template <uint32_t T>
__global__ void gemv_kernel(const uint8_t* w, size_t row_bytes, int64_t rows, int64_t k,
                            const float* x, float* y) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const uint8_t* row = w + size_t(r) * row_bytes;
  float s = 0.f;
  for (int64_t i = lane; i < k; i += 32) s += load_value<T>(row, i) * x[i];
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
  if (lane == 0) y[r] = s;
}

// Block geometry comes from the traits table; this backend has kernels for a few types only.
size_t row_size(uint32_t type_id, int64_t k) {
  if (type_id != 1 && type_id != 3 && type_id != 8) {
    const TypeTraits* t = find_type_traits(type_id);
    fail(ErrorKind::Unsupported, "CUDA backend: type ", t ? t->name : std::to_string(type_id).c_str(),
         " has no kernel yet (F16, Q8_0, Q4_1)");
  }
  return row_bytes(static_cast<GgmlType>(type_id), k);
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t n) { check(cudaMalloc(&p, n ? n : 1), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(p); }
};

}  // namespace

bool built_with_cuda() { return true; }

bool forward_supported() { return false; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  return p.name;
}

void dequantize(uint32_t type_id, const void* src, size_t src_bytes, float* dst, int64_t n) {
  TF_CHECK(src_bytes == row_size(type_id, n), "dequantize: buffer size does not match n");
  DeviceBuffer s(src_bytes), d(size_t(n) * sizeof(float));
  check(cudaMemcpy(s.p, src, src_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  const int threads = 256;
  const unsigned blocks = unsigned((n + threads - 1) / threads);
  const auto* sp = static_cast<const uint8_t*>(s.p);
  auto* dp = static_cast<float*>(d.p);
  switch (type_id) {
    case 1: dequantize_kernel<1><<<blocks, threads>>>(sp, dp, n); break;
    case 8: dequantize_kernel<8><<<blocks, threads>>>(sp, dp, n); break;
    case 3: dequantize_kernel<3><<<blocks, threads>>>(sp, dp, n); break;
  }
  check(cudaGetLastError(), "kernel launch");
  check(cudaMemcpy(dst, d.p, size_t(n) * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
}

void gemv(uint32_t type_id, const void* w, size_t w_bytes, int64_t rows, int64_t k, const float* x,
          float* y) {
  const size_t rb = row_size(type_id, k);
  TF_CHECK(w_bytes == rb * size_t(rows), "gemv: weight buffer size does not match rows x k");
  DeviceBuffer dw(w_bytes), dx(size_t(k) * 4), dy(size_t(rows) * 4);
  check(cudaMemcpy(dw.p, w, w_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemcpy(dx.p, x, size_t(k) * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  const int warps = 8;
  const unsigned blocks = unsigned((rows + warps - 1) / warps);
  const auto* wp = static_cast<const uint8_t*>(dw.p);
  const auto* xp = static_cast<const float*>(dx.p);
  auto* yp = static_cast<float*>(dy.p);
  switch (type_id) {
    case 1: gemv_kernel<1><<<blocks, warps * 32>>>(wp, rb, rows, k, xp, yp); break;
    case 8: gemv_kernel<8><<<blocks, warps * 32>>>(wp, rb, rows, k, xp, yp); break;
    case 3: gemv_kernel<3><<<blocks, warps * 32>>>(wp, rb, rows, k, xp, yp); break;
  }
  check(cudaGetLastError(), "kernel launch");
  check(cudaMemcpy(y, dy.p, size_t(rows) * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
}

}  // namespace tf::cuda
