#include "model/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include <fcntl.h>
#include <unistd.h>

#include "backend/cpu/attention.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/vec_ops.h"
#include "core/error.h"
#include "core/half.h"
#include "core/interrupt.h"
#include "quant/traits.h"

namespace tf {

namespace {
constexpr int64_t kMaxLogitRows = 64;  // the engine never asks for more rows per forward

std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}
}  // namespace

namespace {
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
  if (compute) w.layout = cpu::act_layout(w.type);
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
  w.first.layout = cpu::act_layout(w.first.type);
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

LlamaModel::LlamaModel(std::shared_ptr<GgufFile> file, const TpShard& tp) : file_(std::move(file)), tp_(tp) {
  cfg_ = ModelConfig::from_gguf(*file_);
  TF_CHECK(tp_.size == 1 || (tp_.size == 2 && tp_.group), "tensor parallel size must be 1 or 2 (with a group)");
  TF_CHECK(tp_.rank >= 0 && tp_.rank < tp_.size, "TP rank ", tp_.rank, " is out of range");
  if (tp_.size > 1) file_->advise_random();  // the mappings serve only the header now
  const int64_t E = cfg_.n_embd, H = cfg_.n_head, HK = cfg_.n_head_kv, D = cfg_.head_dim;
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
    L.ffn_norm = load_vector(p + "ffn_norm.weight", E);
    L.moe = cfg_.is_moe() && file_->find_tensor(p + "ffn_gate_inp.weight") != nullptr;
    if (L.moe) {
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
  hl_ = H;
  hkl_ = HK;
  fl_ = cfg_.n_ff;
  fel_ = cfg_.n_ff_exp;
  v0_ = 0;
  v1_ = cfg_.n_vocab;
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

namespace {
int64_t block_of(const Weight& w) { return w.rows > 0 ? find_type_traits(uint32_t(w.type))->block_size : 1; }

}  // namespace

LlamaModel::~LlamaModel() = default;

void LlamaModel::read_at(const uint8_t* src, void* dst, size_t n, bool drop_cache) const {
  // Read from the file rather than the mapping, so the mapping's pages stay untouched; the
  // part (of a split model) that holds the bytes is found from their address.
  const auto [part, start] = file_->locate(src, n);
  uint64_t offset = start;
  const size_t total = n;
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    check_interrupt();  // TP loads read gigabytes: Ctrl-C must not wait for all of them
    const ssize_t r = ::pread(part->fd, p, std::min(n, size_t(64) << 20), off_t(offset));
    if (r <= 0) fail(ErrorKind::Runtime, part->shown, ": read failed while loading a TP slice");
    p += r;
    offset += uint64_t(r);
    n -= size_t(r);
  }
  // The private copy is what stays resident; don't also keep the file's pages cached.
  if (drop_cache) ::posix_fadvise(part->fd, off_t(start), off_t(total), POSIX_FADV_DONTNEED);
}

Weight LlamaModel::slice_rows(const Weight& w, int64_t r0, int64_t r1) {
  Weight s = w;
  s.rows = r1 - r0;
  const size_t n = w.row_stride * size_t(s.rows);
  owned_weights_.emplace_back(new uint8_t[n]);
  read_at(w.data + size_t(r0) * w.row_stride, owned_weights_.back().get(), n);
  s.data = owned_weights_.back().get();
  return s;
}

ExpertWeight LlamaModel::slice_rows(const ExpertWeight& w, int64_t r0, int64_t r1) {
  ExpertWeight s = w;
  s.first.rows = r1 - r0;
  const size_t per = w.first.row_stride * size_t(s.first.rows);
  s.expert_stride = per;
  owned_weights_.emplace_back(new uint8_t[per * size_t(w.n_expert)]);
  uint8_t* dst = owned_weights_.back().get();
  for (int64_t e = 0; e < w.n_expert; ++e)
    read_at(w.first.data + size_t(e) * w.expert_stride + size_t(r0) * w.first.row_stride, dst + size_t(e) * per, per);
  s.first.data = dst;
  return s;
}

ExpertWeight LlamaModel::slice_experts(const ExpertWeight& w, int64_t e0, int64_t e1) {
  ExpertWeight s = w;
  s.n_expert = e1 - e0;
  const size_t n = w.expert_stride * size_t(s.n_expert);
  owned_weights_.emplace_back(new uint8_t[n]);
  read_at(w.first.data + size_t(e0) * w.expert_stride, owned_weights_.back().get(), n);
  s.first.data = owned_weights_.back().get();
  return s;  // expert e of the model is local expert e - e0
}

Weight LlamaModel::slice_cols(const Weight& w, int64_t c0, int64_t c1) {
  Weight s = w;
  s.k = c1 - c0;
  s.row_stride = row_bytes(w.type, s.k);
  const size_t skip = row_bytes(w.type, c0);
  owned_weights_.emplace_back(new uint8_t[s.row_stride * size_t(w.rows)]);
  uint8_t* dst = owned_weights_.back().get();
  for (int64_t r = 0; r < w.rows; ++r)
    read_at(w.data + size_t(r) * w.row_stride + skip, dst + size_t(r) * s.row_stride, s.row_stride);
  s.data = dst;
  return s;
}

ExpertWeight LlamaModel::slice_cols(const ExpertWeight& w, int64_t c0, int64_t c1) {
  ExpertWeight s = w;
  s.first.k = c1 - c0;
  s.first.row_stride = row_bytes(w.first.type, s.first.k);
  s.expert_stride = s.first.row_stride * size_t(w.first.rows);
  const size_t skip = row_bytes(w.first.type, c0);
  owned_weights_.emplace_back(new uint8_t[s.expert_stride * size_t(w.n_expert)]);
  uint8_t* dst = owned_weights_.back().get();
  for (int64_t e = 0; e < w.n_expert; ++e)
    for (int64_t r = 0; r < w.first.rows; ++r)
      read_at(w.first.data + size_t(e) * w.expert_stride + size_t(r) * w.first.row_stride + skip,
              dst + size_t(e) * s.expert_stride + size_t(r) * s.first.row_stride, s.first.row_stride);
  s.first.data = dst;
  return s;
}

void LlamaModel::plan_splits() {
  // The boundaries at which TP=2 splits every reduction dimension. TP=1 splits its sums at
  // the same boundaries (partial + partial, as the All-Reduce does), so any TP degree gives
  // bit-identical results. -1: no block-aligned split exists (TP=2 is then refused).
  // A split point must be a block boundary of every weight it cuts, whatever their types
  // (32 and 256 mixed, layer by layer): a multiple of all their block sizes.
  const int64_t H = cfg_.n_head, HK = cfg_.n_head_kv, D = cfg_.head_dim, g = H / HK;
  int64_t align = 1;
  for (const auto& L : layers_) align = std::lcm(align, block_of(L.wo));
  kv_split_ = -1;
  for (int64_t c = 1; c < HK; ++c)
    if ((c * g * D) % align == 0 && (kv_split_ < 0 || std::llabs(2 * c - HK) < std::llabs(2 * kv_split_ - HK)))
      kv_split_ = c;
  auto point = [](int64_t n, int64_t al) {
    int64_t best = -1;
    for (int64_t c = al; c < n; c += al)
      if (best < 0 || std::llabs(2 * c - n) < std::llabs(2 * best - n)) best = c;
    return best;
  };
  int64_t al_ff = 1, al_exp = 1;
  for (const auto& L : layers_) {
    al_ff = std::lcm(al_ff, block_of(L.w_down));
    al_exp = std::lcm(al_exp, block_of(L.down_exps.first));
  }
  f_split_ = cfg_.n_ff > 0 ? point(cfg_.n_ff, al_ff) : -1;
  fe_split_ = cfg_.is_moe() ? point(cfg_.n_ff_exp, al_exp) : -1;
  // Experts are split by width when the width halves evenly on block boundaries (every rank
  // works on every token); otherwise by expert index (expert-parallel: whole experts per
  // rank). TENSORFOLD_TP_EXPERTS=width|experts forces one (for measuring both).
  expert_parallel_ = false;
  if (cfg_.is_moe() && cfg_.n_expert >= 2) {
    const char* force = std::getenv("TENSORFOLD_TP_EXPERTS");
    const bool even = fe_split_ > 0 && 2 * fe_split_ == cfg_.n_ff_exp;
    expert_parallel_ = force ? std::string(force) == "experts" : !even;
    if (force && std::string(force) == "width" && fe_split_ < 0) expert_parallel_ = true;
  }
  if (expert_parallel_) fe_split_ = -1;
  expert_group_ = cfg_.n_expert / 2;
  fs_split_.assign(layers_.size(), -1);
  for (size_t i = 0; i < layers_.size(); ++i)
    if (layers_[i].gate_shexp.rows > 0) fs_split_[i] = point(layers_[i].gate_shexp.rows, block_of(layers_[i].down_shexp));
}

void LlamaModel::shard_weights() {
  const std::string& path = file_->display_path();
  const int64_t HK = cfg_.n_head_kv, D = cfg_.head_dim, g = cfg_.n_head / HK;
  const int r = tp_.rank;
  auto need = [&](int64_t c, const char* what) {
    if (c < 0)
      fail(ErrorKind::Unsupported, path, ": cannot split ", what,
           " across 2 ranks on the weight format's block boundaries; use TP=1 for this model");
    return c;
  };
  const int64_t kv0 = need(kv_split_, "the KV heads");
  const int64_t k0 = r == 0 ? 0 : kv0, k1 = r == 0 ? kv0 : HK;
  hkl_ = k1 - k0;
  hl_ = hkl_ * g;
  const int64_t q0 = k0 * g;
  auto range = [&](int64_t n, int64_t c, int64_t& a, int64_t& b) {
    a = r == 0 ? 0 : c;
    b = r == 0 ? c : n;
  };
  int64_t f0 = 0, f1 = 0, e0 = 0, e1 = 0;
  if (std::any_of(layers_.begin(), layers_.end(), [](const LayerWeights& L) { return !L.moe; }))
    range(cfg_.n_ff, need(f_split_, "the FFN width"), f0, f1);
  if (cfg_.is_moe() && !expert_parallel_) range(cfg_.n_ff_exp, need(fe_split_, "the expert FFN width"), e0, e1);
  if (expert_parallel_) {
    e0 = 0;
    e1 = cfg_.n_ff_exp;
    exp_lo_ = r == 0 ? 0 : expert_group_;
    exp_hi_ = r == 0 ? expert_group_ : cfg_.n_expert;
  }
  fl_ = f1 - f0;
  fel_ = e1 - e0;
  const int64_t vsplit = cfg_.n_vocab / 2;
  v0_ = r == 0 ? 0 : vsplit;
  v1_ = r == 0 ? vsplit : cfg_.n_vocab;
  weight_bytes_ = 0;  // recounted: what this rank holds
  auto count = [&](const Weight& w) { weight_bytes_ += w.row_stride * uint64_t(w.rows); };
  output_ = slice_rows(output_, v0_, v1_);
  count(output_);
  for (size_t il = 0; il < layers_.size(); ++il) {
    LayerWeights& L = layers_[il];
    L.wq = slice_rows(L.wq, q0 * D, (q0 + hl_) * D);
    L.wk = slice_rows(L.wk, k0 * D, k1 * D);
    L.wv = slice_rows(L.wv, k0 * D, k1 * D);
    if (L.bq) {
      L.bq += q0 * D;
      L.bk += k0 * D;
      L.bv += k0 * D;
    }
    L.wo = slice_cols(L.wo, q0 * D, (q0 + hl_) * D);
    count(L.wq); count(L.wk); count(L.wv); count(L.wo);
    if (L.moe) {
      if (expert_parallel_) {
        L.gate_exps = slice_experts(L.gate_exps, exp_lo_, exp_hi_);
        L.up_exps = slice_experts(L.up_exps, exp_lo_, exp_hi_);
        L.down_exps = slice_experts(L.down_exps, exp_lo_, exp_hi_);
      } else {
        L.gate_exps = slice_rows(L.gate_exps, e0, e1);
        L.up_exps = slice_rows(L.up_exps, e0, e1);
        L.down_exps = slice_cols(L.down_exps, e0, e1);
      }
      weight_bytes_ += (L.gate_exps.expert_stride + L.up_exps.expert_stride + L.down_exps.expert_stride) *
                       uint64_t(L.gate_exps.n_expert);
      count(L.router);
      if (L.gate_shexp.rows > 0) {
        int64_t s0, s1;
        range(L.gate_shexp.rows, need(fs_split_[il], "the shared expert width"), s0, s1);
        L.gate_shexp = slice_rows(L.gate_shexp, s0, s1);
        L.up_shexp = slice_rows(L.up_shexp, s0, s1);
        L.down_shexp = slice_cols(L.down_shexp, s0, s1);
        count(L.gate_shexp); count(L.up_shexp); count(L.down_shexp);
      }
    } else {
      L.w_gate = slice_rows(L.w_gate, f0, f1);
      L.w_up = slice_rows(L.w_up, f0, f1);
      L.w_down = slice_cols(L.w_down, f0, f1);
      count(L.w_gate); count(L.w_up); count(L.w_down);
    }
  }
  // Under TP each rank holds one part of every split sum: no further splitting.
  kv_split_ = f_split_ = fe_split_ = -1;
  std::fill(fs_split_.begin(), fs_split_.end(), -1);
  emb_row_.assign(tok_embd_.row_stride, 0);
}

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
  const double QD = double(hl_) * D, KD = double(hkl_) * D;
  const double FW = std::max(double(fl_), double(shexp_width_));
  double act = 0;  // widest quantized activation row, about one byte per value plus scales
  unsigned layouts = 1u << unsigned(output_.layout);
  auto use = [&](const Weight& w) {
    if (w.rows > 0) layouts |= 1u << unsigned(w.layout);
  };
  for (const auto& L : layers_) {
    act = std::max({act, double(L.wq.k), double(L.wo.k), double(L.w_down.k), double(L.down_exps.first.k)});
    for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down, &L.router,
                            &L.gate_exps.first, &L.up_exps.first, &L.down_exps.first, &L.gate_shexp,
                            &L.up_shexp, &L.down_shexp})
      use(*w);
  }
  act *= double(__builtin_popcount(layouts));  // one buffer per layout in use
  double floats = T * (6 * E + 2 * QD + 2 * KD + 2 * FW + double(cfg_.rope_dim));
  double bytes = 4 * floats + T * (1.25 * act + 64);
  if (cfg_.is_moe()) {
    const double K = double(cfg_.n_expert_used), FE = double(fel_);
    bytes += 4 * T * K * (2 * FE + 2 * E + 4) + T * K * (1.25 * act + 64) + 4 * T * double(cfg_.n_expert);
  }
  return bytes;
}

void LlamaModel::reserve(int max_tokens, int64_t max_ctx, int n_threads) {
  TF_CHECK(max_tokens > 0 && max_ctx > 0 && n_threads > 0, "invalid scratch sizes");
  max_tokens_ = max_tokens;
  max_ctx_ = max_ctx;
  n_threads_ = n_threads;
  const size_t T = size_t(max_tokens);
  const size_t E = size_t(cfg_.n_embd), QD = size_t(hl_) * size_t(cfg_.head_dim),
               KD = size_t(hkl_) * size_t(cfg_.head_dim), F = size_t(fl_);
  ffn_out_.assign(T * E, 0.f);
  ffn_out2_.assign(T * E, 0.f);
  part_.assign(T * E, 0.f);
  if (tp_.size > 1) logits_local_.assign(size_t(kMaxLogitRows) * size_t(cfg_.n_vocab - v0_), 0.f);
  x_.assign(T * E, 0.f);
  xn_.assign(T * E, 0.f);
  q_.assign(T * QD, 0.f);
  k_.assign(T * KD, 0.f);
  v_.assign(T * KD, 0.f);
  attn_.assign(T * QD, 0.f);
  const size_t FW = std::max(F, size_t(shexp_width_));  // dense or shared-expert FFN width
  gate_.assign(T * FW, 0.f);
  up_.assign(T * FW, 0.f);
  rope_cs_.assign(T * size_t(cfg_.rope_dim), 0.f);
  // One activation buffer per layout, rows as wide as the widest input of that layout; the
  // gathered expert buffers only for the layouts the experts use.
  size_t stride[kLayouts] = {};
  bool exp_layout[kLayouts] = {};
  auto consider = [&](const Weight& w, bool expert = false) {
    if (w.rows <= 0) return;
    const size_t l = size_t(w.layout);
    stride[l] = std::max(stride[l], cpu::act_row_bytes(w.type, w.k));
    if (expert) exp_layout[l] = true;
  };
  consider(output_);
  for (const auto& L : layers_) {
    for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down, &L.router,
                            &L.gate_shexp, &L.up_shexp, &L.down_shexp})
      consider(*w);
    for (const Weight* w : {&L.gate_exps.first, &L.up_exps.first, &L.down_exps.first}) consider(*w, true);
  }
  for (size_t l = 0; l < kLayouts; ++l) {
    act_[l].stride = exp_act_[l].stride = (stride[l] + 63) & ~size_t(63);
    act_[l].data.assign(T * act_[l].stride, 0);
    exp_act_[l].data.clear();
  }
  jobs_.clear();
  jobs_.reserve(size_t(2 * std::max(cfg_.n_expert, 2) + 4));
  job_chunk_begin_.reserve(jobs_.capacity());
  reset_expert_usage();
  if (cfg_.is_moe()) {
    const size_t NE = size_t(cfg_.n_expert), K = size_t(cfg_.n_expert_used), FE = size_t(fel_);
    router_logits_.assign(T * NE, 0.f);
    route_w_.assign(T * K, 0.f);
    route_ids_.assign(T * K, 0);
    route_scratch_.assign(3 * NE, 0.f);
    exp_count_.assign(NE, 0);
    exp_offset_.assign(NE + 1, 0);
    exp_rows_.assign(T * K, 0);
    slot_of_.assign(T * K, 0);
    exp_gate_.assign(T * K * FE, 0.f);
    exp_up_.assign(T * K * FE, 0.f);
    exp_out_.assign(T * K * E, 0.f);
    exp_out2_.assign(fe_split_ > 0 ? T * K * E : 0, 0.f);
    for (size_t l = 0; l < kLayouts; ++l)
      if (exp_layout[l]) exp_act_[l].data.assign(T * K * exp_act_[l].stride, 0);
  }
}

unsigned LlamaModel::quantize_acts(std::initializer_list<const Weight*> ws, const float* x, int64_t T,
                                   int64_t k, int64_t ldx, ActBuf* bufs, ThreadPool& pool) {
  // A weight type of each layout needed stands for all weights of that layout.
  GgmlType rep[kLayouts] = {};
  unsigned mask = 0;
  for (const Weight* w : ws) {
    const unsigned l = unsigned(w->layout);
    if (!(mask & (1u << l))) rep[l] = w->type;
    mask |= 1u << l;
  }
  quantize_layouts(mask, rep, x, T, k, ldx, bufs, pool);
  return mask;
}

void LlamaModel::quantize_layouts(unsigned mask, const GgmlType* rep, const float* x, int64_t T, int64_t k,
                                  int64_t ldx, ActBuf* bufs, ThreadPool& pool) {
  // One parallel section for all layouts: each thread quantizes its rows into each of them.
  pool.parallel_for(T, 8, [&](int64_t b, int64_t e) {
    for (size_t l = 0; l < kLayouts; ++l) {
      if (!(mask & (1u << l))) continue;
      uint8_t* dst = bufs[l].data.data();
      const size_t stride = bufs[l].stride;
      for (int64_t c = b; c < e; ++c) cpu::quantize_act_row(rep[l], x + c * ldx, dst + size_t(c) * stride, k);
    }
  });
}

void LlamaModel::project(std::initializer_list<Proj> ps, const float* x, int64_t T, int64_t ldx,
                         ThreadPool& pool) {
  GgmlType rep[kLayouts] = {};
  unsigned mask = 0;
  for (const Proj& p : ps) {
    const unsigned l = unsigned(p.w->layout);
    if (!(mask & (1u << l))) rep[l] = p.w->type;
    mask |= 1u << l;
  }
  quantize_layouts(mask, rep, x, T, ps.begin()->w->k, ldx, act_, pool);  // the group shares its input
  jobs_.clear();
  for (const Proj& p : ps) {
    const ActBuf& a = act_[size_t(p.w->layout)];
    jobs_.push_back({*p.w, a.data.data(), a.stride, T, p.y, p.w->rows});
  }
  run_jobs(jobs_, pool);
}

Weight LlamaModel::kview(const Weight& w, int64_t c0, int64_t c1) {
  Weight v = w;
  v.data = w.data + row_bytes(w.type, c0);
  v.k = c1 - c0;
  return v;  // row_stride unchanged: a column range of every row
}

void LlamaModel::ksplit_matmul(const Weight& w, const float* x, int64_t T, int64_t ldx, int64_t split,
                               float* y, float* scratch, ThreadPool& pool) {
  if (split <= 0) {
    project({{&w, y}}, x, T, ldx, pool);
    return;
  }
  const Weight a = kview(w, 0, split), b = kview(w, split, w.k);
  project({{&a, y}}, x, T, ldx, pool);
  project({{&b, scratch}}, x + split, T, ldx, pool);
  for (int64_t i = 0; i < T * w.rows; ++i) y[i] += scratch[i];  // partial + partial, as TP sums
}

void LlamaModel::run_jobs(const std::vector<MatmulJob>& jobs, ThreadPool& pool) {
  // Every job's rows are cut into chunks of whole 16-row tiles, about kChunksPerThread chunks
  // per thread over all jobs together; threads claim chunks as they come free, so a slow or
  // descheduled thread holds back one chunk, not a fixed share.
  int64_t total = 0;
  for (const MatmulJob& j : jobs) total += j.w.rows;
  if (total == 0) return;
  const int64_t target = int64_t(pool.size()) * ThreadPool::kChunksPerThread;
  const int64_t per = pool.size() == 1 ? total : std::max<int64_t>(16, ((total + target - 1) / target + 15) & ~int64_t(15));
  job_chunk_begin_.clear();
  int64_t n_chunks = 0;
  for (const MatmulJob& j : jobs) {
    job_chunk_begin_.push_back(n_chunks);
    n_chunks += (j.w.rows + per - 1) / per;
  }
  pool.run_chunks(n_chunks, [&](int64_t c, int) {
    const size_t ji = size_t(std::upper_bound(job_chunk_begin_.begin(), job_chunk_begin_.end(), c) -
                             job_chunk_begin_.begin()) - 1;
    const MatmulJob& j = jobs[ji];
    const int64_t r0 = (c - job_chunk_begin_[ji]) * per, r1 = std::min(j.w.rows, r0 + per);
    cpu::matmul_rows(j.w.type, j.w.k, j.w.data, j.w.row_stride, r0, r1, j.xq, j.xq_stride, j.ncols, j.y, j.ldy);
  });
}

void LlamaModel::moe_ffn(int layer, int64_t T, ThreadPool& pool) {
  const LayerWeights& L = layers_[size_t(layer)];
  const int64_t E = cfg_.n_embd, NE = cfg_.n_expert, K = cfg_.n_expert_used, FE = fel_;
  // 1. Router logits and routing.
  project({{&L.router, router_logits_.data()}}, xn_.data(), T, E, pool);
  moe::RouterConfig rc = cfg_.router;
  rc.selection_bias = L.selection_bias;
  moe::route(rc, router_logits_.data(), T, route_ids_.data(), route_w_.data(), route_scratch_.data());
  if (tracing_)
    trace_[size_t(layer)].insert(trace_[size_t(layer)].end(), route_ids_.begin(), route_ids_.begin() + T * K);
  // 2. Counting sort of the (token, slot) pairs by expert.
  std::fill(exp_count_.begin(), exp_count_.end(), 0);
  for (int64_t i = 0; i < T * K; ++i) ++exp_count_[size_t(route_ids_[size_t(i)])];
  exp_offset_[0] = 0;
  for (int64_t e = 0; e < NE; ++e) exp_offset_[size_t(e + 1)] = exp_offset_[size_t(e)] + exp_count_[size_t(e)];
  auto& usage = expert_usage_[size_t(layer)];
  for (int64_t e = 0; e < NE; ++e) {
    usage[size_t(e)] += exp_count_[size_t(e)];
    exp_count_[size_t(e)] = 0;  // reused as the fill cursor below
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = route_ids_[size_t(t * K + k)];
      const int32_t row = exp_offset_[size_t(e)] + exp_count_[size_t(e)]++;
      exp_rows_[size_t(row)] = int32_t(t);
      slot_of_[size_t(t * K + k)] = row;
    }
  // 3. Gate/up: each expert's tokens gathered (already quantized) into consecutive rows, for
  // each layout the two need (gate and up may be of different types).
  const unsigned mask = quantize_acts({&L.gate_exps.first, &L.up_exps.first}, xn_.data(), T, E, E, act_, pool);
  const int64_t R = T * K;
  for (size_t l = 0; l < kLayouts; ++l) {
    if (!(mask & (1u << l))) continue;
    const size_t S = act_[l].stride;
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(exp_act_[l].data.data() + size_t(r) * S, act_[l].data.data() + size_t(exp_rows_[size_t(r)]) * S, S);
  }
  const ActBuf& ag = exp_act_[size_t(L.gate_exps.first.layout)];
  const ActBuf& au = exp_act_[size_t(L.up_exps.first.layout)];
  const ActBuf& ad = exp_act_[size_t(L.down_exps.first.layout)];
  // Experts this rank computes: all of them, or its half under expert-parallel TP.
  const int64_t lo = exp_lo_, hi = exp_hi_ > 0 ? exp_hi_ : NE;
  jobs_.clear();
  for (int64_t e = lo; e < hi; ++e) {
    const int64_t off = exp_offset_[size_t(e)], c = exp_offset_[size_t(e + 1)] - off;
    if (c == 0) continue;
    jobs_.push_back({L.gate_exps.expert(e - lo), ag.data.data() + size_t(off) * ag.stride, ag.stride, c,
                     exp_gate_.data() + off * FE, FE});
    jobs_.push_back({L.up_exps.expert(e - lo), au.data.data() + size_t(off) * au.stride, au.stride, c,
                     exp_up_.data() + off * FE, FE});
  }
  run_jobs(jobs_, pool);
  const cpu::VecOps& ops = cpu::vec_ops();
  pool.parallel_for(R, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) ops.silu_mul(FE, exp_gate_.data() + r * FE, exp_up_.data() + r * FE, exp_gate_.data() + r * FE);
  });
  // 4. Down projections and the weighted combine (slot order: fixed), per split part: the
  // partial sums TP ranks hold, added as the All-Reduce adds them.
  const bool ep = expert_parallel_;
  const bool two = fe_split_ > 0 || (ep && tp_.size == 1);
  if (ep) {
    quantize_acts({&L.down_exps.first}, exp_gate_.data(), R, FE, FE, exp_act_, pool);
    jobs_.clear();
    for (int64_t e = lo; e < hi; ++e) {
      const int64_t off = exp_offset_[size_t(e)], c = exp_offset_[size_t(e + 1)] - off;
      if (c == 0) continue;
      jobs_.push_back({L.down_exps.expert(e - lo), ad.data.data() + size_t(off) * ad.stride, ad.stride, c,
                       exp_out_.data() + off * E, E});
    }
    run_jobs(jobs_, pool);
    std::fill(ffn_out_.begin(), ffn_out_.begin() + T * E, 0.f);
    if (two) std::fill(ffn_out2_.begin(), ffn_out2_.begin() + T * E, 0.f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = route_ids_[size_t(t * K + k)];
        if (e < lo || e >= hi) continue;  // another rank's expert
        float* xt = (two && e >= expert_group_ ? ffn_out2_.data() : ffn_out_.data()) + t * E;
        const float w = route_w_[size_t(t * K + k)];
        const float* o = exp_out_.data() + int64_t(slot_of_[size_t(t * K + k)]) * E;
        for (int64_t i = 0; i < E; ++i) xt[i] += w * o[i];
      }
  }
  for (int part = 0; part < (ep ? 0 : (two ? 2 : 1)); ++part) {
    const int64_t c0 = part == 0 ? 0 : fe_split_, c1 = two && part == 0 ? fe_split_ : FE;
    float* eo = part == 0 ? exp_out_.data() : exp_out2_.data();
    quantize_acts({&L.down_exps.first}, exp_gate_.data() + c0, R, c1 - c0, FE, exp_act_, pool);
    jobs_.clear();
    for (int64_t e = 0; e < NE; ++e) {
      const int64_t off = exp_offset_[size_t(e)], c = exp_offset_[size_t(e + 1)] - off;
      if (c == 0) continue;
      jobs_.push_back({kview(L.down_exps.expert(e), c0, c1), ad.data.data() + size_t(off) * ad.stride, ad.stride, c,
                       eo + off * E, E});
    }
    run_jobs(jobs_, pool);
    float* out = part == 0 ? ffn_out_.data() : ffn_out2_.data();
    for (int64_t t = 0; t < T; ++t) {
      float* xt = out + t * E;
      std::fill(xt, xt + E, 0.f);
      for (int64_t k = 0; k < K; ++k) {
        const float w = route_w_[size_t(t * K + k)];
        const float* o = eo + int64_t(slot_of_[size_t(t * K + k)]) * E;
        for (int64_t i = 0; i < E; ++i) xt[i] += w * o[i];
      }
    }
  }
  // 5. Shared expert (always on), optionally scaled by a sigmoid gate; its down projection
  // split like the experts' when emulating TP=2's sums.
  if (L.gate_shexp.rows > 0) {
    const int64_t FS = L.gate_shexp.rows;
    project({{&L.gate_shexp, gate_.data()}, {&L.up_shexp, up_.data()}}, xn_.data(), T, E, pool);
    for (int64_t t = 0; t < T; ++t) ops.silu_mul(FS, gate_.data() + t * FS, up_.data() + t * FS, gate_.data() + t * FS);
    const int64_t split = fs_split_[size_t(layer)];
    for (int part = 0; part < (two ? 2 : 1); ++part) {
      const int64_t c0 = part == 0 || split <= 0 ? 0 : split;
      const int64_t c1 = two && part == 0 && split > 0 ? split : FS;
      float* sh = part_.data();
      if (two && split <= 0 && part == 1) break;  // unsplittable shared expert: all in part 0
      const Weight dw = kview(L.down_shexp, c0, c1);
      project({{&dw, sh}}, gate_.data() + c0, T, FS, pool);
      float* out = part == 0 ? ffn_out_.data() : ffn_out2_.data();
      for (int64_t t = 0; t < T; ++t) {
        float g = 1.f;
        if (L.shexp_gate) {
          float z = 0.f;
          for (int64_t i = 0; i < E; ++i) z += xn_[size_t(t * E + i)] * L.shexp_gate[i];
          g = 1.f / (1.f + std::exp(-z));
        }
        float* xt = out + t * E;
        for (int64_t i = 0; i < E; ++i) xt[i] += g * sh[t * E + i];
      }
    }
  }
  if (two)
    for (int64_t i = 0; i < T * E; ++i) ffn_out_[size_t(i)] += ffn_out2_[size_t(i)];
}

void LlamaModel::rmsnorm(const float* x, const float* w, float* y, int64_t T, int64_t n) const {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * n;
    float* yr = y + t * n;
    double sum = 0.0;  // double accumulation, like ggml
    for (int64_t i = 0; i < n; ++i) sum += double(xr[i] * xr[i]);
    const float scale = 1.0f / std::sqrt(float(sum / double(n)) + cfg_.rms_eps);
    for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] * scale) * w[i];
  }
}

namespace {
// Rotate one head in place. cs holds (cos, sin) pairs for each rotated dimension pair.
inline void rope_head(float* v, const float* cs, int rope_dim, bool neox) {
  const int half = rope_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float x0 = v[a], x1 = v[b];
    v[a] = x0 * c - x1 * s;
    v[b] = x0 * s + x1 * c;
  }
}

inline void head_rmsnorm(float* v, const float* w, int n, float eps) {
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += double(v[i] * v[i]);
  const float scale = 1.0f / std::sqrt(float(sum / double(n)) + eps);
  for (int i = 0; i < n; ++i) v[i] = (v[i] * scale) * w[i];
}
}  // namespace

void LlamaModel::attention(const std::vector<BatchToken>& batch, int layer, PagedKvCache& kv,
                           ThreadPool& pool) {
  const int H = int(hl_), D = cfg_.head_dim, group = cfg_.n_head / cfg_.n_head_kv, HK = H / group;
  const int64_t T = int64_t(batch.size());
  const float scale = 1.0f / std::sqrt(float(D));
  // Tokens go in blocks: a run of consecutive positions of one sequence (a prefill chunk),
  // up to kAttentionBlockRows query rows, is attended at once (its K/V tiles converted once);
  // a lone token (decode) takes the single-query kernel. One item per (block, KV head): the
  // `group` query heads that share the KV head read its pages together. Items go in
  // contiguous runs, many more runs than threads: causal prefill's triangular cost evens out
  // because threads claim runs as they come free.
  const int max_block = std::max(1, cpu::kAttentionBlockRows / group);
  std::vector<std::pair<int64_t, int>> blocks;  // (first token, tokens)
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
  const int64_t items = int64_t(blocks.size()) * HK;
  const int64_t runs = std::min<int64_t>(items, int64_t(pool.size()) * 16);
  pool.run_chunks(runs, [&](int64_t r, int) {
    for (int64_t it = r * items / runs; it < (r + 1) * items / runs; ++it) {
      const auto [t, nt] = blocks[size_t(it / HK)];
      const int g = int(it % HK);
      const BatchToken& bt = batch[size_t(t)];
      const cpu::PagedKv pages{kv.k_block(layer, 0, g), kv.v_block(layer, 0, g), kv.page_stride(),
                               kv.block_table(bt.seq).data(), kv.block_size(), kv.type() == KvType::F32};
      const int64_t at = (t * H + int64_t(g) * group) * D;
      if (nt == 1)
        cpu::paged_attention(q_.data() + at, group, D, pages, int64_t(bt.pos) + 1, scale, attn_.data() + at);
      else
        cpu::paged_attention_causal(q_.data() + at, int64_t(H) * D, nt, group, D, pages, bt.pos, scale,
                                    attn_.data() + at);
    }
  });
}

void LlamaModel::forward(const std::vector<BatchToken>& batch, PagedKvCache& kv, ThreadPool& pool,
                         float* logits) {
  const int64_t T = int64_t(batch.size());
  TF_CHECK(T > 0 && T <= max_tokens_, "batch of ", T, " tokens exceeds the reserved ", max_tokens_);
  const int64_t E = cfg_.n_embd, H = hl_, HK = hkl_, D = cfg_.head_dim;
  const int64_t QD = H * D, KD = HK * D, F = fl_;
  const int rd = cfg_.rope_dim;
  const cpu::VecOps& ops = cpu::vec_ops();

  // Embedding rows and the rotary table for each token (shared by all layers).
  const float theta_scale = std::pow(cfg_.rope_base, -2.0f / float(rd));
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
    float theta = float(bt.pos);
    float* cs = rope_cs_.data() + t * rd;
    for (int i = 0; i < rd / 2; ++i) {
      const float th = theta * cfg_.rope_freq_scale;
      cs[2 * i] = std::cos(th);
      cs[2 * i + 1] = std::sin(th);
      theta *= theta_scale;
    }
  }

  for (int il = 0; il < cfg_.n_layer; ++il) {
    const LayerWeights& L = layers_[size_t(il)];
    rmsnorm(x_.data(), L.attn_norm, xn_.data(), T, E);
    project({{&L.wq, q_.data()}, {&L.wk, k_.data()}, {&L.wv, v_.data()}}, xn_.data(), T, E, pool);
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
          if (L.q_norm) head_rmsnorm(q + h * D, L.q_norm, int(D), cfg_.rms_eps);
          rope_head(q + h * D, cs, rd, cfg_.rope_neox);
        }
        const BatchToken& bt = batch[size_t(t)];
        for (int64_t h = 0; h < HK; ++h) {
          if (L.k_norm) head_rmsnorm(k + h * D, L.k_norm, int(D), cfg_.rms_eps);
          rope_head(k + h * D, cs, rd, cfg_.rope_neox);
          if (kv.type() == KvType::F32) {
            std::memcpy(kv.k_row(il, bt.seq, bt.pos, int(h)), k + h * D, size_t(D) * sizeof(float));
            std::memcpy(kv.v_row(il, bt.seq, bt.pos, int(h)), v + h * D, size_t(D) * sizeof(float));
          } else {
            ops.f32_to_f16(D, k + h * D, static_cast<uint16_t*>(kv.k_row(il, bt.seq, bt.pos, int(h))));
            ops.f32_to_f16(D, v + h * D, static_cast<uint16_t*>(kv.v_row(il, bt.seq, bt.pos, int(h))));
          }
        }
      }
    });
    attention(batch, il, kv, pool);
    ksplit_matmul(L.wo, attn_.data(), T, QD, kv_split_ > 0 ? kv_split_ * (cfg_.n_head / cfg_.n_head_kv) * D : -1,
                  xn_.data(), part_.data(), pool);
    reduce(xn_.data(), T * E);  // TP: sum of the ranks' partial projections
    for (int64_t i = 0; i < T * E; ++i) x_[size_t(i)] += xn_[size_t(i)];

    rmsnorm(x_.data(), L.ffn_norm, xn_.data(), T, E);
    if (L.moe) {
      moe_ffn(il, T, pool);
      reduce(ffn_out_.data(), T * E);
      for (int64_t i = 0; i < T * E; ++i) x_[size_t(i)] += ffn_out_[size_t(i)];
      continue;
    }
    project({{&L.w_gate, gate_.data()}, {&L.w_up, up_.data()}}, xn_.data(), T, E, pool);
    pool.parallel_for(T, 4, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        ops.silu_mul(F, gate_.data() + t * F, up_.data() + t * F, gate_.data() + t * F);
    });
    ksplit_matmul(L.w_down, gate_.data(), T, F, f_split_, xn_.data(), part_.data(), pool);
    reduce(xn_.data(), T * E);
    for (int64_t i = 0; i < T * E; ++i) x_[size_t(i)] += xn_[size_t(i)];
  }

  // Final norm and LM head, only for the tokens whose logits are wanted.
  int64_t n_out = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (!batch[size_t(t)].want_logits) continue;
    rmsnorm(x_.data() + t * E, output_norm_, xn_.data() + n_out * E, 1, E);
    ++n_out;
  }
  if (n_out == 0) return;
  const int64_t V = cfg_.n_vocab;
  if (tp_.size == 1) {
    project({{&output_, logits}}, xn_.data(), n_out, E, pool);
    return;
  }
  quantize_acts({&output_}, xn_.data(), n_out, E, E, act_, pool);
  const ActBuf& ao = act_[size_t(output_.layout)];
  // TP: each rank computes its vocabulary rows; rank 1's reach rank 0, which samples.
  TF_CHECK(n_out <= kMaxLogitRows, "too many logit rows for one TP forward");
  const int64_t V1 = V - (tp_.rank == 0 ? v1_ : v0_);  // rank 1's slice width
  jobs_.clear();
  if (tp_.rank == 0)
    jobs_.push_back({output_, ao.data.data(), ao.stride, n_out, logits, V});
  else
    jobs_.push_back({output_, ao.data.data(), ao.stride, n_out, logits_local_.data(), V1});
  run_jobs(jobs_, pool);
  tp_.group->broadcast(logits_local_.data(), size_t(n_out * V1) * sizeof(float), tp_.group_rank(1));
  if (tp_.rank == 0)
    for (int64_t t = 0; t < n_out; ++t)
      std::memcpy(logits + t * V + v1_, logits_local_.data() + t * V1, size_t(V1) * sizeof(float));
}

}  // namespace tf
