#pragma once
#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>

#include "core/thread_pool.h"

namespace tf {
// A thread pool per thread count, shared by the kernel and quantizer bindings; one call at a
// time per pool (hold mu while using it).
struct SharedPool {
  std::mutex mu;
  std::unique_ptr<ThreadPool> pool;
};
SharedPool& pool_for(int threads);
namespace comm {
struct GroupStats;
}
// Python view of a group's counters (shared by the comm and engine bindings).
pybind11::dict comm_stats_dict(const comm::GroupStats& s);
void bind_core(pybind11::module_& m);
void bind_gguf(pybind11::module_& m);
void bind_quant(pybind11::module_& m);
void bind_engine(pybind11::module_& m);
void bind_kernels(pybind11::module_& m);
void bind_cuda(pybind11::module_& m);
void bind_ops(pybind11::module_& m);
void bind_moe(pybind11::module_& m);
void bind_comm(pybind11::module_& m);
void bind_backend(pybind11::module_& m);
void bind_kv(pybind11::module_& m);
void bind_bench(pybind11::module_& m);
}  // namespace tf
