// Decoder-only transformer forward pass (llama / qwen2 / qwen3 / deepseek2, dense or MoE) over
// a batch of tokens from any number of sequences, reading and writing the paged KV cache.
// Weights are views into the mmapped GGUF; all scratch is allocated once by reserve().
//
// A layer is two blocks, each chosen by kind, never by architecture name: the attention block
// the architecture's row names (model_config.cpp, kArchitectures: GQA in attention_gqa.cpp,
// MLA in attention_mla.cpp; each kind states its cache rows, ModelConfig::kv_layout) and the
// FFN block the layer's tensors name (dense here, MoE in moe/moe_ffn.cpp when the layer has a
// router: deepseek2's leading dense layers). RMSNorm and RoPE (model/rope.*: plain, linear,
// YaRN) sit between them. Every operation runs through the backend seam (backend/backend.h).
// Loading is apart from the forward: weight_loading.cpp (the tensors of each block kind),
// tp_shard.cpp (the TP plan and this rank's slices), linear.cpp (grouped products).
//
// Tensor parallel (TP=2): each rank holds a contiguous range of KV heads (and their query
// heads; MLA: a range of query heads, the latent projection and cache replicated), half of
// every FFN's intermediate dimension (dense, each expert, shared expert) and half of the
// vocabulary rows of the LM head. Its slices are read with pread into private buffers (the
// file's cached pages are dropped after), so a rank keeps only its half resident; the mapping
// then serves only the header and embedding rows. The output projection and the FFN produce
// partial sums, combined by one All-Reduce each.
//
// Weight types: every weight may have its own type (llama.cpp's mixes give attn_v and
// ffn_down more bits than attn_q/attn_k, change types from layer to layer, ...). Matrices
// multiplied with the same input (q/k/v, gate/up, experts' gate/up) are grouped by the
// activation layout their types multiply with (Backend::act_layout): the input is quantized once
// per layout the group needs, into that layout's buffer, and all products of the group run in
// one parallel section.
#pragma once
#include <cstdint>
#include <atomic>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "gguf/gguf_reader.h"
#include "kv/paged_kv_cache.h"
#include "comm/group.h"
#include "model/activation_stats.h"
#include "model/model_config.h"

namespace tf {

// A 3-D expert tensor: n_expert matrices of `rows` x `k`, expert e at data + e * expert_stride.
struct ExpertWeight {
  Weight first;            // expert 0 (type, k, rows, row_stride)
  int64_t n_expert = 0;
  size_t expert_stride = 0;
  Weight expert(int64_t e) const {
    Weight w = first;
    w.data = first.data + size_t(e) * expert_stride;
    return w;
  }
};

enum class FfnKind { Dense, Moe };

struct LayerWeights {
  const float* attn_norm = nullptr;
  Weight wq, wk, wv, wo;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr;
  // Multi-head latent attention (wo as above; wq when there is no q-LoRA).
  Weight wq_a, wq_b, wkv_a;             // x -> q-LoRA, q-LoRA -> q, x -> latent + rope key
  const float *q_a_norm = nullptr, *kv_a_norm = nullptr;
  ExpertWeight wk_b;                    // per head: latent <- q_nope (rows kv_lora, k qk_nope)
  ExpertWeight wv_b;                    // per head: latent -> value (rows v_head, k kv_lora)
  bool wk_b_owned = false;              // W_kb is a float copy (from attn_kv_b), not in the file
  const float* ffn_norm = nullptr;
  Weight w_gate, w_up, w_down;          // dense FFN (absent in MoE layers)
  // MoE FFN
  FfnKind ffn = FfnKind::Dense;         // MoE where the layer has a router (leading dense layers)
  Weight router;                        // [n_expert rows x n_embd]
  const float* selection_bias = nullptr;  // exp_probs_b
  ExpertWeight gate_exps, up_exps, down_exps;
  Weight gate_shexp, up_shexp, down_shexp;  // shared expert (rows == 0: none)
  const float* shexp_gate = nullptr;    // qwen2moe: sigmoid gate of the shared expert
};

struct BatchToken {
  int32_t token = 0;
  int32_t pos = 0;      // position within its sequence
  int32_t seq = 0;      // KV cache sequence slot
  bool want_logits = false;
};

struct TpShard {
  int rank = 0;                  // engine rank: 0 schedules and samples
  int size = 1;
  comm::Group* group = nullptr;  // required when size > 1
  int group_rank(int engine_rank) const { return group ? (engine_rank + group_rank_offset) % size : 0; }
  int group_rank_offset = 0;     // engine rank -> group rank mapping (the listener is group rank 0)
  // TP=1 only: split the reduction sums at TP=2's boundaries, so results are bit-identical
  // to a TP=2 run of the same model (costs ~5-10% decode speed: two half-width passes).
  bool tp_compatible = false;
  // Only plan: this rank's geometry and bytes are computed (weight_bytes, scratch_bytes) but
  // no slice is read or allocated and no group is needed; such a model cannot run forward.
  bool plan_only = false;
  // Set (by another thread) when the load is pointless, the peer being gone: reading the
  // slices stops at the next window instead of finishing a load nobody will use.
  const std::atomic<bool>* abandon = nullptr;
};

class LlamaModel {
 public:
  explicit LlamaModel(std::shared_ptr<GgufFile> file, const TpShard& tp = TpShard{});
  ~LlamaModel();
  const TpShard& tp() const { return tp_; }
  int local_kv_heads() const { return int(local_kv_heads_); }
  // The cache rows this rank's attention keeps per position (GQA: its KV heads' K and V rows).
  KvLayout kv_layout() const { return cfg_.kv_layout(int(local_kv_heads_)); }

  const ModelConfig& config() const { return cfg_; }
  const GgufFile& file() const { return *file_; }
  uint64_t weight_bytes() const { return weight_bytes_; }
  // Tokens routed to each expert so far: [n_layer][n_expert] (zeros for dense layers).
  const std::vector<std::vector<int64_t>>& expert_usage() const { return expert_usage_; }
  void reset_expert_usage();
  // When enabled, every MoE layer appends its chosen experts ([T][n_used] per forward) to
  // routing_trace()[layer]: for checking routing against a reference, not for serving.
  void set_routing_trace(bool on);
  const std::vector<std::vector<int32_t>>& routing_trace() const { return trace_; }
  // Calibration (activation_stats.cpp): while `stats` is set, every forward adds the inputs of
  // every weight matrix to it, under the weights' GGUF names (registered here, so `stats` must
  // be a fresh collector); nullptr detaches. TP=1 only (a rank sees only its slices).
  void set_activation_stats(ActivationStats* stats);

  // Size scratch for batches of up to max_tokens tokens, sequences up to max_ctx positions.
  // Returns the bytes; count_only: nothing allocated, only the bytes (for the memory plan).
  uint64_t reserve(int max_tokens, int64_t max_ctx, int n_threads, bool count_only = false);
  // About what reserve(max_tokens, ...) allocates, computed without overflow (for the
  // engine's memory check before anything is allocated).
  double scratch_bytes(int64_t max_tokens) const;
  int max_tokens() const { return max_tokens_; }

  // Runs the batch. For each token with want_logits, writes n_vocab floats to `logits`
  // (consecutive rows, batch order).
  void forward(const std::vector<BatchToken>& batch, PagedKvCache& kv, ThreadPool& pool,
               float* logits);

 private:
  static constexpr size_t kLayouts = kActLayouts;
  // Quantized activation rows of one layout, `stride` bytes apart.
  struct ActBuf {
    std::vector<uint8_t> data;
    size_t stride = 0;
  };
  // A product of a group: y[c * W.rows + r] = W[r] . x[c].
  struct Proj {
    const Weight* w;
    float* y;
  };

  // compute = false: only read through the reference dequantization (the embedding table).
  Weight load_weight(const std::string& name, int64_t k, int64_t rows, bool required = true,
                     bool compute = true);
  ExpertWeight load_experts(const std::string& name, int64_t k, int64_t rows, int64_t n_expert);
  // TP slicing (see the header comment).
  void shard_weights();
  void shard_mla(LayerWeights& L, int64_t h0, int64_t h1);  // MLA's attention weights, heads [h0, h1)
  Weight slice_rows(const Weight& w, int64_t r0, int64_t r1);
  ExpertWeight slice_rows(const ExpertWeight& w, int64_t r0, int64_t r1);
  Weight slice_cols(const Weight& w, int64_t c0, int64_t c1);
  ExpertWeight slice_experts(const ExpertWeight& w, int64_t e0, int64_t e1);
  ExpertWeight slice_cols(const ExpertWeight& w, int64_t c0, int64_t c1);
  // pread of the n mapped bytes at src from the file (part) they belong to.
  void read_at(const uint8_t* src, void* dst, size_t n, bool drop_cache = true) const;
  // Bytes [skip, skip + n) of each of `rows` rows (row_stride apart, from src) into dst, n apart.
  void read_cols(const uint8_t* src, int64_t rows, size_t row_stride, size_t skip, size_t n, uint8_t* dst) const;
  void reduce(float* data, int64_t n);
  const float* load_vector(const std::string& name, int64_t n, bool required = true);
  // Quantizes T rows of x (ldx floats apart, k values each) once per activation layout the
  // weights need, into bufs[layout]; returns the layouts (bit l: ActLayout l).
  unsigned quantize_acts(std::initializer_list<const Weight*> ws, const float* x, int64_t T, int64_t k,
                         int64_t ldx, ActBuf* bufs, ThreadPool& pool);
  // The same for the layouts in `mask`, rep[l] a weight type of layout l.
  void quantize_layouts(unsigned mask, const GgmlType* rep, const float* x, int64_t T, int64_t k,
                        int64_t ldx, ActBuf* bufs, ThreadPool& pool);
  // Every product of a group whose weights take the same input x (T rows, ldx floats apart,
  // the weights' k values each): x quantized once per layout, all products in one section.
  void project(std::initializer_list<Proj> ps, const float* x, int64_t T, int64_t ldx, ThreadPool& pool);
  // A column range [c0, c1) of every row of w, as a view.
  static Weight kview(const Weight& w, int64_t c0, int64_t c1);
  // y = W . x with the reduction split at `split` (<= 0: not split) into two partial sums
  // added in one fixed order, exactly as TP=2 ranks and their All-Reduce compute it.
  void ksplit_matmul(const Weight& w, const float* x, int64_t T, int64_t ldx, int64_t split, float* y,
                     float* scratch, ThreadPool& pool);
  void plan_splits();
  void run_jobs(const std::vector<MatmulJob>& jobs, ThreadPool& pool) { be_.matmul(jobs.data(), jobs.size(), pool); }
  // The FFN blocks: xn_ in, this rank's (partial) output in ffn_out_.
  void dense_ffn(int layer, int64_t T, ThreadPool& pool);
  void moe_ffn(int layer, int64_t T, ThreadPool& pool);
  // T rows of n values (y may be x).
  void rmsnorm(const float* x, const float* w, float* y, int64_t T, int64_t n) const {
    for (int64_t t = 0; t < T; ++t) be_.rmsnorm(x + t * n, w, y + t * n, n, cfg_.rms_eps);
  }
  // g = silu(g) * u over n values; split > 0: the two parts separately, as TP=2's ranks do.
  void silu_mul_parts(int64_t n, int64_t split, float* g, const float* u);
  // q_/k_/v_ of a layer's batch: biases, q/k norms and RoPE applied, K/V rows into the cache.
  void store_qkv(const std::vector<BatchToken>& batch, int layer, PagedKvCache& kv, ThreadPool& pool);
  // Attention over the pages for the whole batch: per token, local_heads_ query rows of
  // head_dim at q + t * q_stride (query heads of one cache head consecutive, `group` per cache
  // head); outputs of v_dim values at out + t * out_stride.
  void attention(const std::vector<BatchToken>& batch, int layer, PagedKvCache& kv, const float* q, int64_t q_stride,
                 int group, int head_dim, int v_dim, float* out, int64_t out_stride, ThreadPool& pool);
  // The attention block of a layer: xn_ in, the output projection's (partial) sum in xn_.
  void gqa_block(const std::vector<BatchToken>& batch, int layer, PagedKvCache& kv, ThreadPool& pool);
  void mla_block(const std::vector<BatchToken>& batch, int layer, PagedKvCache& kv, ThreadPool& pool);
  void load_gqa(LayerWeights& L, const std::string& prefix);
  void load_mla(LayerWeights& L, const std::string& prefix);
  // attn_kv_b of older deepseek2 files, as the per-head W_kb (transposed, in float) and W_vb views.
  void split_kv_b(LayerWeights& L, const std::string& name);
  // Per-head products: for each head h, y[t * ldy + h * hy + r] = W[h][r] . x[t * ldx + h * hx]
  // over T tokens (x rows quantized once for all heads, every head's product in one section).
  void head_project(const ExpertWeight& w, const float* x, int64_t T, int64_t ldx, int64_t hx, float* y,
                    int64_t ldy, int64_t hy, ThreadPool& pool);

  const Backend& be_ = cpu_backend();  // every operation of the forward pass goes through it
  std::shared_ptr<GgufFile> file_;
  ModelConfig cfg_;
  Weight tok_embd_, output_;
  void (*emb_dequant_)(const void*, float*, int64_t) = nullptr;  // token_embd's reference dequant
  const float* output_norm_ = nullptr;
  std::vector<LayerWeights> layers_;
  std::vector<std::vector<float>> owned_vectors_;  // norms stored as F16/BF16, converted once
  std::vector<std::unique_ptr<uint8_t[]>> owned_weights_;  // TP column slices
  TpShard tp_;
  std::vector<uint8_t> emb_row_;  // TP: one embedding row, read with pread
  // Local (this rank's) extents: query/KV heads, FFN widths, vocabulary rows.
  int64_t local_heads_ = 0, local_kv_heads_ = 0, local_ff_ = 0, local_ff_exp_ = 0, vocab_begin_ = 0, vocab_end_ = 0;
  // Split points of the reductions (see plan_splits); -1 = not split on this rank.
  int64_t kv_split_ = -1, f_split_ = -1, fe_split_ = -1;
  bool expert_parallel_ = false;  // experts split by index instead of by width
  int64_t expert_group_ = 0;      // first expert of the second half
  int64_t exp_lo_ = 0, exp_hi_ = 0;  // this rank's experts (hi 0: all)
  std::vector<int64_t> fs_split_;
  uint64_t weight_bytes_ = 0;
  int64_t shexp_width_ = 0;  // widest shared expert FFN

  // scratch
  int max_tokens_ = 0;
  int64_t max_ctx_ = 0;
  int n_threads_ = 1;
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, rope_cs_, ffn_out_, ffn_out2_, part_,
      logits_local_;
  // MLA: q-LoRA rows, latent + rope key rows, absorbed queries [T][H][latent + rope], attention
  // output in latent space [T][H][latent].
  std::vector<float> q_lora_, latent_, q_abs_, o_latent_;
  std::vector<std::vector<float>> owned_f32_;  // W_kb transposed from attn_kv_b
  ActBuf act_[kLayouts];
  ActBuf head_act_[kLayouts];  // per-head rows (T x heads) of the MLA products
  // MoE scratch: router logits, routing, per-expert token lists, gathered activations.
  std::vector<float> router_logits_, route_w_, route_scratch_, exp_gate_, exp_up_, exp_out_, exp_out2_;
  std::vector<int32_t> route_ids_, exp_count_, exp_offset_, exp_rows_;  // exp_rows_: token of each slot
  std::vector<int32_t> slot_of_;        // [T * n_used] -> row in expert order
  ActBuf exp_act_[kLayouts];  // gathered in expert order
  std::vector<MatmulJob> jobs_;
  std::vector<std::pair<int64_t, int>> attn_blocks_;  // attention(): runs of one sequence's tokens
  std::vector<std::vector<int64_t>> expert_usage_;
  bool tracing_ = false;
  std::vector<std::vector<int32_t>> trace_;
  // Calibration: the collector (null: none, nothing recorded) and its accumulator of each
  // input of each layer (-1: no such input).
  struct LayerStatIds {
    int attn_in = -1;    // attn_q/k/v (GQA), attn_q or attn_q_a, attn_kv_a_mqa (MLA)
    int q_b = -1;        // attn_q_b: the normed q-LoRA
    int k_b = -1;        // attn_k_b per head: q_nope
    int v_b = -1;        // attn_v_b per head: the attention output in latent space
    int kv_b = -1;       // attn_kv_b (older files): the normed latent, as its expanded form takes it
    int attn_out = -1;   // attn_output
    int ffn_in = -1;     // ffn_gate/up, or router + shared expert gate/up (+ its sigmoid gate)
    int ffn_down = -1;   // ffn_down
    int exp_in = -1;     // ffn_gate_exps/ffn_up_exps, per expert
    int exp_down = -1;   // ffn_down_exps, per expert
    int shexp_down = -1; // ffn_down_shexp
  };
  ActivationStats* stats_ = nullptr;
  std::vector<LayerStatIds> stat_ids_;
  int stat_output_ = -1;
};

}  // namespace tf
