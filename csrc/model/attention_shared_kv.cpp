// Shared-KV attention (the SharedKv* kinds): every position keeps one row of head_dim values,
// read as both K and V by every query head (q through a low-rank projection with per-head
// RMSNorm; rope on the last rope_dim values, undone on the output); attention sinks; a grouped
// low-rank output projection. Every layer reads the last `sliding_window` rows; a layer with a
// compression ratio also reads compressed entries, one per `ratio` tokens: softmax-gated pools
// of its own projections of those tokens (ratio 4: overlapping, each entry also pooling the
// previous window's tokens), normed and rotated at the window's first position. Ratio 4 layers
// read only the entries a lightning indexer ranks highest for each query; others read them all.
//
// TP=2: each rank holds half of the output groups with their query heads (q_b rows, sinks,
// o_a matrices, o_b columns: a partial sum); the shared row, the compressors and the indexer
// are computed on both ranks alike (small, and every head reads them), so both keep every
// cache stream whole.
//
// Cache streams (kv_specs): the window rows; the compressor's per-token projections (a window of
// the last one or two compression windows: the state of the unfinished window); the compressed
// entries; the indexer's compressed keys. Chunked prefill, batching, truncation and the prefix
// cache need nothing more: every stream is rows by position.
#include <cmath>

#include "core/error.h"
#include "model/block.h"
#include "model/linear.h"
#include "model/rope.h"

namespace tf {

namespace {

// A compressor: per token kv and gate projections (coff series of dim values each) kept in the
// state rows at [kv_at, kv_at + coff*dim) and [gate_at, ...); entries pooled from them.
struct Compressor {
  Weight wkv, wgate;
  const float* ape = nullptr;   // [ratio][coff * dim]: position bias of the gate logits
  const float* norm = nullptr;  // [dim]
  int64_t dim = 0, coff = 1, kv_at = 0, gate_at = 0;
  std::vector<PoolSlot> slots;  // coff * ratio slots: the previous window's first series, then this window's last

  void load(WeightLoader& w, const std::string& p, int64_t E, int64_t d, int64_t ratio, int64_t at) {
    dim = d;
    coff = ratio == 4 ? 2 : 1;
    wkv = w.weight(p + "_kv.weight", E, coff * d);
    wgate = w.weight(p + "_gate.weight", E, coff * d);
    ape = w.floats(p + "_ape.weight", {coff * d, ratio});
    norm = w.vector(p + "_norm.weight", d);
    kv_at = at;
    gate_at = at + coff * d;
    for (int64_t s = 0; s < coff * ratio; ++s) {
      const int64_t series = coff == 2 && s >= ratio ? 1 : 0, j = s % ratio;
      slots.push_back({kv_at + series * d, gate_at + series * d, ape + j * coff * d + series * d});
    }
  }
  int64_t state_values() const { return 2 * coff * dim; }
};

class SharedKvAttention final : public AttentionBlock {
 public:
  SharedKvAttention(const BlockContext& c, AttentionKind kind);
  std::vector<KvSpec> kv_specs() const override;
  void prepare(WeightLoader& w) override;
  void plan_scratch(Scratch& s, int64_t T) override;
  void attach_stats(ActivationStats* stats) override;
  void forward(StepContext& ctx, const float* x, float* out) override;

 private:
  // Pools the entries the batch's tokens complete into stream `entries` (rows of comp.dim).
  void compress(StepContext& ctx, const Compressor& comp, int entries);

  const ModelConfig& cfg_;
  int layer_;
  std::string prefix_;
  int64_t ratio_ = 0;  // 0: window only
  bool sparse_ = false;
  const float *norm_ = nullptr, *q_norm_ = nullptr, *kv_norm_ = nullptr, *sinks_ = nullptr;
  Weight wq_a_, wq_b_, wkv_, wo_b_, wi_q_, wi_w_;
  WeightStack wo_a_;  // o_groups matrices of o_lora_rank rows
  Compressor comp_, index_comp_;
  int64_t state_dim_ = 0;
  int64_t heads_ = 0, groups_ = 0;  // this rank's
  int64_t o_split_ = -1;            // TP=1 compatible: where o_b's sum splits
  // scratch
  float *xn_ = nullptr, *qa_ = nullptr, *q_ = nullptr, *kv_ = nullptr, *attn_ = nullptr, *og_ = nullptr,
        *state_ = nullptr, *pooled_ = nullptr, *cs_ = nullptr, *ent_cs_ = nullptr, *iq_ = nullptr, *iw_ = nullptr,
        *iws_ = nullptr, *iscale_ = nullptr, *part_ = nullptr;
  int32_t *ent_seq_ = nullptr, *idx_ = nullptr;
  int64_t* count_ = nullptr;
  void** rows_ = nullptr;
  ActivationStats* stats_ = nullptr;
  int st_in_ = -1, st_qa_ = -1, st_oa_ = -1, st_ob_ = -1;
};

SharedKvAttention::SharedKvAttention(const BlockContext& c, AttentionKind kind)
    : cfg_(c.cfg), layer_(c.layer), prefix_(c.prefix) {
  const int64_t E = cfg_.n_embd, H = cfg_.n_head, D = cfg_.head_dim, QL = cfg_.q_lora_rank, G = cfg_.o_groups,
                OL = cfg_.o_lora_rank;
  const std::string& p = prefix_;
  WeightLoader& w = c.w;
  ratio_ = cfg_.compress_ratio[size_t(layer_)];
  sparse_ = kind == AttentionKind::SharedKvSparse;
  if ((kind == AttentionKind::SharedKvWindow) != (ratio_ == 0))
    fail(ErrorKind::InvalidInput, w.file().display_path(), ": layer ", layer_, " has compression ratio ", ratio_,
         " but attention kind ", attention_kind_name(kind));
  norm_ = w.vector(p + "attn_norm.weight", E);
  sinks_ = w.vector(p + "attn_sinks.weight", H);
  wq_a_ = w.weight(p + "attn_q_a.weight", E, QL);
  q_norm_ = w.vector(p + "attn_q_a_norm.weight", QL);
  wq_b_ = w.weight(p + "attn_q_b.weight", QL, H * D);
  wkv_ = w.weight(p + "attn_kv.weight", E, D);
  kv_norm_ = w.vector(p + "attn_kv_a_norm.weight", D);
  const Weight oa = w.weight(p + "attn_output_a.weight", H * D / G, G * OL);
  wo_a_ = WeightStack{oa, G, size_t(OL) * oa.row_stride};
  wo_a_.first.rows = OL;
  wo_b_ = w.weight(p + "attn_output_b.weight", G * OL, E);
  if (ratio_ > 0) {
    comp_.load(w, p + "attn_compressor", E, D, ratio_, 0);
    state_dim_ = comp_.state_values();
  }
  if (sparse_) {
    const int64_t HI = cfg_.index_heads, DI = cfg_.index_dim;
    index_comp_.load(w, p + "indexer_compressor", E, DI, ratio_, state_dim_);
    state_dim_ += index_comp_.state_values();
    wi_q_ = w.weight(p + "indexer.attn_q_b.weight", QL, HI * DI);
    wi_w_ = w.weight(p + "indexer.proj.weight", E, HI);
  }
  heads_ = H;
  groups_ = G;
}

std::vector<KvSpec> SharedKvAttention::kv_specs() const {
  KvSpec window;
  window.n_heads = 1;
  window.k_dim = cfg_.head_dim;
  window.v_dim = 0;  // V is the K row
  window.window = cfg_.sliding_window;
  if (ratio_ == 0) return {window};
  KvSpec state = window;
  state.k_dim = int(state_dim_);
  state.window = comp_.coff * ratio_;  // the tokens the next entries still pool
  KvSpec entries = window;
  entries.window = 0;
  entries.compression = int(ratio_);
  if (!sparse_) return {window, state, entries};
  KvSpec keys = entries;
  keys.k_dim = cfg_.index_dim;
  return {window, state, entries, keys};
}

void SharedKvAttention::prepare(WeightLoader& w) {
  const int64_t G = cfg_.o_groups, OL = cfg_.o_lora_rank, HG = cfg_.n_head / G, D = cfg_.head_dim;
  const TpShard& tp = w.tp();
  const bool even = G % 2 == 0 && (G / 2 * OL) % WeightLoader::block_size(wo_b_) == 0;
  if (tp.size == 1) {
    o_split_ = tp.tp_compatible && even ? G / 2 * OL : -1;
    return;
  }
  if (!even)
    fail(ErrorKind::Unsupported, w.file().display_path(), ": cannot split the ", G, " output groups of layer ", layer_,
         " across 2 ranks on the block boundaries of ", prefix_, "attn_output_b.weight; use TP=1 for this model");
  const int64_t g0 = tp.rank == 0 ? 0 : G / 2, g1 = tp.rank == 0 ? G / 2 : G;
  groups_ = g1 - g0;
  heads_ = groups_ * HG;
  wq_a_ = w.keep(wq_a_);
  wkv_ = w.keep(wkv_);
  wq_b_ = w.slice_rows(wq_b_, g0 * HG * D, g1 * HG * D);
  sinks_ += g0 * HG;  // a private copy under TP: this rank's part is a range of it
  wo_a_ = w.slice_stack(wo_a_, g0, g1);
  wo_b_ = w.slice_cols(wo_b_, g0 * OL, g1 * OL);
  for (Compressor* c : {&comp_, &index_comp_}) {
    if (c->wkv.rows == 0) continue;
    c->wkv = w.keep(c->wkv);
    c->wgate = w.keep(c->wgate);
  }
  if (sparse_) {
    wi_q_ = w.keep(wi_q_);
    wi_w_ = w.keep(wi_w_);
  }
  o_split_ = -1;
}

void SharedKvAttention::plan_scratch(Scratch& s, int64_t T) {
  const int64_t E = cfg_.n_embd, H = heads_, D = cfg_.head_dim, QL = cfg_.q_lora_rank, rd = cfg_.rope_dim;
  const int64_t G = groups_, OL = cfg_.o_lora_rank;
  xn_ = s.f32("xn", T * E);
  qa_ = s.f32("attn.q_a", T * QL);
  q_ = s.f32("attn.q", T * H * D);
  kv_ = s.f32("attn.k", T * D);
  attn_ = s.f32("attn.out", T * H * D);
  og_ = s.f32("attn.o_groups", T * G * OL);
  cs_ = s.f32("attn.rope", T * rd, true);
  rows_ = s.ptrs("attn.rows", T * 2 * std::max<int64_t>(1, ratio_));
  part_ = o_split_ > 0 ? s.f32("part", T * E) : nullptr;
  for (const Weight* w : {&wq_a_, &wq_b_, &wkv_, &wo_b_}) s.product(*w, T);
  s.product(wo_a_, T * G);  // the batched form: T rows for each group
  if (ratio_ > 0) {
    const int64_t n_ent = T;  // entries a batch can complete: one per token at most (one per sequence)
    state_ = s.f32("attn.state", T * state_dim_);
    pooled_ = s.f32("attn.pooled", n_ent * D);
    ent_cs_ = s.f32("attn.entry_rope", n_ent * rd, true);
    ent_seq_ = s.i32("attn.entry_seq", n_ent);
    count_ = s.i64("attn.entries", T);
    for (const Weight* w : {&comp_.wkv, &comp_.wgate}) s.product(*w, T);
  }
  if (sparse_) {
    const int64_t HI = cfg_.index_heads, DI = cfg_.index_dim;
    iq_ = s.f32("attn.index_q", T * HI * DI);
    iw_ = s.f32("attn.index_w", T * HI);
    iws_ = s.f32("attn.index_ws", T * HI);
    iscale_ = s.f32("attn.index_scale", T);
    idx_ = s.i32("attn.index_top", T * cfg_.index_topk);
    for (const Weight* w : {&index_comp_.wkv, &index_comp_.wgate, &wi_q_, &wi_w_}) s.product(*w, T);
  }
}

void SharedKvAttention::attach_stats(ActivationStats* st) {
  stats_ = st;
  if (!st) return;
  const std::string& p = prefix_;
  st_in_ = st->add(cfg_.n_embd);
  for (const char* n : {"attn_q_a.weight", "attn_kv.weight"}) st->name(p + n, st_in_);
  if (ratio_ > 0)
    for (const char* n : {"attn_compressor_kv.weight", "attn_compressor_gate.weight"}) st->name(p + n, st_in_);
  if (sparse_)
    for (const char* n : {"indexer_compressor_kv.weight", "indexer_compressor_gate.weight", "indexer.proj.weight"})
      st->name(p + n, st_in_);
  st_qa_ = st->add(cfg_.q_lora_rank);
  st->name(p + "attn_q_b.weight", st_qa_);
  if (sparse_) st->name(p + "indexer.attn_q_b.weight", st_qa_);
  st_oa_ = st->add(wo_a_.first.k);
  st->name(p + "attn_output_a.weight", st_oa_);
  st_ob_ = st->add(wo_b_.k);
  st->name(p + "attn_output_b.weight", st_ob_);
}

void SharedKvAttention::compress(StepContext& ctx, const Compressor& comp, int entries) {
  Backend& be = ctx.be;
  const int64_t T = ctx.T, slots = int64_t(comp.slots.size()), rd = cfg_.rope_dim, d = comp.dim;
  const KvLayer state = ctx.kv.layer(kv_base_ + 1), out = ctx.kv.layer(kv_base_ + entries);
  int64_t n = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = ctx.end[t] - 1;
    if ((pos + 1) % ratio_ != 0) continue;
    const int64_t e = (pos + 1) / ratio_ - 1, first = e * ratio_ - (comp.coff - 1) * ratio_;
    for (int64_t s = 0; s < slots; ++s) {
      const int64_t p = first + s;
      rows_[n * slots + s] = p < 0 ? nullptr : state.pool->k_row(state.layer, ctx.seq[t], p, 0);
    }
    rope_angles(cfg_.compress_rope, e * ratio_, ent_cs_ + n * rd);
    ent_seq_[n] = int32_t(t);
    ++n;
  }
  if (n == 0) return;
  be.gated_pool(rows_, comp.slots.data(), int(slots), n, d, ctx.kv.type(), pooled_, d);
  be.rmsnorm(pooled_, d, comp.norm, pooled_, d, n, d, cfg_.rms_eps);
  be.rope(pooled_, n, d, 1, d, d - rd, ent_cs_, rd, int(rd), false);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = ent_seq_[i];
    rows_[i] = out.pool->k_row(out.layer, ctx.seq[t], ctx.end[t] / ratio_ - 1, 0);
  }
  be.store_rows(pooled_, d, d, rows_, n, ctx.kv.type());
}

void SharedKvAttention::forward(StepContext& ctx, const float* x, float* out) {
  Backend& be = ctx.be;
  const int64_t T = ctx.T, E = cfg_.n_embd, H = heads_, D = cfg_.head_dim, QL = cfg_.q_lora_rank;
  const int64_t G = groups_, OL = cfg_.o_lora_rank, rd = cfg_.rope_dim, QD = H * D;
  be.rmsnorm(x, E, norm_, xn_, E, T, E, cfg_.rms_eps);
  if (ctx.calibrating) stats_->record(st_in_, xn_, T, E);
  // Every projection of the normed input in one pass; the compressors' into the state rows.
  std::vector<Product> ps = {{&wq_a_, qa_, QL}, {&wkv_, kv_, D}};
  if (ratio_ > 0) {
    ps.push_back({&comp_.wkv, state_ + comp_.kv_at, state_dim_});
    ps.push_back({&comp_.wgate, state_ + comp_.gate_at, state_dim_});
  }
  if (sparse_) {
    ps.push_back({&index_comp_.wkv, state_ + index_comp_.kv_at, state_dim_});
    ps.push_back({&index_comp_.wgate, state_ + index_comp_.gate_at, state_dim_});
    ps.push_back({&wi_w_, iw_, cfg_.index_heads});
  }
  be.matmul(xn_, T, E, ps.data(), ps.size());
  // The rotation of this layer: the plain rope (window only) or the compressed branches'.
  const float* cs = ctx.rope_cs;
  if (ratio_ > 0) {
    for (int64_t t = 0; t < T; ++t) rope_angles(cfg_.compress_rope, ctx.end[t] - 1, cs_ + t * rd);
    cs = cs_;
  }
  // q: low rank, normed per head, rotated.
  be.rmsnorm(qa_, QL, q_norm_, qa_, QL, T, QL, cfg_.rms_eps);
  if (ctx.calibrating) stats_->record(st_qa_, qa_, T, QL);
  const Product qb{&wq_b_, q_, QD};
  be.matmul(qa_, T, QL, &qb, 1);
  be.rmsnorm(q_, D, nullptr, q_, D, T * H, D, cfg_.rms_eps);
  be.rope(q_, T, QD, int(H), D, D - rd, cs, rd, int(rd), false);
  // The position's row: normed, rotated, into the window stream.
  be.rmsnorm(kv_, D, kv_norm_, kv_, D, T, D, cfg_.rms_eps);
  be.rope(kv_, T, D, 1, D, D - rd, cs, rd, int(rd), false);
  const KvLayer window = ctx.kv.layer(kv_base_);
  for (int64_t t = 0; t < T; ++t) rows_[t] = window.pool->k_row(window.layer, ctx.seq[t], ctx.end[t] - 1, 0);
  be.store_rows(kv_, D, D, rows_, T, ctx.kv.type());
  AttentionBatch a;
  if (ratio_ > 0) {
    // The compressors' projections of every token into the state stream, then the entries the
    // batch completes (all of them written before any query reads).
    const KvLayer state = ctx.kv.layer(kv_base_ + 1);
    for (int64_t t = 0; t < T; ++t) rows_[t] = state.pool->k_row(state.layer, ctx.seq[t], ctx.end[t] - 1, 0);
    be.store_rows(state_, state_dim_, state_dim_, rows_, T, ctx.kv.type());
    compress(ctx, comp_, 2);
    if (sparse_) compress(ctx, index_comp_, 3);
    for (int64_t t = 0; t < T; ++t) count_[t] = ctx.end[t] / ratio_;  // entries complete at this position
    a.extra_count = count_;
  }
  if (sparse_) {
    // The indexer: its queries (low rank, rotated), per-head weights scaled by
    // 1 / sqrt(heads * key_length), and each query's top entries.
    const int64_t HI = cfg_.index_heads, DI = cfg_.index_dim;
    const Product iq{&wi_q_, iq_, HI * DI};
    be.matmul(qa_, T, QL, &iq, 1);
    be.rope(iq_, T, HI * DI, int(HI), DI, DI - rd, cs, rd, int(rd), false);
    be.fill(iws_, T * HI, 0.f);
    be.fill(iscale_, T, float(1.0 / std::sqrt(double(HI) * double(DI))));
    be.add_scaled(iws_, HI, iw_, HI, iscale_, T, HI, false);
    be.index_topk(iq_, HI * DI, int(HI), DI, iws_, HI, ctx.kv.layer(kv_base_ + 3), ctx.seq, count_, T,
                  cfg_.index_topk, idx_);
    a.extra_count = nullptr;
    a.extra_list = idx_;
    a.extra_len = cfg_.index_topk;
  }
  const KvLayer entries = ratio_ > 0 ? ctx.kv.layer(kv_base_ + 2) : KvLayer{};
  a.q = q_;
  a.q_stride = QD;
  a.out = attn_;
  a.out_stride = QD;
  a.T = T;
  a.seq = ctx.seq;
  a.end = ctx.end;
  a.window = cfg_.sliding_window;
  a.n_cache_heads = 1;
  a.group = int(H);
  a.head_dim = a.v_dim = int(D);
  a.scale = float(1.0 / std::sqrt(double(D)));
  a.sinks = sinks_;
  a.extra = ratio_ > 0 ? &entries : nullptr;
  be.attention(a, window);
  // The values carry their rows' rotation: undone at the query's position, then the grouped
  // output projection (each group of heads to o_lora_rank values) and the mix to n_embd.
  be.rope(attn_, T, QD, int(H), D, D - rd, cs, rd, int(rd), false, true);
  if (ctx.calibrating) stats_->record(st_oa_, attn_, T * G, QD / G);
  Grouping g;
  g.rows = T;
  g.x_mat = QD / G;
  g.y_mat = OL;
  g.first = 0;
  g.last = G;
  const StackProduct oa{&wo_a_, og_, G * OL};
  be.matmul_stack(attn_, QD, g, &oa, 1);
  if (ctx.calibrating) stats_->record(st_ob_, og_, T, G * OL);
  split_matmul(be, wo_b_, og_, T, G * OL, o_split_, out, part_);
}

}  // namespace

std::unique_ptr<AttentionBlock> make_shared_kv_window(const BlockContext& c) {
  return std::make_unique<SharedKvAttention>(c, AttentionKind::SharedKvWindow);
}
std::unique_ptr<AttentionBlock> make_shared_kv_compressed(const BlockContext& c) {
  return std::make_unique<SharedKvAttention>(c, AttentionKind::SharedKvCompressed);
}
std::unique_ptr<AttentionBlock> make_shared_kv_sparse(const BlockContext& c) {
  return std::make_unique<SharedKvAttention>(c, AttentionKind::SharedKvSparse);
}

}  // namespace tf
