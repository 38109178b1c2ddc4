// Binds tf::Engine. Compute releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "engine/engine.h"

namespace py = pybind11;

namespace tf {

void bind_engine(py::module_& m) {
  py::class_<Engine>(m, "Engine")
      .def(py::init([](const std::string& path, int threads, int64_t kv_tokens, int64_t context,
                       int max_batch_tokens, const std::string& kv_type, int tp_size, int tp_rank,
                       const std::string& tp_addr, const std::vector<std::string>& tp_rails,
                       double tp_timeout, bool tp_compatible) {
             EngineOptions o;
             o.tp.compatible = tp_compatible;
             o.tp.size = tp_size;
             o.tp.rank = tp_rank;
             o.tp.addr = tp_addr;
             o.tp.rails = tp_rails;
             o.tp.timeout_s = tp_timeout;
             if (kv_type == "f16") o.kv_type = KvType::F16;
             else if (kv_type == "f32") o.kv_type = KvType::F32;
             else throw py::value_error("kv_type must be 'f16' or 'f32', got '" + kv_type + "'");
             o.threads = threads;
             o.kv_tokens = kv_tokens;
             o.context = context;
             o.max_batch_tokens = max_batch_tokens;
             py::gil_scoped_release nogil;
             return std::make_unique<Engine>(path, o);
           }),
           py::arg("path"), py::arg("threads") = 0, py::arg("kv_tokens") = 0, py::arg("context") = 0,
           py::arg("max_batch_tokens") = 512, py::arg("kv_type") = "f16", py::arg("tp_size") = 1,
           py::arg("tp_rank") = 0, py::arg("tp_addr") = "", py::arg("tp_rails") = std::vector<std::string>{},
           py::arg("tp_timeout") = 30.0, py::arg("tp_compatible") = false)
      .def("follow",
           [](Engine& e) {
             py::gil_scoped_release nogil;
             e.follow();
           },
           "TP rank 1: execute rank 0's forwards until it shuts down (raises if it is lost)")
      .def_property_readonly("tp_rank", &Engine::tp_rank)
      .def_property_readonly("tp_size", &Engine::tp_size)
      .def_property_readonly("weight_bytes", &Engine::weight_bytes)
      .def("comm_stats", [](const Engine& e) { return comm_stats_dict(e.comm_stats()); })
      .def("add_request",
           [](Engine& e, const std::vector<int32_t>& prompt, int max_tokens, float temperature,
              int top_k, float top_p, float min_p, uint64_t seed, const std::vector<int32_t>& eog_ids,
              bool ignore_eos) {
             RequestParams p;
             p.max_tokens = max_tokens;
             p.sampling.temperature = temperature;
             p.sampling.top_k = top_k;
             p.sampling.top_p = top_p;
             p.sampling.min_p = min_p;
             p.sampling.seed = seed;
             p.eog_ids = eog_ids;
             p.ignore_eos = ignore_eos;
             return e.add_request(prompt, p);
           },
           py::arg("prompt"), py::arg("max_tokens") = 128, py::arg("temperature") = 0.8f,
           py::arg("top_k") = 40, py::arg("top_p") = 0.95f, py::arg("min_p") = 0.05f,
           py::arg("seed") = 0, py::arg("eog_ids") = std::vector<int32_t>{},
           py::arg("ignore_eos") = false)
      .def("step",
           [](Engine& e) {
             std::vector<StepOutput> out;
             {
               py::gil_scoped_release nogil;
               out = e.step();
             }
             py::list res;
             for (const auto& o : out)
               res.append(py::make_tuple(o.request_id, o.token, o.finished, finish_reason_name(o.reason)));
             return res;
           },
           "Advance all active requests by one scheduled batch; returns [(id, token, finished, reason)]")
      .def("abort", &Engine::abort, py::arg("request_id"))
      .def("has_unfinished", &Engine::has_unfinished)
      .def("n_active", &Engine::n_active)
      .def("logits",
           [](Engine& e, const std::vector<int32_t>& ids) {
             std::vector<float> v;
             {
               py::gil_scoped_release nogil;
               v = e.logits(ids);
             }
             const int64_t V = e.config().n_vocab;
             py::array_t<float> a({int64_t(ids.size()), V});
             std::copy(v.begin(), v.end(), a.mutable_data());
             return a;
           },
           py::arg("ids"))
      .def("routing",
           [](Engine& e, const std::vector<int32_t>& ids) {
             std::vector<std::vector<int32_t>> tr;
             {
               py::gil_scoped_release nogil;
               tr = e.routing(ids);
             }
             return tr;
           },
           py::arg("ids"), "experts chosen by each MoE layer for each position: [n_layer][len * top_k]")
      .def_property_readonly("threads", &Engine::threads)
      .def_property_readonly("context", &Engine::context)
      .def_property_readonly("kv_tokens", &Engine::kv_tokens)
      .def_property_readonly("free_kv_tokens", &Engine::free_kv_tokens)
      .def_property_readonly("kv_bytes", &Engine::kv_bytes)
      .def_property_readonly("config", [](const Engine& e) {
        const ModelConfig& c = e.config();
        py::dict d;
        d["arch"] = c.arch;
        d["name"] = c.name;
        d["n_embd"] = c.n_embd;
        d["n_layer"] = c.n_layer;
        d["n_head"] = c.n_head;
        d["n_head_kv"] = c.n_head_kv;
        d["head_dim"] = c.head_dim;
        d["n_ff"] = c.n_ff;
        d["n_vocab"] = c.n_vocab;
        d["n_ctx_train"] = c.n_ctx_train;
        d["rope_base"] = c.rope_base;
        d["rope_neox"] = c.rope_neox;
        d["tied_output"] = c.tied_output;
        d["n_expert"] = c.n_expert;
        d["n_expert_used"] = c.n_expert_used;
        d["n_ff_exp"] = c.n_ff_exp;
        d["summary"] = c.summary();
        return d;
      })
      .def("stats", [](const Engine& e) {
        const EngineStats& s = e.stats();
        py::dict d;
        d["steps"] = s.steps;
        d["prompt_tokens"] = s.prompt_tokens;
        d["generated_tokens"] = s.generated_tokens;
        d["preemptions"] = s.preemptions;
        d["prefill_seconds"] = s.prefill_seconds;
        d["decode_seconds"] = s.decode_seconds;
        d["active_requests"] = e.n_active();
        d["kv_tokens"] = e.kv_tokens();
        d["free_kv_tokens"] = e.free_kv_tokens();
        if (e.config().is_moe()) d["expert_usage"] = e.expert_usage();
        return d;
      });
}

}  // namespace tf
