// Binds the CUDA backend's entry points (stubs when built without CUDA), the host emulation of
// its format arithmetic and its memory plan (both plain C++, present in every build).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device_plan.h"
#include "backend/cuda/host_emulation.h"
#include "bindings/bindings.h"
#include "core/error.h"
#include "quant/traits.h"

namespace py = pybind11;

namespace tf {

namespace {
template <typename T>
using carray = py::array_t<T, py::array::c_style | py::array::forcecast>;

py::dict info_dict(const cuda::DeviceInfo& d) {
  py::dict o;
  o["name"] = d.name;
  o["cc_major"] = d.cc_major;
  o["cc_minor"] = d.cc_minor;
  o["total_bytes"] = d.total_bytes;
  o["free_bytes"] = d.free_bytes;
  o["integrated"] = d.integrated;
  o["pageable_access"] = d.pageable_access;
  o["sm_count"] = d.sm_count;
  o["bandwidth_gbs"] = d.bandwidth_gbs;
  return o;
}

template <typename T>
T get(const py::dict& d, const char* k, T def) {
  return d.contains(k) ? d[k].cast<T>() : def;
}
}  // namespace

void bind_cuda(py::module_& m) {
  auto c = m.def_submodule("cuda", "CUDA backend: device queries, test entry points, host emulation, memory plan");
  c.def("built_with_cuda", &cuda::built_with_cuda);
  c.def("forward_supported", &cuda::forward_supported);
  c.def("device_count", &cuda::device_count);
  c.def("device_name", &cuda::device_name, py::arg("device") = 0);
  c.def("compiled_archs", &cuda::compiled_archs, "GPU architectures the kernels were compiled for, e.g. '90,120,121'");
  c.def("build_note", &cuda::build_note, "why CUDA is not compiled in ('' when it is)");
  c.def("device_info", [](int dev) { return info_dict(cuda::device_info(dev)); }, py::arg("device") = 0);
  c.def("measure_read_bandwidth", &cuda::measure_read_bandwidth, py::arg("bytes") = size_t(1) << 30,
        py::arg("reps") = 5, py::call_guard<py::gil_scoped_release>(),
        "device memory read bandwidth in bytes/s (best of reps passes over a buffer of `bytes`)");
  c.def("has_kernel", &cuda::has_kernel, py::arg("type_id"));
  c.def("kernel_types", &cuda::kernel_type_names);
  c.def("dequantize",
        [](uint32_t type_id, carray<uint8_t> data, int64_t n) {
          py::array_t<float> out(n);
          cuda::dequantize(type_id, data.data(), size_t(data.size()), out.mutable_data(), n);
          return out;
        },
        py::arg("type_id"), py::arg("data"), py::arg("n"));
  c.def("gemv",
        [](uint32_t type_id, carray<uint8_t> w, int64_t rows, int64_t k, carray<float> x) {
          if (x.size() != k) throw py::value_error("x must have k elements");
          py::array_t<float> y(rows);
          cuda::gemv(type_id, w.data(), size_t(w.size()), rows, k, x.data(), y.mutable_data());
          return y;
        },
        py::arg("type_id"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("x"));
  c.def("emulate_dequantize",
        [](uint32_t type_id, carray<uint8_t> data, int64_t n) {
          TF_CHECK(n >= 0 && size_t(data.size()) >= row_bytes(GgmlType(type_id), n), "data holds fewer than n values");
          py::array_t<float> out(n);
          cuda::emulate_dequantize(type_id, data.data(), n, out.mutable_data());
          return out;
        },
        py::arg("type_id"), py::arg("data"), py::arg("n"),
        "n values decoded by the CUDA kernels' chunk decoder, run on the host");
  c.def("emulate_matmul",
        [](uint32_t type_id, carray<uint8_t> w, int64_t rows, int64_t k, carray<float> x) {
          if (x.ndim() != 2 || x.shape(1) != k) throw py::value_error("x must be [T, k]");
          TF_CHECK(rows >= 0 && size_t(w.size()) >= row_bytes(GgmlType(type_id), k) * size_t(rows), "w too small");
          const int64_t T = x.shape(0);
          py::array_t<float> y({T, rows});
          cuda::emulate_matmul(type_id, w.data(), rows, k, x.data(), T, y.mutable_data());
          return y;
        },
        py::arg("type_id"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("x"),
        "y[t, r] = W[r] . x[t] with the CUDA kernels' arithmetic (int8 activations, dp4a sums), on the host");
  c.def("plan_device",
        [](const py::dict& info, const py::dict& need) {
          cuda::DeviceInfo d;
          d.name = get<std::string>(info, "name", "");
          d.cc_major = get<int>(info, "cc_major", 0);
          d.cc_minor = get<int>(info, "cc_minor", 0);
          d.total_bytes = get<uint64_t>(info, "total_bytes", 0);
          d.free_bytes = get<uint64_t>(info, "free_bytes", d.total_bytes);
          d.integrated = get<bool>(info, "integrated", false);
          d.sm_count = get<int>(info, "sm_count", 0);
          cuda::DeviceNeed n;
          n.weights = get<uint64_t>(need, "weights", 0);
          n.kv = get<uint64_t>(need, "kv", 0);
          n.scratch = get<uint64_t>(need, "scratch", 0);
          n.workspace = get<uint64_t>(need, "workspace", 0);
          n.budget = get<uint64_t>(need, "budget", 0);
          const cuda::DevicePlan p = cuda::plan_device(d, n);
          py::dict o;
          o["fits"] = p.fits();
          o["unified"] = p.unified;
          o["weights_in_place"] = p.weights_in_place;
          o["total"] = p.total();
          o["limit"] = p.limit;
          o["limit_source"] = p.limit_source;
          o["table"] = p.table();
          py::list lines;
          for (const auto& l : p.lines) lines.append(py::make_tuple(l.what, l.bytes));
          o["lines"] = lines;
          return o;
        },
        py::arg("info"), py::arg("need"),
        "the CUDA memory plan for a device description and the engine's needs (host logic, no GPU needed)");
}

}  // namespace tf
