// The CPU backend (cpu_backend.cpp): built by make_backend("cpu").
#pragma once
#include <memory>

#include "backend/backend.h"
#include "core/cpu_features.h"

namespace tf {

std::unique_ptr<Backend> make_cpu_backend(int threads, CpuIsa isa);

}  // namespace tf
