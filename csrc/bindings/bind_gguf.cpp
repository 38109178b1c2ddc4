// Python bindings for the GGUF reader: tensorfold._core.GgufFile. Bindings only; all parsing and
// validation live in gguf/gguf_reader.cpp.
//
// Metadata conversion: integers -> int, floats -> float, bool -> bool, strings -> str (bytes that
// are not valid UTF-8 are decoded with errors="replace"). Arrays are not turned into lists up
// front, so metadata() costs O(keys), whatever the arrays hold:
//   - integer and float arrays -> read-only numpy arrays of the element dtype, viewing the
//     mapping (no copy); bool arrays -> read-only numpy bool arrays (a copy, one byte each);
//   - string arrays and arrays of arrays -> GgufArray, a lazy sequence (len, indexing, slicing,
//     iteration, tolist(), == with lists) that decodes elements from the mapping on access.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bindings/bindings.h"
#include "core/error.h"
#include "gguf/gguf_reader.h"
#include "kv/kv_cache.h"
#include "model/model.h"
#include "model/model_config.h"
#include "quant/traits.h"

namespace py = pybind11;

namespace tf {
namespace {

py::object str_to_py(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

// A path as os.fsdecode() gives it (undecodable bytes as surrogates, so it round-trips).
py::object path_to_py(const std::string& s) {
  PyObject* o = PyUnicode_DecodeFSDefaultAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

py::object scalar_to_py(const GgufValue& v) {
  PyObject* o = nullptr;
  switch (v.type) {
    case GgufValueType::STRING: return str_to_py(v.s);
    case GgufValueType::FLOAT32:
    case GgufValueType::FLOAT64: return py::float_(v.f);
    case GgufValueType::BOOL: return py::bool_(v.i != 0);
    case GgufValueType::UINT8: case GgufValueType::UINT16: case GgufValueType::UINT32:
    case GgufValueType::UINT64:
      o = PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(v.u));
      break;
    default: o = PyLong_FromLongLong(static_cast<long long>(v.i)); break;
  }
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

const char* numpy_format(GgufValueType t) {
  switch (t) {
    case GgufValueType::UINT8: return "<u1";
    case GgufValueType::INT8: return "<i1";
    case GgufValueType::UINT16: return "<u2";
    case GgufValueType::INT16: return "<i2";
    case GgufValueType::UINT32: return "<u4";
    case GgufValueType::INT32: return "<i4";
    case GgufValueType::FLOAT32: return "<f4";
    case GgufValueType::UINT64: return "<u8";
    case GgufValueType::INT64: return "<i8";
    case GgufValueType::FLOAT64: return "<f8";
    default: return nullptr;
  }
}

// A string array or an array of arrays, decoded on access.
struct GgufArrayRef {
  std::shared_ptr<GgufFile> file;
  GgufValue v;
  std::vector<uint64_t> offsets;  // start of each element, built on first random access
  bool indexed = false;

  const std::vector<uint64_t>& index() {
    if (!indexed) {
      file->check_unchanged();
      offsets = file->element_offsets(v);
      indexed = true;
    }
    return offsets;
  }
};

struct GgufArrayIter {
  std::shared_ptr<GgufArrayRef> a;
  uint64_t pos = 0, k = 0;
};

py::object array_to_py(const std::shared_ptr<GgufFile>& f, const GgufValue& v);

py::object element_to_py(const std::shared_ptr<GgufFile>& f, const GgufValue& e) {
  return e.type == GgufValueType::ARRAY ? array_to_py(f, e) : scalar_to_py(e);
}

py::object array_to_py(const std::shared_ptr<GgufFile>& f, const GgufValue& v) {
  const char* fmt = numpy_format(v.elem_type);
  const uint64_t n = v.count;
  if (fmt) {
    const auto esize = static_cast<py::ssize_t>(gguf_fixed_size(v.elem_type));
    py::array a(py::dtype(fmt), {static_cast<py::ssize_t>(n)}, {esize}, f->base() + v.begin,
                py::cast(f));  // the array keeps the file (and its mapping) alive
    a.attr("setflags")(py::arg("write") = false);
    return std::move(a);
  }
  if (v.elem_type == GgufValueType::BOOL) {
    py::array_t<bool> a(static_cast<py::ssize_t>(n));
    bool* dst = a.mutable_data();
    const uint8_t* src = f->base() + v.begin;
    for (uint64_t k = 0; k < n; ++k) dst[k] = src[k] != 0;
    a.attr("setflags")(py::arg("write") = false);  // read-only like the other arrays
    return std::move(a);
  }
  auto ref = std::make_shared<GgufArrayRef>();
  ref->file = f;
  ref->v = v;
  return py::cast(ref);
}

// Plain Python lists all the way down.
py::list array_to_list(const std::shared_ptr<GgufFile>& f, const GgufValue& v) {
  if (numpy_format(v.elem_type) || v.elem_type == GgufValueType::BOOL) {
    return array_to_py(f, v).attr("tolist")();
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(v.count));
  if (!list) throw py::error_already_set();
  py::list out = py::reinterpret_steal<py::list>(list);
  uint64_t pos = v.begin;
  for (uint64_t k = 0; k < v.count; ++k) {
    GgufValue e = f->read_element(v, pos);
    py::object item = e.type == GgufValueType::ARRAY ? py::object(array_to_list(f, e))
                                                     : scalar_to_py(e);
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(k), item.release().ptr());
  }
  return out;
}

py::object value_to_py(const std::shared_ptr<GgufFile>& f, const GgufValue& v) {
  return v.type == GgufValueType::ARRAY ? array_to_py(f, v) : scalar_to_py(v);
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
  d["part"] = t.part;
  d["nbytes"] = t.nbytes;
  d["supported"] = t.type_supported;
  return d;
}

std::string fspath(const py::object& p) {
  py::object s = py::module_::import("os").attr("fspath")(p);
  if (py::isinstance<py::bytes>(s)) return s.cast<std::string>();
  // str paths: encoded as os.fsencode() does, so undecodable names (surrogates) still open
  py::object b = py::module_::import("os").attr("fsencode")(s);
  return b.cast<std::string>();
}

void bind_array(py::module_& m) {
  py::class_<GgufArrayIter>(m, "_GgufArrayIterator")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__", [](GgufArrayIter& it) {
        if (it.k >= it.a->v.count) throw py::stop_iteration();
        GgufValue e = it.a->file->read_element(it.a->v, it.pos);
        ++it.k;
        return element_to_py(it.a->file, e);
      });

  py::class_<GgufArrayRef, std::shared_ptr<GgufArrayRef>>(
      m, "GgufArray",
      "A GGUF metadata array of strings or of arrays, decoded from the file on access. "
      "Behaves as a read-only sequence; tolist() gives plain Python lists.")
      .def("__len__", [](const GgufArrayRef& a) { return static_cast<size_t>(a.v.count); })
      .def_property_readonly(
          "elem_type", [](const GgufArrayRef& a) { return std::string(gguf_type_name(a.v.elem_type)); },
          "Element type: 'string' or 'array'.")
      .def("__getitem__",
           [](GgufArrayRef& a, int64_t i) {
             const auto n = static_cast<int64_t>(a.v.count);
             if (i < 0) i += n;
             if (i < 0 || i >= n) throw py::index_error("GgufArray index out of range");
             uint64_t pos = a.index()[static_cast<size_t>(i)];
             return element_to_py(a.file, a.file->read_element(a.v, pos));
           })
      .def("__getitem__",
           [](GgufArrayRef& a, const py::slice& s) {
             size_t start = 0, stop = 0, step = 0, len = 0;
             if (!s.compute(static_cast<size_t>(a.v.count), &start, &stop, &step, &len)) {
               throw py::error_already_set();
             }
             py::list out;
             const auto& idx = a.index();
             for (size_t k = 0; k < len; ++k) {
               uint64_t pos = idx[start + k * step];
               out.append(element_to_py(a.file, a.file->read_element(a.v, pos)));
             }
             return out;
           })
      .def("__iter__",
           [](const std::shared_ptr<GgufArrayRef>& a) {
             a->file->check_unchanged();
             return GgufArrayIter{a, a->v.begin, 0};
           })
      .def("tolist",
           [](const GgufArrayRef& a) {
             a.file->check_unchanged();
             return array_to_list(a.file, a.v);
           },
           "All elements as a (nested) list of Python values.")
      .def("__eq__",
           [](const GgufArrayRef& a, const py::object& other) -> py::object {
             if (py::isinstance<GgufArrayRef>(other)) {
               const auto& b = other.cast<const GgufArrayRef&>();
               return py::bool_(array_to_list(a.file, a.v).equal(array_to_list(b.file, b.v)));
             }
             if (py::isinstance<py::list>(other) || py::isinstance<py::tuple>(other)) {
               if (py::len(other) != a.v.count) return py::bool_(false);
               return py::bool_(array_to_list(a.file, a.v).equal(py::list(other)));
             }
             return py::reinterpret_borrow<py::object>(Py_NotImplemented);
           })
      .def("__repr__", [](const GgufArrayRef& a) {
        return "GgufArray(" + std::string(gguf_type_name(a.v.elem_type)) + ", " +
               std::to_string(a.v.count) + " elements)";
      });
}

}  // namespace

void bind_gguf(py::module_& m) {
  bind_array(m);
  m.def("kv_bytes_per_token",
        [](std::shared_ptr<GgufFile> f, const std::string& kv_type, bool per_sequence) -> py::object {
          if (kv_type != "f16" && kv_type != "f32") throw py::value_error("kv_type must be 'f16' or 'f32'");
          TpShard sizes;
          sizes.plan_only = true;
          const Model m(f, nullptr, sizes);  // refuses what the engine refuses; reads only the header
          uint64_t b = 0, s = 0;
          // A long pool and one sequence: window groups count per sequence (a window and one token).
          const KvSizing one{int64_t(1) << 30, 1, 1};
          for (const KvGroupPlan& g : KvCache::plan(m.kv_specs(), one, kv_type == "f32" ? KvType::F32 : KvType::F16, false)) {
            b += g.bytes_per_token;
            s += g.bytes_per_seq;
          }
          if (per_sequence) return py::make_tuple(b, s);
          return py::int_(b);
        },
        py::arg("file"), py::arg("kv_type") = "f16", py::arg("per_sequence") = false,
        "KV cache bytes one token takes in a TensorFold engine on this model (all layers, TP=1); with "
        "per_sequence, also the bytes a sequence's sliding windows take (bytes_per_token, bytes_per_seq)");
  py::class_<GgufFile, std::shared_ptr<GgufFile>>(m, "GgufFile",
                                                  "A memory-mapped, fully validated GGUF file.")
      .def(py::init([](const py::object& path) {
             std::string p = fspath(path);
             py::gil_scoped_release nogil;
             return GgufFile::open(p);
           }),
           py::arg("path"))
      .def_property_readonly("path", [](const GgufFile& f) { return path_to_py(f.path()); })
      .def_property_readonly("version", &GgufFile::version)
      .def_property_readonly("file_size", &GgufFile::file_size, "Bytes of all parts together.")
      .def_property_readonly(
          "parts",
          [](const GgufFile& f) {
            py::list out;
            for (const GgufPart& p : f.parts()) {
              py::dict d;
              d["path"] = path_to_py(p.path);
              d["size"] = p.size;
              d["data_offset"] = p.data_offset;
              d["n_tensors"] = p.n_tensors;
              out.append(d);
            }
            return out;
          },
          "The files of the model in split order (one for an unsplit file): path, size, "
          "data_offset, n_tensors.")
      .def_property_readonly("data_offset", &GgufFile::data_offset)
      .def_property_readonly("alignment", &GgufFile::alignment)
      .def("metadata",
           [](const std::shared_ptr<GgufFile>& f) {
             f->check_unchanged();  // bool arrays are copied out of the mapping here
             py::dict d;
             for (const auto& kv : f->metadata()) d[str_to_py(kv.first)] = value_to_py(f, kv.second);
             return d;
           },
           "All key/value metadata, in file order. Numeric arrays are read-only numpy arrays, "
           "string arrays and nested arrays lazy GgufArray sequences.")
      .def("get",
           [](const std::shared_ptr<GgufFile>& f, const std::string& key, py::object def) {
             const GgufValue* v = f->find(key);
             return v ? value_to_py(f, *v) : def;
           },
           py::arg("key"), py::arg("default") = py::none())
      .def("get_int",
           [](const GgufFile& f, const std::string& key, py::object def) -> py::object {
             if (!def.is_none() && !f.find(key)) return def;
             return py::int_(f.get_int(key));
           },
           py::arg("key"), py::arg("default") = py::none(),
           "Integer (or bool) value; raises ValueError when missing without a default or of "
           "another type.")
      .def("get_float",
           [](const GgufFile& f, const std::string& key, py::object def) -> py::object {
             if (!def.is_none() && !f.find(key)) return def;
             return py::float_(f.get_float(key));
           },
           py::arg("key"), py::arg("default") = py::none())
      .def("get_string",
           [](const GgufFile& f, const std::string& key, py::object def) -> py::object {
             if (!def.is_none() && !f.find(key)) return def;
             return str_to_py(f.get_string(key));
           },
           py::arg("key"), py::arg("default") = py::none())
      .def("get_bool",
           [](const GgufFile& f, const std::string& key, py::object def) -> py::object {
             if (!f.find(key)) return def;
             return py::bool_(f.get_bool(key, false));
           },
           py::arg("key"), py::arg("default"))
      .def("__contains__", [](const GgufFile& f, const std::string& key) {
        return f.find(key) != nullptr;
      })
      .def("check_unchanged", &GgufFile::check_unchanged,
           "Raise ValueError if the file shrank or was modified in place since it was opened "
           "(reading a shrunk mapping would crash the process with SIGBUS). One fstat(); call "
           "it between requests.")
      .def("tensors",
           [](const GgufFile& f) {
             py::list out;
             for (const auto& t : f.tensors()) out.append(tensor_to_py(t));
             return out;
           },
           "Tensor infos in file order (split models: part by part): name, type, type_id, "
           "shape (ne[0] first), offset (absolute, in its part's file), part (index into "
           "parts), nbytes, supported.")
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
        return str_to_py("<GgufFile '" + f.display_path() + "' v" + std::to_string(f.version()) +
                         ", " + std::to_string(f.tensors().size()) + " tensors, " +
                         std::to_string(f.metadata().size()) + " keys" +
                         (f.parts().size() > 1 ? ", " + std::to_string(f.parts().size()) + " parts" : "") +
                         ">");
      });
}

}  // namespace tf
