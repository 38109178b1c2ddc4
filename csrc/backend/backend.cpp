// Choosing a backend by name: the engine's `backend` option and the op tests.
#include "backend/backend.h"

#include <cstdlib>

#include "backend/cpu/cpu_backend.h"
#include "backend/profiled_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "core/cpu_features.h"

namespace tf {

std::vector<std::string> available_backends() {
  std::vector<std::string> out;
  for (const std::string& v : cpu_backend_variants()) out.push_back("cpu:" + v);
  if (cuda::device_count() > 0) out.push_back("cuda");
  return out;
}

namespace {
std::unique_ptr<Backend> make_named_backend(const BackendOptions& opts);
}

std::unique_ptr<Backend> make_backend(const BackendOptions& opts) {
  // TENSORFOLD_PROFILE_OPS=1: every op timed (bench/profile_decode.py reads tf::op_profile()).
  const char* prof = std::getenv("TENSORFOLD_PROFILE_OPS");
  auto b = make_named_backend(opts);
  if (prof && *prof && std::string(prof) != "0") return make_profiled_backend(std::move(b));
  return b;
}

namespace {

std::unique_ptr<Backend> make_named_backend(const BackendOptions& opts) {
  std::string name = opts.name, variant = opts.variant;
  if (const auto colon = name.find(':'); colon != std::string::npos) {
    variant = name.substr(colon + 1);
    name = name.substr(0, colon);
  }
  if (name == "auto") name = cuda::device_count() > 0 && cuda::forward_supported() ? "cuda" : "cpu";
  if (name == "cpu") {
    const int threads = opts.threads > 0 ? opts.threads : usable_cpus();
    return make_cpu_backend(threads, variant);
  }
  if (name == "cuda") {
    if (!cuda::built_with_cuda())
      fail(ErrorKind::Unsupported, "backend 'cuda': TensorFold was built without CUDA (", cuda::build_note(),
           "); use backend='cpu'");
    if (cuda::device_count() == 0)
      fail(ErrorKind::Unsupported, "backend 'cuda': no CUDA device is visible; use backend='cpu'");
    return cuda::make_cuda_backend(variant);
  }
  fail(ErrorKind::InvalidInput, "unknown backend '", opts.name, "' (available: cpu, cuda, auto)");
}

}  // namespace

}  // namespace tf
