// The one Python extension module, tensorfold._core. Each bind_*.cpp exports one concern;
// no logic lives in the bindings.
#include <pybind11/pybind11.h>

#include <cstring>

#include "bindings/bindings.h"
#include "core/cpu_features.h"
#include "core/error.h"

namespace py = pybind11;

namespace {
// Messages may quote file contents or paths that are not UTF-8: decode with replacement so
// the user gets the intended exception, never a UnicodeDecodeError.
void set_error(PyObject* type, const char* msg) {
  PyObject* text = PyUnicode_DecodeUTF8(msg, Py_ssize_t(std::strlen(msg)), "replace");
  if (!text) return;  // MemoryError is already set
  PyErr_SetObject(type, text);
  Py_DECREF(text);
}
}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "TensorFold native core";
  static py::exception<tf::Error> unsupported(m, "UnsupportedError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tf::Error& e) {
      switch (e.kind()) {
        case tf::ErrorKind::InvalidInput: set_error(PyExc_ValueError, e.what()); break;
        case tf::ErrorKind::Unsupported: set_error(unsupported.ptr(), e.what()); break;
        case tf::ErrorKind::OutOfMemory: set_error(PyExc_MemoryError, e.what()); break;
        case tf::ErrorKind::Interrupted:
          // Python's own handler saw the SIGINT too: let it raise (KeyboardInterrupt or
          // whatever the program installed); otherwise raise KeyboardInterrupt ourselves.
          if (PyErr_CheckSignals() == 0) PyErr_SetNone(PyExc_KeyboardInterrupt);
          break;
        default: set_error(PyExc_RuntimeError, e.what()); break;
      }
    }
  });
  m.def("cpu_isa", [] { return tf::isa_name(tf::best_isa()); },
        "ISA the CPU kernels dispatch to: avx512, avx2 or scalar");
  tf::bind_core(m);
  tf::bind_gguf(m);
  tf::bind_quant(m);
  tf::bind_kernels(m);
  tf::bind_engine(m);
  tf::bind_cuda(m);
  tf::bind_ops(m);
  tf::bind_moe(m);
  tf::bind_comm(m);
  tf::bind_backend(m);
  tf::bind_kv(m);
  tf::bind_bench(m);
}
