// The CPU backend (cpu_backend.cpp): built by make_backend("cpu").
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace tf {

// variant: the instruction set to cap the kernels at ("scalar", "avx2", "avx512"; "": the best
// this CPU has).
std::unique_ptr<Backend> make_cpu_backend(int threads, const std::string& variant);
// The variants this CPU and build can run, best first.
std::vector<std::string> cpu_backend_variants();

}  // namespace tf
