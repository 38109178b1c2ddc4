#pragma once
#include <pybind11/pybind11.h>

namespace tf {
void bind_gguf(pybind11::module_& m);
void bind_quant(pybind11::module_& m);
void bind_engine(pybind11::module_& m);
void bind_kernels(pybind11::module_& m);
void bind_cuda(pybind11::module_& m);
void bind_ops(pybind11::module_& m);
void bind_moe(pybind11::module_& m);
void bind_comm(pybind11::module_& m);
}  // namespace tf
