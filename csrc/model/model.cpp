#include "model/model.h"

#include <algorithm>
#include <cstring>

#include "comm/group.h"
#include "core/error.h"
#include "core/interrupt.h"
#include "model/rope.h"
#include "quant/traits.h"

namespace tf {

Model::Model(std::shared_ptr<GgufFile> file, Backend* be, const TpShard& tp)
    : file_(std::move(file)), be_(be), tp_(tp), cfg_(ModelConfig::from_gguf(*file_)), loader_(file_, tp, be) {
  TF_CHECK(tp_.size == 1 || (tp_.size == 2 && (tp_.group || tp_.plan_only)),
           "tensor parallel size must be 1 or 2 (with a group)");
  TF_CHECK(tp_.rank >= 0 && tp_.rank < tp_.size, "TP rank ", tp_.rank, " is out of range");
  if (tp_.size > 1) file_->advise_random();  // the mappings serve only the header now
  const int64_t E = cfg_.n_embd;
  // The embedding is only read row by row (reference dequant) unless it is also the output.
  tok_embd_ = loader_.weight("token_embd.weight", E, cfg_.n_vocab, true, cfg_.tied_output);
  loader_.dequantizer("token_embd.weight");
  output_norm_ = loader_.vector("output_norm.weight", E);
  output_ = cfg_.tied_output ? tok_embd_ : loader_.weight("output.weight", E, cfg_.n_vocab);
  layers_.resize(size_t(cfg_.n_layer));
  for (int il = 0; il < cfg_.n_layer; ++il) {
    check_interrupt();
    const BlockContext c{cfg_, loader_, il, "blk." + std::to_string(il) + "."};
    layers_[size_t(il)].attn = make_attention(cfg_.layer_attention[size_t(il)], c);
    layers_[size_t(il)].ffn = make_ffn(c);
  }
  for (int j = 0; j < cfg_.n_nextn; ++j) {
    const int il = cfg_.n_layer + j;
    const BlockContext c{cfg_, loader_, il, "blk." + std::to_string(il) + "."};
    NextnLayer n;
    n.blocks.attn = make_attention(nextn_attention(il), c);
    n.blocks.ffn = make_ffn(c);
    n.eh_proj = loader_.weight(c.prefix + "nextn.eh_proj.weight", 2 * E, E);
    n.enorm = loader_.vector(c.prefix + "nextn.enorm.weight", E);
    n.hnorm = loader_.vector(c.prefix + "nextn.hnorm.weight", E);
    n.head_norm = loader_.vector(c.prefix + "nextn.shared_head_norm.weight", E, false);
    // llama.cpp's nextn tensors may carry the embedding and head again (DeepSeek's MTP block has
    // its own copies); used when present, as llama.cpp does.
    n.embed = loader_.weight(c.prefix + "nextn.embed_tokens.weight", E, cfg_.n_vocab, false, false);
    n.head = loader_.weight(c.prefix + "nextn.shared_head_head.weight", E, cfg_.n_vocab, false);
    nextn_.push_back(std::move(n));
  }
  residual_ = make_residual(cfg_, loader_);
  vocab_begin_ = 0;
  vocab_end_ = cfg_.n_vocab;
  if (tp_.size > 1) {
    loader_.reset_bytes();  // counted afresh: what this rank holds
    const int64_t vsplit = cfg_.n_vocab / 2;
    vocab_begin_ = tp_.rank == 0 ? 0 : vsplit;
    vocab_end_ = tp_.rank == 0 ? vsplit : cfg_.n_vocab;
    output_ = loader_.slice_rows(output_, vocab_begin_, vocab_end_);
  }
  int kv_base = 0;  // the cache layers of each block's streams, in layer order
  for (Layer& L : layers_) {
    check_interrupt();
    L.attn->prepare(loader_);
    L.ffn->prepare(loader_);
    L.attn->set_kv_base(kv_base);
    kv_base += int(L.attn->kv_specs().size());
  }
  for (NextnLayer& n : nextn_) {
    n.blocks.attn->prepare(loader_);
    n.blocks.ffn->prepare(loader_);
    n.blocks.attn->set_kv_base(0);  // in its own cache
  }
  residual_->prepare(loader_);
  reset_expert_usage();
}

std::vector<KvSpec> Model::nextn_kv_specs(int j) const {
  TF_CHECK(j >= 0 && j < int(nextn_.size()), "next-token-prediction layer ", j, " does not exist");
  return nextn_[size_t(j)].blocks.attn->kv_specs();
}

std::string Model::nextn_unsupported(int j) const {
  if (j < 0 || j >= int(nextn_.size())) return "the model file has no next-token-prediction (nextn) layers";
  if (tp_.size > 1) return "next-token prediction runs with TP=1 only";
  if (!residual_->has_layer(cfg_.n_layer + j))
    return "its next-token-prediction layer has no hyper-connection maps (blk." + std::to_string(cfg_.n_layer + j) +
           ".hc_attn_*) in the file";
  return "";
}

void Model::hand_weights_to_backend() {
  // The weights' host memory, handed to the backend once (a GPU uploads or registers it).
  TF_CHECK(be_ != nullptr && !tp_.plan_only, "a plan-only model has no weights to hand over");
  // TP=1 computes from the mapping; at TP=2 every weight a rank keeps is its own copy.
  if (tp_.size == 1)
    for (const GgufPart& part : file_->parts()) be_->adopt_mapped_range(part.base, size_t(part.size));
  for (const auto& [p, n] : loader_.owned_ranges()) be_->adopt_host_range(p, n);
}

Model::~Model() = default;

AttentionKind Model::nextn_attention(int il) const {
  if (cfg_.compress_ratio.empty()) return cfg_.attention;
  const int r = cfg_.compress_ratio[size_t(il)];
  return r == 0 ? AttentionKind::SharedKvWindow : r == 4 ? AttentionKind::SharedKvSparse : AttentionKind::SharedKvCompressed;
}

std::vector<KvSpec> Model::kv_specs() const {
  std::vector<KvSpec> out;
  for (const Layer& L : layers_) {
    const std::vector<KvSpec> s = L.attn->kv_specs();
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

void Model::plan(Scratch& s, int64_t T) {
  const int64_t E = cfg_.n_embd;
  emb_ = s.f32("model.emb", T * E);
  xn_ = s.f32("xn", T * E);
  rope_cs_ = s.f32("model.rope", T * cfg_.rope_dim, true);
  tokens_ = s.i32("model.tokens", T);
  seqs_ = s.i32("model.seqs", T);
  ends_ = s.i64("model.ends", T);
  emb_idx_ = tp_.size > 1 ? s.i32("model.emb_idx", T) : nullptr;
  if (tp_.size > 1) logits_local_ = s.f32("model.logits_local", kMaxLogitRows * (cfg_.n_vocab - vocab_begin_), true);
  s.product(output_, std::min<int64_t>(T, kMaxLogitRows));
  residual_->plan_scratch(s, T);
  for (Layer& L : layers_) {
    L.attn->plan_scratch(s, T);
    L.ffn->plan_scratch(s, T);
  }
  if (!nextn_.empty()) {
    const int64_t S = residual_->state_width() / E;  // streams
    nextn_in_ = s.f32("nextn.in", T * S * 2 * E);
    nextn_x_ = s.f32("nextn.x", T * S * E);
    nextn_h_ = s.f32("nextn.h", T * S * E);
    for (NextnLayer& n : nextn_) {
      s.product(n.eh_proj, T * S);
      if (n.head.data) s.product(n.head, std::min<int64_t>(T, kMaxLogitRows));
      n.blocks.attn->plan_scratch(s, T);
      n.blocks.ffn->plan_scratch(s, T);
    }
  }
}

double Model::reserve(int max_tokens, int64_t max_ctx, bool count_only) {
  TF_CHECK(max_tokens > 0 && max_ctx > 0, "invalid scratch sizes");
  auto s = std::make_unique<Scratch>();
  plan(*s, max_tokens);
  const double bytes = s->bytes(be_, max_tokens);
  if (count_only) return bytes;
  TF_CHECK(be_ != nullptr && !tp_.plan_only, "a plan-only model cannot run forward");
  s->allocate(*be_, max_tokens);
  plan(*s, max_tokens);  // binds every block's buffers
  be_->prepare_products(s->product_weights(), {tok_embd_});  // the CPU repacks them now, at load
  scratch_ = std::move(s);
  max_tokens_ = max_tokens;
  max_ctx_ = max_ctx;
  exact_.assign(size_t(max_tokens), 0);
  all_exact_.assign(size_t(max_tokens), 1);
  if (tp_.size > 1) emb_rows_.assign(size_t(max_tokens) * tok_embd_.row_stride, 0);
  return bytes;
}

void Model::load_batch(const std::vector<BatchToken>& batch) {
  const int64_t T = int64_t(batch.size());
  TF_CHECK(T > 0 && T <= max_tokens_, "batch of ", T, " tokens exceeds the reserved ", max_tokens_);
  const int rd = cfg_.rope_dim;
  be_->host_access();  // the previous step's kernels may still read what is rewritten below
  // Token ids and the rotary angles of each token (shared by all layers).
  for (int64_t t = 0; t < T; ++t) {
    const BatchToken& bt = batch[size_t(t)];
    TF_CHECK(bt.token >= 0 && bt.token < cfg_.n_vocab, "token id ", bt.token, " out of range");
    TF_CHECK(bt.pos >= 0 && bt.pos < max_ctx_, "position ", bt.pos, " exceeds the context");
    tokens_[t] = bt.token;
    exact_[size_t(t)] = bt.exact ? 1 : 0;
    seqs_[t] = bt.seq;
    ends_[t] = int64_t(bt.pos) + 1;
    rope_angles(cfg_, bt.pos, rope_cs_ + t * rd);
  }
}

namespace {
// The batch's exact rows on the backend for one forward, reset however the forward ends.
struct ExactRows {
  Backend& be;
  ExactRows(Backend& b, const uint8_t* mask, int64_t T) : be(b) { be.set_exact_rows(mask, T); }
  ~ExactRows() { be.set_exact_rows(nullptr, 0); }
};
}  // namespace

void Model::forward_nextn(int j, const std::vector<BatchToken>& batch, const float* hidden, KvCache& kv,
                          float* logits) {
  const std::string why = nextn_unsupported(j);
  TF_CHECK(why.empty(), "next-token prediction: ", why);
  NextnLayer& n = nextn_[size_t(j)];
  load_batch(batch);
  const int64_t T = int64_t(batch.size()), E = cfg_.n_embd;
  Backend& be = *be_;
  const ExactRows exact_rows(be, exact_.data(), T);
  const int64_t W = residual_->state_width(), S = W / E;
  be.embed(n.embed.data ? n.embed : tok_embd_, tokens_, T, emb_, E);
  be.from_host(nextn_h_, hidden, size_t(T * W) * sizeof(float));
  // One stream: the hidden state as the LM head reads it (after the final norm), as llama.cpp,
  // vLLM and SGLang feed DeepSeek's MTP layer. Streams: each as it is (llama.cpp's V4 graph).
  const float* h = nextn_h_;
  if (S == 1) {
    be.rmsnorm(nextn_h_, E, output_norm_, xn_, E, T, E, cfg_.rms_eps);
    h = xn_;
  }
  for (int64_t st = 0; st < S; ++st) {
    be.rmsnorm(emb_, E, n.enorm, nextn_in_ + st * 2 * E, S * 2 * E, T, E, cfg_.rms_eps);
    be.rmsnorm(h + st * E, W, n.hnorm, nextn_in_ + st * 2 * E + E, S * 2 * E, T, E, cfg_.rms_eps);
  }
  const Product p{&n.eh_proj, nextn_x_, E};
  be.matmul(nextn_in_, T * S, 2 * E, &p, 1);  // every (token, stream) row: [T][S][E]
  StepContext ctx{be, kv, cfg_, tp_, batch, T, tokens_, seqs_, ends_, rope_cs_, cfg_.n_layer + j, false};
  residual_->begin_state(ctx, nextn_x_);
  residual_->layer(ctx, *n.blocks.attn, *n.blocks.ffn);
  head(ctx, residual_->end(ctx), logits, n.head_norm ? n.head_norm : output_norm_, n.head.data ? &n.head : nullptr);
}

void Model::forward(const std::vector<BatchToken>& batch, KvCache& kv, float* logits, float* hidden) {
  load_batch(batch);
  const int64_t T = int64_t(batch.size());
  Backend& be = *be_;
  const ExactRows exact_rows(be, exact_.data(), T);
  const int64_t E = cfg_.n_embd;
  if (tp_.size > 1) {
    // Under TP the mapping stays untouched: the batch's embedding rows read with pread.
    Weight rows = tok_embd_;
    rows.data = emb_rows_.data();
    for (int64_t t = 0; t < T; ++t) {
      loader_.read_at(tok_embd_.data + size_t(tokens_[t]) * tok_embd_.row_stride,
                      emb_rows_.data() + size_t(t) * tok_embd_.row_stride, tok_embd_.row_stride, false);
      emb_idx_[t] = int32_t(t);
    }
    be.embed(rows, emb_idx_, T, emb_, E);
  } else {
    be.embed(tok_embd_, tokens_, T, emb_, E);
  }
  StepContext ctx{be, kv, cfg_, tp_, batch, T, tokens_, seqs_, ends_, rope_cs_, 0, stats_ != nullptr};
  residual_->begin(ctx, emb_);
  for (int il = 0; il < cfg_.n_layer; ++il) {
    ctx.layer = il;
    residual_->layer(ctx, *layers_[size_t(il)].attn, *layers_[size_t(il)].ffn);
  }
  if (hidden) be.to_host(hidden, residual_->state(), size_t(T * residual_->state_width()) * sizeof(float));
  head(ctx, residual_->end(ctx), logits);
}

int64_t Model::hidden_width() const { return residual_->state_width(); }

void Model::head(StepContext& ctx, const float* h, float* logits, const float* norm, const Weight* out) {
  if (!norm) norm = output_norm_;
  if (!out) out = &output_;
  // Final norm and LM head, only for the tokens whose logits are wanted.
  Backend& be = ctx.be;
  const int64_t T = ctx.T, E = cfg_.n_embd, V = cfg_.n_vocab;
  int64_t n_out = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (!ctx.batch[size_t(t)].want_logits) continue;
    be.rmsnorm(h + t * E, E, norm, xn_ + n_out * E, E, 1, E, cfg_.rms_eps);
    ++n_out;
  }
  if (n_out == 0 || !logits) return;
  TF_CHECK(n_out <= kMaxLogitRows, "too many logit rows for one forward");
  if (stats_) stats_->record(stat_output_, xn_, n_out, E);
  // Logit rows are few (decode-like): every one is computed as a one-row product, whatever its
  // token's role and however many there are.
  be.set_exact_rows(all_exact_.data(), n_out);
  if (tp_.size == 1) {
    const Product p{out, logits, V};
    be.matmul(xn_, n_out, E, &p, 1);
    return;
  }
  // TP: each rank computes its vocabulary rows; rank 1's reach rank 0, which samples.
  const int64_t V1 = V - (tp_.rank == 0 ? vocab_end_ : vocab_begin_);  // rank 1's slice width
  const Product p{&output_, tp_.rank == 0 ? logits : logits_local_, tp_.rank == 0 ? V : V1};
  be.matmul(xn_, n_out, E, &p, 1);
  be.host_access();  // the broadcast reads the logits from the host
  tp_.group->broadcast(logits_local_, size_t(n_out * V1) * sizeof(float), tp_.group_rank(1));
  if (tp_.rank == 0)
    for (int64_t t = 0; t < n_out; ++t)
      std::memcpy(logits + t * V + vocab_end_, logits_local_ + t * V1, size_t(V1) * sizeof(float));
}

std::vector<std::vector<int64_t>> Model::expert_usage() const {
  std::vector<std::vector<int64_t>> out;
  for (const Layer& L : layers_) {
    const std::vector<int64_t>* u = L.ffn->expert_usage();
    out.push_back(u ? *u : std::vector<int64_t>(size_t(cfg_.n_expert), 0));
  }
  return out;
}

void Model::reset_expert_usage() {
  for (Layer& L : layers_)
    if (std::vector<int64_t>* u = L.ffn->expert_usage()) std::fill(u->begin(), u->end(), 0);
}

void Model::set_routing_trace(bool on) {
  trace_.assign(size_t(cfg_.n_layer), {});
  for (size_t il = 0; il < layers_.size(); ++il) layers_[il].ffn->set_trace(on ? &trace_[il] : nullptr);
}

void Model::set_activation_stats(ActivationStats* stats) {
  stats_ = nullptr;
  stat_output_ = -1;
  for (Layer& L : layers_) {
    L.attn->attach_stats(nullptr);
    L.ffn->attach_stats(nullptr);
  }
  if (!stats) return;
  if (tp_.size > 1)
    fail(ErrorKind::Unsupported, "calibration statistics need the whole model on one engine (TP=1); this is TP rank ",
         tp_.rank, " of ", tp_.size);
  TF_CHECK(stats->names().empty(), "activation stats: the collector is already in use");
  for (Layer& L : layers_) {
    L.attn->attach_stats(stats);
    L.ffn->attach_stats(stats);
  }
  stat_output_ = stats->add(cfg_.n_embd);
  stats->name(cfg_.tied_output ? "token_embd.weight" : "output.weight", stat_output_);
  stats_ = stats;
}

}  // namespace tf
