// Binds core services: the thread pool (so its scheduling, error and interrupt behaviour can be
// checked from Python), CPU counting and the interrupt flag.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>

#include "backend/cuda/cuda_backend.h"
#include "bindings/bindings.h"
#include "comm/ibverbs_transport.h"
#include "core/cpu_features.h"
#include "core/interrupt.h"
#include "core/thread_pool.h"

namespace py = pybind11;

namespace tf {

void bind_core(py::module_& m) {
  m.def("usable_cpus", &usable_cpus,
        "CPUs this process may use: its affinity mask, capped by the cgroup CPU quota");
  m.def("cgroup_cpu_limit", &cgroup_cpu_limit, py::arg("cgroup_fs"), py::arg("proc_self_cgroup"),
        "CPU quota (rounded up) found for a /proc/self/cgroup text under a cgroup mount; 0 = none");
  m.def("request_interrupt", &request_interrupt,
        "raise the native interrupt flag, as SIGINT does inside a native call (for tests)");
  m.def("capabilities",
        [] {
          py::list backends;
          backends.append("cpu");
          if (cuda::built_with_cuda()) backends.append("cuda");
          py::dict caps;
          caps["logprobs"] = true;  // add_request(top_logprobs=...), step() tuples with (logprob, top)
          caps["backends"] = backends;
          caps["isa"] = isa_name(best_isa());
          caps["cpu_features"] = cpu_feature_note();  // e.g. "sve2/128" on aarch64; "" when none
          caps["ibverbs"] = comm::built_with_ibverbs();
          return caps;
        },
        "what this build can do, for the Python layer to ask rather than guess: logprobs (bool), "
        "backends (list), isa (the CPU kernels' ISA), cpu_features (extra CPU features, e.g. sve2/128), "
        "ibverbs (bool)");

  py::class_<ThreadPool>(m, "ThreadPool",
                         "The engine's worker pool. Python callbacks run with the GIL held, so this "
                         "is for checking the pool's behaviour, not for speed.")
      .def(py::init<int, int>(), py::arg("threads"), py::arg("spin_us") = -1)
      .def_property_readonly("size", &ThreadPool::size)
      .def("set_interruptible", &ThreadPool::set_interruptible, py::arg("on"))
      .def("run_chunks",
           [](ThreadPool& pool, int64_t n_chunks, const std::function<void(int64_t, int)>& fn) {
             py::gil_scoped_release nogil;
             InterruptScope scope;
             pool.run_chunks(n_chunks, [&](int64_t c, int t) {
               py::gil_scoped_acquire gil;
               fn(c, t);
             });
           },
           py::arg("n_chunks"), py::arg("fn"), "fn(chunk, thread) once per chunk, on any thread")
      .def("parallel_for",
           [](ThreadPool& pool, int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
             py::gil_scoped_release nogil;
             InterruptScope scope;
             pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
               py::gil_scoped_acquire gil;
               fn(b, e);
             });
           },
           py::arg("n"), py::arg("grain"), py::arg("fn"), "fn(begin, end) over [0, n) in grain-aligned chunks");
}

}  // namespace tf
