// CUDA backend entry points. With nvcc present these are implemented in cuda_backend.cu;
// otherwise no_cuda.cpp provides the same API reporting that CUDA is absent. So far this
// holds the first kernels (dequantization and GEMV for the SmolLM2 formats); the full CUDA
// engine is its own piece of work.
#pragma once
#include <cstdint>
#include <string>

namespace tf::cuda {

bool built_with_cuda();
// Number of usable devices (0 when built without CUDA or no driver/device is present).
int device_count();
// Whether this build's CUDA backend runs whole forward passes (backend='auto' picks it then).
bool forward_supported();
std::string device_name(int device);

// Host-to-host helpers for tests: upload, run the kernel, download.
// Dequantize n values of type `type_id` (F16, Q8_0, Q4_1 so far).
void dequantize(uint32_t type_id, const void* src, size_t src_bytes, float* dst, int64_t n);
// y[r] = dot(W row r, x) for a rows x k weight of type_id (F16, Q8_0, Q4_1), x float32.
void gemv(uint32_t type_id, const void* w, size_t w_bytes, int64_t rows, int64_t k, const float* x,
          float* y);

}  // namespace tf::cuda
