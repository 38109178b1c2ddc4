// Python bindings of the quantization traits table and the scalar reference (de)quantizers.
// Only argument validation and conversion here; the logic is in csrc/quant.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <mutex>
#include <string>

#include "bindings/bindings.h"
#include "core/error.h"
#include "quant/quantize_rows.h"
#include "quant/traits.h"

namespace py = pybind11;

namespace tf {
namespace {

// Dequantization and quantization need the format's reference, not its kernels (Q8_1 and
// Q8_K have references but no weight kernels).
const TypeTraits& reference_traits(uint32_t type_id) {
  const TypeTraits* t = find_type_traits(type_id);
  if (t == nullptr || t->dequantize_ref == nullptr)
    fail(ErrorKind::Unsupported, "tensor type ", t ? t->name : ("id " + std::to_string(type_id)).c_str(),
         " has no reference (de)quantization in TensorFold");
  return *t;
}

// Byte view of a bytes-like object or a C-contiguous numpy array of 1-byte items.
struct ByteView {
  py::buffer_info info;
  const uint8_t* data = nullptr;
  size_t size = 0;
};

ByteView byte_view(const py::buffer& obj) {
  ByteView v;
  v.info = obj.request();
  TF_CHECK(v.info.itemsize == 1, "data must be bytes or a uint8 array, got items of ",
           v.info.itemsize, " bytes (format '", v.info.format, "')");
  py::ssize_t expect = 1;
  for (py::ssize_t d = v.info.ndim - 1; d >= 0; --d) {
    TF_CHECK(v.info.shape[d] <= 1 || v.info.strides[d] == expect, "data must be C-contiguous");
    expect *= v.info.shape[d];
  }
  v.data = static_cast<const uint8_t*>(v.info.ptr);
  v.size = static_cast<size_t>(v.info.size);
  return v;
}

}  // namespace

void bind_quant(py::module_& m) {
  m.def(
      "quant_types",
      [] {
        py::list out;
        for (uint32_t id = 0; id < kGgmlTypeIdLimit; ++id) {
          const TypeTraits* t = find_type_traits(id);
          if (!t) continue;
          py::dict d;
          d["id"] = t->id;
          d["name"] = t->name;
          d["block_size"] = t->block_size;
          d["type_size"] = t->type_size;
          d["supported"] = t->computable();
          d["has_reference"] = t->dequantize_ref != nullptr;
          out.append(d);
        }
        return out;
      },
      "Every ggml type id TensorFold knows the layout of: list of dicts with id, name, "
      "block_size, type_size, supported (kernels exist), has_reference (reference dequantization).");

  m.def(
      "dequantize",
      [](uint32_t type_id, const py::buffer& data, int64_t n) {
        const TypeTraits& t = reference_traits(type_id);
        TF_CHECK(n >= 0, "dequantize ", t.name, ": n must be >= 0, got ", n);
        TF_CHECK(n % t.block_size == 0, "dequantize ", t.name, ": n=", n,
                 " is not a multiple of the block size ", t.block_size);
        const size_t need = row_bytes(static_cast<GgmlType>(type_id), n);
        ByteView v = byte_view(data);
        TF_CHECK(v.size == need, "dequantize ", t.name, ": ", n, " values take ", need,
                 " bytes, got ", v.size);
        py::array_t<float> out(static_cast<py::ssize_t>(n));
        float* dst = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          if (n > 0) t.dequantize_ref(v.data, dst, n);
        }
        return out;
      },
      py::arg("type_id"), py::arg("data"), py::arg("n"),
      "Scalar reference dequantization of n values of ggml type type_id from raw bytes "
      "(bytes or uint8 array of exactly row_bytes(type, n)) -> float32 [n].");

  m.def(
      "quantize",
      [](uint32_t type_id, const py::array& x_obj) {
        const TypeTraits& t = reference_traits(type_id);
        if (t.quantize_ref == nullptr)
          fail(ErrorKind::Unsupported, "quantization to ", t.name, " is not implemented");
        TF_CHECK(x_obj.ndim() == 1, "quantize ", t.name, ": x must be 1-D, got ", x_obj.ndim(),
                 " dimensions");
        TF_CHECK(x_obj.dtype().equal(py::dtype::of<float>()), "quantize ", t.name,
                 ": x must be float32, got ", std::string(py::str(x_obj.dtype())));
        auto x = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(x_obj);
        TF_CHECK(bool(x), "quantize ", t.name, ": x must be a float32 array");
        const int64_t n = static_cast<int64_t>(x.size());
        TF_CHECK(n % t.block_size == 0, "quantize ", t.name, ": length ", n,
                 " is not a multiple of the block size ", t.block_size);
        const size_t nbytes = row_bytes(static_cast<GgmlType>(type_id), n);
        py::array_t<uint8_t> out(static_cast<py::ssize_t>(nbytes));
        uint8_t* dst = out.mutable_data();
        const float* src = x.data();
        {
          py::gil_scoped_release nogil;
          if (n > 0) t.quantize_ref(src, dst, n);
        }
        return out;
      },
      py::arg("type_id"), py::arg("x"),
      "Scalar reference quantization of a 1-D float32 array to ggml type type_id -> uint8 "
      "[row_bytes(type, len(x))].");
  m.def(
      "quantize_rows",
      [](uint32_t type_id, const py::array& x_obj, const py::object& importance, int threads) {
        const TypeTraits* t = find_type_traits(type_id);
        TF_CHECK(t != nullptr, "quantize_rows: unknown ggml type id ", type_id);
        TF_CHECK(x_obj.ndim() == 2, "quantize_rows ", t->name, ": x must be 2-D [rows, cols], got ",
                 x_obj.ndim(), " dimensions");
        TF_CHECK(x_obj.dtype().equal(py::dtype::of<float>()), "quantize_rows ", t->name,
                 ": x must be float32, got ", std::string(py::str(x_obj.dtype())));
        TF_CHECK(threads >= 1 && threads <= 256, "threads must be in [1, 256], got ", threads);
        auto x = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(x_obj);
        const int64_t rows = x.shape(0), cols = x.shape(1);
        py::array_t<float, py::array::c_style | py::array::forcecast> imp;
        const float* imp_ptr = nullptr;
        if (!importance.is_none()) {
          imp = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(importance);
          TF_CHECK(bool(imp) && imp.ndim() == 1 && imp.shape(0) == cols, "quantize_rows ", t->name,
                   ": importance must be a 1-D float array of ", cols, " values (one per column)");
          imp_ptr = imp.data();
        }
        const size_t rb = row_bytes(static_cast<GgmlType>(type_id), cols);
        py::array_t<uint8_t> out({static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(rb)});
        uint8_t* dst = out.mutable_data();
        const float* src = x.data();
        {
          py::gil_scoped_release nogil;
          SharedPool& slot = pool_for(threads);
          std::lock_guard<std::mutex> lock(slot.mu);
          quantize_rows(static_cast<GgmlType>(type_id), src, rows, cols, imp_ptr, dst, *slot.pool);
        }
        return out;
      },
      py::arg("type_id"), py::arg("x"), py::arg("importance") = py::none(), py::arg("threads") = 1,
      "Importance-weighted quantization of a float32 matrix [rows, cols] to ggml type type_id, "
      "minimising sum_j importance[j] * (x[r, j] - dequantized[r, j])^2 per row (importance: "
      "[cols] non-negative, None = uniform) -> uint8 [rows, row_bytes(type, cols)].");

  m.def("can_quantize", [](uint32_t type_id) { return can_quantize(static_cast<GgmlType>(type_id)); },
        py::arg("type_id"), "Whether TensorFold can write weights of ggml type type_id.");
}

}  // namespace tf
