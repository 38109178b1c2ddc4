#include "model/attention_gqa.h"

#include <cstdlib>

#include "core/error.h"
#include "model/linear.h"

namespace tf {

GqaAttention::GqaAttention(const BlockContext& c, int64_t window)
    : cfg_(c.cfg), layer_(c.layer), prefix_(c.prefix), window_(window) {
  const int64_t E = cfg_.n_embd, H = cfg_.n_head, HK = cfg_.n_head_kv, D = cfg_.head_dim;
  const std::string& p = prefix_;
  WeightLoader& w = c.w;
  norm_ = w.vector(p + "attn_norm.weight", E);
  wq_ = w.weight(p + "attn_q.weight", E, H * D);
  wk_ = w.weight(p + "attn_k.weight", E, HK * D);
  wv_ = w.weight(p + "attn_v.weight", E, HK * D);
  wo_ = w.weight(p + "attn_output.weight", H * D, E);
  if (cfg_.qkv_bias) {
    bq_ = w.vector(p + "attn_q.bias", H * D);
    bk_ = w.vector(p + "attn_k.bias", HK * D);
    bv_ = w.vector(p + "attn_v.bias", HK * D);
  }
  if (cfg_.qk_norm) {
    q_norm_ = w.vector(p + "attn_q_norm.weight", D);
    k_norm_ = w.vector(p + "attn_k_norm.weight", D);
  }
  heads_ = H;
  kv_heads_ = HK;
}

std::vector<KvSpec> GqaAttention::kv_specs() const {
  KvSpec s;
  s.n_heads = int(kv_heads_);
  s.k_dim = s.v_dim = cfg_.head_dim;
  s.window = window_;
  return {s};
}

void GqaAttention::prepare(WeightLoader& w) {
  // TP=2 splits by KV head (with its query heads); the output projection's input follows, so
  // the split must fall on a block boundary of attn_output's type.
  const int64_t HK = cfg_.n_head_kv, D = cfg_.head_dim, g = cfg_.n_head / HK, width = g * D;
  const int64_t align = WeightLoader::block_size(wo_);
  int64_t split = -1;
  for (int64_t c = 1; c < HK; ++c)
    if ((c * width) % align == 0 && (split < 0 || std::llabs(2 * c - HK) < std::llabs(2 * split - HK))) split = c;
  const TpShard& tp = w.tp();
  if (tp.size == 1) {
    o_split_ = tp.tp_compatible && split > 0 ? split * width : -1;
    return;
  }
  if (split < 0)
    fail(ErrorKind::Unsupported, w.file().display_path(), ": cannot split the KV heads of layer ", layer_,
         " across 2 ranks on the block boundaries of ", prefix_, "attn_output.weight; use TP=1 for this model");
  const int64_t k0 = tp.rank == 0 ? 0 : split, k1 = tp.rank == 0 ? split : HK;
  kv_heads_ = k1 - k0;
  heads_ = kv_heads_ * g;
  wq_ = w.slice_rows(wq_, k0 * g * D, k1 * g * D);
  wk_ = w.slice_rows(wk_, k0 * D, k1 * D);
  wv_ = w.slice_rows(wv_, k0 * D, k1 * D);
  wo_ = w.slice_cols(wo_, k0 * g * D, k1 * g * D);
  if (bq_) {  // private copies under TP: this rank's part is a range of them
    bq_ += k0 * g * D;
    bk_ += k0 * D;
    bv_ += k0 * D;
  }
  o_split_ = -1;  // each rank holds one part of the split sum
}

void GqaAttention::plan_scratch(Scratch& s, int64_t T) {
  const int64_t E = cfg_.n_embd, D = cfg_.head_dim, QD = heads_ * D, KD = kv_heads_ * D;
  xn_ = s.f32("xn", T * E);
  q_ = s.f32("attn.q", T * QD);
  k_ = s.f32("attn.k", T * KD);
  v_ = s.f32("attn.v", T * KD);
  attn_ = s.f32("attn.out", T * QD);
  part_ = o_split_ > 0 ? s.f32("part", T * E) : nullptr;
  rows_ = s.ptrs("attn.rows", 2 * T * kv_heads_);
  for (const Weight* w : {&wq_, &wk_, &wv_, &wo_}) s.product(*w, T);
}

void GqaAttention::attach_stats(ActivationStats* st) {
  stats_ = st;
  if (!st) return;
  st_in_ = st->add(cfg_.n_embd);
  for (const char* n : {"attn_q.weight", "attn_k.weight", "attn_v.weight"}) st->name(prefix_ + n, st_in_);
  st_out_ = st->add(wo_.k);
  st->name(prefix_ + "attn_output.weight", st_out_);
}

void GqaAttention::forward(StepContext& ctx, const float* x, float* out) {
  Backend& be = ctx.be;
  const int64_t T = ctx.T, E = cfg_.n_embd, D = cfg_.head_dim, H = heads_, HK = kv_heads_, QD = H * D, KD = HK * D;
  const int rd = cfg_.rope_dim;
  be.rmsnorm(x, E, norm_, xn_, E, T, E, cfg_.rms_eps);
  if (ctx.calibrating) stats_->record(st_in_, xn_, T, E);
  const Product qkv[] = {{&wq_, q_, QD}, {&wk_, k_, KD}, {&wv_, v_, KD}};
  be.matmul(xn_, T, E, qkv, 3);
  if (bq_) {
    be.add_bias(q_, QD, bq_, T, QD);
    be.add_bias(k_, KD, bk_, T, KD);
    be.add_bias(v_, KD, bv_, T, KD);
  }
  if (q_norm_) {  // RMSNorm over each head
    be.rmsnorm(q_, D, q_norm_, q_, D, T * H, D, cfg_.rms_eps);
    be.rmsnorm(k_, D, k_norm_, k_, D, T * HK, D, cfg_.rms_eps);
  }
  be.rope(q_, T, QD, int(H), D, 0, ctx.rope_cs, rd, rd, cfg_.rope_neox);
  be.rope(k_, T, KD, int(HK), D, 0, ctx.rope_cs, rd, rd, cfg_.rope_neox);
  // K and V rows into the cache: row (t, h) of K, then of V.
  const KvLayer kv = ctx.kv.layer(kv_base_);
  for (int64_t t = 0; t < T; ++t) {
    const BatchToken& bt = ctx.batch[size_t(t)];
    for (int64_t h = 0; h < HK; ++h) {
      rows_[t * HK + h] = kv.pool->k_row(kv.layer, bt.seq, bt.pos, int(h));
      rows_[T * HK + t * HK + h] = kv.pool->v_row(kv.layer, bt.seq, bt.pos, int(h));
    }
  }
  be.store_rows(k_, D, D, rows_, T * HK, ctx.kv.type());
  be.store_rows(v_, D, D, rows_ + T * HK, T * HK, ctx.kv.type());
  AttentionBatch a;
  a.q = q_;
  a.q_stride = QD;
  a.out = attn_;
  a.out_stride = QD;
  a.T = T;
  a.seq = ctx.seq;
  a.end = ctx.end;
  a.window = window_;
  a.n_cache_heads = int(HK);
  a.group = int(H / HK);
  a.head_dim = a.v_dim = int(D);
  a.scale = cfg_.attn_scale;
  be.attention(a, kv);
  if (ctx.calibrating) stats_->record(st_out_, attn_, T, QD);
  split_matmul(be, wo_, attn_, T, QD, o_split_, out, part_);
}

}  // namespace tf

namespace tf {
std::unique_ptr<AttentionBlock> make_gqa_attention(const BlockContext& c) {
  return std::make_unique<GqaAttention>(c, 0);
}
}  // namespace tf
