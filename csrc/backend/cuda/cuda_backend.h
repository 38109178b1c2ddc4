// CUDA backend entry points. With nvcc present (and the CUDA sources compiling) these are
// implemented in cuda_backend.cu; otherwise no_cuda.cpp provides the same API reporting that
// CUDA is absent, so the package builds, imports and tests on any machine.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "backend/cuda/device_plan.h"

namespace tf {
class Backend;
}

namespace tf::cuda {

bool built_with_cuda();
// Number of usable devices (0 when built without CUDA or no driver/device is present).
int device_count();
// Whether this build's CUDA backend runs whole forward passes (backend='auto' picks it then).
bool forward_supported();
std::string device_name(int device);
// The GPU architectures this build's kernels were compiled for (CMAKE_CUDA_ARCHITECTURES), "" without CUDA.
std::string compiled_archs();
// Why CUDA is not compiled in ("" when it is): no nvcc, disabled, or the CUDA build failed.
std::string build_note();
DeviceInfo device_info(int device);
// Device memory read bandwidth (bytes/s) measured on device 0: best of `reps` passes over `bytes`.
double measure_read_bandwidth(size_t bytes, int reps);

// The backend (make_backend("cuda")): throws when built without CUDA or no device is visible.
std::unique_ptr<Backend> make_cuda_backend(const std::string& variant);

// Host-to-host helpers for tests, through the backend's ops (host arrays are staged).
// Dequantize n values of type `type_id` (any type with a CUDA kernel).
void dequantize(uint32_t type_id, const void* src, size_t src_bytes, float* dst, int64_t n);
// y[r] = dot(W row r, x) for a rows x k weight of type_id, x float32.
void gemv(uint32_t type_id, const void* w, size_t w_bytes, int64_t rows, int64_t k, const float* x, float* y);

}  // namespace tf::cuda
