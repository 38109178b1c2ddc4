// Binds the CUDA backend's entry points (stubs when built without CUDA), the host emulation of
// its format arithmetic and its memory plan (both plain C++, present in every build).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device_plan.h"
#include "backend/cuda/host_emulation.h"
#include <algorithm>
#include <cmath>

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
  c.def("emulate_matmul_stack",
        [](uint32_t type_id, carray<uint8_t> w, int64_t n, int64_t rows, int64_t k, carray<float> x,
           carray<int32_t> offsets, py::object gather_obj, int64_t first, int64_t last) {
          // lists: the same arguments as Backend.matmul_stack, matrices [first, last) of n
          if (x.ndim() != 2 || x.shape(1) != k) throw py::value_error("x must be [rows, k]");
          const size_t rb = row_bytes(GgmlType(type_id), k);
          TF_CHECK(size_t(w.size()) >= rb * size_t(rows * n) && offsets.size() == n + 1, "w or offsets too small");
          if (last < 0) last = n;
          TF_CHECK(0 <= first && first <= last && last <= n, "first/last out of range");
          Grouping g;
          g.offsets = offsets.data();
          g.first = first;
          g.last = last;
          carray<int32_t> gather;
          if (!gather_obj.is_none()) {
            gather = gather_obj.cast<carray<int32_t>>();
            g.gather = gather.data();
            for (int64_t i = offsets.data()[first]; i < offsets.data()[last]; ++i)
              TF_CHECK(g.gather[i] >= 0 && g.gather[i] < x.shape(0), "gather out of range");
          } else {
            TF_CHECK(offsets.data()[last] <= x.shape(0), "offsets reach past x");
          }
          const int64_t list = offsets.data()[n];
          py::array_t<float> y({list, rows});
          std::fill(y.mutable_data(), y.mutable_data() + y.size(), std::nanf(""));
          cuda::emulate_matmul_stack(type_id, w.data() + rb * size_t(rows) * size_t(first), rb * size_t(rows), rb, rows, k,
                                     x.data(), k, g, y.mutable_data(), rows);
          return y;
        },
        py::arg("type_id"), py::arg("w"), py::arg("n"), py::arg("rows"), py::arg("k"), py::arg("x"),
        py::arg("offsets"), py::arg("gather") = py::none(), py::arg("first") = 0, py::arg("last") = -1,
        "grouped product (lists) through the CUDA packing plan and arithmetic, on the host (rows not computed: nan)");
  c.def("emulate_matmul_batches",
        [](uint32_t type_id, carray<uint8_t> w, int64_t n, int64_t rows, int64_t k, carray<float> x) {
          // batches: x [R, n * k] interleaved (row j of matrix e at x[j, e*k:(e+1)*k]); y [n, R, rows]
          if (x.ndim() != 2 || x.shape(1) != n * k) throw py::value_error("x must be [R, n * k]");
          const size_t rb = row_bytes(GgmlType(type_id), k);
          TF_CHECK(size_t(w.size()) >= rb * size_t(rows * n), "w too small");
          const int64_t R = x.shape(0);
          Grouping g;
          g.rows = R;
          g.x_mat = k;
          g.y_mat = R * rows;
          g.first = 0;
          g.last = n;
          py::array_t<float> y({n, R, rows});
          cuda::emulate_matmul_stack(type_id, w.data(), rb * size_t(rows), rb, rows, k, x.data(), n * k, g,
                                     y.mutable_data(), rows);
          return y;
        },
        py::arg("type_id"), py::arg("w"), py::arg("n"), py::arg("rows"), py::arg("k"), py::arg("x"),
        "per-matrix products of interleaved rows through the CUDA packing plan, on the host");
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
