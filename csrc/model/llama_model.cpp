// LlamaModel, the forward pass: embeddings and RoPE angles, then per layer the attention block
// (attention_gqa.cpp) and the FFN block (dense here, MoE in moe/moe_ffn.cpp), each with its TP
// All-Reduce, and the LM head. Loading is in weight_loading.cpp, the TP plan in tp_shard.cpp,
// the products in linear.cpp.
#include "model/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "model/rope.h"
#include "quant/traits.h"

namespace tf {

namespace {
constexpr int64_t kMaxLogitRows = 64;  // the engine never asks for more rows per forward
}  // namespace

LlamaModel::~LlamaModel() = default;

void LlamaModel::reduce(float* data, int64_t n) {
  if (tp_.size > 1) tp_.group->all_reduce(data, size_t(n), comm::DType::F32);
}

void LlamaModel::reset_expert_usage() {
  expert_usage_.assign(size_t(cfg_.n_layer), std::vector<int64_t>(size_t(cfg_.n_expert), 0));
}

void LlamaModel::set_routing_trace(bool on) {
  tracing_ = on;
  trace_.assign(size_t(cfg_.n_layer), {});
}

double LlamaModel::scratch_bytes(int64_t max_tokens) const {
  // In double: a hostile geometry must produce a huge number, not a wrapped small one.
  const double T = double(max_tokens), E = double(cfg_.n_embd), D = double(cfg_.head_dim);
  const double QD = double(local_heads_) * D, KD = double(local_kv_heads_) * D;
  const double FW = std::max(double(local_ff_), double(shexp_width_));
  double act = 0;  // widest quantized activation row, about one byte per value plus scales
  unsigned layouts = 1u << unsigned(output_.layout);
  auto use = [&](const Weight& w) {
    if (w.rows > 0) layouts |= 1u << unsigned(w.layout);
  };
  for (const auto& L : layers_) {
    act = std::max({act, double(L.wq.k), double(L.wo.k), double(L.w_down.k), double(L.down_exps.first.k),
                    double(L.wq_b.k)});
    for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down, &L.router,
                            &L.gate_exps.first, &L.up_exps.first, &L.down_exps.first, &L.gate_shexp,
                            &L.up_shexp, &L.down_shexp, &L.wq_a, &L.wq_b, &L.wkv_a})
      use(*w);
  }
  act *= double(__builtin_popcount(layouts));  // one buffer per layout in use
  double floats = T * (6 * E + 2 * QD + 2 * KD + 2 * FW + double(cfg_.rope_dim));
  if (cfg_.attention == AttentionKind::Mla) {
    const double H = double(local_heads_), C = double(cfg_.kv_lora_rank), CR = C + double(cfg_.rope_dim);
    floats += T * (double(cfg_.q_lora_rank) + CR + H * CR + H * C + H * double(cfg_.v_head_dim));
    floats += T * H * (C + double(cfg_.qk_nope_dim) + 32);  // per-head activation rows (at most float)
  }
  double bytes = 4 * floats + T * (1.25 * act + 64);
  if (cfg_.is_moe()) {
    const double K = double(cfg_.n_expert_used), FE = double(local_ff_exp_);
    bytes += 4 * T * K * (2 * FE + 2 * E + 4) + T * K * (1.25 * act + 64) + 4 * T * double(cfg_.n_expert);
  }
  return bytes;
}

uint64_t LlamaModel::reserve(int max_tokens, int64_t max_ctx, int n_threads, bool count_only) {
  TF_CHECK(max_tokens > 0 && max_ctx > 0 && n_threads > 0, "invalid scratch sizes");
  // Every buffer goes through take(): allocated (zeroed, so resident), or only counted.
  uint64_t bytes = 0;
  auto take = [&](auto& vec, size_t n) {
    using V = typename std::decay_t<decltype(vec)>::value_type;
    bytes += uint64_t(n) * sizeof(V);
    if (!count_only) vec.assign(n, V{});
  };
  if (!count_only) {
    max_tokens_ = max_tokens;
    max_ctx_ = max_ctx;
    n_threads_ = n_threads;
  }
  const size_t T = size_t(max_tokens);
  const size_t E = size_t(cfg_.n_embd), QD = size_t(local_heads_) * size_t(cfg_.head_dim),
               KD = size_t(local_kv_heads_) * size_t(cfg_.head_dim), F = size_t(local_ff_);
  take(ffn_out_, T * E);
  take(ffn_out2_, T * E);
  take(part_, T * E);
  if (tp_.size > 1) take(logits_local_, size_t(kMaxLogitRows) * size_t(cfg_.n_vocab - vocab_begin_));
  take(x_, T * E);
  take(xn_, T * E);
  take(q_, T * QD);
  take(k_, T * KD);
  take(v_, T * KD);
  take(attn_, T * std::max(QD, size_t(local_heads_) * size_t(cfg_.v_head_dim)));
  if (cfg_.attention == AttentionKind::Mla) {
    const size_t H = size_t(local_heads_), C = size_t(cfg_.kv_lora_rank), CR = C + size_t(cfg_.rope_dim);
    take(q_lora_, T * size_t(cfg_.q_lora_rank));
    take(latent_, T * CR);
    take(q_abs_, T * H * CR);
    take(o_latent_, T * H * C);
  }
  const size_t FW = std::max(F, size_t(shexp_width_));  // dense or shared-expert FFN width
  take(gate_, T * FW);
  take(up_, T * FW);
  take(rope_cs_, T * size_t(cfg_.rope_dim));
  // One activation buffer per layout, rows as wide as the widest input of that layout; the
  // gathered expert buffers only for the layouts the experts use.
  size_t stride[kLayouts] = {};
  bool exp_layout[kLayouts] = {};
  auto consider = [&](const Weight& w, bool expert = false) {
    if (w.rows <= 0) return;
    const size_t l = size_t(w.layout);
    stride[l] = std::max(stride[l], be_.act_row_bytes(w.type, w.k));
    if (expert) exp_layout[l] = true;
  };
  consider(output_);
  for (const auto& L : layers_) {
    for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down, &L.router,
                            &L.gate_shexp, &L.up_shexp, &L.down_shexp, &L.wq_a, &L.wq_b, &L.wkv_a})
      consider(*w);
    for (const Weight* w : {&L.gate_exps.first, &L.up_exps.first, &L.down_exps.first}) consider(*w, true);
  }
  for (size_t l = 0; l < kLayouts; ++l) {
    act_[l].stride = exp_act_[l].stride = (stride[l] + 63) & ~size_t(63);
    take(act_[l].data, T * act_[l].stride);
    if (!count_only) exp_act_[l].data.clear();
  }
  // MLA's per-head products: T x heads rows for the layouts W_kb and W_vb use.
  size_t head_stride[kLayouts] = {};
  for (const auto& L : layers_)
    for (const Weight* w : {&L.wk_b.first, &L.wv_b.first})
      if (w->rows > 0)
        head_stride[size_t(w->layout)] = std::max(head_stride[size_t(w->layout)], be_.act_row_bytes(w->type, w->k));
  for (size_t l = 0; l < kLayouts; ++l) {
    head_act_[l].stride = (head_stride[l] + 63) & ~size_t(63);
    take(head_act_[l].data, T * size_t(local_heads_) * head_act_[l].stride);
  }
  if (!count_only) {
    attn_blocks_.reserve(T);  // at most one run per token
    jobs_.clear();
    jobs_.reserve(size_t(std::max<int64_t>(2 * std::max(cfg_.n_expert, 2), local_heads_) + 4));
    reset_expert_usage();
  }
  if (cfg_.is_moe()) {
    const size_t NE = size_t(cfg_.n_expert), K = size_t(cfg_.n_expert_used), FE = size_t(local_ff_exp_);
    take(router_logits_, T * NE);
    take(route_w_, T * K);
    take(route_ids_, T * K);
    take(route_scratch_, 3 * NE);
    take(exp_count_, NE);
    take(exp_offset_, NE + 1);
    take(exp_rows_, T * K);
    take(slot_of_, T * K);
    take(exp_gate_, T * K * FE);
    take(exp_up_, T * K * FE);
    take(exp_out_, T * K * E);
    take(exp_out2_, fe_split_ > 0 ? T * K * E : 0);
    for (size_t l = 0; l < kLayouts; ++l)
      if (exp_layout[l]) take(exp_act_[l].data, T * K * exp_act_[l].stride);
  }
  return bytes;
}

void LlamaModel::silu_mul_parts(int64_t n, int64_t split, float* g, const float* u) {
  if (split > 0 && split < n) {  // each TP rank's part on its own (vector body and tail as there)
    be_.silu_mul(split, g, u, g);
    be_.silu_mul(n - split, g + split, u + split, g + split);
  } else {
    be_.silu_mul(n, g, u, g);
  }
}

void LlamaModel::dense_ffn(int layer, int64_t T, ThreadPool& pool) {
  const LayerWeights& L = layers_[size_t(layer)];
  const int64_t E = cfg_.n_embd, F = local_ff_;
  if (stats_) stats_->record(stat_ids_[size_t(layer)].ffn_in, xn_.data(), T, E, pool);
  project({{&L.w_gate, gate_.data()}, {&L.w_up, up_.data()}}, xn_.data(), T, E, pool);
  pool.parallel_for(T, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) silu_mul_parts(F, f_split_, gate_.data() + t * F, up_.data() + t * F);
  });
  if (stats_) stats_->record(stat_ids_[size_t(layer)].ffn_down, gate_.data(), T, F, pool);
  ksplit_matmul(L.w_down, gate_.data(), T, F, f_split_, ffn_out_.data(), part_.data(), pool);
}

void LlamaModel::forward(const std::vector<BatchToken>& batch, PagedKvCache& kv, ThreadPool& pool,
                         float* logits) {
  const int64_t T = int64_t(batch.size());
  TF_CHECK(T > 0 && T <= max_tokens_, "batch of ", T, " tokens exceeds the reserved ", max_tokens_);
  const int64_t E = cfg_.n_embd;
  const int rd = cfg_.rope_dim;

  // Embedding rows and the rotary angles of each token (shared by all layers).
  for (int64_t t = 0; t < T; ++t) {
    const BatchToken& bt = batch[size_t(t)];
    TF_CHECK(bt.token >= 0 && bt.token < cfg_.n_vocab, "token id ", bt.token, " out of range");
    TF_CHECK(bt.pos >= 0 && bt.pos < max_ctx_, "position ", bt.pos, " exceeds the context");
    const uint8_t* row = tok_embd_.data + size_t(bt.token) * tok_embd_.row_stride;
    if (tp_.size > 1) {
      // Under TP the mapping stays untouched: read the one embedding row.
      read_at(row, emb_row_.data(), tok_embd_.row_stride, false);
      row = emb_row_.data();
    }
    emb_dequant_(row, x_.data() + t * E, E);
    rope_angles(cfg_, bt.pos, rope_cs_.data() + t * rd);
  }

  for (int il = 0; il < cfg_.n_layer; ++il) {
    const LayerWeights& L = layers_[size_t(il)];
    rmsnorm(x_.data(), L.attn_norm, xn_.data(), T, E);
    switch (cfg_.attention) {
      case AttentionKind::Gqa: gqa_block(batch, il, kv, pool); break;
      case AttentionKind::Mla: mla_block(batch, il, kv, pool); break;
    }
    reduce(xn_.data(), T * E);  // TP: sum of the ranks' partial projections
    for (int64_t i = 0; i < T * E; ++i) x_[size_t(i)] += xn_[size_t(i)];

    rmsnorm(x_.data(), L.ffn_norm, xn_.data(), T, E);
    switch (L.ffn) {
      case FfnKind::Dense: dense_ffn(il, T, pool); break;
      case FfnKind::Moe: moe_ffn(il, T, pool); break;
    }
    reduce(ffn_out_.data(), T * E);
    for (int64_t i = 0; i < T * E; ++i) x_[size_t(i)] += ffn_out_[size_t(i)];
  }

  // Final norm and LM head, only for the tokens whose logits are wanted.
  int64_t n_out = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (!batch[size_t(t)].want_logits) continue;
    rmsnorm(x_.data() + t * E, output_norm_, xn_.data() + n_out * E, 1, E);
    ++n_out;
  }
  if (n_out == 0) return;
  if (stats_) stats_->record(stat_output_, xn_.data(), n_out, E, pool);
  const int64_t V = cfg_.n_vocab;
  if (tp_.size == 1) {
    project({{&output_, logits}}, xn_.data(), n_out, E, pool);
    return;
  }
  quantize_acts({&output_}, xn_.data(), n_out, E, E, act_, pool);
  const ActBuf& ao = act_[size_t(output_.layout)];
  // TP: each rank computes its vocabulary rows; rank 1's reach rank 0, which samples.
  TF_CHECK(n_out <= kMaxLogitRows, "too many logit rows for one TP forward");
  const int64_t V1 = V - (tp_.rank == 0 ? vocab_end_ : vocab_begin_);  // rank 1's slice width
  jobs_.clear();
  if (tp_.rank == 0)
    jobs_.push_back({output_, ao.data.data(), ao.stride, n_out, logits, V});
  else
    jobs_.push_back({output_, ao.data.data(), ao.stride, n_out, logits_local_.data(), V1});
  run_jobs(jobs_, pool);
  tp_.group->broadcast(logits_local_.data(), size_t(n_out * V1) * sizeof(float), tp_.group_rank(1));
  if (tp_.rank == 0)
    for (int64_t t = 0; t < n_out; ++t)
      std::memcpy(logits + t * V + vocab_end_, logits_local_.data() + t * V1, size_t(V1) * sizeof(float));
}

}  // namespace tf
