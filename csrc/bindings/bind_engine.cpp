// Binds tf::Engine. Every call that may wait for the engine's lock or compute releases the
// GIL (so one Python thread stepping never freezes the others); long calls run inside an
// InterruptScope so Ctrl-C ends them (KeyboardInterrupt).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdlib>
#include <optional>

#include "bindings/bindings.h"
#include "core/error.h"
#include "core/interrupt.h"
#include "engine/engine.h"

namespace py = pybind11;

namespace tf {

namespace {
// TP token: the argument, else $TENSORFOLD_TP_TOKEN (the same default on both ranks).
std::string tp_token(const std::optional<std::string>& given) {
  if (given) return *given;
  const char* env = std::getenv("TENSORFOLD_TP_TOKEN");
  return env ? std::string(env) : std::string();
}

// {weight name: (sum2 [n_mat, in_dim] float64, counts [n_mat] int64)}; names of one
// accumulator share one pair of arrays.
py::dict activation_stats_dict(const ActivationStats& s) {
  std::vector<py::object> by_id;
  py::dict d;
  for (const auto& [name, id] : s.names()) {
    if (size_t(id) >= by_id.size()) by_id.resize(size_t(id) + 1);
    if (!by_id[size_t(id)]) {
      const ActivationStats::Accumulator& a = s.accumulator(id);
      py::array_t<double> sum2({a.n_mat, a.in_dim});
      std::copy(a.sum2.begin(), a.sum2.end(), sum2.mutable_data());
      py::array_t<int64_t> counts(a.n_mat);
      std::copy(a.counts.begin(), a.counts.end(), counts.mutable_data());
      by_id[size_t(id)] = py::make_tuple(sum2, counts);
    }
    d[py::str(name)] = by_id[size_t(id)];
  }
  return d;
}

KvType kv_type_of(const std::string& kv_type) {
  if (kv_type == "f16") return KvType::F16;
  if (kv_type == "f32") return KvType::F32;
  throw py::value_error("kv_type must be 'f16' or 'f32', got '" + kv_type + "'");
}

py::dict memory_plan_dict(const MemoryPlan& p) {
  py::dict d;
  d["tp_size"] = p.tp_size;
  d["tp_rank"] = p.tp_rank;
  d["context"] = p.context;
  d["kv_tokens"] = p.kv_tokens;
  d["max_batch_tokens"] = p.max_batch_tokens;
  d["kv_bytes_per_token"] = p.kv_bytes_per_token;
  uint64_t per_seq = 0;  // window caches sized by sequences
  for (const KvGroupPlan& g : p.kv_groups) per_seq += g.bytes_per_seq;
  d["kv_bytes_per_seq"] = per_seq;
  d["weights"] = p.weights;
  d["kv"] = p.kv;
  d["index_bytes_per_block"] = p.index_bytes_per_block;
  d["scratch"] = p.scratch;
  d["comm"] = p.comm;
  d["draft"] = p.draft;
  d["margin"] = p.margin;
  d["total"] = p.total();
  d["budget"] = p.budget;
  d["budget_source"] = p.budget_source;
  d["fits"] = p.fits();
  d["max_kv_tokens"] = p.max_kv_tokens;
  d["max_context"] = p.max_context;
  d["n_ctx_train"] = p.n_ctx_train;
  d["table"] = p.table();
  return d;
}
}  // namespace

void bind_engine(py::module_& m) {
  m.def(
      "_sample_given_draft",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, int32_t draft, float temperature,
         int top_k, float top_p, float min_p, uint64_t seed, int64_t n) {
        TF_CHECK(logits.ndim() == 1 && logits.shape(0) > 0 && n >= 0, "_sample_given_draft: bad arguments");
        SamplingParams sp{temperature, top_k, top_p, min_p, seed};
        Sampler sampler(sp);
        const int64_t V = logits.shape(0);
        py::array_t<int64_t> counts(V);
        auto c = counts.mutable_unchecked<1>();
        for (int64_t i = 0; i < V; ++i) c(i) = 0;
        int64_t accepted = 0;
        for (int64_t i = 0; i < n; ++i) {
          bool ok = false;
          ++c(sampler.sample_given_draft(logits.data(), V, draft, ok));
          accepted += ok;
        }
        return py::make_tuple(counts, accepted);
      },
      py::arg("logits"), py::arg("draft"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
      py::arg("min_p"), py::arg("seed"), py::arg("n"),
      "n verifications of `draft` against one logits row with one sampler: (counts of the emitted tokens, "
      "how many were the draft accepted) — for testing the rejection sampling");
  m.def(
      "plan_memory",
      [](const std::string& path, int64_t context, int64_t kv_tokens, int max_batch_tokens, const std::string& kv_type,
         int tp_size, int tp_rank, int64_t memory_budget, int max_seqs, const std::string& draft) {
        EngineOptions o;
        o.max_seqs = max_seqs;
        o.draft = draft;
        o.context = context;
        o.kv_tokens = kv_tokens;
        o.max_batch_tokens = max_batch_tokens;
        o.kv_type = kv_type_of(kv_type);
        o.tp.size = tp_size;
        o.tp.rank = tp_rank;
        o.memory_budget = memory_budget;
        TF_CHECK(tp_size == 1 || tp_size == 2, "tp must be 1 or 2, got ", tp_size);
        TF_CHECK(tp_rank >= 0 && tp_rank < tp_size, "rank ", tp_rank, " is out of range for tp ", tp_size);
        MemoryPlan p;
        {
          py::gil_scoped_release nogil;
          p = plan_memory(GgufFile::open(path), o);
        }
        return memory_plan_dict(p);
      },
      py::arg("path"), py::arg("context") = 0, py::arg("kv_tokens") = 0, py::arg("max_batch_tokens") = 512,
      py::arg("kv_type") = "f16", py::arg("tp") = 1, py::arg("rank") = 0, py::arg("memory_budget") = 0,
      py::arg("max_seqs") = 32, py::arg("draft") = "",
      "The memory plan an engine with these options would have on this rank (nothing allocated); draft: "
      "'' none, 'lookup', 'mtp' or a draft model GGUF path.");

  py::class_<Engine>(m, "Engine")
      .def(py::init([](const std::string& path, int threads, int64_t kv_tokens, int64_t context,
                       int max_batch_tokens, const std::string& kv_type, int tp_size, int tp_rank,
                       const std::string& tp_addr, const std::vector<std::string>& tp_rails,
                       double tp_timeout, bool tp_compatible, const std::optional<std::string>& tp_token_arg,
                       int64_t memory_budget, const std::string& tp_transport, double tp_wait,
                       double tp_load_timeout, bool prefix_cache, const std::string& backend, int max_seqs,
                       const std::string& draft, int draft_max, bool draft_adaptive) {
             EngineOptions o;
             o.max_seqs = max_seqs;
             o.draft = draft;
             o.draft_max = draft_max;
             o.draft_adaptive = draft_adaptive;
             o.backend = backend;
             o.memory_budget = memory_budget;
             o.prefix_cache = prefix_cache;
             o.tp.transport = tp_transport;
             o.tp.wait_s = tp_wait;
             o.tp.load_timeout_s = tp_load_timeout;
             TF_CHECK(tp_wait >= 0 && tp_load_timeout > 0, "tp_wait must be >= 0 and tp_load_timeout > 0");
             o.tp.compatible = tp_compatible;
             o.tp.size = tp_size;
             o.tp.rank = tp_rank;
             o.tp.addr = tp_addr;
             o.tp.rails = tp_rails;
             o.tp.timeout_s = tp_timeout;
             o.tp.token = tp_token(tp_token_arg);
             o.kv_type = kv_type_of(kv_type);
             o.threads = threads;
             o.kv_tokens = kv_tokens;
             o.context = context;
             o.max_batch_tokens = max_batch_tokens;
             py::gil_scoped_release nogil;
             InterruptScope ctrl_c;  // loading, and waiting for the TP peer
             return std::make_unique<Engine>(path, o);
           }),
           py::arg("path"), py::arg("threads") = 0, py::arg("kv_tokens") = 0, py::arg("context") = 0,
           py::arg("max_batch_tokens") = 512, py::arg("kv_type") = "f16", py::arg("tp_size") = 1,
           py::arg("tp_rank") = 0, py::arg("tp_addr") = "", py::arg("tp_rails") = std::vector<std::string>{},
           py::arg("tp_timeout") = 30.0, py::arg("tp_compatible") = false, py::arg("tp_token") = py::none(),
           py::arg("memory_budget") = 0, py::arg("tp_transport") = "tcp", py::arg("tp_wait") = 0.0,
           py::arg("tp_load_timeout") = 3600.0, py::arg("prefix_cache") = true, py::arg("backend") = "cpu",
           py::arg("max_seqs") = 32, py::arg("draft") = "", py::arg("draft_max") = 8,
           py::arg("draft_adaptive") = true,
           "tp_token: shared secret of the TP pair (default: $TENSORFOLD_TP_TOKEN; empty: none); memory_budget: "
           "bytes this rank may use (0: the memory available now; < 0: no budget); prefix_cache: reuse the KV "
           "blocks of earlier identical prompt prefixes; backend: where the forward runs ('cpu', 'cpu:avx2', "
           "'cuda', 'auto'); draft: speculative decoding source ('' none, 'lookup', or a draft model GGUF path); "
           "draft_max: drafts per sequence and step, at most; draft_adaptive: fewer where they do not pay (False: always "
           "draft_max)")
      .def_property_readonly("backend", &Engine::backend_name)
      .def_property_readonly("memory_plan", [](const Engine& e) { return memory_plan_dict(e.memory_plan()); })
      .def_static(
          "_tp_identity",
          [](const std::string& path, int tp_size, int64_t context, int64_t kv_tokens, int max_batch_tokens,
             const std::string& kv_type, int max_seqs) {
            EngineOptions o;
            o.max_seqs = max_seqs;
            o.tp.size = tp_size;
            o.context = context;
            o.kv_tokens = kv_tokens;
            o.max_batch_tokens = max_batch_tokens;
            o.kv_type = kv_type_of(kv_type);
            py::gil_scoped_release nogil;
            return Engine::tp_identity(*GgufFile::open(path), o);
          },
          py::arg("path"), py::arg("tp_size") = 2, py::arg("context") = 0, py::arg("kv_tokens") = 0,
          py::arg("max_batch_tokens") = 512, py::arg("kv_type") = "f16", py::arg("max_seqs") = 32,
          "The configuration string TP ranks compare at connect (public, like the file; tests use it)")
      .def("follow",
           [](Engine& e) {
             py::gil_scoped_release nogil;
             InterruptScope ctrl_c;  // honoured while waiting for rank 0's next command
             e.follow();
           },
           "TP rank 1: execute rank 0's forwards until it shuts down (raises if it is lost)")
      .def_property_readonly("max_batch_tokens", &Engine::max_batch_tokens)
      .def_property_readonly("tp_rank", &Engine::tp_rank)
      .def_property_readonly("tp_size", &Engine::tp_size)
      .def_property_readonly("weight_bytes", &Engine::weight_bytes)
      .def("comm_stats", [](const Engine& e) { return comm_stats_dict(e.comm_stats()); })
      .def("add_request",
           [](Engine& e, const std::vector<int32_t>& prompt, int max_tokens, float temperature,
              int top_k, float top_p, float min_p, uint64_t seed, const std::vector<int32_t>& eog_ids,
              bool ignore_eos, int top_logprobs, const std::string& speculative, float presence_penalty,
              float frequency_penalty, int64_t resumed) {
             RequestParams p;
             p.resumed = resumed;
             p.sampling.presence_penalty = presence_penalty;
             p.sampling.frequency_penalty = frequency_penalty;
             p.speculative = speculative;
             p.top_logprobs = top_logprobs;
             p.max_tokens = max_tokens;
             p.sampling.temperature = temperature;
             p.sampling.top_k = top_k;
             p.sampling.top_p = top_p;
             p.sampling.min_p = min_p;
             p.sampling.seed = seed;
             p.eog_ids = eog_ids;
             p.ignore_eos = ignore_eos;
             py::gil_scoped_release nogil;  // may wait for a step on another thread
             return e.add_request(prompt, p);
           },
           py::arg("prompt"), py::arg("max_tokens") = 128, py::arg("temperature") = 0.8f,
           py::arg("top_k") = 40, py::arg("top_p") = 0.95f, py::arg("min_p") = 0.05f,
           py::arg("seed") = 0, py::arg("eog_ids") = std::vector<int32_t>{},
           py::arg("ignore_eos") = false, py::arg("top_logprobs") = -1, py::arg("speculative") = "",
           py::arg("presence_penalty") = 0.f, py::arg("frequency_penalty") = 0.f, py::arg("resumed") = 0,
           "presence_penalty / frequency_penalty: OpenAI's, over the generated tokens (0 = off); resumed: the "
           "last prompt tokens that this request generated before (a resubmitted stream); speculative: '' the engine's draft source, 'none', 'lookup' or 'draft'; top_logprobs: -1 off; 0 the sampled token's log-probability; 1..20 also that many most likely "
           "tokens' (log-softmax of the raw logits: temperature 1, before top-k/top-p/min-p)")
      .def("step",
           [](Engine& e) {
             std::vector<StepOutput> out;
             {
               py::gil_scoped_release nogil;
               InterruptScope ctrl_c;
               out = e.step();
             }
             py::list res;
             for (const auto& o : out) {
               const bool spec = o.spec_drafted >= 0;
               if (!o.has_logprobs && !spec) {
                 res.append(py::make_tuple(o.request_id, o.token, o.finished, finish_reason_name(o.reason)));
                 continue;
               }
               py::object lp = py::none();  // an event without a token (max_tokens=0) has none
               if (o.has_logprobs && o.token >= 0) {
                 py::list top;
                 for (const auto& [tok, l] : o.top) top.append(py::make_tuple(tok, l));
                 lp = py::make_tuple(o.logprob, top);
               }
               if (spec)
                 res.append(py::make_tuple(o.request_id, o.token, o.finished, finish_reason_name(o.reason), lp,
                                           py::make_tuple(o.spec_drafted, o.spec_accepted)));
               else
                 res.append(py::make_tuple(o.request_id, o.token, o.finished, finish_reason_name(o.reason), lp));
             }
             return res;
           },
           "Advance all active requests by one scheduled batch; returns [(id, token, finished, reason)], and "
           "for tokens of requests with top_logprobs >= 0 (id, token, finished, reason, (logprob, "
           "[(token, logprob), ...]) or None when the event has no token), and on the event finishing a request that "
           "could speculate a sixth item (drafted tokens, accepted drafts)")
      .def("abort", &Engine::abort, py::arg("request_id"), py::call_guard<py::gil_scoped_release>())
      .def("has_unfinished", &Engine::has_unfinished, py::call_guard<py::gil_scoped_release>())
      .def("n_active", &Engine::n_active, py::call_guard<py::gil_scoped_release>())
      .def("logits",
           [](Engine& e, const std::vector<int32_t>& ids, int64_t generated_from) {
             // The engine writes straight into the array it returns: the result exists once.
             const int64_t V = e.config().n_vocab;
             py::array_t<float> a({int64_t(ids.size()), V});
             float* out = a.mutable_data();
             {
               py::gil_scoped_release nogil;
               InterruptScope ctrl_c;
               e.logits(ids, out, generated_from);
             }
             return a;
           },
           py::arg("ids"), py::arg("generated_from") = -1,
           "logits of every position; generated_from: ids from there on are generated tokens (computed "
           "as decoding computes them: a generation's logits exactly)")
      .def("nextn_logits",
           [](Engine& e, const std::vector<int32_t>& ids) {
             const int64_t V = e.config().n_vocab;
             py::array_t<float> a({std::max<int64_t>(0, int64_t(ids.size()) - 1), V});
             float* out = a.mutable_data();
             {
               py::gil_scoped_release nogil;
               InterruptScope ctrl_c;
               e.nextn_logits(ids, out);
             }
             return a;
           },
           py::arg("ids"),
           "the next-token-prediction (MTP) layer's logits: row i predicts token i + 2 from the hidden state at i "
           "and token i + 1")
      .def("routing",
           [](Engine& e, const std::vector<int32_t>& ids) {
             std::vector<std::vector<int32_t>> tr;
             {
               py::gil_scoped_release nogil;
               InterruptScope ctrl_c;
               tr = e.routing(ids);
             }
             return tr;
           },
           py::arg("ids"), "experts chosen by each MoE layer for each position: [n_layer][len * top_k]")
      .def("observe",
           [](Engine& e, const std::vector<int32_t>& ids) {
             py::gil_scoped_release nogil;
             InterruptScope ctrl_c;
             e.logits(ids, nullptr);  // the forward only: no logits kept
           },
           py::arg("ids"), "run ids through the model as one fresh sequence, keeping no logits (calibration)")
      .def("start_activation_stats", &Engine::start_activation_stats, py::call_guard<py::gil_scoped_release>(),
           "calibration: from now on every forward adds the inputs of every weight matrix to a fresh "
           "collector (TP=1 only)")
      .def("stop_activation_stats",
           [](Engine& e) {
             ActivationStats s;
             {
               py::gil_scoped_release nogil;
               s = e.stop_activation_stats();
             }
             return activation_stats_dict(s);
           },
           "calibration: detach the collector and return what it collected (empty when none was attached), "
           "as activation_stats()")
      .def("activation_stats",
           [](const Engine& e) {
             ActivationStats s;
             {
               py::gil_scoped_release nogil;
               s = e.activation_stats();
             }
             return activation_stats_dict(s);
           },
           "the statistics collected so far: {GGUF weight name: (sum of squares per matrix and input channel "
           "[n_mat, in_dim] float64, tokens per matrix [n_mat] int64)}; weights that take the same input "
           "share one pair of arrays")
      .def_property_readonly("threads", &Engine::threads)
      .def_property_readonly("context", &Engine::context)
      .def_property_readonly("kv_tokens", &Engine::kv_tokens)
      .def_property_readonly("free_kv_tokens",
                             py::cpp_function(&Engine::free_kv_tokens, py::call_guard<py::gil_scoped_release>()))
      .def_property_readonly("kv_bytes", &Engine::kv_bytes)
      .def_property_readonly("config", [](const Engine& e) {
        const ModelConfig& c = e.config();
        py::dict d;
        d["arch"] = c.arch;
        d["name"] = c.name;
        d["n_embd"] = c.n_embd;
        d["n_layer"] = c.n_layer;
        d["nextn_layers"] = c.n_nextn;  // next-token-prediction layers, loaded and kept (not run)
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
        EngineStats s;
        size_t active = 0;
        int64_t free_kv = 0;
        std::vector<std::vector<int64_t>> usage;
        {
          py::gil_scoped_release nogil;  // each getter may wait for a running step
          s = e.stats();
          active = e.n_active();
          free_kv = e.free_kv_tokens();
          if (e.config().is_moe()) usage = e.expert_usage();
        }
        py::dict d;
        d["steps"] = s.steps;
        d["prompt_tokens"] = s.prompt_tokens;
        d["generated_tokens"] = s.generated_tokens;
        d["preemptions"] = s.preemptions;
        d["prefill_seconds"] = s.prefill_seconds;
        d["decode_seconds"] = s.decode_seconds;
        d["active_requests"] = active;
        d["kv_tokens"] = e.kv_tokens();
        d["kv_bytes_per_token"] = e.kv_bytes_per_token();
        uint64_t per_seq = 0;  // sliding windows: bytes a sequence's rows may take, not per token
        for (const KvGroupPlan& g : e.memory_plan().kv_groups) per_seq += g.bytes_per_seq;
        d["kv_bytes_per_seq"] = per_seq;
        d["free_kv_tokens"] = free_kv;
        d["prefix_cache_hits"] = s.prefix_cache_hits;
        d["prefix_cached_tokens"] = s.prefix_cached_tokens;
        d["kv_blocks_used"] = s.kv_blocks_used;
        d["kv_blocks_free"] = s.kv_blocks_free;
        d["kv_blocks_cached"] = s.kv_blocks_cached;
        d["spec_verifies"] = s.spec_verifies;
        d["spec_drafted"] = s.spec_drafted;
        d["spec_accepted"] = s.spec_accepted;
        d["draft_seconds"] = s.draft_seconds;
        if (e.config().is_moe()) d["expert_usage"] = usage;
        return d;
      });
}

}  // namespace tf
