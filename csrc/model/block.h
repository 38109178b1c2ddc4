// The pieces a layer is made of. A layer is an attention block and an FFN block joined by a
// residual policy; each block owns its weights (loaded by its constructor), its TP shard plan
// (prepare), its scratch needs (plan_scratch), its KV spec (attention), its calibration hooks
// and its forward. The kinds are chosen per layer from the architecture table; model/kinds.cpp
// makes the block of each kind. Blocks run every operation through the backend seam and name
// no ISA and no architecture.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "kv/kv_cache.h"
#include "model/activation_stats.h"
#include "model/model_config.h"
#include "model/scratch.h"
#include "model/weights.h"

namespace tf {

struct BatchToken {
  int32_t token = 0;
  int32_t pos = 0;      // position within its sequence
  int32_t seq = 0;      // KV cache sequence slot
  bool want_logits = false;
  // A generated token (decoded, drafted, or the generated part of a resubmitted stream): its
  // products run exactly as a one-row product would, whatever else is in the batch, so that
  // speculation and parked streams give bit for bit the tokens plain decoding gives. Prompt
  // tokens may take faster batch kernels (prefill panels) whose rounding differs.
  bool exact = false;
};

// What one forward gives every block.
struct StepContext {
  Backend& be;
  KvCache& kv;
  const ModelConfig& cfg;
  const TpShard& tp;
  const std::vector<BatchToken>& batch;
  int64_t T = 0;
  const int32_t* tokens = nullptr;  // [T] token ids (host)
  const int32_t* seq = nullptr;     // [T] sequence slots (host)
  const int64_t* end = nullptr;     // [T] position + 1: the cache entries a token reads end there (host)
  const float* rope_cs = nullptr;   // [T][rope_dim] cos/sin of each token's position (model's rope)
  int layer = 0;
  bool calibrating = false;         // blocks record their inputs into their ActivationStats
};

// Loading-time context of one layer's blocks.
struct BlockContext {
  const ModelConfig& cfg;
  WeightLoader& w;
  int layer;
  std::string prefix;  // "blk.N."
};

class Block {
 public:
  virtual ~Block() = default;
  // After loading: TP=2 reads this rank's slices (w.tp().size == 2); TP=1 in compatible mode
  // finds the split points of its reductions (the sums TP=2 ranks hold, added in TP=2's order).
  virtual void prepare(WeightLoader& w) = 0;
  // The scratch one forward of up to T tokens needs (asked twice: sizes, then pointers).
  virtual void plan_scratch(Scratch& s, int64_t T) = 0;
  // Calibration: accumulators for the inputs of its matrices, named after them; nullptr detaches.
  virtual void attach_stats(ActivationStats* stats) = 0;
  // x: [T][n_embd] the residual stream; out: [T][n_embd] this rank's (partial) output.
  virtual void forward(StepContext& ctx, const float* x, float* out) = 0;
};

class AttentionBlock : public Block {
 public:
  // What the block keeps in the KV cache: one spec per cache stream (rows per token, compressed
  // entries, a window of per-token state...). Each stream is a cache layer of its own; the
  // model numbers them in order and tells the block its first (kv_base).
  virtual std::vector<KvSpec> kv_specs() const = 0;
  void set_kv_base(int base) { kv_base_ = base; }

 protected:
  int kv_base_ = 0;
};

class FfnBlock : public Block {
 public:
  // Tokens routed to each expert so far (empty for a dense block), and the routing trace.
  virtual std::vector<int64_t>* expert_usage() { return nullptr; }
  virtual void set_trace(std::vector<int32_t>*) {}
};

// How the blocks' outputs join the residual stream(s).
class ResidualPolicy {
 public:
  virtual ~ResidualPolicy() = default;
  virtual void plan_scratch(Scratch& s, int64_t T) = 0;
  // After loading (as Block::prepare): under TP=2, the weights it keeps read privately.
  virtual void prepare(WeightLoader&) {}
  // The streams start from the token embeddings ([T][n_embd]).
  virtual void begin(StepContext& ctx, const float* emb) = 0;
  virtual void layer(StepContext& ctx, AttentionBlock& attn, FfnBlock& ffn) = 0;
  // The hidden state the head reads, [T][n_embd].
  virtual const float* end(StepContext& ctx) = 0;
  // Whether it can run layer `il` (a next-token-prediction layer may lack what it needs).
  virtual bool has_layer(int il) const { (void)il; return true; }
  // The residual state after the last layer, before end(): [T][state_width()] (one stream: the
  // hidden state; hyper-connections: every stream), and a start from such a state instead of
  // the embeddings (a next-token-prediction layer's input).
  virtual int64_t state_width() const = 0;
  virtual const float* state() const = 0;
  virtual void begin_state(StepContext& ctx, const float* state) = 0;
};

// The blocks of each kind (model/kinds.cpp).
std::unique_ptr<AttentionBlock> make_attention(AttentionKind kind, const BlockContext& c);
std::unique_ptr<FfnBlock> make_ffn(const BlockContext& c);
std::unique_ptr<ResidualPolicy> make_residual(const ModelConfig& cfg, WeightLoader& w);

}  // namespace tf
