// Hyper-connections: the residual is hc_mult streams per token (the embedding repeated to
// start). Around every block a map computed from the streams themselves (an unweighted RMSNorm
// of all streams together, one small product, then sigmoid / Sinkhorn: Backend::hyper_maps)
// gives the block's input as a weighted sum of the streams (pre), and each stream's new value
// as a weighted share of the block's output (post) plus a doubly stochastic mix of the old
// streams (comb). A final map collapses the streams for the head. Under TP=2 both ranks hold
// every stream and compute the same maps; only the block outputs are reduced.
#include <string>

#include "comm/group.h"
#include "model/block.h"

namespace tf {

namespace {

struct HyperMap {
  Weight fn;  // [mix][n * n_embd]
  const float* base = nullptr;
  const float* scale = nullptr;
};

class HyperStreams final : public ResidualPolicy {
 public:
  HyperStreams(const ModelConfig& cfg, WeightLoader& w) : cfg_(cfg), n_(cfg.hc_mult) {
    const int64_t NE = int64_t(n_) * cfg.n_embd, mix = int64_t(2 + n_) * n_;
    auto load = [&](const std::string& p, int64_t rows, int64_t scales) {
      HyperMap m;
      m.fn = w.weight(p + "_fn.weight", NE, rows);
      m.base = w.vector(p + "_base.weight", rows);
      m.scale = w.vector(p + "_scale.weight", scales);
      return m;
    };
    // The next-token-prediction layers have maps of their own (their streams collapse through
    // the main head, as llama.cpp runs them).
    for (int il = 0; il < cfg.n_layer + cfg.n_nextn; ++il) {
      const std::string p = "blk." + std::to_string(il) + ".hc_";
      if (il >= cfg.n_layer && !w.has(p + "attn_fn.weight")) break;
      attn_.push_back(load(p + "attn", mix, 3));
      ffn_.push_back(load(p + "ffn", mix, 3));
    }
    head_ = load("output_hc", n_, 1);
  }

  void prepare(WeightLoader& w) override {
    if (w.tp().size == 1) return;
    for (std::vector<HyperMap>* v : {&attn_, &ffn_})
      for (HyperMap& m : *v) m.fn = w.keep(m.fn);
    head_.fn = w.keep(head_.fn);
  }

  void plan_scratch(Scratch& s, int64_t T) override {
    const int64_t E = cfg_.n_embd, NE = n_ * E;
    streams_ = s.f32("hyper.streams", T * NE);
    flat_ = s.f32("hyper.flat", T * NE);
    mix_ = s.f32("hyper.mix", T * (2 + n_) * n_);
    pre_ = s.f32("hyper.pre", T * n_);
    post_ = s.f32("hyper.post", T * n_);
    comb_ = s.f32("hyper.comb", T * n_ * n_);
    in_ = s.f32("hyper.in", T * E);
    out_ = s.f32("hyper.out", T * E);
    for (const std::vector<HyperMap>* v : {&attn_, &ffn_})
      for (const HyperMap& m : *v) s.product(m.fn, T);
    s.product(head_.fn, T);
  }

  void begin(StepContext& ctx, const float* emb) override {
    const int64_t E = cfg_.n_embd;
    for (int i = 0; i < n_; ++i) ctx.be.copy_rows(streams_ + i * E, n_ * E, emb, E, ctx.T, E);
  }

  bool has_layer(int il) const override { return il >= 0 && size_t(il) < attn_.size(); }
  int64_t state_width() const override { return int64_t(n_) * cfg_.n_embd; }
  const float* state() const override { return streams_; }
  void begin_state(StepContext& ctx, const float* state) override {
    const int64_t NE = int64_t(n_) * cfg_.n_embd;
    ctx.be.copy_rows(streams_, NE, state, NE, ctx.T, NE);
  }

  void layer(StepContext& ctx, AttentionBlock& attn, FfnBlock& ffn) override {
    around(ctx, attn_[size_t(ctx.layer)], attn);
    around(ctx, ffn_[size_t(ctx.layer)], ffn);
  }

  const float* end(StepContext& ctx) override {
    maps(ctx, head_, false);
    ctx.be.hyper_collapse(streams_, pre_, n_, cfg_.n_embd, ctx.T, in_, cfg_.n_embd);
    return in_;
  }

 private:
  void maps(StepContext& ctx, const HyperMap& m, bool full) {
    Backend& be = ctx.be;
    const int64_t T = ctx.T, NE = int64_t(n_) * cfg_.n_embd;
    be.rmsnorm(streams_, NE, nullptr, flat_, NE, T, NE, cfg_.rms_eps);
    const int64_t mix = full ? int64_t(2 + n_) * n_ : n_;
    const Product p{&m.fn, mix_, mix};
    be.matmul(flat_, T, NE, &p, 1);
    HyperMaps h;
    h.mix = mix_;
    h.ldm = mix;
    h.base = m.base;
    h.scale = m.scale;
    h.n = n_;
    h.iters = cfg_.hc_sinkhorn_iters;
    h.eps = cfg_.hc_eps;
    h.pre = pre_;
    h.post = full ? post_ : nullptr;
    h.comb = full ? comb_ : nullptr;
    be.hyper_maps(h, T);
  }

  void around(StepContext& ctx, const HyperMap& m, Block& block) {
    Backend& be = ctx.be;
    const int64_t T = ctx.T, E = cfg_.n_embd;
    maps(ctx, m, true);
    be.hyper_collapse(streams_, pre_, n_, E, T, in_, E);
    block.forward(ctx, in_, out_);
    if (ctx.tp.size > 1) ctx.tp.group->all_reduce(out_, size_t(T * E), comm::DType::F32);
    be.hyper_expand(streams_, out_, E, post_, comb_, n_, E, T);
  }

  const ModelConfig& cfg_;
  int n_;
  std::vector<HyperMap> attn_, ffn_;
  HyperMap head_;
  float *streams_ = nullptr, *flat_ = nullptr, *mix_ = nullptr, *pre_ = nullptr, *post_ = nullptr,
        *comb_ = nullptr, *in_ = nullptr, *out_ = nullptr;
};

}  // namespace

std::unique_ptr<ResidualPolicy> make_hyper_streams(const ModelConfig& cfg, WeightLoader& w) {
  return std::make_unique<HyperStreams>(cfg, w);
}

}  // namespace tf
