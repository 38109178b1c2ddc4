// Grouped-query attention: q/k/v projections of the normed input (biases, per-head q/k norms
// where the architecture has them), RoPE, K and V rows of each KV head into the cache, attention
// over the cache entries each token reads (all of them, or a sliding window), and the output
// projection (this rank's partial sum under TP=2: its KV heads and their query heads).
#pragma once
#include "model/block.h"

namespace tf {

class GqaAttention : public AttentionBlock {
 public:
  // window > 0: every token reads only its last `window` positions (the Swa kind).
  GqaAttention(const BlockContext& c, int64_t window);
  std::vector<KvSpec> kv_specs() const override;
  void prepare(WeightLoader& w) override;
  void plan_scratch(Scratch& s, int64_t T) override;
  void attach_stats(ActivationStats* stats) override;
  void forward(StepContext& ctx, const float* x, float* out) override;

 private:
  const ModelConfig& cfg_;
  int layer_;
  std::string prefix_;
  int64_t window_;
  const float* norm_ = nullptr;
  Weight wq_, wk_, wv_, wo_;
  const float *bq_ = nullptr, *bk_ = nullptr, *bv_ = nullptr;
  const float *q_norm_ = nullptr, *k_norm_ = nullptr;
  int64_t heads_ = 0, kv_heads_ = 0;  // this rank's
  int64_t o_split_ = -1;              // TP=1 compatible: where the output projection's sum splits
  float *xn_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *attn_ = nullptr, *part_ = nullptr;
  void** rows_ = nullptr;  // cache row of each (token, KV head): K rows, then V rows
  ActivationStats* stats_ = nullptr;
  int st_in_ = -1, st_out_ = -1;
};

}  // namespace tf
