// Python bindings for the GGUF reader: tensorfold._core.GgufFile. Bindings only; all parsing and
// validation live in gguf/gguf_reader.cpp.
//
// Metadata conversion: integers -> int, floats -> float, bool -> bool, strings -> str (bytes that
// are not valid UTF-8 are decoded with errors="replace"), arrays -> list (nested -> nested lists).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "gguf/gguf_reader.h"
#include "quant/traits.h"

namespace py = pybind11;

namespace tf {
namespace {

py::object str_to_py(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

py::object int_to_py(GgufValueType t, int64_t i) {
  PyObject* o = t == GgufValueType::UINT64
                    ? PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(i))
                    : PyLong_FromLongLong(static_cast<long long>(i));
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

py::object value_to_py(const GgufValue& v);

py::list array_to_py(const GgufValue& v) {
  const size_t n = v.array_size();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(n));
  if (!list) throw py::error_already_set();
  py::list out = py::reinterpret_steal<py::list>(list);
  for (size_t k = 0; k < n; ++k) {
    py::object item;
    switch (v.elem_type) {
      case GgufValueType::STRING: item = str_to_py(v.strings[k]); break;
      case GgufValueType::ARRAY: item = array_to_py(v.items[k]); break;
      case GgufValueType::FLOAT32:
      case GgufValueType::FLOAT64: item = py::float_(v.floats[k]); break;
      case GgufValueType::BOOL: item = py::bool_(v.ints[k] != 0); break;
      default: item = int_to_py(v.elem_type, v.ints[k]); break;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(k), item.release().ptr());
  }
  return out;
}

py::object value_to_py(const GgufValue& v) {
  switch (v.type) {
    case GgufValueType::STRING: return str_to_py(v.s);
    case GgufValueType::ARRAY: return array_to_py(v);
    case GgufValueType::FLOAT32:
    case GgufValueType::FLOAT64: return py::float_(v.f);
    case GgufValueType::BOOL: return py::bool_(v.i != 0);
    case GgufValueType::UINT64: return int_to_py(v.type, static_cast<int64_t>(v.u));
    default: return int_to_py(v.type, v.i);
  }
}

py::dict tensor_to_py(const GgufTensorInfo& t) {
  py::dict d;
  d["name"] = str_to_py(t.name);
  const char* tn = type_name(t.type_id);
  d["type"] = tn ? py::str(tn) : py::str("type#" + std::to_string(t.type_id));
  d["type_id"] = t.type_id;
  py::list shape;
  for (int64_t n : t.ne) shape.append(n);
  d["shape"] = shape;
  d["offset"] = t.offset;
  d["nbytes"] = t.nbytes;
  d["supported"] = t.type_supported;
  return d;
}

std::string fspath(const py::object& p) {
  py::object s = py::module_::import("os").attr("fspath")(p);
  if (py::isinstance<py::bytes>(s)) return s.cast<std::string>();
  return s.cast<std::string>();
}

}  // namespace

void bind_gguf(py::module_& m) {
  py::class_<GgufFile, std::shared_ptr<GgufFile>>(m, "GgufFile",
                                                  "A memory-mapped, fully validated GGUF file.")
      .def(py::init([](const py::object& path) {
             std::string p = fspath(path);
             py::gil_scoped_release nogil;
             return GgufFile::open(p);
           }),
           py::arg("path"))
      .def_property_readonly("path", &GgufFile::path)
      .def_property_readonly("version", &GgufFile::version)
      .def_property_readonly("file_size", &GgufFile::file_size)
      .def_property_readonly("data_offset", &GgufFile::data_offset)
      .def_property_readonly("alignment", &GgufFile::alignment)
      .def("metadata",
           [](const GgufFile& f) {
             py::dict d;
             for (const auto& kv : f.metadata()) d[str_to_py(kv.first)] = value_to_py(kv.second);
             return d;
           },
           "All key/value metadata, in file order.")
      .def("get",
           [](const GgufFile& f, const std::string& key, py::object def) {
             const GgufValue* v = f.find(key);
             return v ? value_to_py(*v) : def;
           },
           py::arg("key"), py::arg("default") = py::none())
      .def("get_int",
           [](const GgufFile& f, const std::string& key, py::object def) -> py::object {
             if (def.is_none()) return py::int_(f.get_int(key));
             return py::int_(f.get_int(key, def.cast<int64_t>()));
           },
           py::arg("key"), py::arg("default") = py::none(),
           "Integer (or bool) value; raises ValueError when missing without a default or of "
           "another type.")
      .def("get_float",
           [](const GgufFile& f, const std::string& key, py::object def) -> py::object {
             if (def.is_none()) return py::float_(f.get_float(key));
             return py::float_(f.get_float(key, def.cast<double>()));
           },
           py::arg("key"), py::arg("default") = py::none())
      .def("get_string",
           [](const GgufFile& f, const std::string& key, py::object def) -> py::object {
             if (def.is_none()) return str_to_py(f.get_string(key));
             return str_to_py(f.get_string(key, def.cast<std::string>()));
           },
           py::arg("key"), py::arg("default") = py::none())
      .def("get_bool", &GgufFile::get_bool, py::arg("key"), py::arg("default"))
      .def("__contains__", [](const GgufFile& f, const std::string& key) {
        return f.find(key) != nullptr;
      })
      .def("tensors",
           [](const GgufFile& f) {
             py::list out;
             for (const auto& t : f.tensors()) out.append(tensor_to_py(t));
             return out;
           },
           "Tensor infos in file order: name, type, type_id, shape (ne[0] first), offset "
           "(absolute), nbytes, supported.")
      .def("tensor",
           [](const GgufFile& f, const std::string& name) {
             const GgufTensorInfo* t = f.find_tensor(name);
             if (!t) throw py::key_error(name);
             return tensor_to_py(*t);
           },
           py::arg("name"))
      .def("tensor_data",
           [](const std::shared_ptr<GgufFile>& f, const std::string& name) {
             const GgufTensorInfo* t = f->find_tensor(name);
             if (!t) throw py::key_error(name);
             py::object owner = py::cast(f);
             py::array_t<uint8_t> a({static_cast<py::ssize_t>(t->nbytes)}, {py::ssize_t{1}},
                                    t->data, owner);
             a.attr("setflags")(py::arg("write") = false);  // the mapping is read-only
             return a;
           },
           py::arg("name"),
           "Raw bytes of a tensor: a read-only zero-copy uint8 view into the mapping.")
      .def("__repr__", [](const GgufFile& f) {
        return "<GgufFile '" + f.path() + "' v" + std::to_string(f.version()) + ", " +
               std::to_string(f.tensors().size()) + " tensors, " +
               std::to_string(f.metadata().size()) + " keys>";
      });
}

}  // namespace tf
