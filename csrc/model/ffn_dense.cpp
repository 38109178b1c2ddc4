// The dense FFN block: down(silu(gate x) * up x) of the normed input; under TP=2 each rank
// holds half of the intermediate width (its gate/up rows, its down columns) and produces a
// partial sum.
#include "core/error.h"
#include "model/block.h"
#include "model/linear.h"

namespace tf {

namespace {

class DenseFfn final : public FfnBlock {
 public:
  explicit DenseFfn(const BlockContext& c) : cfg_(c.cfg), layer_(c.layer), prefix_(c.prefix) {
    const int64_t E = cfg_.n_embd;
    if (cfg_.n_ff <= 0)
      fail(ErrorKind::InvalidInput, c.w.file().display_path(), ": layer ", c.layer,
           " has no router and no dense FFN size");
    norm_ = c.w.vector(prefix_ + "ffn_norm.weight", E);
    gate_ = c.w.weight(prefix_ + "ffn_gate.weight", E, cfg_.n_ff);
    up_ = c.w.weight(prefix_ + "ffn_up.weight", E, cfg_.n_ff);
    down_ = c.w.weight(prefix_ + "ffn_down.weight", cfg_.n_ff, E);
  }

  void prepare(WeightLoader& w) override {
    const int64_t split = WeightLoader::split_point(cfg_.n_ff, WeightLoader::block_size(down_));
    const TpShard& tp = w.tp();
    if (tp.size == 1) {
      split_ = tp.tp_compatible ? split : -1;
      return;
    }
    if (split < 0)
      fail(ErrorKind::Unsupported, w.file().display_path(), ": cannot split the FFN width of layer ", layer_,
           " across 2 ranks on the block boundaries of ", prefix_, "ffn_down.weight; use TP=1 for this model");
    const int64_t f0 = tp.rank == 0 ? 0 : split, f1 = tp.rank == 0 ? split : cfg_.n_ff;
    gate_ = w.slice_rows(gate_, f0, f1);
    up_ = w.slice_rows(up_, f0, f1);
    down_ = w.slice_cols(down_, f0, f1);
    split_ = -1;
  }

  void plan_scratch(Scratch& s, int64_t T) override {
    const int64_t E = cfg_.n_embd, F = gate_.rows;
    xn_ = s.f32("xn", T * E);
    g_ = s.f32("ffn.gate", T * F);
    u_ = s.f32("ffn.up", T * F);
    part_ = split_ > 0 ? s.f32("part", T * E) : nullptr;
    for (const Weight* w : {&gate_, &up_, &down_}) s.product(*w, T);
  }

  void attach_stats(ActivationStats* st) override {
    stats_ = st;
    if (!st) return;
    st_in_ = st->add(cfg_.n_embd);
    st->name(prefix_ + "ffn_gate.weight", st_in_);
    st->name(prefix_ + "ffn_up.weight", st_in_);
    st_down_ = st->add(down_.k);
    st->name(prefix_ + "ffn_down.weight", st_down_);
  }

  void forward(StepContext& ctx, const float* x, float* out) override {
    Backend& be = ctx.be;
    const int64_t T = ctx.T, E = cfg_.n_embd, F = gate_.rows;
    be.rmsnorm(x, E, norm_, xn_, E, T, E, cfg_.rms_eps);
    if (ctx.calibrating) stats_->record(st_in_, xn_, T, E);
    const Product gu[] = {{&gate_, g_, F}, {&up_, u_, F}};
    be.matmul(xn_, T, E, gu, 2);
    be.silu_mul(g_, F, u_, F, T, F, split_);
    if (ctx.calibrating) stats_->record(st_down_, g_, T, F);
    split_matmul(be, down_, g_, T, F, split_, out, part_);
  }

 private:
  const ModelConfig& cfg_;
  int layer_;
  std::string prefix_;
  const float* norm_ = nullptr;
  Weight gate_, up_, down_;
  int64_t split_ = -1;
  float *xn_ = nullptr, *g_ = nullptr, *u_ = nullptr, *part_ = nullptr;
  ActivationStats* stats_ = nullptr;
  int st_in_ = -1, st_down_ = -1;
};

}  // namespace

std::unique_ptr<FfnBlock> make_dense_ffn(const BlockContext& c) { return std::make_unique<DenseFfn>(c); }

}  // namespace tf
