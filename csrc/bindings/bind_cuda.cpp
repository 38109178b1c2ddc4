// Binds the CUDA backend's test entry points (stubs when built without CUDA).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "backend/cuda/cuda_backend.h"
#include "bindings/bindings.h"

namespace py = pybind11;

namespace tf {

void bind_cuda(py::module_& m) {
  auto c = m.def_submodule("cuda", "CUDA backend (first kernels)");
  c.def("built_with_cuda", &cuda::built_with_cuda);
  c.def("device_count", &cuda::device_count);
  c.def("device_name", &cuda::device_name, py::arg("device") = 0);
  c.def("dequantize",
        [](uint32_t type_id, py::array_t<uint8_t, py::array::c_style | py::array::forcecast> data, int64_t n) {
          py::array_t<float> out(n);
          cuda::dequantize(type_id, data.data(), size_t(data.size()), out.mutable_data(), n);
          return out;
        },
        py::arg("type_id"), py::arg("data"), py::arg("n"));
  c.def("gemv",
        [](uint32_t type_id, py::array_t<uint8_t, py::array::c_style | py::array::forcecast> w,
           int64_t rows, int64_t k, py::array_t<float, py::array::c_style | py::array::forcecast> x) {
          if (x.size() != k) throw py::value_error("x must have k elements");
          py::array_t<float> y(rows);
          cuda::gemv(type_id, w.data(), size_t(w.size()), rows, k, x.data(), y.mutable_data());
          return y;
        },
        py::arg("type_id"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("x"));
}

}  // namespace tf
