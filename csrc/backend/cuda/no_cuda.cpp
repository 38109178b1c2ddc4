// Stub used when the package is built without nvcc: same API, CUDA reported absent.
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

namespace tf::cuda {

bool built_with_cuda() { return false; }
bool forward_supported() { return false; }

int device_count() { return 0; }
std::string device_name(int) { return ""; }

void dequantize(uint32_t, const void*, size_t, float*, int64_t) {
  fail(ErrorKind::Unsupported, "TensorFold was built without CUDA (nvcc was not found at build time)");
}
void gemv(uint32_t, const void*, size_t, int64_t, int64_t, const float*, float*) {
  fail(ErrorKind::Unsupported, "TensorFold was built without CUDA (nvcc was not found at build time)");
}

}  // namespace tf::cuda
