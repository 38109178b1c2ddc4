// Binds the MoE router (fast path and reference) for tests and tools. No logic here beyond
// argument checking.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "moe/router.h"

namespace py = pybind11;

namespace tf {

namespace {
template <typename T>
using carray = py::array_t<T, py::array::c_style | py::array::forcecast>;
}

void bind_moe(py::module_& m) {
  m.def(
      "moe_route",
      [](carray<float> logits, int n_used, const std::string& gating, bool norm_topk, float scale,
         std::optional<carray<float>> bias, int n_group, int n_group_used, bool reference,
         std::optional<carray<int32_t>> fixed) {
        if (logits.ndim() != 2) throw py::value_error("logits must be a 2-D array [T, n_expert]");
        const int64_t T = logits.shape(0), n_expert = logits.shape(1);
        if (n_expert < 1 || n_expert > (int64_t{1} << 30)) throw py::value_error("logits must have 1 <= n_expert columns");
        moe::RouterConfig cfg;
        cfg.n_expert = static_cast<int>(n_expert);
        cfg.n_used = n_used;
        if (gating == "softmax")
          cfg.gating = moe::Gating::Softmax;
        else if (gating == "sigmoid")
          cfg.gating = moe::Gating::Sigmoid;
        else if (gating == "sqrtsoftplus")
          cfg.gating = moe::Gating::SqrtSoftplus;
        else
          throw py::value_error("gating must be 'softmax', 'sigmoid' or 'sqrtsoftplus', got '" + gating + "'");
        cfg.norm_topk = norm_topk;
        cfg.scale = scale;
        if (bias) {
          if (bias->ndim() != 1 || bias->shape(0) != n_expert)
            throw py::value_error("bias must be a 1-D array of n_expert=" + std::to_string(n_expert) +
                                  " elements");
          cfg.selection_bias = bias->data();
        }
        cfg.n_group = n_group;
        cfg.n_group_used = n_group_used;
        moe::validate(cfg);  // tf::Error(InvalidInput) -> ValueError
        if (fixed && (fixed->ndim() != 2 || fixed->shape(0) != T || fixed->shape(1) != n_used))
          throw py::value_error("fixed must be a 2-D array [T, n_used] of expert ids");
        const int32_t* fixed_ids = fixed ? fixed->data() : nullptr;  // ids out of range raise in the router

        const int k = cfg.n_used;
        py::array_t<int32_t> ids({T, static_cast<int64_t>(k)});
        py::array_t<float> weights({T, static_cast<int64_t>(k)});
        std::vector<float> scratch(reference ? 0 : 3 * static_cast<size_t>(n_expert));
        {
          py::gil_scoped_release nogil;
          if (reference)
            moe::route_reference(cfg, logits.data(), T, ids.mutable_data(), weights.mutable_data(), fixed_ids);
          else
            moe::route(cfg, logits.data(), T, ids.mutable_data(), weights.mutable_data(), scratch.data(), fixed_ids);
        }
        return py::make_tuple(ids, weights);
      },
      py::arg("logits"), py::arg("n_used"), py::arg("gating") = "softmax", py::arg("norm_topk") = false,
      py::arg("scale") = 1.0f, py::arg("bias") = py::none(), py::arg("n_group") = 1,
      py::arg("n_group_used") = 1, py::arg("reference") = false, py::arg("fixed") = py::none(),
      "Route tokens to experts: returns (ids int32 [T, n_used], weights float32 [T, n_used]), ids best "
      "first (ties: lower expert id). gating 'softmax', 'sigmoid' or 'sqrtsoftplus'; bias shifts the selection "
      "scores only; n_group/n_group_used enable group-limited top-k; reference=True runs the "
      "double-precision reference; fixed: [T, n_used] expert ids chosen by a table (hash routing), "
      "only their weights computed.");
}

}  // namespace tf
