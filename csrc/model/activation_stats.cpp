// ActivationStats: per-channel sums of squares of matrix inputs (see activation_stats.h), and
// LlamaModel::set_activation_stats, which names the accumulators after the model's weights (the
// forward's call sites record into them: attention_gqa.cpp, attention_mla.cpp, llama_model.cpp,
// moe/moe_ffn.cpp).
#include "model/activation_stats.h"

#include <algorithm>

#include "core/error.h"
#include "model/llama_model.h"

namespace tf {

namespace {
constexpr int64_t kBlock = 256;  // channels per work item
}  // namespace

int ActivationStats::add(int64_t in_dim, int64_t n_mat) {
  TF_CHECK(in_dim > 0 && n_mat > 0, "activation stats: invalid accumulator size ", in_dim, " x ", n_mat);
  Accumulator a;
  a.in_dim = in_dim;
  a.n_mat = n_mat;
  a.sum2.assign(size_t(in_dim * n_mat), 0.0);
  a.counts.assign(size_t(n_mat), 0);
  accs_.push_back(std::move(a));
  return int(accs_.size() - 1);
}

size_t ActivationStats::bytes() const {
  size_t n = 0;
  for (const auto& a : accs_) n += a.sum2.size() * sizeof(double) + a.counts.size() * sizeof(int64_t);
  return n;
}

template <typename RowFn, typename CountFn>
void ActivationStats::accumulate(Accumulator& a, RowFn row, CountFn n_rows, ThreadPool& pool) {
  const int64_t blocks = (a.in_dim + kBlock - 1) / kBlock;
  // One item per (matrix, channel block): each value is added to by one item only.
  pool.run_chunks(a.n_mat * blocks, [&](int64_t item, int) {
    const int64_t m = item / blocks, j0 = item % blocks * kBlock, j1 = std::min(a.in_dim, j0 + kBlock);
    const int64_t n = n_rows(m);
    double* acc = a.sum2.data() + m * a.in_dim;
    for (int64_t i = 0; i < n; ++i) {
      const float* x = row(m, i);
      for (int64_t j = j0; j < j1; ++j) acc[j] += double(x[j]) * double(x[j]);
    }
  });
  for (int64_t m = 0; m < a.n_mat; ++m) a.counts[size_t(m)] += n_rows(m);
}

void ActivationStats::record(int id, const float* x, int64_t T, int64_t ldx, ThreadPool& pool, int64_t mat) {
  Accumulator& a = accs_.at(size_t(id));
  TF_CHECK(mat >= 0 && mat < a.n_mat && ldx >= a.in_dim, "activation stats: bad record");
  if (T <= 0) return;
  const int64_t blocks = (a.in_dim + kBlock - 1) / kBlock;
  pool.run_chunks(blocks, [&](int64_t b, int) {
    const int64_t j0 = b * kBlock, j1 = std::min(a.in_dim, j0 + kBlock);
    double* acc = a.sum2.data() + mat * a.in_dim;
    for (int64_t t = 0; t < T; ++t) {
      const float* xt = x + t * ldx;
      for (int64_t j = j0; j < j1; ++j) acc[j] += double(xt[j]) * double(xt[j]);
    }
  });
  a.counts[size_t(mat)] += T;
}

void ActivationStats::record_heads(int id, const float* x, int64_t T, int64_t ldx, int64_t hx, ThreadPool& pool) {
  Accumulator& a = accs_.at(size_t(id));
  if (T <= 0) return;
  accumulate(a, [&](int64_t h, int64_t t) { return x + t * ldx + h * hx; }, [&](int64_t) { return T; }, pool);
}

void ActivationStats::record_grouped(int id, const float* x, int64_t ldx, const int32_t* offsets, const int32_t* rows,
                                     ThreadPool& pool) {
  Accumulator& a = accs_.at(size_t(id));
  accumulate(
      a,
      [&](int64_t m, int64_t i) {
        const int64_t r = int64_t(offsets[m]) + i;
        return x + (rows ? int64_t(rows[r]) : r) * ldx;
      },
      [&](int64_t m) { return int64_t(offsets[m + 1] - offsets[m]); }, pool);
}

void LlamaModel::set_activation_stats(ActivationStats* stats) {
  stat_ids_.clear();
  stat_output_ = -1;
  stats_ = nullptr;
  if (!stats) return;
  if (tp_.size > 1)
    fail(ErrorKind::Unsupported, "calibration statistics need the whole model on one engine (TP=1); this is TP rank ",
         tp_.rank, " of ", tp_.size);
  TF_CHECK(stats->names().empty(), "activation stats: the collector is already in use");
  const int64_t E = cfg_.n_embd;
  auto acc = [&](int64_t in_dim, int64_t n_mat, std::initializer_list<std::string> names) {
    const int id = stats->add(in_dim, n_mat);
    for (const std::string& n : names) stats->name(n, id);
    return id;
  };
  stat_ids_.resize(layers_.size());
  for (size_t il = 0; il < layers_.size(); ++il) {
    const LayerWeights& L = layers_[il];
    LayerStatIds& s = stat_ids_[il];
    const std::string p = "blk." + std::to_string(il) + ".";
    switch (cfg_.attention) {
      case AttentionKind::Gqa:
        s.attn_in = acc(E, 1, {p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"});
        break;
      case AttentionKind::Mla:
        if (cfg_.q_lora_rank > 0) {
          s.attn_in = acc(E, 1, {p + "attn_q_a.weight", p + "attn_kv_a_mqa.weight"});
          s.q_b = acc(cfg_.q_lora_rank, 1, {p + "attn_q_b.weight"});
        } else {
          s.attn_in = acc(E, 1, {p + "attn_q.weight", p + "attn_kv_a_mqa.weight"});
        }
        if (L.wk_b_owned) {
          s.kv_b = acc(cfg_.kv_lora_rank, 1, {p + "attn_kv_b.weight"});
        } else {
          s.k_b = acc(L.wk_b.first.k, L.wk_b.n_expert, {p + "attn_k_b.weight"});
          s.v_b = acc(L.wv_b.first.k, L.wv_b.n_expert, {p + "attn_v_b.weight"});
        }
        break;
    }
    s.attn_out = acc(L.wo.k, 1, {p + "attn_output.weight"});
    if (L.ffn == FfnKind::Dense) {
      s.ffn_in = acc(E, 1, {p + "ffn_gate.weight", p + "ffn_up.weight"});
      s.ffn_down = acc(L.w_down.k, 1, {p + "ffn_down.weight"});
      continue;
    }
    s.ffn_in = acc(E, 1, {p + "ffn_gate_inp.weight"});
    if (L.gate_shexp.rows > 0) {
      stats->name(p + "ffn_gate_shexp.weight", s.ffn_in);
      stats->name(p + "ffn_up_shexp.weight", s.ffn_in);
      if (L.shexp_gate) stats->name(p + "ffn_gate_inp_shexp.weight", s.ffn_in);
      s.shexp_down = acc(L.down_shexp.k, 1, {p + "ffn_down_shexp.weight"});
    }
    s.exp_in = acc(E, L.gate_exps.n_expert, {p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"});
    s.exp_down = acc(L.down_exps.first.k, L.down_exps.n_expert, {p + "ffn_down_exps.weight"});
  }
  stat_output_ = acc(E, 1, {cfg_.tied_output ? "token_embd.weight" : "output.weight"});
  stats_ = stats;
}

}  // namespace tf
