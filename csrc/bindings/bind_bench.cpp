// Binds state for the microbenchmarks (bench/): what a timed operation reads is built once, so a
// timed call runs the operation and nothing else. No logic here beyond shaping arrays.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <memory>
#include <string>
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

// One sequence's K/V rows for positions [0, n), stored once into a one-layer paged cache of the
// backend (Backend.attention stores them on every call, which at long context costs more than
// the attention itself).
struct CachedAttention {
  Backend* be = nullptr;
  std::unique_ptr<KvCache> kv;
  int seq = 0;
  int64_t n = 0, heads = 0, k_dim = 0, v_dim = 0, window = 0;
};
}  // namespace

void bind_bench(py::module_& m) {
  py::class_<CachedAttention>(m, "BenchAttention",
                              "K/V rows stored once in a paged cache; run() times one attention call")
      .def(py::init([](Backend& be, carray<float> k, py::object v_obj, int64_t v_dim, int64_t window,
                       const std::string& kv_type) {
             if (k.ndim() != 3) throw py::value_error("k must be [n, Hk, D]");
             TF_CHECK(kv_type == "f16" || kv_type == "f32", "kv_type must be 'f16' or 'f32'");
             auto a = std::make_unique<CachedAttention>();
             a->be = &be;
             a->n = k.shape(0);
             a->heads = k.shape(1);
             a->k_dim = k.shape(2);
             a->window = window;
             const bool latent = v_obj.is_none();
             carray<float> v;
             if (!latent) {
               v = v_obj.cast<carray<float>>();
               TF_CHECK(v.ndim() == 3 && v.shape(0) == a->n && v.shape(1) == a->heads, "v must be [n, Hk, Dv]");
               v_dim = v.shape(2);
             }
             TF_CHECK(a->n >= 1 && a->heads >= 1 && v_dim >= 1 && v_dim <= a->k_dim, "shapes do not agree");
             a->v_dim = v_dim;
             KvSpec spec;
             spec.n_heads = int(a->heads);
             spec.k_dim = int(a->k_dim);
             spec.v_dim = latent ? 0 : int(v_dim);
             spec.window = window;
             const KvType type = kv_type == "f32" ? KvType::F32 : KvType::F16;
             py::gil_scoped_release nogil;
             a->kv = std::make_unique<KvCache>(std::vector<KvSpec>{spec}, a->n, type, be);
             a->seq = a->kv->create_sequence();
             TF_CHECK(a->kv->reserve(a->seq, a->n), "cannot reserve the cache");
             const KvLayer layer = a->kv->layer(0);
             const int64_t count = a->n * a->heads;
             std::vector<void*> krows(static_cast<size_t>(count)), vrows(static_cast<size_t>(count));
             for (int64_t p = 0; p < a->n; ++p)
               for (int64_t h = 0; h < a->heads; ++h) {
                 krows[size_t(p * a->heads + h)] = layer.pool->k_row(layer.layer, a->seq, p, int(h));
                 if (!latent) vrows[size_t(p * a->heads + h)] = layer.pool->v_row(layer.layer, a->seq, p, int(h));
               }
             be.store_rows(k.data(), a->k_dim, a->k_dim, krows.data(), count, type);
             if (!latent) be.store_rows(v.data(), v_dim, v_dim, vrows.data(), count, type);
             return a;
           }),
           py::arg("backend"), py::arg("k"), py::arg("v"), py::arg("v_dim") = 0, py::arg("window") = 0,
           py::arg("kv_type") = "f16", py::keep_alive<1, 2>(),
           "k: [n, Hk, D] rows of positions 0..n-1; v: [n, Hk, Dv], or None: V is the first v_dim values "
           "of each K row (one latent row per position)")
      .def_property_readonly("positions", [](const CachedAttention& a) { return a.n; })
      .def_property_readonly("bytes", [](const CachedAttention& a) { return a.kv->bytes(); })
      .def("run",
           [](CachedAttention& a, carray<float> q, carray<int64_t> ends, float scale) {
             if (q.ndim() != 3) throw py::value_error("q must be [T, Hq, D]");
             const int64_t T = q.shape(0), HQ = q.shape(1);
             TF_CHECK(q.shape(2) == a.k_dim && HQ % a.heads == 0 && ends.size() == T, "shapes do not agree");
             for (int64_t t = 0; t < T; ++t)
               TF_CHECK(ends.data()[t] >= 1 && ends.data()[t] <= a.n, "ends out of range");
             py::array_t<float> out({T, HQ, a.v_dim});
             {
               py::gil_scoped_release nogil;
               const std::vector<int32_t> seqs(size_t(T), a.seq);
               AttentionBatch b;
               b.q = q.data();
               b.q_stride = HQ * a.k_dim;
               b.out = out.mutable_data();
               b.out_stride = HQ * a.v_dim;
               b.T = T;
               b.seq = seqs.data();
               b.end = ends.data();
               b.window = a.window;
               b.n_cache_heads = int(a.heads);
               b.group = int(HQ / a.heads);
               b.head_dim = int(a.k_dim);
               b.v_dim = int(a.v_dim);
               b.scale = scale;
               a.be->attention(b, a.kv->layer(0));
             }
             return out;
           },
           py::arg("q"), py::arg("ends"), py::arg("scale") = 1.0f,
           "out[t] = softmax(q[t] . K[:ends[t]] * scale) . V (query tokens at consecutive ends: a causal block)");
}

}  // namespace tf
