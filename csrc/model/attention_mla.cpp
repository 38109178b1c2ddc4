// Multi-head latent attention, in absorbed form for decode and prefill alike:
//   q      = W_q x  or  W_qb norm(W_qa x)                      [heads][nope + rope]
//   c, k_r = norm(W_kva x)[:latent], rope(W_kva x [latent:])    one row per token, in the cache
//   q_abs  = [W_kb[h] q_nope[h], rope(q_rope[h])]               [heads][latent + rope]
//   o      = softmax(q_abs . [c, k_r] * scale) . c              [heads][latent]
//   out    = W_o [W_vb[h] o[h]]_h
// Decode reads one latent row per position for all heads together (the cache is 576 values a
// token and layer for V3, not 2 x 128 x 192), which is what makes long contexts fit.
// Prefill uses the same absorbed form rather than expanding K/V per head: for the chunk sizes
// the engine prefills (<= 512 tokens) the two cost about the same, and one form keeps decode
// and prefill bit-consistent. Under TP=2 a rank holds a range of query heads; the latent and
// its cache are replicated (one row per token for all heads).
#include <cstdlib>

#include "core/error.h"
#include "model/block.h"
#include "model/linear.h"

namespace tf {

namespace {

class MlaAttention final : public AttentionBlock {
 public:
  explicit MlaAttention(const BlockContext& c);
  std::vector<KvSpec> kv_specs() const override {
    KvSpec s;
    s.n_heads = 1;
    s.k_dim = cfg_.kv_lora_rank + cfg_.rope_dim;  // the latent, then the rope key
    s.v_dim = 0;                                  // V: the latent, a prefix of the row
    return {s};
  }
  void prepare(WeightLoader& w) override;
  void plan_scratch(Scratch& s, int64_t T) override;
  void attach_stats(ActivationStats* stats) override;
  void forward(StepContext& ctx, const float* x, float* out) override;

 private:
  void split_kv_b(WeightLoader& w, const std::string& name);

  const ModelConfig& cfg_;
  int layer_;
  std::string prefix_;
  const float* norm_ = nullptr;
  Weight wq_, wq_a_, wq_b_, wkv_a_, wo_;
  const float *q_a_norm_ = nullptr, *kv_a_norm_ = nullptr;
  WeightStack wk_b_;  // per head: latent <- q_nope (rows kv_lora, k qk_nope)
  WeightStack wv_b_;  // per head: latent -> value (rows v_head, k kv_lora)
  bool wk_b_owned_ = false;  // W_kb is a float copy (from an older file's attn_kv_b)
  int64_t heads_ = 0;
  int64_t o_split_ = -1;
  float *xn_ = nullptr, *q_lora_ = nullptr, *q_ = nullptr, *latent_ = nullptr, *q_abs_ = nullptr, *o_latent_ = nullptr,
        *attn_ = nullptr, *part_ = nullptr;
  void** rows_ = nullptr;
  ActivationStats* stats_ = nullptr;
  int st_in_ = -1, st_q_b_ = -1, st_k_b_ = -1, st_v_b_ = -1, st_kv_b_ = -1, st_out_ = -1;
};

MlaAttention::MlaAttention(const BlockContext& c) : cfg_(c.cfg), layer_(c.layer), prefix_(c.prefix) {
  const int64_t E = cfg_.n_embd, H = cfg_.n_head, D = cfg_.head_dim, C = cfg_.kv_lora_rank, R = cfg_.rope_dim,
                N = cfg_.qk_nope_dim, V = cfg_.v_head_dim, QL = cfg_.q_lora_rank;
  const std::string& p = prefix_;
  WeightLoader& w = c.w;
  norm_ = w.vector(p + "attn_norm.weight", E);
  if (QL > 0) {
    wq_a_ = w.weight(p + "attn_q_a.weight", E, QL);
    q_a_norm_ = w.vector(p + "attn_q_a_norm.weight", QL);
    wq_b_ = w.weight(p + "attn_q_b.weight", QL, H * D);
  } else {
    wq_ = w.weight(p + "attn_q.weight", E, H * D);
  }
  wkv_a_ = w.weight(p + "attn_kv_a_mqa.weight", E, C + R);
  kv_a_norm_ = w.vector(p + "attn_kv_a_norm.weight", C);
  if (w.has(p + "attn_k_b.weight")) {
    wk_b_ = w.stack(p + "attn_k_b.weight", N, C, H);
    wv_b_ = w.stack(p + "attn_v_b.weight", C, V, H);
  } else if (w.has(p + "attn_kv_b.weight")) {
    split_kv_b(w, p + "attn_kv_b.weight");
  } else {
    fail(ErrorKind::InvalidInput, w.file().display_path(), ": tensors ", p, "attn_k_b.weight/attn_v_b.weight (or ",
         p, "attn_kv_b.weight) are missing");
  }
  wo_ = w.weight(p + "attn_output.weight", H * V, E);
  heads_ = H;
}

void MlaAttention::split_kv_b(WeightLoader& w, const std::string& name) {
  // attn_kv_b: per head h, rows h (N + V) .. + N map the latent to the key's nope part, the next
  // V rows to the value. W_vb is a view of the value rows; W_kb is needed the other way round
  // (rows: latent, k: nope), so it is transposed into a float copy at load.
  const int64_t H = cfg_.n_head, C = cfg_.kv_lora_rank, N = cfg_.qk_nope_dim, V = cfg_.v_head_dim;
  const Weight kvb = w.weight(name, C, H * (N + V));
  wv_b_.first = kvb;
  wv_b_.first.rows = V;
  wv_b_.first.data = kvb.data + size_t(N) * kvb.row_stride;
  wv_b_.n = H;
  wv_b_.stride = size_t(N + V) * kvb.row_stride;
  const auto dequant = w.dequantizer(name);
  float* wkb = w.owned_floats(size_t(H * C * N));
  std::vector<float> row(static_cast<size_t>(C));
  std::vector<uint8_t> raw(kvb.row_stride);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < N; ++j) {
      const uint8_t* src = kvb.data + size_t(h * (N + V) + j) * kvb.row_stride;
      if (w.tp().size > 1) {  // under TP the mapping stays untouched
        w.read_at(src, raw.data(), raw.size(), false);
        src = raw.data();
      }
      dequant(src, row.data(), C);
      for (int64_t c = 0; c < C; ++c) wkb[(h * C + c) * N + j] = row[size_t(c)];
    }
  Weight& k = wk_b_.first;
  k.type = GgmlType::F32;
  k.k = N;
  k.rows = C;
  k.data = reinterpret_cast<const uint8_t*>(wkb);
  k.row_stride = size_t(N) * sizeof(float);
  wk_b_.n = H;
  wk_b_.stride = size_t(C * N) * sizeof(float);
  wk_b_owned_ = true;
}

void MlaAttention::prepare(WeightLoader& w) {
  // TP=2 splits the query heads (every head reads the one latent row); the output
  // projection's input follows them, V values per head.
  const int64_t H = cfg_.n_head, D = cfg_.head_dim, V = cfg_.v_head_dim;
  const int64_t align = WeightLoader::block_size(wo_);
  int64_t split = -1;
  for (int64_t c = 1; c < H; ++c)
    if ((c * V) % align == 0 && (split < 0 || std::llabs(2 * c - H) < std::llabs(2 * split - H))) split = c;
  const TpShard& tp = w.tp();
  if (tp.size == 1) {
    o_split_ = tp.tp_compatible && split > 0 ? split * V : -1;
    return;
  }
  if (split < 0)
    fail(ErrorKind::Unsupported, w.file().display_path(), ": cannot split the attention heads of layer ", layer_,
         " across 2 ranks on the block boundaries of ", prefix_, "attn_output.weight; use TP=1 for this model");
  const int64_t h0 = tp.rank == 0 ? 0 : split, h1 = tp.rank == 0 ? split : H;
  heads_ = h1 - h0;
  // The q-LoRA and latent projections are replicated; this rank's heads' rows of W_q / W_qb,
  // their W_kb and W_vb, their columns of W_o.
  if (wq_b_.rows > 0) {
    wq_a_ = w.keep(wq_a_);
    wq_b_ = w.slice_rows(wq_b_, h0 * D, h1 * D);
  } else {
    wq_ = w.slice_rows(wq_, h0 * D, h1 * D);
  }
  wkv_a_ = w.keep(wkv_a_);
  if (wk_b_owned_) {  // a float copy made at load: keep this rank's heads' part of it
    wk_b_.first.data += size_t(h0) * wk_b_.stride;
    wk_b_.n = h1 - h0;
    w.count(Weight{GgmlType::F32, wk_b_.first.k, wk_b_.first.rows * wk_b_.n, nullptr, wk_b_.first.row_stride});
  } else {
    wk_b_ = w.slice_stack(wk_b_, h0, h1);
  }
  wv_b_ = w.slice_stack(wv_b_, h0, h1);
  wo_ = w.slice_cols(wo_, h0 * V, h1 * V);
  o_split_ = -1;
}

void MlaAttention::plan_scratch(Scratch& s, int64_t T) {
  const int64_t E = cfg_.n_embd, H = heads_, D = cfg_.head_dim, C = cfg_.kv_lora_rank, CR = C + cfg_.rope_dim,
                V = cfg_.v_head_dim;
  xn_ = s.f32("xn", T * E);
  q_lora_ = s.f32("mla.q_lora", T * cfg_.q_lora_rank);
  q_ = s.f32("attn.q", T * H * D);
  latent_ = s.f32("mla.latent", T * CR);
  q_abs_ = s.f32("mla.q_abs", T * H * CR);
  o_latent_ = s.f32("mla.o_latent", T * H * C);
  attn_ = s.f32("attn.out", T * H * V);
  part_ = o_split_ > 0 ? s.f32("part", T * E) : nullptr;
  rows_ = s.ptrs("attn.rows", T);
  for (const Weight* w : {&wq_, &wq_a_, &wq_b_, &wkv_a_, &wo_}) s.product(*w, T);
  s.product(wk_b_, T * H);
  s.product(wv_b_, T * H);
}

void MlaAttention::attach_stats(ActivationStats* st) {
  stats_ = st;
  if (!st) return;
  const std::string& p = prefix_;
  st_in_ = st->add(cfg_.n_embd);
  st->name(p + (cfg_.q_lora_rank > 0 ? "attn_q_a.weight" : "attn_q.weight"), st_in_);
  st->name(p + "attn_kv_a_mqa.weight", st_in_);
  if (cfg_.q_lora_rank > 0) {
    st_q_b_ = st->add(cfg_.q_lora_rank);
    st->name(p + "attn_q_b.weight", st_q_b_);
  }
  if (wk_b_owned_) {
    st_kv_b_ = st->add(cfg_.kv_lora_rank);
    st->name(p + "attn_kv_b.weight", st_kv_b_);
  } else {
    st_k_b_ = st->add(wk_b_.first.k, wk_b_.n);
    st->name(p + "attn_k_b.weight", st_k_b_);
    st_v_b_ = st->add(wv_b_.first.k, wv_b_.n);
    st->name(p + "attn_v_b.weight", st_v_b_);
  }
  st_out_ = st->add(wo_.k);
  st->name(p + "attn_output.weight", st_out_);
}

void MlaAttention::forward(StepContext& ctx, const float* x, float* out) {
  Backend& be = ctx.be;
  const int64_t T = ctx.T, E = cfg_.n_embd, H = heads_, D = cfg_.head_dim;
  const int64_t C = cfg_.kv_lora_rank, R = cfg_.rope_dim, N = cfg_.qk_nope_dim, V = cfg_.v_head_dim;
  const int64_t QL = cfg_.q_lora_rank, CR = C + R;
  be.rmsnorm(x, E, norm_, xn_, E, T, E, cfg_.rms_eps);
  // 1. The projections of the normed input: q (through its LoRA) and the latent + rope key.
  if (ctx.calibrating) stats_->record(st_in_, xn_, T, E);
  if (QL > 0) {
    const Product a[] = {{&wq_a_, q_lora_, QL}, {&wkv_a_, latent_, CR}};
    be.matmul(xn_, T, E, a, 2);
    be.rmsnorm(q_lora_, QL, q_a_norm_, q_lora_, QL, T, QL, cfg_.rms_eps);
    if (ctx.calibrating) stats_->record(st_q_b_, q_lora_, T, QL);
    const Product b{&wq_b_, q_, H * D};
    be.matmul(q_lora_, T, QL, &b, 1);
  } else {
    const Product a[] = {{&wq_, q_, H * D}, {&wkv_a_, latent_, CR}};
    be.matmul(xn_, T, E, a, 2);
  }
  // 2. The latent normalised and the rope key rotated: the token's cache row; the query's rope
  // parts rotated into the absorbed queries.
  be.rmsnorm(latent_, CR, kv_a_norm_, latent_, CR, T, C, cfg_.rms_eps);
  be.rope(latent_, T, CR, 1, CR, C, ctx.rope_cs, R, int(R), cfg_.rope_neox);
  const KvLayer kv = ctx.kv.layer(kv_base_);
  for (int64_t t = 0; t < T; ++t) rows_[t] = kv.pool->k_row(kv.layer, ctx.batch[size_t(t)].seq, ctx.batch[size_t(t)].pos, 0);
  be.store_rows(latent_, CR, CR, rows_, T, ctx.kv.type());
  be.rope(q_, T, H * D, int(H), D, N, ctx.rope_cs, R, int(R), cfg_.rope_neox);
  be.copy_rows(q_abs_ + C, CR, q_ + N, D, T * H, R);
  if (ctx.calibrating) {
    if (st_k_b_ >= 0) stats_->record_heads(st_k_b_, q_, T, H * D, D);
    if (st_kv_b_ >= 0) stats_->record(st_kv_b_, latent_, T, CR);
  }
  // 3. W_kb absorbed into the query: q_abs[t][h][:latent] = W_kb[h] . q_nope[t][h].
  Grouping heads;
  heads.rows = T;
  heads.last = H;
  heads.x_mat = D;
  heads.y_mat = CR;
  const StackProduct kb{&wk_b_, q_abs_, H * CR};
  be.matmul_stack(q_, H * D, heads, &kb, 1);
  // 4. Attention over the latent rows: every head reads the same row (one cache head).
  AttentionBatch a;
  a.q = q_abs_;
  a.q_stride = H * CR;
  a.out = o_latent_;
  a.out_stride = H * C;
  a.T = T;
  a.seq = ctx.seq;
  a.end = ctx.end;
  a.n_cache_heads = 1;
  a.group = int(H);
  a.head_dim = int(CR);
  a.v_dim = int(C);
  a.scale = cfg_.attn_scale;
  be.attention(a, kv);
  // 5. W_vb per head, then the output projection (split where TP=2 splits the heads).
  if (ctx.calibrating && st_v_b_ >= 0) stats_->record_heads(st_v_b_, o_latent_, T, H * C, C);
  heads.x_mat = C;
  heads.y_mat = V;
  const StackProduct vb{&wv_b_, attn_, H * V};
  be.matmul_stack(o_latent_, H * C, heads, &vb, 1);
  if (ctx.calibrating) stats_->record(st_out_, attn_, T, H * V);
  split_matmul(be, wo_, attn_, T, H * V, o_split_, out, part_);
}

}  // namespace

std::unique_ptr<AttentionBlock> make_mla_attention(const BlockContext& c) {
  return std::make_unique<MlaAttention>(c);
}

}  // namespace tf
