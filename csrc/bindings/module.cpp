// The one Python extension module, tensorfold._core. Each bind_*.cpp exports one concern;
// no logic lives in the bindings.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "core/cpu_features.h"
#include "core/error.h"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "TensorFold native core";
  static py::exception<tf::Error> unsupported(m, "UnsupportedError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tf::Error& e) {
      switch (e.kind()) {
        case tf::ErrorKind::InvalidInput: PyErr_SetString(PyExc_ValueError, e.what()); break;
        case tf::ErrorKind::Unsupported: py::set_error(unsupported, e.what()); break;
        case tf::ErrorKind::OutOfMemory: PyErr_SetString(PyExc_MemoryError, e.what()); break;
        case tf::ErrorKind::Interrupted:
          // Python's own handler saw the SIGINT too: let it raise (KeyboardInterrupt or
          // whatever the program installed); otherwise raise KeyboardInterrupt ourselves.
          if (PyErr_CheckSignals() == 0) PyErr_SetNone(PyExc_KeyboardInterrupt);
          break;
        default: PyErr_SetString(PyExc_RuntimeError, e.what()); break;
      }
    }
  });
  m.def("usable_cpus", &tf::usable_cpus,
        "CPUs this process may use: its affinity mask, capped by the cgroup CPU quota");
  m.def("cgroup_cpu_limit", &tf::cgroup_cpu_limit, py::arg("cgroup_fs"), py::arg("proc_self_cgroup"),
        "CPU quota (rounded up) found for a /proc/self/cgroup text under a cgroup mount; 0 = none");
  m.def("cpu_isa", [] { return tf::isa_name(tf::best_isa()); },
        "ISA the CPU kernels dispatch to: avx512, avx2 or scalar");
  tf::bind_gguf(m);
  tf::bind_quant(m);
  tf::bind_kernels(m);
  tf::bind_engine(m);
  tf::bind_cuda(m);
  tf::bind_ops(m);
  tf::bind_moe(m);
  tf::bind_comm(m);
}
