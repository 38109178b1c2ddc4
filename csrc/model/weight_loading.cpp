// LlamaModel, part 1: reading the weights the GGUF names for each layer into views (or, under
// TP, into this rank's slices: tp_shard.cpp). The architecture decides which tensors exist
// (ModelConfig); the forward pass is elsewhere (llama_model.cpp, attention_gqa.cpp,
// moe/moe_ffn.cpp).
#include "model/llama_model.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "core/half.h"
#include "core/interrupt.h"
#include "quant/traits.h"

namespace tf {

namespace {
std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

// A tensor TensorFold cannot multiply with: the traits table's message (it lists the
// supported types), prefixed with the file and tensor.
[[noreturn]] void not_computable(const GgufFile& f, const GgufTensorInfo& t) {
  try {
    type_traits(t.type());
  } catch (const Error& e) {
    fail(ErrorKind::Unsupported, f.display_path(), ": tensor ", t.name, ": ", e.what());
  }
  fail(ErrorKind::Unsupported, f.display_path(), ": tensor ", t.name, " has type ",
       type_name(t.type_id) ? type_name(t.type_id) : "?", " which TensorFold cannot compute with");
}

// The reference dequantization of a tensor's type; throws naming the tensor when it has none.
void (*dequant_of(const GgufFile& f, const GgufTensorInfo& t))(const void*, float*, int64_t) {
  const TypeTraits* tr = find_type_traits(t.type_id);
  if (!tr || !tr->dequantize_ref)
    fail(ErrorKind::Unsupported, f.display_path(), ": tensor ", t.name, " has type ",
         tr ? tr->name : "?", " which TensorFold cannot read (no dequantization for it)");
  return tr->dequantize_ref;
}
}  // namespace

Weight LlamaModel::load_weight(const std::string& name, int64_t k, int64_t rows, bool required, bool compute) {
  const GgufTensorInfo* t = file_->find_tensor(name);
  if (!t) {
    if (required) fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " is missing");
    return Weight{};
  }
  if (t->ne.size() != 2 || t->ne[0] != k || t->ne[1] != rows)
    fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " has shape ", shape_str(t->ne),
         ", expected [", k, ", ", rows, "]");
  if (compute && !t->type_supported) not_computable(*file_, *t);
  if (!compute) dequant_of(*file_, *t);
  Weight w;
  w.type = t->type();
  if (compute) w.layout = be_.act_layout(w.type);
  w.k = k;
  w.rows = rows;
  w.data = t->data;
  w.row_stride = row_bytes(w.type, k);
  weight_bytes_ += t->nbytes;
  return w;
}

ExpertWeight LlamaModel::load_experts(const std::string& name, int64_t k, int64_t rows, int64_t n_expert) {
  const GgufTensorInfo* t = file_->find_tensor(name);
  if (!t) fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " is missing");
  if (t->ne.size() != 3 || t->ne[0] != k || t->ne[1] != rows || t->ne[2] != n_expert)
    fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " has shape ", shape_str(t->ne),
         ", expected [", k, ", ", rows, ", ", n_expert, "]");
  if (!t->type_supported) not_computable(*file_, *t);
  ExpertWeight w;
  w.first.type = t->type();
  w.first.layout = be_.act_layout(w.first.type);
  w.first.k = k;
  w.first.rows = rows;
  w.first.data = t->data;
  w.first.row_stride = row_bytes(w.first.type, k);
  w.n_expert = n_expert;
  w.expert_stride = w.first.row_stride * size_t(rows);
  weight_bytes_ += t->nbytes;
  return w;
}

const float* LlamaModel::load_vector(const std::string& name, int64_t n, bool required) {
  const GgufTensorInfo* t = file_->find_tensor(name);
  if (!t) {
    if (required) fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " is missing");
    return nullptr;
  }
  // A vector may be stored with trailing unit dimensions ([n, 1]), as ggml treats them alike.
  bool ok = !t->ne.empty() && t->ne[0] == n;
  for (size_t i = 1; i < t->ne.size(); ++i) ok = ok && t->ne[i] == 1;
  if (!ok)
    fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " has shape ", shape_str(t->ne),
         ", expected [", n, "]");
  weight_bytes_ += t->nbytes;
  const bool aligned = reinterpret_cast<uintptr_t>(t->data) % alignof(float) == 0;
  if (t->type() == GgmlType::F32 && tp_.size == 1 && aligned) return reinterpret_cast<const float*>(t->data);
  if (t->type() == GgmlType::F32) {
    // A private copy: under TP so the mapping's pages (and their neighbours) stay untouched;
    // otherwise because general.alignment 1 or 2 may leave the floats misaligned.
    owned_vectors_.emplace_back(size_t(n));
    if (tp_.size > 1)
      read_at(t->data, owned_vectors_.back().data(), size_t(n) * sizeof(float), false);
    else
      std::memcpy(owned_vectors_.back().data(), t->data, size_t(n) * sizeof(float));
    return owned_vectors_.back().data();
  }
  // Small vectors in other formats are converted once at load.
  const auto dequant = dequant_of(*file_, *t);
  owned_vectors_.emplace_back(size_t(n));
  if (tp_.size > 1) {
    std::vector<uint8_t> raw(size_t(t->nbytes));
    read_at(t->data, raw.data(), raw.size(), false);
    dequant(raw.data(), owned_vectors_.back().data(), n);
  } else {
    dequant(t->data, owned_vectors_.back().data(), n);
  }
  return owned_vectors_.back().data();
}

void LlamaModel::load_gqa(LayerWeights& L, const std::string& p) {
  const int64_t E = cfg_.n_embd, H = cfg_.n_head, HK = cfg_.n_head_kv, D = cfg_.head_dim;
  L.wq = load_weight(p + "attn_q.weight", E, H * D);
  L.wk = load_weight(p + "attn_k.weight", E, HK * D);
  L.wv = load_weight(p + "attn_v.weight", E, HK * D);
  L.wo = load_weight(p + "attn_output.weight", H * D, E);
  if (cfg_.qkv_bias) {
    L.bq = load_vector(p + "attn_q.bias", H * D);
    L.bk = load_vector(p + "attn_k.bias", HK * D);
    L.bv = load_vector(p + "attn_v.bias", HK * D);
  }
  if (cfg_.qk_norm) {
    L.q_norm = load_vector(p + "attn_q_norm.weight", D);
    L.k_norm = load_vector(p + "attn_k_norm.weight", D);
  }
}

void LlamaModel::load_mla(LayerWeights& L, const std::string& p) {
  const int64_t E = cfg_.n_embd, H = cfg_.n_head, D = cfg_.head_dim, C = cfg_.kv_lora_rank, R = cfg_.rope_dim,
                N = cfg_.qk_nope_dim, V = cfg_.v_head_dim, QL = cfg_.q_lora_rank;
  if (QL > 0) {
    L.wq_a = load_weight(p + "attn_q_a.weight", E, QL);
    L.q_a_norm = load_vector(p + "attn_q_a_norm.weight", QL);
    L.wq_b = load_weight(p + "attn_q_b.weight", QL, H * D);
  } else {
    L.wq = load_weight(p + "attn_q.weight", E, H * D);
  }
  L.wkv_a = load_weight(p + "attn_kv_a_mqa.weight", E, C + R);
  L.kv_a_norm = load_vector(p + "attn_kv_a_norm.weight", C);
  if (file_->find_tensor(p + "attn_k_b.weight")) {
    L.wk_b = load_experts(p + "attn_k_b.weight", N, C, H);
    L.wv_b = load_experts(p + "attn_v_b.weight", C, V, H);
  } else if (file_->find_tensor(p + "attn_kv_b.weight")) {
    split_kv_b(L, p + "attn_kv_b.weight");
  } else {
    fail(ErrorKind::InvalidInput, file_->display_path(), ": tensors ", p, "attn_k_b.weight/attn_v_b.weight (or ", p,
         "attn_kv_b.weight) are missing");
  }
  L.wo = load_weight(p + "attn_output.weight", H * V, E);
}

void LlamaModel::split_kv_b(LayerWeights& L, const std::string& name) {
  // attn_kv_b: per head h, rows h (N + V) .. + N map the latent to the key's nope part, the next
  // V rows to the value. W_vb is a view of the value rows; W_kb is needed the other way round
  // (rows: latent, k: nope), so it is transposed into a float copy at load.
  const int64_t H = cfg_.n_head, C = cfg_.kv_lora_rank, N = cfg_.qk_nope_dim, V = cfg_.v_head_dim;
  const Weight kvb = load_weight(name, C, H * (N + V));
  L.wv_b.first = kvb;
  L.wv_b.first.rows = V;
  L.wv_b.first.data = kvb.data + size_t(N) * kvb.row_stride;
  L.wv_b.n_expert = H;
  L.wv_b.expert_stride = size_t(N + V) * kvb.row_stride;
  const auto dequant = dequant_of(*file_, *file_->find_tensor(name));
  owned_f32_.emplace_back(size_t(H * C * N));
  float* wkb = owned_f32_.back().data();
  std::vector<float> row(static_cast<size_t>(C));
  std::vector<uint8_t> raw(kvb.row_stride);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < N; ++j) {
      const uint8_t* src = kvb.data + size_t(h * (N + V) + j) * kvb.row_stride;
      if (tp_.size > 1) {  // under TP the mapping stays untouched
        read_at(src, raw.data(), raw.size(), false);
        src = raw.data();
      }
      dequant(src, row.data(), C);
      for (int64_t c = 0; c < C; ++c) wkb[(h * C + c) * N + j] = row[size_t(c)];
    }
  Weight& k = L.wk_b.first;
  k.type = GgmlType::F32;
  k.layout = be_.act_layout(k.type);
  k.k = N;
  k.rows = C;
  k.data = reinterpret_cast<const uint8_t*>(wkb);
  k.row_stride = size_t(N) * sizeof(float);
  L.wk_b.n_expert = H;
  L.wk_b.expert_stride = size_t(C * N) * sizeof(float);
  L.wk_b_owned = true;
}

LlamaModel::LlamaModel(std::shared_ptr<GgufFile> file, const TpShard& tp) : file_(std::move(file)), tp_(tp) {
  cfg_ = ModelConfig::from_gguf(*file_);
  TF_CHECK(tp_.size == 1 || (tp_.size == 2 && (tp_.group || tp_.plan_only)),
           "tensor parallel size must be 1 or 2 (with a group)");
  TF_CHECK(tp_.rank >= 0 && tp_.rank < tp_.size, "TP rank ", tp_.rank, " is out of range");
  if (tp_.size > 1) file_->advise_random();  // the mappings serve only the header now
  const int64_t E = cfg_.n_embd, H = cfg_.n_head, HK = cfg_.n_head_kv;
  // The embedding is only read row by row (reference dequant) unless it is also the output.
  tok_embd_ = load_weight("token_embd.weight", E, cfg_.n_vocab, true, cfg_.tied_output);
  emb_dequant_ = dequant_of(*file_, *file_->find_tensor("token_embd.weight"));
  output_norm_ = load_vector("output_norm.weight", E);
  output_ = cfg_.tied_output ? tok_embd_ : load_weight("output.weight", E, cfg_.n_vocab);
  layers_.resize(size_t(cfg_.n_layer));
  for (int il = 0; il < cfg_.n_layer; ++il) {
    check_interrupt();
    const std::string p = "blk." + std::to_string(il) + ".";
    LayerWeights& L = layers_[size_t(il)];
    L.attn_norm = load_vector(p + "attn_norm.weight", E);
    switch (cfg_.attention) {
      case AttentionKind::Gqa: load_gqa(L, p); break;
      case AttentionKind::Mla: load_mla(L, p); break;
    }
    L.ffn_norm = load_vector(p + "ffn_norm.weight", E);
    const bool routed = cfg_.is_moe() && file_->find_tensor(p + "ffn_gate_inp.weight") != nullptr;
    L.ffn = routed ? FfnKind::Moe : FfnKind::Dense;
    if (routed) {
      const int64_t NE = cfg_.n_expert, FE = cfg_.n_ff_exp;
      L.router = load_weight(p + "ffn_gate_inp.weight", E, NE);
      L.selection_bias = load_vector(p + "exp_probs_b.bias", NE, false);
      L.gate_exps = load_experts(p + "ffn_gate_exps.weight", E, FE, NE);
      L.up_exps = load_experts(p + "ffn_up_exps.weight", E, FE, NE);
      L.down_exps = load_experts(p + "ffn_down_exps.weight", FE, E, NE);
      if (const GgufTensorInfo* sh = file_->find_tensor(p + "ffn_gate_shexp.weight")) {
        const int64_t FS = sh->ne.size() == 2 ? sh->ne[1] : 0;
        L.gate_shexp = load_weight(p + "ffn_gate_shexp.weight", E, FS);
        L.up_shexp = load_weight(p + "ffn_up_shexp.weight", E, FS);
        L.down_shexp = load_weight(p + "ffn_down_shexp.weight", FS, E);
        L.shexp_gate = load_vector(p + "ffn_gate_inp_shexp.weight", E, false);
        shexp_width_ = std::max<int64_t>(shexp_width_, FS);
      }
    } else {
      if (cfg_.n_ff <= 0)
        fail(ErrorKind::InvalidInput, file_->display_path(), ": layer ", il, " has no router and no dense FFN size");
      L.w_gate = load_weight(p + "ffn_gate.weight", E, cfg_.n_ff);
      L.w_up = load_weight(p + "ffn_up.weight", E, cfg_.n_ff);
      L.w_down = load_weight(p + "ffn_down.weight", cfg_.n_ff, E);
    }
  }
  local_heads_ = H;
  local_kv_heads_ = HK;
  local_ff_ = cfg_.n_ff;
  local_ff_exp_ = cfg_.n_ff_exp;
  vocab_begin_ = 0;
  vocab_end_ = cfg_.n_vocab;
  plan_splits();
  if (tp_.size > 1) {
    shard_weights();
  } else if (!tp_.tp_compatible) {
    // Plain TP=1: one pass over each reduction (the splits are only needed to match TP=2).
    kv_split_ = f_split_ = fe_split_ = -1;
    std::fill(fs_split_.begin(), fs_split_.end(), -1);
    expert_parallel_ = false;
  }
}

}  // namespace tf
