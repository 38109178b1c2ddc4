// A decoder-only model: the token embedding, one attention block and one FFN block per layer
// joined by the residual policy (model/block.h: kinds chosen per layer from the architecture
// table), the final norm and the LM head, over a batch of tokens from any number of sequences
// reading and writing the KV cache. Weights are views into the mmapped GGUF (or, under TP=2,
// this rank's slices); all scratch is allocated once by reserve(); every operation runs on the
// backend.
//
// Tensor parallel (TP=2): each block holds its share (attention: a range of KV heads with their
// query heads, or for MLA of query heads; FFN: half of every width, or half of the experts) and
// produces a partial sum, completed by one All-Reduce; the LM head holds half of the
// vocabulary rows.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf_reader.h"
#include "kv/kv_cache.h"
#include "model/activation_stats.h"
#include "model/block.h"
#include "model/model_config.h"
#include "model/scratch.h"
#include "model/weights.h"

namespace tf {

class Model {
 public:
  static constexpr int64_t kMaxLogitRows = 64;  // logits rows one forward may produce
  // `be` computes (and decides which weight types are accepted); a plan-only shard (or a null
  // backend) only sizes the model.
  Model(std::shared_ptr<GgufFile> file, Backend* be, const TpShard& tp = TpShard{});
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  const TpShard& tp() const { return tp_; }
  const GgufFile& file() const { return *file_; }
  int nextn_layers() const { return int(nextn_.size()); }
  uint64_t weight_bytes() const { return loader_.bytes(); }
  // What each layer keeps in the KV cache (this rank's share).
  std::vector<KvSpec> kv_specs() const;

  // Scratch for batches of up to max_tokens tokens and sequences up to max_ctx positions,
  // planned from the blocks' needs (one source); count_only: only the bytes. Returns the bytes
  // (in double: a hostile geometry gives a huge number, not a wrapped one).
  double reserve(int max_tokens, int64_t max_ctx, bool count_only = false);
  // Hands the weights' host memory (mapped file, loader arrays) to the backend (Backend::adopt_host_range),
  // once the memory plan was checked.
  void hand_weights_to_backend();
  int max_tokens() const { return max_tokens_; }

  // Runs the batch. For each token with want_logits, writes n_vocab floats to `logits`
  // (consecutive rows, batch order). hidden (optional): the last hidden state of every token,
  // [T][n_embd], before the final norm (draft heads and embeddings read it).
  // hidden (optional): the residual state after the last layer, [T][hidden_width()] (one
  // stream: the hidden state before the final norm; V4: all hyper-connection streams).
  void forward(const std::vector<BatchToken>& batch, KvCache& kv, float* logits, float* hidden = nullptr);
  int64_t hidden_width() const;

  // Next-token prediction layer j (a draft head, DeepSeek's MTP), as llama.cpp's MTP graphs run
  // it: token i of the batch is the token at pos + 1 of its sequence, hidden row i forward()'s
  // hidden row at pos ([T][hidden_width()], host). One stream: eh_proj(enorm(embedding) ++
  // hnorm(output_norm(hidden))); hyper-connections: the same for every stream (hnorm of each
  // stream, no final norm), which start the layer's streams. Then the layer's blocks with its own
  // cache `kv` (nextn_kv_specs), the residual's end, the shared head's norm and the head: logits
  // of the token at pos + 2 for every token with want_logits. TP=1 only.
  void forward_nextn(int j, const std::vector<BatchToken>& batch, const float* hidden, KvCache& kv, float* logits);
  // The cache streams of next-token-prediction layer j (its own KvCache).
  std::vector<KvSpec> nextn_kv_specs(int j) const;
  // Whether layer j can run (V4: its hyper-connection maps are in the file), and why not.
  std::string nextn_unsupported(int j) const;

  // Tokens routed to each expert so far: [n_layer][n_expert] (zeros for dense layers).
  std::vector<std::vector<int64_t>> expert_usage() const;
  void reset_expert_usage();
  // When on, every MoE layer appends its chosen experts ([T][n_used] per forward) to
  // routing_trace()[layer]: for checking routing against a reference, not for serving.
  void set_routing_trace(bool on);
  const std::vector<std::vector<int32_t>>& routing_trace() const { return trace_; }
  // Calibration: while set, every forward adds the inputs of every weight matrix to `stats`,
  // under the weights' GGUF names (a fresh collector); nullptr detaches. TP=1 only.
  void set_activation_stats(ActivationStats* stats);

 private:
  struct Layer {
    std::unique_ptr<AttentionBlock> attn;
    std::unique_ptr<FfnBlock> ffn;
  };
  void plan(Scratch& s, int64_t T);
  AttentionKind nextn_attention(int il) const;
  void head(StepContext& ctx, const float* h, float* logits, const float* norm = nullptr,
            const Weight* out = nullptr);
  // Token ids, slots, positions and rotary angles of a batch into the model's scratch.
  void load_batch(const std::vector<BatchToken>& batch);

  std::shared_ptr<GgufFile> file_;
  Backend* be_;
  TpShard tp_;
  ModelConfig cfg_;
  WeightLoader loader_;
  Weight tok_embd_, output_;
  const float* output_norm_ = nullptr;
  std::vector<Layer> layers_;
  // Next-token-prediction layers (a draft head: the embedding of the next token and the last
  // hidden state, normed and projected, through one more layer): loaded and kept, not run by
  // forward.
  struct NextnLayer {
    Layer blocks;
    Weight eh_proj;  // [2 n_embd] -> n_embd: (enorm(embedding), hnorm(hidden))
    Weight embed, head;  // its own embedding and LM head when the file has them (else the model's)
    const float *enorm = nullptr, *hnorm = nullptr, *head_norm = nullptr;
  };
  std::vector<NextnLayer> nextn_;
  std::unique_ptr<ResidualPolicy> residual_;
  int64_t vocab_begin_ = 0, vocab_end_ = 0;  // this rank's rows of the LM head
  int max_tokens_ = 0;
  int64_t max_ctx_ = 0;
  std::unique_ptr<Scratch> scratch_;
  float *emb_ = nullptr, *xn_ = nullptr, *rope_cs_ = nullptr, *logits_local_ = nullptr;
  float *nextn_in_ = nullptr, *nextn_x_ = nullptr, *nextn_h_ = nullptr;  // [T][S][2 E], [T][S][E], [T][S E]
  int32_t *tokens_ = nullptr, *seqs_ = nullptr, *emb_idx_ = nullptr;
  int64_t* ends_ = nullptr;
  std::vector<uint8_t> emb_rows_;  // TP: the batch's embedding rows, read with pread
  std::vector<uint8_t> exact_;     // per batch row: BatchToken::exact (Backend::set_exact_rows)
  std::vector<uint8_t> all_exact_;  // all ones: the logit rows
  std::vector<std::vector<int32_t>> trace_;
  ActivationStats* stats_ = nullptr;
  int stat_output_ = -1;
};

}  // namespace tf
