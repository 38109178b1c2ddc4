// The multi-head latent attention block of LlamaModel (deepseek2), in absorbed form for decode
// and prefill alike:
//   q      = W_q x  or  W_qb norm(W_qa x)                      [heads][nope + rope]
//   c, k_r = norm(W_kva x)[:latent], rope(W_kva x [latent:])    one row per token, in the cache
//   q_abs  = [W_kb[h] q_nope[h], rope(q_rope[h])]               [heads][latent + rope]
//   o      = softmax(q_abs . [c, k_r] * scale) . c              [heads][latent]
//   out    = W_o [W_vb[h] o[h]]_h
// Decode reads one latent row per position for all heads together (the cache is 576 values a
// token and layer for V3, not 2 x 128 x 192), which is what makes long contexts fit.
// Prefill uses the same absorbed form rather than expanding K/V per head: the expanded form
// spends less on attention (nope + rope + v = 320 values per head and position instead of
// latent + rope + latent = 1088) but must first run W_kb/W_vb over every cached position and
// hold the expanded K/V — for the chunk sizes the engine prefills (<= 512 tokens) the two cost
// about the same, and one form keeps decode and prefill bit-consistent.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "model/llama_model.h"
#include "model/rope.h"

namespace tf {

void LlamaModel::head_project(const ExpertWeight& w, const float* x, int64_t T, int64_t ldx, int64_t hx, float* y,
                              int64_t ldy, int64_t hy, ThreadPool& pool) {
  const int64_t H = w.n_expert;
  TF_CHECK(ldx == H * hx, "head_project: heads must be consecutive rows");
  // The T x H input rows are hx floats apart: quantized as one batch of rows.
  const Weight& w0 = w.first;
  GgmlType rep[kLayouts] = {};
  rep[size_t(w0.layout)] = w0.type;
  quantize_layouts(1u << unsigned(w0.layout), rep, x, T * H, w0.k, hx, head_act_, pool);
  const ActBuf& a = head_act_[size_t(w0.layout)];
  jobs_.clear();
  for (int64_t h = 0; h < H; ++h)
    jobs_.push_back({w.expert(h), a.data.data() + size_t(h) * a.stride, size_t(H) * a.stride, T, y + h * hy, ldy});
  run_jobs(jobs_, pool);
}

void LlamaModel::mla_block(const std::vector<BatchToken>& batch, int il, PagedKvCache& kv, ThreadPool& pool) {
  const LayerWeights& L = layers_[size_t(il)];
  const int64_t T = int64_t(batch.size()), E = cfg_.n_embd, H = local_heads_, D = cfg_.head_dim;
  const int64_t C = cfg_.kv_lora_rank, R = cfg_.rope_dim, N = cfg_.qk_nope_dim, V = cfg_.v_head_dim;
  const int64_t QL = cfg_.q_lora_rank, CR = C + R;

  // 1. The projections of the normed input: q (through its LoRA) and the latent + rope key.
  if (stats_) stats_->record(stat_ids_[size_t(il)].attn_in, xn_.data(), T, E, pool);
  if (QL > 0) {
    project({{&L.wq_a, q_lora_.data()}, {&L.wkv_a, latent_.data()}}, xn_.data(), T, E, pool);
    rmsnorm(q_lora_.data(), L.q_a_norm, q_lora_.data(), T, QL);
    if (stats_) stats_->record(stat_ids_[size_t(il)].q_b, q_lora_.data(), T, QL, pool);
    project({{&L.wq_b, q_.data()}}, q_lora_.data(), T, QL, pool);
  } else {
    project({{&L.wq, q_.data()}, {&L.wkv_a, latent_.data()}}, xn_.data(), T, E, pool);
  }
  // 2. Per token: the latent normalised and the rope key rotated, stored as the token's cache
  // row; the query's rope parts rotated into the absorbed queries.
  pool.parallel_for(T, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* cs = rope_cs_.data() + t * R;
      float* row = latent_.data() + t * CR;
      rmsnorm(row, L.kv_a_norm, row, 1, C);
      be_.rope(row + C, cs, int(R), cfg_.rope_neox);
      const BatchToken& bt = batch[size_t(t)];
      be_.store_row(row, kv.k_row(il, bt.seq, bt.pos, 0), CR, kv.type() == KvType::F16);
      for (int64_t h = 0; h < H; ++h) {
        float* q = q_.data() + (t * H + h) * D;
        be_.rope(q + N, cs, int(R), cfg_.rope_neox);
        std::memcpy(q_abs_.data() + (t * H + h) * CR + C, q + N, size_t(R) * sizeof(float));
      }
    }
  });
  // Calibration: W_kb and W_vb per head (their inputs: q_nope, o_latent below); an older file's
  // attn_kv_b as its expanded form takes it (the normed latent, before its rows were absorbed).
  if (stats_) {
    const LayerStatIds& s = stat_ids_[size_t(il)];
    if (s.k_b >= 0) stats_->record_heads(s.k_b, q_.data(), T, H * D, D, pool);
    if (s.kv_b >= 0) stats_->record(s.kv_b, latent_.data(), T, CR, pool);
  }
  // 3. W_kb absorbed into the query: q_abs[t][h][:latent] = W_kb[h] . q_nope[t][h].
  head_project(L.wk_b, q_.data(), T, H * D, D, q_abs_.data(), H * CR, CR, pool);
  // 4. Attention over the latent rows: every head reads the same row (one cache head).
  attention(batch, il, kv, q_abs_.data(), H * CR, int(H), int(CR), int(C), o_latent_.data(), H * C, pool);
  // 5. W_vb per head, then the output projection (split where TP=2 splits the heads).
  if (stats_ && stat_ids_[size_t(il)].v_b >= 0)
    stats_->record_heads(stat_ids_[size_t(il)].v_b, o_latent_.data(), T, H * C, C, pool);
  head_project(L.wv_b, o_latent_.data(), T, H * C, C, attn_.data(), H * V, V, pool);
  if (stats_) stats_->record(stat_ids_[size_t(il)].attn_out, attn_.data(), T, H * V, pool);
  ksplit_matmul(L.wo, attn_.data(), T, H * V, kv_split_ > 0 ? kv_split_ * V : -1, xn_.data(), part_.data(), pool);
}

}  // namespace tf
