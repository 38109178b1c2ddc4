// The mixture-of-experts FFN block: the router's logits, routing (moe/router: softmax, sigmoid
// or sqrtsoftplus gating, selection bias, groups, top-k; or, in hash layers, the experts a
// token -> experts table names, weighted by their scores), the tokens grouped by expert, one low-bit
// product per active expert for gate/up and for down, the weighted combine, and the shared
// expert (optionally scaled by a sigmoid gate). Under TP=2 experts are split by width (every
// rank works on every token) when the width halves on block boundaries, else by expert index
// (expert-parallel: whole experts per rank); TENSORFOLD_TP_EXPERTS=width|experts forces one.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "model/block.h"
#include "model/linear.h"

namespace tf {

namespace {

class MoeFfn final : public FfnBlock {
 public:
  explicit MoeFfn(const BlockContext& c);
  void prepare(WeightLoader& w) override;
  void plan_scratch(Scratch& s, int64_t T) override;
  void attach_stats(ActivationStats* stats) override;
  void forward(StepContext& ctx, const float* x, float* out) override;
  std::vector<int64_t>* expert_usage() override { return &usage_; }
  void set_trace(std::vector<int32_t>* trace) override { trace_ = trace; }

 private:
  void shared_expert(StepContext& ctx, float* out, float* out2, bool two);

  const ModelConfig& cfg_;
  int layer_;
  std::string prefix_;
  const float* norm_ = nullptr;
  Weight router_;
  const float* selection_bias_ = nullptr;
  const int32_t* token_experts_ = nullptr;  // hash layers: [n_vocab][n_used] expert ids
  float limit_ = 0.f, sh_limit_ = 0.f;      // clamped SwiGLU (0: none)
  WeightStack gate_, up_, down_;
  Weight sh_gate_, sh_up_, sh_down_;  // shared expert (rows == 0: none)
  Weight sh_scale_;                   // gated shared expert: the logit of its sigmoid gate ([E] x 1 row)
  int64_t width_ = 0;                 // this rank's expert width
  int64_t split_ = -1, sh_split_ = -1;
  bool expert_parallel_ = false;
  int64_t group_ = 0;         // first expert of the second half (expert-parallel)
  int64_t lo_ = 0, hi_ = 0;   // this rank's experts
  std::vector<int64_t> usage_;
  std::vector<int32_t>* trace_ = nullptr;
  // scratch
  float *xn_ = nullptr, *logits_ = nullptr, *eg_ = nullptr, *eu_ = nullptr, *eo_ = nullptr, *eo2_ = nullptr,
        *out2_ = nullptr, *sg_ = nullptr, *su_ = nullptr, *sh_ = nullptr, *sh_logit_ = nullptr, *ones_ = nullptr;
  Routing r_;
  int32_t* fixed_ = nullptr;  // hash layers: the batch's experts
  ActivationStats* stats_ = nullptr;
  int st_in_ = -1, st_exp_in_ = -1, st_exp_down_ = -1, st_sh_down_ = -1;
};

MoeFfn::MoeFfn(const BlockContext& c) : cfg_(c.cfg), layer_(c.layer), prefix_(c.prefix) {
  const int64_t E = cfg_.n_embd, NE = cfg_.n_expert, FE = cfg_.n_ff_exp;
  const std::string& p = prefix_;
  WeightLoader& w = c.w;
  norm_ = w.vector(p + "ffn_norm.weight", E);
  router_ = w.weight(p + "ffn_gate_inp.weight", E, NE);
  selection_bias_ = w.vector(p + "exp_probs_b.bias", NE, false);
  if (c.layer < cfg_.hash_layers) {
    const int64_t K = cfg_.n_expert_used;
    token_experts_ = w.ints(p + "ffn_gate_tid2eid.weight", {K, cfg_.n_vocab});
    for (int64_t i = 0; i < K * cfg_.n_vocab; ++i)
      if (token_experts_[i] < 0 || token_experts_[i] >= NE)
        fail(ErrorKind::InvalidInput, w.file().display_path(), ": ", p, "ffn_gate_tid2eid.weight names expert ",
             token_experts_[i], " for token ", i / K, " (valid: 0..", NE - 1, ")");
  }
  if (!cfg_.swiglu_limit.empty()) limit_ = cfg_.swiglu_limit[size_t(c.layer)];
  if (!cfg_.swiglu_limit_shexp.empty()) sh_limit_ = cfg_.swiglu_limit_shexp[size_t(c.layer)];
  gate_ = w.stack(p + "ffn_gate_exps.weight", E, FE, NE);
  up_ = w.stack(p + "ffn_up_exps.weight", E, FE, NE);
  down_ = w.stack(p + "ffn_down_exps.weight", FE, E, NE);
  if (const GgufTensorInfo* sh = w.file().find_tensor(p + "ffn_gate_shexp.weight")) {
    const int64_t FS = sh->ne.size() == 2 ? sh->ne[1] : 0;
    sh_gate_ = w.weight(p + "ffn_gate_shexp.weight", E, FS);
    sh_up_ = w.weight(p + "ffn_up_shexp.weight", E, FS);
    sh_down_ = w.weight(p + "ffn_down_shexp.weight", FS, E);
    if (const float* g = w.vector(p + "ffn_gate_inp_shexp.weight", E, false))
      sh_scale_ = Weight{GgmlType::F32, E, 1, reinterpret_cast<const uint8_t*>(g), size_t(E) * sizeof(float)};
  }
  width_ = FE;
  hi_ = NE;
  usage_.assign(size_t(NE), 0);
}

void MoeFfn::prepare(WeightLoader& w) {
  const int64_t NE = cfg_.n_expert, FE = cfg_.n_ff_exp;
  split_ = WeightLoader::split_point(FE, WeightLoader::block_size(down_.first));
  expert_parallel_ = false;
  if (NE >= 2) {
    const char* force = std::getenv("TENSORFOLD_TP_EXPERTS");
    const bool even = split_ > 0 && 2 * split_ == FE;
    expert_parallel_ = force ? std::string(force) == "experts" : !even;
    if (force && std::string(force) == "width" && split_ < 0) expert_parallel_ = true;
  }
  if (expert_parallel_) split_ = -1;
  group_ = NE / 2;
  if (sh_gate_.rows > 0) sh_split_ = WeightLoader::split_point(sh_gate_.rows, WeightLoader::block_size(sh_down_));
  const TpShard& tp = w.tp();
  if (tp.size == 1) {
    if (!tp.tp_compatible) {
      split_ = sh_split_ = -1;
      expert_parallel_ = false;
    }
    return;
  }
  const int r = tp.rank;
  auto need = [&](int64_t c, const char* what) {
    if (c < 0)
      fail(ErrorKind::Unsupported, w.file().display_path(), ": cannot split ", what, " of layer ", layer_,
           " across 2 ranks on the weight format's block boundaries; use TP=1 for this model");
    return c;
  };
  router_ = w.keep(router_);
  if (expert_parallel_) {
    lo_ = r == 0 ? 0 : group_;
    hi_ = r == 0 ? group_ : NE;
    gate_ = w.slice_stack(gate_, lo_, hi_);
    up_ = w.slice_stack(up_, lo_, hi_);
    down_ = w.slice_stack(down_, lo_, hi_);
  } else {
    const int64_t c = need(split_, "the expert FFN width");
    const int64_t e0 = r == 0 ? 0 : c, e1 = r == 0 ? c : FE;
    gate_ = w.slice_rows(gate_, e0, e1);
    up_ = w.slice_rows(up_, e0, e1);
    down_ = w.slice_cols(down_, e0, e1);
    width_ = e1 - e0;
  }
  if (sh_gate_.rows > 0) {
    const int64_t c = need(sh_split_, "the shared expert width");
    const int64_t s0 = r == 0 ? 0 : c, s1 = r == 0 ? c : sh_gate_.rows;
    sh_gate_ = w.slice_rows(sh_gate_, s0, s1);
    sh_up_ = w.slice_rows(sh_up_, s0, s1);
    sh_down_ = w.slice_cols(sh_down_, s0, s1);
  }
  // Each rank holds one part of every split sum: no further splitting.
  split_ = sh_split_ = -1;
}

void MoeFfn::plan_scratch(Scratch& s, int64_t T) {
  const int64_t E = cfg_.n_embd, NE = cfg_.n_expert, K = cfg_.n_expert_used, FE = width_, R = T * K;
  const bool two = split_ > 0 || (expert_parallel_ && cfg_.n_expert >= 2);
  xn_ = s.f32("xn", T * E);
  logits_ = s.f32("moe.logits", T * NE, true);  // routing reads them on the host
  r_.ids = s.i32("moe.ids", R);
  r_.weights = s.f32("moe.weights", R, true);
  r_.offsets = s.i32("moe.offsets", NE + 1);
  r_.rows = s.i32("moe.rows", R);
  r_.slot_of = s.i32("moe.slot_of", R);
  fixed_ = token_experts_ ? s.i32("moe.fixed", R) : nullptr;
  eg_ = s.f32("moe.gate", R * FE);
  eu_ = s.f32("moe.up", R * FE);
  eo_ = s.f32("moe.out", R * E);
  eo2_ = split_ > 0 ? s.f32("moe.out2", R * E) : nullptr;
  out2_ = two ? s.f32("moe.ffn_out2", T * E) : nullptr;
  s.product(router_, T);
  s.product(gate_, R);
  s.product(up_, R);
  s.product(down_, R);
  if (sh_gate_.rows > 0) {
    sg_ = s.f32("ffn.gate", T * sh_gate_.rows);
    su_ = s.f32("ffn.up", T * sh_gate_.rows);
    sh_ = s.f32("part", T * E);
    sh_logit_ = s.f32("moe.sh_logit", T);
    ones_ = sh_scale_.rows > 0 ? nullptr : s.f32("moe.ones", T);
    for (const Weight* w : {&sh_gate_, &sh_up_, &sh_down_, &sh_scale_}) s.product(*w, T);
  }
}

void MoeFfn::attach_stats(ActivationStats* st) {
  stats_ = st;
  if (!st) return;
  const std::string& p = prefix_;
  st_in_ = st->add(cfg_.n_embd);
  st->name(p + "ffn_gate_inp.weight", st_in_);
  if (sh_gate_.rows > 0) {
    st->name(p + "ffn_gate_shexp.weight", st_in_);
    st->name(p + "ffn_up_shexp.weight", st_in_);
    if (sh_scale_.rows > 0) st->name(p + "ffn_gate_inp_shexp.weight", st_in_);
    st_sh_down_ = st->add(sh_down_.k);
    st->name(p + "ffn_down_shexp.weight", st_sh_down_);
  }
  st_exp_in_ = st->add(cfg_.n_embd, gate_.n);
  st->name(p + "ffn_gate_exps.weight", st_exp_in_);
  st->name(p + "ffn_up_exps.weight", st_exp_in_);
  st_exp_down_ = st->add(down_.first.k, down_.n);
  st->name(p + "ffn_down_exps.weight", st_exp_down_);
}

void MoeFfn::forward(StepContext& ctx, const float* x, float* out) {
  Backend& be = ctx.be;
  const int64_t T = ctx.T, E = cfg_.n_embd, NE = cfg_.n_expert, FE = width_;
  const int K = cfg_.n_expert_used;
  const int64_t R = T * K;
  be.rmsnorm(x, E, norm_, xn_, E, T, E, cfg_.rms_eps);
  // 1. Router logits and routing (tokens grouped by expert).
  if (ctx.calibrating) stats_->record(st_in_, xn_, T, E);
  const Product rp{&router_, logits_, NE};
  be.matmul(xn_, T, E, &rp, 1);
  moe::RouterConfig rc = cfg_.router;
  rc.selection_bias = selection_bias_;
  if (token_experts_) {
    const int64_t Kx = K;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < Kx; ++k) fixed_[t * Kx + k] = token_experts_[int64_t(ctx.tokens[t]) * Kx + k];
  }
  be.route(rc, logits_, T, r_, fixed_);
  for (int64_t e = 0; e < NE; ++e) usage_[size_t(e)] += r_.offsets[e + 1] - r_.offsets[e];
  if (trace_) trace_->insert(trace_->end(), r_.ids, r_.ids + R);
  if (ctx.calibrating) stats_->record_grouped(st_exp_in_, xn_, E, r_.offsets, r_.rows);
  // 2. Gate/up of this rank's experts over their tokens' rows (gathered), then silu(gate) * up.
  Grouping g;
  g.offsets = r_.offsets;
  g.gather = r_.rows;
  g.first = lo_;
  g.last = hi_;
  const StackProduct gu[] = {{&gate_, eg_, FE}, {&up_, eu_, FE}};
  be.matmul_stack(xn_, E, g, gu, 2);
  be.silu_mul(eg_, FE, eu_, FE, R, FE, split_, limit_);
  if (ctx.calibrating) stats_->record_grouped(st_exp_down_, eg_, FE, r_.offsets, nullptr);
  // 3. Down projections and the weighted combine (slot order: fixed), per split part: the
  // partial sums TP ranks hold, added as the All-Reduce adds them.
  const bool two = split_ > 0 || (expert_parallel_ && ctx.tp.size == 1);
  g.gather = nullptr;
  be.fill(out, T * E, 0.f);
  if (two) be.fill(out2_, T * E, 0.f);
  if (expert_parallel_) {
    const StackProduct d{&down_, eo_, E};
    be.matmul_stack(eg_, FE, g, &d, 1);
    if (two) {
      be.combine(out, E, eo_, E, T, E, r_, K, int(lo_), int(group_));
      be.combine(out2_, E, eo_, E, T, E, r_, K, int(group_), int(hi_));
    } else {
      be.combine(out, E, eo_, E, T, E, r_, K, int(lo_), int(hi_));
    }
  } else {
    for (int part = 0; part < (two ? 2 : 1); ++part) {
      const int64_t c0 = part == 0 ? 0 : split_, c1 = two && part == 0 ? split_ : FE;
      const WeightStack dv = WeightLoader::kview(down_, c0, c1);
      float* eo = part == 0 ? eo_ : eo2_;
      const StackProduct d{&dv, eo, E};
      be.matmul_stack(eg_ + c0, FE, g, &d, 1);
      be.combine(part == 0 ? out : out2_, E, eo, E, T, E, r_, K, 0, int(NE));
    }
  }
  // 4. The shared expert (always on).
  if (sh_gate_.rows > 0) shared_expert(ctx, out, out2_, two);
  if (two) be.add(out, out2_, T * E);
}

void MoeFfn::shared_expert(StepContext& ctx, float* out, float* out2, bool two) {
  Backend& be = ctx.be;
  const int64_t T = ctx.T, E = cfg_.n_embd, FS = sh_gate_.rows;
  const Product gu[] = {{&sh_gate_, sg_, FS}, {&sh_up_, su_, FS}};
  be.matmul(xn_, T, E, gu, 2);
  be.silu_mul(sg_, FS, su_, FS, T, FS, sh_split_, sh_limit_);
  if (ctx.calibrating) stats_->record(st_sh_down_, sg_, T, FS);
  // Its gate: sigmoid(x . w) per token where the architecture gates it, else 1.
  if (sh_scale_.rows > 0) {
    const Product sp{&sh_scale_, sh_logit_, 1};
    be.matmul(xn_, T, E, &sp, 1);
  } else {
    be.fill(ones_, T, 1.f);
  }
  const float* scale = sh_scale_.rows > 0 ? sh_logit_ : ones_;
  // Its down projection split like the experts' when emulating TP=2's sums.
  for (int part = 0; part < (two ? 2 : 1); ++part) {
    if (two && sh_split_ <= 0 && part == 1) break;  // unsplittable: all in part 0
    const int64_t c0 = part == 0 || sh_split_ <= 0 ? 0 : sh_split_;
    const int64_t c1 = two && part == 0 && sh_split_ > 0 ? sh_split_ : FS;
    const Weight dw = WeightLoader::kview(sh_down_, c0, c1);
    const Product d{&dw, sh_, E};
    be.matmul(sg_ + c0, T, FS, &d, 1);
    be.add_scaled(part == 0 ? out : out2, E, sh_, E, scale, T, E, sh_scale_.rows > 0);
  }
}

}  // namespace

std::unique_ptr<FfnBlock> make_moe_ffn(const BlockContext& c) { return std::make_unique<MoeFfn>(c); }

}  // namespace tf
