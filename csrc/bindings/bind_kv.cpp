// Binds the KV cache by spec (tensorfold._core.KvCache) for the tests of its bookkeeping:
// groups, reservation, truncation, windows and the prefix cache, with rows written and read
// back through a backend. No logic here beyond shaping arrays.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "backend/backend.h"
#include "bindings/bindings.h"
#include "core/error.h"
#include "kv/kv_cache.h"

namespace py = pybind11;

namespace tf {

namespace {
template <typename T>
using carray = py::array_t<T, py::array::c_style | py::array::forcecast>;

KvSpec spec_of(const py::dict& d) {
  KvSpec s;
  s.n_heads = d["heads"].cast<int>();
  s.k_dim = d["k_dim"].cast<int>();
  s.v_dim = d.contains("v_dim") ? d["v_dim"].cast<int>() : 0;
  s.compression = d.contains("compression") ? d["compression"].cast<int>() : 1;
  s.window = d.contains("window") ? d["window"].cast<int64_t>() : 0;
  s.state_bytes = d.contains("state_bytes") ? d["state_bytes"].cast<int64_t>() : 0;
  return s;
}

std::vector<KvSpec> specs_of(const py::list& l) {
  std::vector<KvSpec> out;
  for (const auto& d : l) out.push_back(spec_of(d.cast<py::dict>()));
  return out;
}

KvType type_of(const std::string& t) {
  TF_CHECK(t == "f16" || t == "f32", "kv_type must be 'f16' or 'f32'");
  return t == "f32" ? KvType::F32 : KvType::F16;
}

// The K (or V) row cells of (layer, seq, entries) for every head: [n][heads].
std::vector<void*> k_cells(const KvCache& kv, int layer, int seq, const carray<int64_t>& entries, bool v = false) {
  const KvLayer l = kv.layer(layer);
  const int H = l.pool->spec().n_heads;
  const auto& table = l.pool->block_table(seq);
  std::vector<void*> cells;
  for (int64_t i = 0; i < entries.size(); ++i) {
    const int64_t e = entries.data()[i];
    TF_CHECK(e >= 0 && e / l.pool->block_size() < int64_t(table.size()) && table[size_t(e / l.pool->block_size())] >= 0,
             "entry ", e, " is not held by the sequence");
    for (int h = 0; h < H; ++h) cells.push_back(v ? l.pool->v_row(l.layer, seq, e, h) : l.pool->k_row(l.layer, seq, e, h));
  }
  return cells;
}
}  // namespace

void bind_kv(py::module_& m) {
  py::class_<KvCache>(m, "KvCache", "The KV cache by spec (kv/kv_cache.h); specs: one dict per layer "
                                    "(heads, k_dim, v_dim, compression, window, state_bytes)")
      .def(py::init([](const py::list& specs, int64_t kv_tokens, const std::string& kv_type, Backend& be) {
             return std::make_unique<KvCache>(specs_of(specs), kv_tokens, type_of(kv_type), be);
           }),
           py::arg("specs"), py::arg("kv_tokens"), py::arg("kv_type"), py::arg("backend"), py::keep_alive<1, 5>())
      .def_static(
          "plan",
          [](const py::list& specs, int64_t kv_tokens, const std::string& kv_type, bool prefix_cache) {
            py::list out;
            for (const KvGroupPlan& g : KvCache::plan(specs_of(specs), kv_tokens, type_of(kv_type), prefix_cache)) {
              py::dict d;
              d["spec"] = g.spec.describe();
              d["layers"] = g.layers;
              d["n_blocks"] = g.n_blocks;
              d["bytes"] = g.bytes;
              d["index_bytes"] = g.index_bytes;
              d["bytes_per_token"] = g.bytes_per_token;
              out.append(d);
            }
            return out;
          },
          py::arg("specs"), py::arg("kv_tokens"), py::arg("kv_type"), py::arg("prefix_cache") = false)
      .def_property_readonly("n_groups", &KvCache::n_groups)
      .def("group_layers", &KvCache::group_layers)
      .def_property_readonly("block_size", [](const KvCache&) { return KvCache::kBlockSize; })
      .def_property_readonly("bytes", &KvCache::bytes)
      .def("counts",
           [](const KvCache& kv) {
             py::dict d;
             d["used"] = kv.used_blocks();
             d["empty"] = kv.empty_blocks();
             d["cached"] = kv.cached_blocks();
             d["total"] = kv.total_blocks();
             d["free_tokens"] = kv.free_tokens();
             return d;
           })
      .def("block_table", [](const KvCache& kv, int group, int seq) { return kv.group(group).block_table(seq); })
      .def("create_sequence", &KvCache::create_sequence)
      .def("free_sequence", &KvCache::free_sequence)
      .def("reserve", &KvCache::reserve)
      .def("capacity", &KvCache::capacity)
      .def("truncate", &KvCache::truncate)
      .def("enable_prefix_cache", &KvCache::enable_prefix_cache, py::arg("seed") = 0)
      .def("advance",
           [](KvCache& kv, int seq, const carray<int32_t>& tokens, int64_t n_computed) {
             TF_CHECK(tokens.size() >= n_computed, "tokens must hold n_computed tokens");
             kv.advance(seq, tokens.data(), n_computed);
           })
      .def("attach_prefix",
           [](KvCache& kv, int seq, const carray<int32_t>& tokens) {
             return kv.attach_prefix(seq, tokens.data(), int64_t(tokens.size()));
           })
      .def("write_k",
           [](KvCache& kv, Backend& be, int layer, int seq, const carray<int64_t>& entries, const carray<float>& rows) {
             const KvPool& p = *kv.layer(layer).pool;
             TF_CHECK(rows.ndim() == 3 && rows.shape(0) == entries.size() && rows.shape(1) == p.spec().n_heads &&
                          rows.shape(2) == p.spec().k_dim,
                      "rows must be [entries, heads, k_dim]");
             std::vector<void*> cells = k_cells(kv, layer, seq, entries);
             be.store_rows(rows.data(), p.spec().k_dim, p.spec().k_dim, cells.data(), int64_t(cells.size()), p.type());
           })
      .def("write_v",
           [](KvCache& kv, Backend& be, int layer, int seq, const carray<int64_t>& entries, const carray<float>& rows) {
             const KvPool& p = *kv.layer(layer).pool;
             TF_CHECK(p.spec().v_dim > 0, "the layer keeps no V rows (V is a prefix of K)");
             TF_CHECK(rows.ndim() == 3 && rows.shape(0) == entries.size() && rows.shape(1) == p.spec().n_heads &&
                          rows.shape(2) == p.spec().v_dim,
                      "rows must be [entries, heads, v_dim]");
             std::vector<void*> cells = k_cells(kv, layer, seq, entries, true);
             be.store_rows(rows.data(), p.spec().v_dim, p.spec().v_dim, cells.data(), int64_t(cells.size()), p.type());
           })
      .def("read_k",
           [](const KvCache& kv, Backend& be, int layer, int seq, const carray<int64_t>& entries) {
             // The stored bytes, [entries, heads, k_dim * element size] (view as float16/float32).
             const KvPool& p = *kv.layer(layer).pool;
             std::vector<void*> cells = k_cells(kv, layer, seq, entries);
             const size_t row = size_t(p.spec().k_dim) * p.elem_size();
             py::array_t<uint8_t> out({entries.size(), py::ssize_t(p.spec().n_heads), py::ssize_t(row)});
             for (size_t c = 0; c < cells.size(); ++c) be.to_host(out.mutable_data() + c * row, cells[c], row);
             return out;
           });
}

}  // namespace tf
