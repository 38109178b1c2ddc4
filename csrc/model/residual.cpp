// The single-stream residual: x += attention(x), then x += ffn(x); under TP=2 each block's
// output is a partial sum, completed by one All-Reduce before it joins the stream.
#include "comm/group.h"
#include "model/block.h"

namespace tf {

namespace {

class SingleStream final : public ResidualPolicy {
 public:
  explicit SingleStream(const ModelConfig& cfg) : cfg_(cfg) {}

  void plan_scratch(Scratch& s, int64_t T) override {
    x_ = s.f32("residual.x", T * cfg_.n_embd);
    out_ = s.f32("residual.out", T * cfg_.n_embd);
  }

  void begin(StepContext& ctx, const float* emb) override {
    ctx.be.copy_rows(x_, cfg_.n_embd, emb, cfg_.n_embd, ctx.T, cfg_.n_embd);
  }

  void layer(StepContext& ctx, AttentionBlock& attn, FfnBlock& ffn) override {
    const int64_t n = ctx.T * cfg_.n_embd;
    attn.forward(ctx, x_, out_);
    reduce(ctx, out_, n);
    ctx.be.add(x_, out_, n);
    ffn.forward(ctx, x_, out_);
    reduce(ctx, out_, n);
    ctx.be.add(x_, out_, n);
  }

  const float* end(StepContext&) override { return x_; }
  int64_t state_width() const override { return cfg_.n_embd; }
  const float* state() const override { return x_; }
  void begin_state(StepContext& ctx, const float* state) override { begin(ctx, state); }

 private:
  static void reduce(StepContext& ctx, float* data, int64_t n) {
    if (ctx.tp.size > 1) ctx.tp.group->all_reduce(data, size_t(n), comm::DType::F32);
  }
  const ModelConfig& cfg_;
  float *x_ = nullptr, *out_ = nullptr;
};

}  // namespace

std::unique_ptr<ResidualPolicy> make_single_stream(const ModelConfig& cfg) { return std::make_unique<SingleStream>(cfg); }

}  // namespace tf
