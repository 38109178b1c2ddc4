// LlamaModel, part 2: the tensor-parallel shard plan (see llama_model.h). Where each reduction
// splits (plan_splits: the same points at TP=1 in compatible mode, so both give the same bits)
// and this rank's slices of every weight, read with pread so only they stay resident.
#include "model/llama_model.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>

#include <fcntl.h>
#include <unistd.h>

#include "core/error.h"
#include "core/interrupt.h"
#include "quant/traits.h"

namespace tf {

namespace {
int64_t block_of(const Weight& w) { return w.rows > 0 ? find_type_traits(uint32_t(w.type))->block_size : 1; }
}  // namespace

namespace {
constexpr size_t kReadWindow = size_t(64) << 20;  // bytes per pread: large, yet a small transient

// Drops the file's cached pages of [offset, offset + n), rounded out to whole pages: a partial
// page would otherwise stay. Pages someone has mapped (or dirty ones) are never dropped, so
// the rounding cannot hurt another user of the file; a neighbour's page merely is re-read.
void drop_page_cache(int fd, uint64_t offset, size_t n) {
  static const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = offset / page * page, end = (offset + n + page - 1) / page * page;
  ::posix_fadvise(fd, off_t(begin), off_t(end - begin), POSIX_FADV_DONTNEED);
}
}  // namespace

void LlamaModel::read_at(const uint8_t* src, void* dst, size_t n, bool drop_cache) const {
  // Read from the file rather than the mapping, so the mapping's pages stay untouched; the
  // part (of a split model) that holds the bytes is found from their address.
  const auto [part, start] = file_->locate(src, n);
  uint64_t offset = start;
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    check_interrupt();  // TP loads read gigabytes: Ctrl-C must not wait for all of them
    if (tp_.abandon && tp_.abandon->load()) fail(ErrorKind::Runtime, "loading abandoned: the TP peer is gone");
    const ssize_t r = ::pread(part->fd, p, std::min(n, kReadWindow), off_t(offset));
    if (r <= 0) fail(ErrorKind::Runtime, part->shown, ": read failed while loading a TP slice");
    // The private copy is what stays resident; the file's pages go as soon as they are copied.
    if (drop_cache) drop_page_cache(part->fd, offset, size_t(r));
    p += r;
    offset += uint64_t(r);
    n -= size_t(r);
  }
}

void LlamaModel::read_cols(const uint8_t* src, int64_t rows, size_t row_stride, size_t skip, size_t n,
                           uint8_t* dst) const {
  // Whole rows in windows of about kReadWindow, one pread each (a pread per row part would be
  // millions of small reads, and dropping a part's pages would miss the pages it shares with
  // the other rank's part), then this rank's part of every row is copied out.
  const int64_t window = std::max<int64_t>(1, int64_t(kReadWindow / row_stride));
  std::unique_ptr<uint8_t[]> buf(new uint8_t[size_t(std::min(window, rows)) * row_stride]);
  for (int64_t r0 = 0; r0 < rows; r0 += window) {
    const int64_t cnt = std::min(window, rows - r0);
    read_at(src + size_t(r0) * row_stride, buf.get(), size_t(cnt) * row_stride);
    for (int64_t r = 0; r < cnt; ++r)
      std::memcpy(dst + size_t(r0 + r) * n, buf.get() + size_t(r) * row_stride + skip, n);
  }
}

Weight LlamaModel::slice_rows(const Weight& w, int64_t r0, int64_t r1) {
  Weight s = w;
  s.rows = r1 - r0;
  if (tp_.plan_only) return s;  // sizes only
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
  if (tp_.plan_only) return s;
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
  // The matrices packed (a view may have gaps between them: MLA's W_vb inside attn_kv_b).
  const size_t per = w.first.row_stride * size_t(w.first.rows);
  s.expert_stride = per;
  if (tp_.plan_only) return s;
  owned_weights_.emplace_back(new uint8_t[per * size_t(s.n_expert)]);
  if (per == w.expert_stride) {
    read_at(w.first.data + size_t(e0) * w.expert_stride, owned_weights_.back().get(), per * size_t(s.n_expert));
  } else {
    for (int64_t e = e0; e < e1; ++e)
      read_at(w.first.data + size_t(e) * w.expert_stride, owned_weights_.back().get() + size_t(e - e0) * per, per);
  }
  s.first.data = owned_weights_.back().get();
  return s;  // expert e of the model is local expert e - e0
}

Weight LlamaModel::slice_cols(const Weight& w, int64_t c0, int64_t c1) {
  Weight s = w;
  s.k = c1 - c0;
  s.row_stride = row_bytes(w.type, s.k);
  if (tp_.plan_only) return s;
  owned_weights_.emplace_back(new uint8_t[s.row_stride * size_t(w.rows)]);
  read_cols(w.data, w.rows, w.row_stride, row_bytes(w.type, c0), s.row_stride, owned_weights_.back().get());
  s.data = owned_weights_.back().get();
  return s;
}

ExpertWeight LlamaModel::slice_cols(const ExpertWeight& w, int64_t c0, int64_t c1) {
  ExpertWeight s = w;
  s.first.k = c1 - c0;
  s.first.row_stride = row_bytes(w.first.type, s.first.k);
  s.expert_stride = s.first.row_stride * size_t(w.first.rows);
  if (tp_.plan_only) return s;
  const size_t skip = row_bytes(w.first.type, c0);
  owned_weights_.emplace_back(new uint8_t[s.expert_stride * size_t(w.n_expert)]);
  uint8_t* dst = owned_weights_.back().get();
  const size_t packed = w.first.row_stride * size_t(w.first.rows);
  if (w.expert_stride == packed) {  // the experts' rows follow each other: one run of rows
    read_cols(w.first.data, w.first.rows * w.n_expert, w.first.row_stride, skip, s.first.row_stride, dst);
  } else {
    for (int64_t e = 0; e < w.n_expert; ++e)
      read_cols(w.first.data + size_t(e) * w.expert_stride, w.first.rows, w.first.row_stride, skip,
                s.first.row_stride, dst + size_t(e) * s.expert_stride);
  }
  s.first.data = dst;
  return s;
}

void LlamaModel::plan_splits() {
  // The boundaries at which TP=2 splits every reduction dimension. TP=1 splits its sums at
  // the same boundaries (partial + partial, as the All-Reduce does), so any TP degree gives
  // bit-identical results. -1: no block-aligned split exists (TP=2 is then refused).
  // A split point must be a block boundary of every weight it cuts, whatever their types
  // (32 and 256 mixed, layer by layer): a multiple of all their block sizes.
  // Attention splits by cache head (GQA: a KV head and its query heads) or, for MLA, whose
  // one latent row every head reads, by query head; the output projection's input follows.
  const bool mla = cfg_.attention == AttentionKind::Mla;
  const int64_t units = mla ? cfg_.n_head : cfg_.n_head_kv;
  const int64_t unit_width = mla ? cfg_.v_head_dim : int64_t(cfg_.n_head / cfg_.n_head_kv) * cfg_.head_dim;
  int64_t align = 1;
  for (const auto& L : layers_) align = std::lcm(align, block_of(L.wo));
  kv_split_ = -1;
  for (int64_t c = 1; c < units; ++c)
    if ((c * unit_width) % align == 0 &&
        (kv_split_ < 0 || std::llabs(2 * c - units) < std::llabs(2 * kv_split_ - units)))
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
  const bool mla = cfg_.attention == AttentionKind::Mla;
  const int64_t kv0 = need(kv_split_, mla ? "the attention heads" : "the KV heads");
  const int64_t units = mla ? cfg_.n_head : HK;  // what kv_split_ counts
  const int64_t k0 = r == 0 ? 0 : kv0, k1 = r == 0 ? kv0 : units;
  local_kv_heads_ = mla ? 1 : k1 - k0;
  local_heads_ = mla ? k1 - k0 : local_kv_heads_ * g;
  const int64_t q0 = mla ? k0 : k0 * g;
  auto range = [&](int64_t n, int64_t c, int64_t& a, int64_t& b) {
    a = r == 0 ? 0 : c;
    b = r == 0 ? c : n;
  };
  int64_t f0 = 0, f1 = 0, e0 = 0, e1 = 0;
  if (std::any_of(layers_.begin(), layers_.end(), [](const LayerWeights& L) { return L.ffn == FfnKind::Dense; }))
    range(cfg_.n_ff, need(f_split_, "the FFN width"), f0, f1);
  if (cfg_.is_moe() && !expert_parallel_) range(cfg_.n_ff_exp, need(fe_split_, "the expert FFN width"), e0, e1);
  if (expert_parallel_) {
    e0 = 0;
    e1 = cfg_.n_ff_exp;
    exp_lo_ = r == 0 ? 0 : expert_group_;
    exp_hi_ = r == 0 ? expert_group_ : cfg_.n_expert;
  }
  local_ff_ = f1 - f0;
  local_ff_exp_ = e1 - e0;
  const int64_t vsplit = cfg_.n_vocab / 2;
  vocab_begin_ = r == 0 ? 0 : vsplit;
  vocab_end_ = r == 0 ? vsplit : cfg_.n_vocab;
  weight_bytes_ = 0;  // recounted: what this rank holds
  auto count = [&](const Weight& w) { weight_bytes_ += w.row_stride * uint64_t(w.rows); };
  output_ = slice_rows(output_, vocab_begin_, vocab_end_);
  count(output_);
  for (size_t il = 0; il < layers_.size(); ++il) {
    LayerWeights& L = layers_[il];
    if (mla) {
      shard_mla(L, q0, q0 + local_heads_);
    } else {
      L.wq = slice_rows(L.wq, q0 * D, (q0 + local_heads_) * D);
      L.wk = slice_rows(L.wk, k0 * D, k1 * D);
      L.wv = slice_rows(L.wv, k0 * D, k1 * D);
      if (L.bq) {
        L.bq += q0 * D;
        L.bk += k0 * D;
        L.bv += k0 * D;
      }
      L.wo = slice_cols(L.wo, q0 * D, (q0 + local_heads_) * D);
      count(L.wq); count(L.wk); count(L.wv); count(L.wo);
    }
    if (L.ffn == FfnKind::Moe) {
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

void LlamaModel::shard_mla(LayerWeights& L, int64_t h0, int64_t h1) {
  // This rank's query heads [h0, h1): their rows of W_q / W_qb, their W_kb and W_vb, their
  // columns of W_o. The q-LoRA and latent projections are replicated (both ranks compute the
  // latent and keep the whole latent cache: it is one row per token for all heads).
  const int64_t D = cfg_.head_dim, V = cfg_.v_head_dim;
  auto count = [&](const Weight& w) { weight_bytes_ += w.row_stride * uint64_t(w.rows); };
  if (L.wq_b.rows > 0) {
    L.wq_a = slice_rows(L.wq_a, 0, L.wq_a.rows);
    L.wq_b = slice_rows(L.wq_b, h0 * D, h1 * D);
    count(L.wq_a); count(L.wq_b);
  } else {
    L.wq = slice_rows(L.wq, h0 * D, h1 * D);
    count(L.wq);
  }
  L.wkv_a = slice_rows(L.wkv_a, 0, L.wkv_a.rows);
  if (L.wk_b_owned) {  // a float copy made at load: keep this rank's heads' part of it
    L.wk_b.first.data += size_t(h0) * L.wk_b.expert_stride;
    L.wk_b.n_expert = h1 - h0;
  } else {
    L.wk_b = slice_experts(L.wk_b, h0, h1);
  }
  L.wv_b = slice_experts(L.wv_b, h0, h1);
  weight_bytes_ += (L.wk_b.expert_stride + L.wv_b.expert_stride) * uint64_t(h1 - h0);
  L.wo = slice_cols(L.wo, h0 * V, h1 * V);
  count(L.wkv_a); count(L.wo);
}

}  // namespace tf
