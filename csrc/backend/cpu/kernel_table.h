// The CPU backend's kernel table: for each weight format it computes with, the layout of the
// activation rows the format multiplies with and one matmul entry point per ISA. Kept apart
// from the core format table (quant/traits.h), which knows no backend.
#pragma once
#include "backend/cpu/cpu_kernels.h"
#include "core/dtype.h"

namespace tf::cpu {

// The kernels of weight type `t`, or nullptr when this backend cannot compute with it.
const CpuKernels* find_kernels(GgmlType t);

}  // namespace tf::cpu
