// Stub used when the package is built without CUDA: same API, CUDA reported absent.
#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

#ifndef TF_CUDA_NOTE
#define TF_CUDA_NOTE "nvcc was not found when TensorFold was built"
#endif

namespace tf::cuda {

namespace {
[[noreturn]] void absent() { fail(ErrorKind::Unsupported, "TensorFold was built without CUDA (", TF_CUDA_NOTE, ")"); }
}  // namespace

bool built_with_cuda() { return false; }
bool forward_supported() { return false; }
int device_count() { return 0; }
std::string device_name(int) { return ""; }
std::string compiled_archs() { return ""; }
DeviceInfo device_info(int) { absent(); }
double measure_read_bandwidth(size_t, int) { absent(); }
std::unique_ptr<Backend> make_cuda_backend(const std::string&) { absent(); }
void dequantize(uint32_t, const void*, size_t, float*, int64_t) { absent(); }
void gemv(uint32_t, const void*, size_t, int64_t, int64_t, const float*, float*) { absent(); }

}  // namespace tf::cuda
