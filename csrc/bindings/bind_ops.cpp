// Binds standalone kernels (paged attention, vector primitives, sampler) for tests and
// microbenchmarks. No logic here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "backend/cpu/attention.h"
#include "backend/cpu/vec_ops.h"
#include "bindings/bindings.h"
#include "engine/sampler.h"

namespace py = pybind11;

namespace tf {

namespace {
template <typename T>
using carray = py::array_t<T, py::array::c_style | py::array::forcecast>;
}

void bind_ops(py::module_& m) {
  auto o = m.def_submodule("ops", "standalone CPU kernels for tests and benchmarks");
  // Shapes of paged half K/V and a page table covering n positions; returns (block_size, head_dim).
  auto check_pages = [](const carray<uint16_t>& k_pages, const carray<uint16_t>& v_pages,
                        const carray<int32_t>& table, int64_t n) {
    if (k_pages.ndim() != 3 || v_pages.ndim() != 3 || k_pages.shape(0) != v_pages.shape(0) ||
        k_pages.shape(1) != v_pages.shape(1) || k_pages.shape(2) != v_pages.shape(2))
      throw py::value_error("k_pages and v_pages must both be [pages, block_size, head_dim]");
    const int64_t pages = k_pages.shape(0), bs = k_pages.shape(1);
    if (n < 1 || n > table.size() * bs) throw py::value_error("n exceeds the pages in the table");
    for (int64_t i = 0; i < table.size(); ++i)
      if (table.data()[i] < 0 || table.data()[i] >= pages) throw py::value_error("table entry out of range");
    return std::pair<int64_t, int64_t>(bs, k_pages.shape(2));
  };
  // v_pages None: V is the first v_dim values of each K row (multi-head latent attention).
  auto pages_of = [](const carray<uint16_t>& k_pages, const py::object& v_pages, carray<uint16_t>& v_holder,
                     int64_t v_dim, int64_t D) {
    if (v_pages.is_none()) {
      if (v_dim < 1 || v_dim > D) throw py::value_error("with v_pages None, v_dim must be in [1, head_dim]");
      return k_pages;
    }
    v_holder = v_pages.cast<carray<uint16_t>>();
    if (v_dim < 0 || v_dim > D) throw py::value_error("v_dim must be in [0, head_dim]");
    return v_holder;
  };
  o.def("paged_attention",
        [check_pages, pages_of](carray<float> q, carray<uint16_t> k_pages, py::object v_pages_obj,
                                carray<int32_t> table, int64_t n, float scale, int64_t v_dim) {
          carray<uint16_t> holder;
          const int64_t D0 = k_pages.ndim() == 3 ? k_pages.shape(2) : 0;
          const carray<uint16_t> v_pages = pages_of(k_pages, v_pages_obj, holder, v_dim, D0);
          const auto [bs, D] = check_pages(k_pages, v_pages, table, n);
          const int64_t Dv = v_dim > 0 ? v_dim : D;
          // q: one head (head_dim values) or several sharing the KV head ([n_heads, head_dim]).
          if (q.size() % D != 0 || q.size() == 0) throw py::value_error("q must be [n_heads, head_dim]");
          const int64_t G = q.size() / D;
          py::array_t<float> out(q.ndim() == 2 ? std::vector<py::ssize_t>{G, Dv} : std::vector<py::ssize_t>{Dv});
          {
            py::gil_scoped_release nogil;
            cpu::PagedKv kv{k_pages.data(), v_pages.data(), size_t(bs * D), table.data(), int(bs)};
            kv.v_dim = int(v_dim);
            cpu::paged_attention(q.data(), int(G), int(D), kv, n, scale, out.mutable_data());
          }
          return out;
        },
        py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("table"), py::arg("n"),
        py::arg("scale"), py::arg("v_dim") = 0,
        "softmax(q.K*scale).V over paged half-precision K/V (pages as uint16 bits); v_pages None: "
        "V is the first v_dim values of each K row (latent attention)");
  o.def("paged_attention_causal",
        [check_pages, pages_of](carray<float> q, carray<uint16_t> k_pages, py::object v_pages_obj,
                                carray<int32_t> table, int64_t pos0, float scale, int64_t v_dim) {
          if (q.ndim() != 3) throw py::value_error("q must be [n_tokens, n_heads, head_dim]");
          carray<uint16_t> holder;
          const int64_t D0 = k_pages.ndim() == 3 ? k_pages.shape(2) : 0;
          const carray<uint16_t> v_pages = pages_of(k_pages, v_pages_obj, holder, v_dim, D0);
          const int64_t nt = q.shape(0), G = q.shape(1);
          const auto [bs, D] = check_pages(k_pages, v_pages, table, pos0 + nt);
          if (q.shape(2) != D || pos0 < 0 || nt * G > cpu::kAttentionBlockRows)
            throw py::value_error("q must be [n_tokens, n_heads, head_dim] with n_tokens * n_heads <= " +
                                  std::to_string(cpu::kAttentionBlockRows));
          const int64_t Dv = v_dim > 0 ? v_dim : D;
          py::array_t<float> out({nt, G, Dv});
          {
            py::gil_scoped_release nogil;
            cpu::PagedKv kv{k_pages.data(), v_pages.data(), size_t(bs * D), table.data(), int(bs)};
            kv.v_dim = int(v_dim);
            cpu::paged_attention_causal(q.data(), G * D, int(nt), int(G), int(D), kv, pos0, scale, out.mutable_data(),
                                        G * Dv);
          }
          return out;
        },
        py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("table"), py::arg("pos0"), py::arg("scale"),
        py::arg("v_dim") = 0,
        "paged_attention for n_tokens consecutive positions from pos0, causally, as one block");
  o.def("silu_mul", [](carray<float> g, carray<float> u) {
    if (g.size() != u.size()) throw py::value_error("g and u differ in size");
    py::array_t<float> out(g.size());
    cpu::vec_ops().silu_mul(g.size(), g.data(), u.data(), out.mutable_data());
    return out;
  });
  o.def("exp_sub_sum", [](carray<float> x, float mx) {
    py::array_t<float> y(x.size());
    std::copy(x.data(), x.data() + x.size(), y.mutable_data());
    const float s = cpu::vec_ops().exp_sub_sum(x.size(), y.mutable_data(), mx);
    return py::make_tuple(y, s);
  });
  o.def("sample",
        [](carray<float> logits, int n, float temperature, int top_k, float top_p, float min_p,
           uint64_t seed, float presence_penalty, float frequency_penalty, const std::vector<int32_t>& generated) {
          SamplingParams p;
          p.presence_penalty = presence_penalty;
          p.frequency_penalty = frequency_penalty;
          p.temperature = temperature;
          p.top_k = top_k;
          p.top_p = top_p;
          p.min_p = min_p;
          p.seed = seed;
          Sampler s(p);
          for (int32_t t : generated) s.observe(t, logits.size());
          py::array_t<int32_t> out(n);
          {
            py::gil_scoped_release nogil;
            for (int i = 0; i < n; ++i) out.mutable_data()[i] = s.sample(logits.data(), logits.size());
          }
          return out;
        },
        py::arg("logits"), py::arg("n") = 1, py::arg("temperature") = 0.8f, py::arg("top_k") = 40,
        py::arg("top_p") = 0.95f, py::arg("min_p") = 0.05f, py::arg("seed") = 0,
        py::arg("presence_penalty") = 0.f, py::arg("frequency_penalty") = 0.f,
        py::arg("generated") = std::vector<int32_t>{},
        "n draws from one sampler (its RNG advances between draws) that has generated `generated` "
        "(the penalties' counts; the draws do not add to them)");
}

}  // namespace tf
