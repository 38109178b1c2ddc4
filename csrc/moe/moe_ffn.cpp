// The MoE FFN block of LlamaModel: routing (moe/router), tokens grouped by expert (counting
// sort), one low-bit GEMM per active expert for gate/up and down, the routing weights, shared
// experts, and expert-parallel or width-split TP (see llama_model.h).
#include "model/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "moe/router.h"
#include "quant/traits.h"

namespace tf {

void LlamaModel::moe_ffn(int layer, int64_t T, ThreadPool& pool) {
  const LayerWeights& L = layers_[size_t(layer)];
  const int64_t E = cfg_.n_embd, NE = cfg_.n_expert, K = cfg_.n_expert_used, FE = local_ff_exp_;
  // 1. Router logits and routing.
  const LayerStatIds* st = stats_ ? &stat_ids_[size_t(layer)] : nullptr;  // calibration
  if (st) stats_->record(st->ffn_in, xn_.data(), T, E, pool);
  project({{&L.router, router_logits_.data()}}, xn_.data(), T, E, pool);
  moe::RouterConfig rc = cfg_.router;
  rc.selection_bias = L.selection_bias;
  moe::route(rc, router_logits_.data(), T, route_ids_.data(), route_w_.data(), route_scratch_.data());
  if (tracing_)
    trace_[size_t(layer)].insert(trace_[size_t(layer)].end(), route_ids_.begin(), route_ids_.begin() + T * K);
  // 2. Counting sort of the (token, slot) pairs by expert.
  std::fill(exp_count_.begin(), exp_count_.end(), 0);
  for (int64_t i = 0; i < T * K; ++i) ++exp_count_[size_t(route_ids_[size_t(i)])];
  exp_offset_[0] = 0;
  for (int64_t e = 0; e < NE; ++e) exp_offset_[size_t(e + 1)] = exp_offset_[size_t(e)] + exp_count_[size_t(e)];
  auto& usage = expert_usage_[size_t(layer)];
  for (int64_t e = 0; e < NE; ++e) {
    usage[size_t(e)] += exp_count_[size_t(e)];
    exp_count_[size_t(e)] = 0;  // reused as the fill cursor below
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = route_ids_[size_t(t * K + k)];
      const int32_t row = exp_offset_[size_t(e)] + exp_count_[size_t(e)]++;
      exp_rows_[size_t(row)] = int32_t(t);
      slot_of_[size_t(t * K + k)] = row;
    }
  if (st) stats_->record_grouped(st->exp_in, xn_.data(), E, exp_offset_.data(), exp_rows_.data(), pool);
  // 3. Gate/up: each expert's tokens gathered (already quantized) into consecutive rows, for
  // each layout the two need (gate and up may be of different types).
  const unsigned mask = quantize_acts({&L.gate_exps.first, &L.up_exps.first}, xn_.data(), T, E, E, act_, pool);
  const int64_t R = T * K;
  for (size_t l = 0; l < kLayouts; ++l) {
    if (!(mask & (1u << l))) continue;
    const size_t S = act_[l].stride;
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(exp_act_[l].data.data() + size_t(r) * S, act_[l].data.data() + size_t(exp_rows_[size_t(r)]) * S, S);
  }
  const ActBuf& ag = exp_act_[size_t(L.gate_exps.first.layout)];
  const ActBuf& au = exp_act_[size_t(L.up_exps.first.layout)];
  const ActBuf& ad = exp_act_[size_t(L.down_exps.first.layout)];
  // Experts this rank computes: all of them, or its half under expert-parallel TP.
  const int64_t lo = exp_lo_, hi = exp_hi_ > 0 ? exp_hi_ : NE;
  jobs_.clear();
  for (int64_t e = lo; e < hi; ++e) {
    const int64_t off = exp_offset_[size_t(e)], c = exp_offset_[size_t(e + 1)] - off;
    if (c == 0) continue;
    jobs_.push_back({L.gate_exps.expert(e - lo), ag.data.data() + size_t(off) * ag.stride, ag.stride, c,
                     exp_gate_.data() + off * FE, FE});
    jobs_.push_back({L.up_exps.expert(e - lo), au.data.data() + size_t(off) * au.stride, au.stride, c,
                     exp_up_.data() + off * FE, FE});
  }
  run_jobs(jobs_, pool);
  pool.parallel_for(R, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) silu_mul_parts(FE, fe_split_, exp_gate_.data() + r * FE, exp_up_.data() + r * FE);
  });
  if (st) stats_->record_grouped(st->exp_down, exp_gate_.data(), FE, exp_offset_.data(), nullptr, pool);
  // 4. Down projections and the weighted combine (slot order: fixed), per split part: the
  // partial sums TP ranks hold, added as the All-Reduce adds them.
  const bool ep = expert_parallel_;
  const bool two = fe_split_ > 0 || (ep && tp_.size == 1);
  if (ep) {
    quantize_acts({&L.down_exps.first}, exp_gate_.data(), R, FE, FE, exp_act_, pool);
    jobs_.clear();
    for (int64_t e = lo; e < hi; ++e) {
      const int64_t off = exp_offset_[size_t(e)], c = exp_offset_[size_t(e + 1)] - off;
      if (c == 0) continue;
      jobs_.push_back({L.down_exps.expert(e - lo), ad.data.data() + size_t(off) * ad.stride, ad.stride, c,
                       exp_out_.data() + off * E, E});
    }
    run_jobs(jobs_, pool);
    std::fill(ffn_out_.begin(), ffn_out_.begin() + T * E, 0.f);
    if (two) std::fill(ffn_out2_.begin(), ffn_out2_.begin() + T * E, 0.f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = route_ids_[size_t(t * K + k)];
        if (e < lo || e >= hi) continue;  // another rank's expert
        float* xt = (two && e >= expert_group_ ? ffn_out2_.data() : ffn_out_.data()) + t * E;
        const float w = route_w_[size_t(t * K + k)];
        const float* o = exp_out_.data() + int64_t(slot_of_[size_t(t * K + k)]) * E;
        for (int64_t i = 0; i < E; ++i) xt[i] += w * o[i];
      }
  }
  for (int part = 0; part < (ep ? 0 : (two ? 2 : 1)); ++part) {
    const int64_t c0 = part == 0 ? 0 : fe_split_, c1 = two && part == 0 ? fe_split_ : FE;
    float* eo = part == 0 ? exp_out_.data() : exp_out2_.data();
    quantize_acts({&L.down_exps.first}, exp_gate_.data() + c0, R, c1 - c0, FE, exp_act_, pool);
    jobs_.clear();
    for (int64_t e = 0; e < NE; ++e) {
      const int64_t off = exp_offset_[size_t(e)], c = exp_offset_[size_t(e + 1)] - off;
      if (c == 0) continue;
      jobs_.push_back({kview(L.down_exps.expert(e), c0, c1), ad.data.data() + size_t(off) * ad.stride, ad.stride, c,
                       eo + off * E, E});
    }
    run_jobs(jobs_, pool);
    float* out = part == 0 ? ffn_out_.data() : ffn_out2_.data();
    for (int64_t t = 0; t < T; ++t) {
      float* xt = out + t * E;
      std::fill(xt, xt + E, 0.f);
      for (int64_t k = 0; k < K; ++k) {
        const float w = route_w_[size_t(t * K + k)];
        const float* o = eo + int64_t(slot_of_[size_t(t * K + k)]) * E;
        for (int64_t i = 0; i < E; ++i) xt[i] += w * o[i];
      }
    }
  }
  // 5. Shared expert (always on), optionally scaled by a sigmoid gate; its down projection
  // split like the experts' when emulating TP=2's sums.
  if (L.gate_shexp.rows > 0) {
    const int64_t FS = L.gate_shexp.rows;
    project({{&L.gate_shexp, gate_.data()}, {&L.up_shexp, up_.data()}}, xn_.data(), T, E, pool);
    const int64_t split = fs_split_[size_t(layer)];
    for (int64_t t = 0; t < T; ++t) silu_mul_parts(FS, split, gate_.data() + t * FS, up_.data() + t * FS);
    if (st) stats_->record(st->shexp_down, gate_.data(), T, FS, pool);
    for (int part = 0; part < (two ? 2 : 1); ++part) {
      const int64_t c0 = part == 0 || split <= 0 ? 0 : split;
      const int64_t c1 = two && part == 0 && split > 0 ? split : FS;
      float* sh = part_.data();
      if (two && split <= 0 && part == 1) break;  // unsplittable shared expert: all in part 0
      const Weight dw = kview(L.down_shexp, c0, c1);
      project({{&dw, sh}}, gate_.data() + c0, T, FS, pool);
      float* out = part == 0 ? ffn_out_.data() : ffn_out2_.data();
      for (int64_t t = 0; t < T; ++t) {
        float g = 1.f;
        if (L.shexp_gate) {
          float z = 0.f;
          for (int64_t i = 0; i < E; ++i) z += xn_[size_t(t * E + i)] * L.shexp_gate[i];
          g = 1.f / (1.f + std::exp(-z));
        }
        float* xt = out + t * E;
        for (int64_t i = 0; i < E; ++i) xt[i] += g * sh[t * E + i];
      }
    }
  }
  if (two)
    for (int64_t i = 0; i < T * E; ++i) ffn_out_[size_t(i)] += ffn_out2_[size_t(i)];
}

}  // namespace tf
