// The GQA attention block of LlamaModel: q/k/v biases, per-head q/k RMSNorm, RoPE, K/V rows
// into the paged cache (store_qkv), and attention over the pages (single-query or prefill-block
// kernels behind the backend seam), which the MLA block (attention_mla.cpp) shares.
#include "model/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "model/rope.h"
#include "quant/traits.h"

namespace tf {

void LlamaModel::store_qkv(const std::vector<BatchToken>& batch, int il, PagedKvCache& kv, ThreadPool& pool) {
  const LayerWeights& L = layers_[size_t(il)];
  const int64_t T = int64_t(batch.size());
  const int64_t H = local_heads_, HK = local_kv_heads_, D = cfg_.head_dim, QD = H * D, KD = HK * D;
  const int rd = cfg_.rope_dim;
  // Per-token: bias, q/k norm, rope, then store K/V into the sequence's pages.
  pool.parallel_for(T, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* q = q_.data() + t * QD;
      float* k = k_.data() + t * KD;
      float* v = v_.data() + t * KD;
      if (L.bq) {
        for (int64_t i = 0; i < QD; ++i) q[i] += L.bq[i];
        for (int64_t i = 0; i < KD; ++i) k[i] += L.bk[i];
        for (int64_t i = 0; i < KD; ++i) v[i] += L.bv[i];
      }
      const float* cs = rope_cs_.data() + t * rd;
      for (int64_t h = 0; h < H; ++h) {
        if (L.q_norm) be_.rmsnorm(q + h * D, L.q_norm, q + h * D, D, cfg_.rms_eps);
        be_.rope(q + h * D, cs, rd, cfg_.rope_neox);
      }
      const BatchToken& bt = batch[size_t(t)];
      for (int64_t h = 0; h < HK; ++h) {
        if (L.k_norm) be_.rmsnorm(k + h * D, L.k_norm, k + h * D, D, cfg_.rms_eps);
        be_.rope(k + h * D, cs, rd, cfg_.rope_neox);
        const bool f16 = kv.type() == KvType::F16;
        be_.store_row(k + h * D, kv.k_row(il, bt.seq, bt.pos, int(h)), D, f16);
        be_.store_row(v + h * D, kv.v_row(il, bt.seq, bt.pos, int(h)), D, f16);
      }
    }
  });
}

void LlamaModel::gqa_block(const std::vector<BatchToken>& batch, int il, PagedKvCache& kv, ThreadPool& pool) {
  const LayerWeights& L = layers_[size_t(il)];
  const int64_t T = int64_t(batch.size()), E = cfg_.n_embd, D = cfg_.head_dim, QD = local_heads_ * D;
  const int group = cfg_.n_head / cfg_.n_head_kv;
  if (stats_) stats_->record(stat_ids_[size_t(il)].attn_in, xn_.data(), T, E, pool);
  project({{&L.wq, q_.data()}, {&L.wk, k_.data()}, {&L.wv, v_.data()}}, xn_.data(), T, E, pool);
  store_qkv(batch, il, kv, pool);
  attention(batch, il, kv, q_.data(), QD, group, int(D), int(D), attn_.data(), QD, pool);
  if (stats_) stats_->record(stat_ids_[size_t(il)].attn_out, attn_.data(), T, QD, pool);
  ksplit_matmul(L.wo, attn_.data(), T, QD, kv_split_ > 0 ? kv_split_ * group * D : -1, xn_.data(), part_.data(), pool);
}

void LlamaModel::attention(const std::vector<BatchToken>& batch, int layer, PagedKvCache& kv, const float* q,
                           int64_t q_stride, int group, int head_dim, int v_dim, float* out, int64_t out_stride,
                           ThreadPool& pool) {
  const int64_t T = int64_t(batch.size());
  const int HK = int(local_heads_) / group;
  const float scale = cfg_.attn_scale;
  // Tokens go in blocks: a run of consecutive positions of one sequence (a prefill chunk),
  // up to kAttentionBlockRows query rows, is attended at once (its K/V tiles converted once);
  // a lone token (decode) takes the single-query kernel. One item per (block, KV head): the
  // `group` query heads that share the KV head read its pages together. Items go in
  // contiguous runs, many more runs than threads: causal prefill's triangular cost evens out
  // because threads claim runs as they come free.
  const int max_block = std::max(1, kAttentionBlockRows / group);
  std::vector<std::pair<int64_t, int>>& blocks = attn_blocks_;  // (first token, tokens); reused, no allocation
  blocks.clear();
  for (int64_t t = 0; t < T; ++t) {
    if (!blocks.empty()) {
      auto& [t0, nt] = blocks.back();
      const BatchToken& first = batch[size_t(t0)];
      if (nt < max_block && batch[size_t(t)].seq == first.seq && batch[size_t(t)].pos == first.pos + nt) {
        ++nt;
        continue;
      }
    }
    blocks.emplace_back(t, 1);
  }
  // Fewer items than threads (decode of one sequence under MLA, whose one cache head serves
  // every query head): the query heads of a cache head are split into parts, each read
  // against the pages on its own. The kernels give every head the same bits whichever heads
  // it is computed with, so this changes no result.
  const int64_t base_items = int64_t(blocks.size()) * HK;
  const int parts = int(std::min<int64_t>(group, std::max<int64_t>(1, int64_t(pool.size()) / base_items)));
  const int64_t items = base_items * parts;
  const int64_t runs = std::min<int64_t>(items, int64_t(pool.size()) * 16);
  pool.run_chunks(runs, [&](int64_t r, int) {
    for (int64_t it = r * items / runs; it < (r + 1) * items / runs; ++it) {
      const int part = int(it % parts);
      const auto [t, nt] = blocks[size_t(it / parts / HK)];
      const int g = int(it / parts % HK);
      const int h0 = group * part / parts, h1 = group * (part + 1) / parts;  // this item's query heads
      const BatchToken& bt = batch[size_t(t)];
      const PagedKv pages{kv.k_block(layer, 0, g), kv.v_block(layer, 0, g), kv.page_stride(),
                               kv.block_table(bt.seq).data(), kv.block_size(), kv.type() == KvType::F32, v_dim};
      const float* qt = q + t * q_stride + (int64_t(g) * group + h0) * head_dim;
      float* ot = out + t * out_stride + (int64_t(g) * group + h0) * v_dim;
      if (nt == 1)
        be_.attention(qt, h1 - h0, head_dim, pages, int64_t(bt.pos) + 1, scale, ot);
      else
        be_.attention_causal(qt, q_stride, nt, h1 - h0, head_dim, pages, bt.pos, scale, ot, out_stride);
    }
  });
}

}  // namespace tf
