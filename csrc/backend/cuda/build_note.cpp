// Why this build has (or lacks) the CUDA backend, as CMake decided (TF_CUDA_NOTE).
#include <string>

#ifndef TF_CUDA_NOTE
#define TF_CUDA_NOTE ""
#endif

namespace tf::cuda {
std::string build_note() { return TF_CUDA_NOTE; }
}  // namespace tf::cuda
