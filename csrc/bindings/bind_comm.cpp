// Python bindings of the tensor-parallel process group (tensorfold._core.comm.Group).
// Argument checking and conversion only; the GIL is released for all communication.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "comm/group.h"
#include "comm/ibverbs_transport.h"
#include "core/error.h"
#include "core/interrupt.h"
#include "core/sha256.h"

namespace py = pybind11;

namespace tf {
namespace {

using comm::DType;

struct PyGroup {
  std::shared_ptr<comm::Group> g;
  int rank = 0, size = 1;

  std::shared_ptr<comm::Group> get() const {
    if (!g) fail(ErrorKind::InvalidInput, "comm group is closed");
    return g;
  }
};

void check_buffer(const py::array& a, const char* what) {
  TF_CHECK(a.writeable(), what, " needs a writeable array (it works in place)");
  TF_CHECK(a.flags() & py::array::c_style, what, " needs a C-contiguous array");
}

DType pick_dtype(const py::array& a, const std::string& dtype) {
  const auto kind = a.dtype().kind();
  const auto item = a.itemsize();
  if (dtype.empty()) {
    if (kind == 'f' && item == 4) return DType::F32;
    if (kind == 'f' && item == 2) return DType::F16;
    fail(ErrorKind::InvalidInput, "all_reduce supports float32 and float16 arrays (and bfloat16 "
         "as a uint16 array with dtype='bf16'), got dtype ", std::string(py::str(a.dtype())));
  }
  if (dtype == "f32" || dtype == "float32") {
    TF_CHECK(item == 4, "dtype='", dtype, "' needs 4-byte items, got ", item);
    return DType::F32;
  }
  if (dtype == "f16" || dtype == "float16") {
    TF_CHECK(item == 2, "dtype='", dtype, "' needs 2-byte items, got ", item);
    return DType::F16;
  }
  if (dtype == "bf16" || dtype == "bfloat16") {
    TF_CHECK(item == 2, "dtype='bf16' needs a 2-byte (e.g. uint16) array, got ", item, "-byte items");
    return DType::BF16;
  }
  fail(ErrorKind::InvalidInput, "unknown dtype '", dtype, "' (expected 'f32', 'f16' or 'bf16')");
}

}  // namespace

py::dict comm_stats_dict(const comm::GroupStats& s) {
  py::dict d;
  d["all_reduces"] = s.all_reduces;
  d["broadcasts"] = s.broadcasts;
  d["barriers"] = s.barriers;
  d["small_messages"] = s.small_messages;
  d["rail_failures"] = s.rail_failures;
  d["seconds_in_collectives"] = s.seconds_in_collectives;
  py::list rails;
  for (const auto& r : s.rails) {
    py::dict rd;
    rd["local"] = r.local;
    rd["peer"] = r.peer;
    rd["up"] = r.up;
    rd["bytes_sent"] = r.bytes_sent;
    rd["bytes_received"] = r.bytes_received;
    rd["throughput_mb_s"] = r.throughput_mb_s;
    rd["down_reason"] = r.down_reason;
    rails.append(rd);
  }
  d["rails"] = rails;
  return d;
}


void bind_comm(py::module_& m) {
  auto cm = m.def_submodule("comm", "Tensor-parallel process group (TCP multi-rail)");
  py::class_<PyGroup>(cm, "Group", R"doc(
Process group of `size` ranks (1 or 2) for tensor parallelism.

Rank 0 listens on `addr` ("HOST:PORT"); rank 1 connects to it, retrying until `timeout`.
`rails` lists this rank's local IP per rail (one TCP connection each); empty = one rail on
the default route. `handshake` must be identical on both ranks (e.g. model hash + TP config)
or both raise. `token`: optional shared secret; when given, only a peer that proves it knows
the same token (HMAC challenge-response, the token is never sent) is admitted. Rank 0 drops
connections that fail the handshake (logged to stderr) and keeps listening until `timeout`.
Every wait is bounded by `timeout` seconds: a lost peer raises RuntimeError.
)doc")
      .def(py::init([](int rank, int size, const std::string& addr, std::vector<std::string> rails,
                       double timeout, const std::string& transport, const std::string& handshake,
                       size_t small_bytes, size_t chunk_bytes, const std::string& token) {
             comm::GroupOptions o;
             o.rank = rank;
             o.size = size;
             o.addr = addr;
             o.rails = std::move(rails);
             o.timeout_s = timeout;
             o.transport = transport;
             o.handshake = handshake;
             o.small_bytes = small_bytes;
             o.chunk_bytes = chunk_bytes;
             o.token = token;
             PyGroup pg;
             {
               py::gil_scoped_release nogil;
               InterruptScope ctrl_c;  // connection setup ends on Ctrl-C
               pg.g = comm::Group::create(o);
             }
             pg.rank = pg.g->rank();
             pg.size = pg.g->size();
             return pg;
           }),
           py::arg("rank"), py::arg("size"), py::arg("addr") = "",
           py::arg("rails") = std::vector<std::string>{}, py::arg("timeout") = 30.0,
           py::arg("transport") = "tcp", py::arg("handshake") = "",
           py::arg("small_bytes") = size_t(64) << 10, py::arg("chunk_bytes") = size_t(512) << 10,
           py::arg("token") = "")
      .def_property_readonly("rank", [](const PyGroup& p) { return p.rank; })
      .def_property_readonly("size", [](const PyGroup& p) { return p.size; })
      .def(
          "all_reduce",
          [](PyGroup& p, py::array a, const std::string& dtype) {
            auto g = p.get();
            check_buffer(a, "all_reduce");
            const DType dt = pick_dtype(a, dtype);
            void* ptr = a.mutable_data();
            const size_t n = static_cast<size_t>(a.size());
            {
              py::gil_scoped_release nogil;
              g->all_reduce(ptr, n, dt);
            }
            return a;
          },
          py::arg("array"), py::arg("dtype") = "",
          "In-place sum over the ranks (float32, float16, or bfloat16 given as a uint16 array with "
          "dtype='bf16'). Both ranks get bit-identical results. Returns the array.")
      .def(
          "broadcast",
          [](PyGroup& p, py::array a, int root) {
            auto g = p.get();
            check_buffer(a, "broadcast");
            void* ptr = a.mutable_data();
            const size_t n = static_cast<size_t>(a.nbytes());
            {
              py::gil_scoped_release nogil;
              g->broadcast(ptr, n, root);
            }
            return a;
          },
          py::arg("array"), py::arg("root") = 0,
          "Copy root's array (any dtype, same shape on all ranks) into every rank's array, in place.")
      .def(
          "barrier",
          [](PyGroup& p) {
            auto g = p.get();
            py::gil_scoped_release nogil;
            g->barrier();
          },
          "Return once every rank has entered the barrier.")
      .def("stats", [](const PyGroup& p) { return comm_stats_dict(p.get()->stats()); },
           "Counters: collectives, small messages, rail failures, time, and per-rail bytes/rate/state.")
      .def(
          "close", [](PyGroup& p) { p.g.reset(); },
          "Close the links (the peer's next collective fails with 'peer lost'). Idempotent.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyGroup& p, py::args) { p.g.reset(); })
      .def(
          "_debug_fail_rail",
          [](PyGroup& p, int rail, uint64_t after_bytes) { p.get()->debug_fail_rail(rail, after_bytes); },
          py::arg("rail"), py::arg("after_bytes") = 0,
          "Test hook: shut rail `rail` down during the next collective once `after_bytes` have "
          "been sent on it.");

  // The handshake's own SHA-256 / HMAC-SHA256, exposed so tests can check them against hashlib.
  cm.def(
      "_sha256",
      [](const py::bytes& data) {
        const Digest256 d = sha256(std::string(data));
        return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
      },
      py::arg("data"));
  cm.def(
      "_hmac_sha256",
      [](const py::bytes& key, const py::bytes& msg) {
        const Digest256 d = hmac_sha256(std::string(key), std::string(msg));
        return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
      },
      py::arg("key"), py::arg("msg"));

  // ibverbs (RDMA) availability, for callers and tests choosing transport="ibverbs".
  cm.def("built_with_ibverbs", &comm::built_with_ibverbs,
         "True when this build includes the ibverbs (RDMA) transport.");
  cm.def(
      "ibverbs_devices",
      [] {
        py::list out;
        for (const auto& d : comm::ibverbs_devices()) {
          py::dict dd;
          dd["name"] = d.name;
          py::list ports;
          for (const auto& p : d.ports) {
            py::dict pd;
            pd["port"] = p.port;
            pd["state"] = p.state;
            pd["link_layer"] = p.link_layer;
            pd["active_mtu"] = p.active_mtu;
            pd["lid"] = p.lid;
            py::list gids;
            for (const auto& g : p.gids) {
              py::dict gd;
              gd["index"] = g.index;
              gd["gid"] = g.gid;
              gd["type"] = g.type;
              gd["ipv4"] = g.ipv4;
              gids.append(gd);
            }
            pd["gids"] = gids;
            ports.append(pd);
          }
          dd["ports"] = ports;
          out.append(dd);
        }
        return out;
      },
      "RDMA devices visible here: [{name, ports: [{port, state, link_layer, active_mtu, lid, "
      "gids: [{index, gid, type, ipv4}]}]}]; empty when none or when built without ibverbs.");
}

}  // namespace tf
