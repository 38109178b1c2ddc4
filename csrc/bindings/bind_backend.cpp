// Binds the backend seam's operations one by one (tensorfold._core.Backend), for the op tests
// that run over every backend this machine has and for the microbenchmarks. No logic here
// beyond shaping arrays and sizing the backend's working memory for the call.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/profiled_backend.h"
#include "bindings/bindings.h"
#include "core/error.h"
#include "kv/kv_cache.h"
#include "quant/traits.h"

namespace py = pybind11;

namespace tf {

namespace {
template <typename T>
using carray = py::array_t<T, py::array::c_style | py::array::forcecast>;

Weight weight_of(uint32_t type_id, const carray<uint8_t>& w, int64_t rows, int64_t k) {
  const TypeTraits* tr = find_type_traits(type_id);
  TF_CHECK(tr != nullptr, "unknown type id ", type_id);
  const size_t stride = row_bytes(GgmlType(type_id), k);
  TF_CHECK(size_t(w.size()) >= stride * size_t(rows), "w has ", w.size(), " bytes, ", rows, " rows of ", k,
           " values need ", stride * size_t(rows));
  return Weight{GgmlType(type_id), k, rows, w.data(), stride, BufferKind::Host};
}

carray<float> rows2(const carray<float>& a, const char* what) {
  if (a.ndim() != 2) throw py::value_error(std::string(what) + " must be 2-D");
  return a;
}

int n_layers(const KvCache& kv) {
  int n = 0;
  for (int g = 0; g < kv.n_groups(); ++g) n += int(kv.group_layers(g).size());
  return n;
}

KvLayer layer_of(const KvCache& kv, int layer) {
  TF_CHECK(layer >= 0 && layer < n_layers(kv), "layer ", layer, " out of range");
  return kv.layer(layer);
}

// Whether the sequence's table in this layer's group holds entry e (a block, not a hole).
bool holds(const KvLayer& l, int seq, int64_t e) {
  const auto& table = l.pool->block_table(seq);
  const int64_t b = e / l.pool->block_size();
  return e >= 0 && b < int64_t(table.size()) && table[size_t(b)] >= 0;
}

// The fields both attention bindings fill alike: T query tokens q [T, HQ, D] over n_cache_heads
// cache heads, written to out [T, HQ, v_dim]. Sinks and a second layer are the caller's.
void fill_attention_batch(AttentionBatch& a, const carray<float>& q, py::array_t<float>& out, int64_t n_cache_heads,
                          int64_t v_dim, const int32_t* seq, const int64_t* end, int64_t window, float scale) {
  const int64_t T = q.shape(0), HQ = q.shape(1), D = q.shape(2);
  a.q = q.data();
  a.q_stride = HQ * D;
  a.out = out.mutable_data();
  a.out_stride = HQ * v_dim;
  a.T = T;
  a.seq = seq;
  a.end = end;
  a.window = window;
  a.n_cache_heads = int(n_cache_heads);
  a.group = int(HQ / n_cache_heads);
  a.head_dim = int(D);
  a.v_dim = int(v_dim);
  a.scale = scale;
}

KvType kv_type_of(const std::string& t) {
  TF_CHECK(t == "f16" || t == "f32", "kv_type must be 'f16' or 'f32'");
  return t == "f32" ? KvType::F32 : KvType::F16;
}
}  // namespace

void bind_backend(py::module_& m) {
  m.def("op_profile",
        [] {
          py::dict out;
          for (const auto& [key, c] : op_profile())
            out[py::str(key)] = py::dict(py::arg("calls") = c.calls, py::arg("seconds") = c.seconds,
                                         py::arg("weight_bytes") = c.weight_bytes);
          return out;
        },
        "Per-op costs since the last reset, of backends made with TENSORFOLD_PROFILE_OPS=1: "
        "{'op' or 'op TYPE decode|prefill': {calls, seconds, weight_bytes}}");
  m.def("reset_op_profile", &reset_op_profile);
  m.def("available_backends", &available_backends,
        "Backends this machine and build can run, e.g. ['cpu:avx512', 'cpu:avx2', 'cpu:scalar']");
  py::class_<Backend>(m, "Backend", "One backend of the seam (backend/backend.h), its operations one at a time")
      .def(py::init([](const std::string& name, int threads) {
             BackendOptions o;
             o.name = name;
             o.threads = threads;
             return make_backend(o);
           }),
           py::arg("name") = "cpu", py::arg("threads") = 1)
      .def_property_readonly("name", &Backend::name)
      .def("supports", [](const Backend& b, uint32_t t) { return b.supports(GgmlType(t)); })
      .def("matmul",
           [](Backend& b, uint32_t type_id, carray<uint8_t> w, int64_t rows, int64_t k, carray<float> x) {
             rows2(x, "x");
             TF_CHECK(x.shape(1) == k, "x rows must hold k values");
             const Weight wt = weight_of(type_id, w, rows, k);
             const int64_t T = x.shape(0);
             py::array_t<float> y({T, rows});
             {
               py::gil_scoped_release nogil;
               b.reserve_products({{wt.type, k, T, false}}, T, false);
               const Product p{&wt, y.mutable_data(), rows};
               b.matmul(x.data(), T, k, &p, 1);
             }
             return y;
           },
           py::arg("type_id"), py::arg("w"), py::arg("rows"), py::arg("k"), py::arg("x"),
           "y[t, r] = W[r] . x[t] (W: rows x k of type_id, x: [T, k] float32)")
      .def("matmul_stack",
           [](Backend& b, uint32_t type_id, carray<uint8_t> w, int64_t n, int64_t rows, int64_t k, carray<float> x,
              carray<int32_t> offsets, py::object gather_obj) {
             rows2(x, "x");
             TF_CHECK(x.shape(1) == k && offsets.size() == n + 1, "x must be [rows, k] and offsets n + 1 long");
             WeightStack s;
             s.first = weight_of(type_id, w, rows * n, k);
             s.first.rows = rows;
             s.n = n;
             s.stride = s.first.row_stride * size_t(rows);
             carray<int32_t> gather;
             Grouping g;
             g.offsets = offsets.data();
             g.first = 0;
             g.last = n;
             const int64_t list = offsets.data()[n];
             for (int64_t e = 0; e < n; ++e)
               TF_CHECK(offsets.data()[e] <= offsets.data()[e + 1], "offsets must not decrease");
             if (!gather_obj.is_none()) {
               gather = gather_obj.cast<carray<int32_t>>();
               TF_CHECK(gather.size() >= list, "gather must hold a row for each list row");
               for (int64_t i = 0; i < list; ++i)
                 TF_CHECK(gather.data()[i] >= 0 && gather.data()[i] < x.shape(0), "gather row out of range");
               g.gather = gather.data();
             } else {
               TF_CHECK(list <= x.shape(0), "offsets reach past x");
             }
             py::array_t<float> y({list, rows});
             {
               py::gil_scoped_release nogil;
               b.reserve_products({{s.first.type, k, std::max<int64_t>(list, 1), true}}, x.shape(0), false);
               const StackProduct p{&s, y.mutable_data(), rows};
               b.matmul_stack(x.data(), k, g, &p, 1);
             }
             return y;
           },
           py::arg("type_id"), py::arg("w"), py::arg("n"), py::arg("rows"), py::arg("k"), py::arg("x"),
           py::arg("offsets"), py::arg("gather") = py::none(),
           "list row i (rows of matrix e: offsets[e]..offsets[e+1]-1) = W[e] . x[gather[i] or i]")
      .def("rmsnorm",
           [](Backend& b, carray<float> x, py::object w_obj, float eps) {
             rows2(x, "x");
             const int64_t T = x.shape(0), n = x.shape(1);
             carray<float> w;
             if (!w_obj.is_none()) {
               w = w_obj.cast<carray<float>>();
               TF_CHECK(w.size() == n, "w must hold n values");
             }
             py::array_t<float> y({T, n});
             b.rmsnorm(x.data(), n, w_obj.is_none() ? nullptr : w.data(), y.mutable_data(), n, T, n, eps);
             return y;
           },
           py::arg("x"), py::arg("w"), py::arg("eps"))
      .def("rope",
           [](Backend& b, carray<float> v, int n_heads, int head_dim, int at, carray<float> cs, int rope_dim, bool neox,
              bool inverse) {
             rows2(v, "v");
             const int64_t T = v.shape(0);
             TF_CHECK(v.shape(1) == int64_t(n_heads) * head_dim && at + rope_dim <= head_dim && rope_dim % 2 == 0,
                      "v must be [T, n_heads * head_dim] with the rotated part inside each head");
             TF_CHECK(cs.ndim() == 2 && cs.shape(0) == T && cs.shape(1) == rope_dim, "cs must be [T, rope_dim]");
             py::array_t<float> out({T, v.shape(1)});
             std::copy(v.data(), v.data() + v.size(), out.mutable_data());
             b.rope(out.mutable_data(), T, v.shape(1), n_heads, head_dim, at, cs.data(), rope_dim, rope_dim, neox, inverse);
             return out;
           },
           py::arg("v"), py::arg("n_heads"), py::arg("head_dim"), py::arg("at"), py::arg("cs"), py::arg("rope_dim"),
           py::arg("neox"), py::arg("inverse") = false)
      .def("silu_mul",
           [](Backend& b, carray<float> g, carray<float> u, int64_t split, float limit) {
             rows2(g, "g");
             TF_CHECK(u.ndim() == 2 && u.shape(0) == g.shape(0) && u.shape(1) == g.shape(1), "u must match g");
             const int64_t T = g.shape(0), n = g.shape(1);
             py::array_t<float> out({T, n});
             std::copy(g.data(), g.data() + g.size(), out.mutable_data());
             b.silu_mul(out.mutable_data(), n, u.data(), n, T, n, split, limit);
             return out;
           },
           py::arg("g"), py::arg("u"), py::arg("split") = 0, py::arg("limit") = 0.0f,
           "silu(g) * u; limit > 0: g = min(g, limit), u = clamp(u, -limit, limit) first")
      .def("add_scaled",
           [](Backend& b, carray<float> y, carray<float> x, carray<float> s, bool sigmoid) {
             rows2(y, "y");
             const int64_t T = y.shape(0), n = y.shape(1);
             TF_CHECK(x.size() == y.size() && s.size() == T, "x must match y and s hold a value per row");
             py::array_t<float> out({T, n});
             std::copy(y.data(), y.data() + y.size(), out.mutable_data());
             b.add_scaled(out.mutable_data(), n, x.data(), n, s.data(), T, n, sigmoid);
             return out;
           },
           py::arg("y"), py::arg("x"), py::arg("s"), py::arg("sigmoid"))
      .def("add_bias",
           [](Backend& b, carray<float> y, carray<float> bias) {
             rows2(y, "y");
             const int64_t T = y.shape(0), n = y.shape(1);
             TF_CHECK(bias.size() == n, "bias must hold n values");
             py::array_t<float> out({T, n});
             std::copy(y.data(), y.data() + y.size(), out.mutable_data());
             b.add_bias(out.mutable_data(), n, bias.data(), T, n);
             b.add(out.mutable_data(), y.data(), T * n);  // y + b + y: add() too
             return out;
           },
           py::arg("y"), py::arg("bias"), "2 y + bias (add_bias, then add)")
      .def("embed",
           [](Backend& b, uint32_t type_id, carray<uint8_t> table, int64_t rows, int64_t k, carray<int32_t> tokens) {
             const Weight t = weight_of(type_id, table, rows, k);
             for (int64_t i = 0; i < tokens.size(); ++i)
               TF_CHECK(tokens.data()[i] >= 0 && tokens.data()[i] < rows, "token out of range");
             py::array_t<float> out({int64_t(tokens.size()), k});
             b.embed(t, tokens.data(), tokens.size(), out.mutable_data(), k);
             return out;
           },
           py::arg("type_id"), py::arg("table"), py::arg("rows"), py::arg("k"), py::arg("tokens"))
      .def("route",
           [](Backend& b, carray<float> logits, int n_used, int gating, bool norm_topk, float scale,
              py::object bias_obj, int n_group, int n_group_used, py::object fixed_obj) {
             rows2(logits, "logits");
             const int64_t T = logits.shape(0);
             moe::RouterConfig rc;
             rc.n_expert = int(logits.shape(1));
             rc.n_used = n_used;
             rc.gating = moe::Gating(gating);
             rc.norm_topk = norm_topk;
             rc.scale = scale;
             rc.n_group = n_group;
             rc.n_group_used = n_group_used;
             carray<float> bias;
             if (!bias_obj.is_none()) {
               bias = bias_obj.cast<carray<float>>();
               TF_CHECK(bias.size() == rc.n_expert, "bias must hold a value per expert");
               rc.selection_bias = bias.data();
             }
             moe::validate(rc);
             carray<int32_t> fixed;
             if (!fixed_obj.is_none()) {
               fixed = fixed_obj.cast<carray<int32_t>>();
               TF_CHECK(fixed.ndim() == 2 && fixed.shape(0) == T && fixed.shape(1) == n_used,
                        "fixed must be [T, n_used] expert ids");
               for (int64_t i = 0; i < fixed.size(); ++i)
                 TF_CHECK(fixed.data()[i] >= 0 && fixed.data()[i] < rc.n_expert, "fixed expert id out of range");
             }
             py::array_t<int32_t> ids({T, int64_t(n_used)}), offsets(rc.n_expert + 1), rows(T * n_used),
                 slot(T * n_used);
             py::array_t<float> w({T, int64_t(n_used)});
             Routing r{ids.mutable_data(), w.mutable_data(), offsets.mutable_data(), rows.mutable_data(),
                       slot.mutable_data()};
             b.route(rc, logits.data(), T, r, fixed_obj.is_none() ? nullptr : fixed.data());
             return py::make_tuple(ids, w, offsets, rows, slot);
           },
           py::arg("logits"), py::arg("n_used"), py::arg("gating") = 1, py::arg("norm_topk") = false,
           py::arg("scale") = 1.0f, py::arg("bias") = py::none(), py::arg("n_group") = 1, py::arg("n_group_used") = 1,
           py::arg("fixed") = py::none(),
           "(ids, weights, offsets, rows, slot_of): routing and the grouping by expert (gating 1 softmax, 2 sigmoid, "
           "4 sqrtsoftplus; fixed: [T, n_used] ids chosen by a table, hash routing)")
      .def("combine",
           [](Backend& b, carray<float> expert_out, carray<int32_t> ids, carray<float> w, carray<int32_t> slot_of,
              int lo, int hi) {
             rows2(expert_out, "expert_out");
             TF_CHECK(ids.ndim() == 2 && w.size() == ids.size() && slot_of.size() == ids.size(),
                      "ids/weights/slot_of must be [T, n_used]");
             const int64_t T = ids.shape(0), K = ids.shape(1), n = expert_out.shape(1);
             for (int64_t i = 0; i < ids.size(); ++i)
               TF_CHECK(slot_of.data()[i] >= 0 && slot_of.data()[i] < expert_out.shape(0), "slot out of range");
             py::array_t<float> out({T, n});
             b.fill(out.mutable_data(), T * n, 0.f);
             Routing r{const_cast<int32_t*>(ids.data()), const_cast<float*>(w.data()), nullptr, nullptr,
                       const_cast<int32_t*>(slot_of.data())};
             b.combine(out.mutable_data(), n, expert_out.data(), n, T, n, r, int(K), lo, hi);
             return out;
           },
           py::arg("expert_out"), py::arg("ids"), py::arg("weights"), py::arg("slot_of"), py::arg("lo"), py::arg("hi"))
      .def("attention",
           [](Backend& b, carray<float> q, carray<float> k, py::object v_obj, int64_t v_dim, carray<int64_t> ends,
              int64_t window, float scale, const std::string& kv_type) {
             // One sequence: K/V rows of positions [0, n) stored through the backend into a paged
             // cache of one layer, then the T query tokens read entries [.., ends[t]).
             if (q.ndim() != 3 || k.ndim() != 3) throw py::value_error("q must be [T, Hq, D], k [n, Hk, D]");
             const int64_t T = q.shape(0), HQ = q.shape(1), D = q.shape(2), n = k.shape(0), HK = k.shape(1);
             TF_CHECK(k.shape(2) == D && HK > 0 && HQ % HK == 0 && ends.size() == T, "shapes do not agree");
             carray<float> v;
             const bool latent = v_obj.is_none();
             if (!latent) {
               v = v_obj.cast<carray<float>>();
               TF_CHECK(v.ndim() == 3 && v.shape(0) == n && v.shape(1) == HK, "v must be [n, Hk, Dv]");
               v_dim = v.shape(2);
             }
             TF_CHECK(v_dim >= 1 && v_dim <= D, "v_dim out of range");
             for (int64_t t = 0; t < T; ++t) TF_CHECK(ends.data()[t] >= 1 && ends.data()[t] <= n, "ends out of range");
             KvSpec spec;
             spec.n_heads = int(HK);
             spec.k_dim = int(D);
             spec.v_dim = latent ? 0 : int(v_dim);
             spec.window = window;
             const KvType type = kv_type == "f32" ? KvType::F32 : KvType::F16;
             py::array_t<float> out({T, HQ, v_dim});
             {
               py::gil_scoped_release nogil;
               KvCache kv({spec}, std::max<int64_t>(n, 1), type, b);
               const int seq = kv.create_sequence();
               TF_CHECK(kv.reserve(seq, n), "cannot reserve the cache");
               const KvLayer layer = kv.layer(0);
               std::vector<void*> krows(size_t(n * HK)), vrows(size_t(n * HK));
               for (int64_t p = 0; p < n; ++p)
                 for (int64_t h = 0; h < HK; ++h) {
                   krows[size_t(p * HK + h)] = layer.pool->k_row(layer.layer, seq, p, int(h));
                   vrows[size_t(p * HK + h)] = layer.pool->v_row(layer.layer, seq, p, int(h));
                 }
               b.store_rows(k.data(), D, D, krows.data(), n * HK, type);
               if (!latent) b.store_rows(v.data(), v_dim, v_dim, vrows.data(), n * HK, type);
               std::vector<int32_t> seqs(size_t(T), seq);
               AttentionBatch a;
               fill_attention_batch(a, q, out, HK, v_dim, seqs.data(), ends.data(), window, scale);
               b.attention(a, layer);
             }
             return out;
           },
           py::arg("q"), py::arg("k"), py::arg("v"), py::arg("v_dim") = 0, py::arg("ends"), py::arg("window") = 0,
           py::arg("scale") = 1.0f, py::arg("kv_type") = "f16",
           "softmax(q . K * scale) . V over a paged cache (v None: V is the first v_dim values of each K row)")
      .def("attention_kv",
           [](Backend& b, KvCache& kv, int layer, carray<float> q, carray<int32_t> seqs, carray<int64_t> ends,
              int64_t window, float scale, int64_t v_dim, py::object sinks_obj, py::object extra_obj,
              py::object count_obj, py::object list_obj) {
             // The batch reads the rows a test wrote into the cache (KvCache.write_k / write_v):
             // token t of sequence seqs[t] reads layer `layer`'s entries before ends[t] (the last
             // `window` of them with a window) and, with extra_layer, that layer's entries
             // [0, extra_count[t]) or extra_list[t] (-1: none).
             if (q.ndim() != 3) throw py::value_error("q must be [T, Hq, D]");
             const int64_t T = q.shape(0), HQ = q.shape(1), D = q.shape(2);
             const KvLayer l = layer_of(kv, layer);
             const KvSpec& spec = l.pool->spec();
             const int64_t HK = spec.n_heads;
             TF_CHECK(spec.k_dim == D && HQ % HK == 0, "q must be [T, a multiple of ", HK, " heads, ", spec.k_dim, "]");
             if (v_dim == 0) v_dim = spec.v_dim > 0 ? spec.v_dim : D;
             TF_CHECK(v_dim >= 1 && v_dim <= (spec.v_dim > 0 ? spec.v_dim : D), "v_dim out of range");
             TF_CHECK(seqs.size() == T && ends.size() == T && window >= 0, "seqs and ends must hold T entries");
             for (int64_t t = 0; t < T; ++t) {
               const int64_t e = ends.data()[t], begin = window > 0 ? std::max<int64_t>(0, e - window) : 0;
               TF_CHECK(seqs.data()[t] >= 0 && seqs.data()[t] < kv.max_seqs() && e >= 1 && holds(l, seqs.data()[t], e - 1) &&
                            holds(l, seqs.data()[t], begin),
                        "token ", t, ": its entries are not in the cache");
             }
             AttentionBatch a;
             carray<float> sinks;
             if (!sinks_obj.is_none()) {
               sinks = sinks_obj.cast<carray<float>>();
               TF_CHECK(sinks.size() == HQ, "sinks must hold a logit per query head");
               a.sinks = sinks.data();
             }
             KvLayer extra;
             carray<int64_t> count;
             carray<int32_t> list;
             if (!extra_obj.is_none()) {
               extra = layer_of(kv, extra_obj.cast<int>());
               const KvSpec& es = extra.pool->spec();
               TF_CHECK(es.n_heads == 1 && es.k_dim == D && (es.v_dim == 0 ? v_dim <= D : v_dim <= es.v_dim),
                        "the extra layer must hold one head of the same rows");
               TF_CHECK(count_obj.is_none() != list_obj.is_none(), "extra entries: give extra_count or extra_list");
               if (!count_obj.is_none()) {
                 count = count_obj.cast<carray<int64_t>>();
                 TF_CHECK(count.size() == T, "extra_count must hold T entries");
                 for (int64_t t = 0; t < T; ++t)
                   TF_CHECK(count.data()[t] >= 0 && (count.data()[t] == 0 || holds(extra, seqs.data()[t], count.data()[t] - 1)),
                            "extra_count[", t, "] reaches past the cache");
                 a.extra_count = count.data();
               } else {
                 list = list_obj.cast<carray<int32_t>>();
                 TF_CHECK(list.ndim() == 2 && list.shape(0) == T, "extra_list must be [T, n]");
                 for (int64_t t = 0; t < T; ++t)
                   for (int64_t i = 0; i < list.shape(1); ++i) {
                     const int32_t e = list.data()[t * list.shape(1) + i];
                     TF_CHECK(e == -1 || holds(extra, seqs.data()[t], e), "extra_list[", t, ", ", i, "] is not in the cache");
                   }
                 a.extra_list = list.data();
                 a.extra_len = list.shape(1);
               }
               a.extra = &extra;
             } else {
               TF_CHECK(count_obj.is_none() && list_obj.is_none(), "extra entries need extra_layer");
             }
             py::array_t<float> out({T, HQ, v_dim});
             fill_attention_batch(a, q, out, HK, v_dim, seqs.data(), ends.data(), window, scale);
             {
               py::gil_scoped_release nogil;
               b.attention(a, l);
             }
             return out;
           },
           py::arg("kv"), py::arg("layer"), py::arg("q"), py::arg("seqs"), py::arg("ends"), py::arg("window") = 0,
           py::arg("scale") = 1.0f, py::arg("v_dim") = 0, py::arg("sinks") = py::none(),
           py::arg("extra_layer") = py::none(), py::arg("extra_count") = py::none(), py::arg("extra_list") = py::none(),
           "attention over rows written into a KvCache, with optional sinks and a second layer's entries")
      .def("gated_pool",
           [](Backend& b, carray<float> src, const std::string& kv_type, carray<int32_t> which, carray<int64_t> kv_at,
              carray<int64_t> gate_at, py::object bias_obj, int64_t D) {
             // src rows are stored through the backend as cache rows of kv_type; entry e's slot s
             // reads row which[e, s] (-1: absent).
             rows2(src, "src");
             TF_CHECK(which.ndim() == 2, "which must be [count, n_slots]");
             const int64_t count = which.shape(0), S = which.shape(1), R = src.shape(0), W = src.shape(1);
             TF_CHECK(kv_at.size() == S && gate_at.size() == S && D >= 1, "kv_at and gate_at: one per slot");
             for (int64_t s = 0; s < S; ++s)
               TF_CHECK(kv_at.data()[s] >= 0 && kv_at.data()[s] + D <= W && gate_at.data()[s] >= 0 &&
                            gate_at.data()[s] + D <= W,
                        "slot ", s, " reads past the row");
             for (int64_t i = 0; i < which.size(); ++i)
               TF_CHECK(which.data()[i] >= -1 && which.data()[i] < R, "which: row out of range");
             carray<float> bias;
             if (!bias_obj.is_none()) {
               bias = bias_obj.cast<carray<float>>();
               TF_CHECK(bias.ndim() == 2 && bias.shape(0) == S && bias.shape(1) == D, "bias must be [n_slots, D]");
             }
             const KvType t = kv_type_of(kv_type);
             const size_t row_bytes = size_t(W) * (t == KvType::F32 ? 4 : 2);
             Buffer store = b.alloc(std::max<size_t>(row_bytes * size_t(R), 1), BufferKind::Device);
             TF_CHECK(bool(store), "cannot allocate the rows");
             std::vector<void*> cells(static_cast<size_t>(R));
             for (int64_t r = 0; r < R; ++r) cells[size_t(r)] = static_cast<uint8_t*>(store.data()) + size_t(r) * row_bytes;
             std::vector<PoolSlot> slots(static_cast<size_t>(S));
             for (int64_t s = 0; s < S; ++s)
               slots[size_t(s)] = {kv_at.data()[s], gate_at.data()[s], bias_obj.is_none() ? nullptr : bias.data() + s * D};
             std::vector<const void*> rows(size_t(count * S));
             for (int64_t i = 0; i < count * S; ++i)
               rows[size_t(i)] = which.data()[i] < 0 ? nullptr : cells[size_t(which.data()[i])];
             py::array_t<float> out({count, D});
             {
               py::gil_scoped_release nogil;
               b.store_rows(src.data(), W, W, cells.data(), R, t);
               b.gated_pool(rows.data(), slots.data(), int(S), count, D, t, out.mutable_data(), D);
             }
             return out;
           },
           py::arg("src"), py::arg("kv_type"), py::arg("which"), py::arg("kv_at"), py::arg("gate_at"),
           py::arg("bias"), py::arg("D"),
           "per entry and channel: softmax over present slots of (gate + bias) times the slots' values")
      .def("index_topk",
           [](Backend& b, KvCache& kv, int layer, carray<float> q, carray<float> w, carray<int32_t> seqs,
              carray<int64_t> counts, int k) {
             if (q.ndim() != 3) throw py::value_error("q must be [T, n_heads, D]");
             const int64_t T = q.shape(0), H = q.shape(1), D = q.shape(2);
             const KvLayer l = layer_of(kv, layer);
             TF_CHECK(l.pool->spec().n_heads == 1 && l.pool->spec().k_dim == D, "the layer must hold one head of D");
             TF_CHECK(w.ndim() == 2 && w.shape(0) == T && w.shape(1) == H, "w must be [T, n_heads]");
             TF_CHECK(seqs.size() == T && counts.size() == T && k >= 1, "seqs and counts: T entries; k >= 1");
             for (int64_t t = 0; t < T; ++t)
               TF_CHECK(seqs.data()[t] >= 0 && seqs.data()[t] < kv.max_seqs() && counts.data()[t] >= 0 &&
                            (counts.data()[t] == 0 || holds(l, seqs.data()[t], counts.data()[t] - 1)),
                        "token ", t, ": its entries are not in the cache");
             py::array_t<int32_t> idx({T, int64_t(k)});
             {
               py::gil_scoped_release nogil;
               b.index_topk(q.data(), H * D, int(H), D, w.data(), H, l, seqs.data(), counts.data(), T, k,
                            idx.mutable_data());
             }
             return idx;
           },
           py::arg("kv"), py::arg("layer"), py::arg("q"), py::arg("w"), py::arg("seqs"), py::arg("counts"),
           py::arg("k"), "the k best entries per token by sum_h w[h] relu(q[h] . k_s), best first, -1 padded")
      .def("hyper_maps",
           [](Backend& b, carray<float> mix, carray<float> base, carray<float> scale, int n, int iters, float eps,
              bool final_collapse) {
             rows2(mix, "mix");
             const int64_t T = mix.shape(0), width = final_collapse ? n : (2 + n) * n;
             TF_CHECK(n >= 1 && n <= 16 && mix.shape(1) == width && base.size() == width &&
                          scale.size() == (final_collapse ? 1 : 3) && (final_collapse || iters >= 1),
                      "mix: [T, ", width, "], base: ", width, " values, scale: ", final_collapse ? 1 : 3, " values");
             py::array_t<float> pre({T, int64_t(n)}), post({T, int64_t(n)}), comb({T, int64_t(n), int64_t(n)});
             HyperMaps m;
             m.mix = mix.data();
             m.ldm = width;
             m.base = base.data();
             m.scale = scale.data();
             m.n = n;
             m.iters = iters;
             m.eps = eps;
             m.pre = pre.mutable_data();
             m.post = final_collapse ? nullptr : post.mutable_data();
             m.comb = final_collapse ? nullptr : comb.mutable_data();
             b.hyper_maps(m, T);
             if (final_collapse) return py::object(pre);
             return py::object(py::make_tuple(pre, post, comb));
           },
           py::arg("mix"), py::arg("base"), py::arg("scale"), py::arg("n"), py::arg("iters") = 1,
           py::arg("eps") = 1e-6f, py::arg("final") = false,
           "(pre, post, comb) of hyper-connections from the mixing logits; final: pre only")
      .def("hyper_collapse",
           [](Backend& b, carray<float> streams, carray<float> pre) {
             if (streams.ndim() != 3) throw py::value_error("streams must be [T, n, E]");
             const int64_t T = streams.shape(0), n = streams.shape(1), E = streams.shape(2);
             TF_CHECK(pre.ndim() == 2 && pre.shape(0) == T && pre.shape(1) == n, "pre must be [T, n]");
             py::array_t<float> out({T, E});
             b.hyper_collapse(streams.data(), pre.data(), int(n), E, T, out.mutable_data(), E);
             return out;
           },
           py::arg("streams"), py::arg("pre"))
      .def("hyper_expand",
           [](Backend& b, carray<float> streams, carray<float> block_out, carray<float> post, carray<float> comb) {
             if (streams.ndim() != 3) throw py::value_error("streams must be [T, n, E]");
             const int64_t T = streams.shape(0), n = streams.shape(1), E = streams.shape(2);
             TF_CHECK(n >= 1 && n <= 16, "1 to 16 streams");
             TF_CHECK(block_out.ndim() == 2 && block_out.shape(0) == T && block_out.shape(1) == E,
                      "block_out must be [T, E]");
             TF_CHECK(post.ndim() == 2 && post.shape(0) == T && post.shape(1) == n, "post must be [T, n]");
             TF_CHECK(comb.ndim() == 3 && comb.shape(0) == T && comb.shape(1) == n && comb.shape(2) == n,
                      "comb must be [T, n, n]");
             py::array_t<float> out({T, n, E});
             std::copy(streams.data(), streams.data() + streams.size(), out.mutable_data());
             b.hyper_expand(out.mutable_data(), block_out.data(), E, post.data(), comb.data(), int(n), E, T);
             return out;
           },
           py::arg("streams"), py::arg("block_out"), py::arg("post"), py::arg("comb"),
           "streams[i] = post[i] * block_out + sum_j comb[j, i] * streams[j]");
}

}  // namespace tf
