// Expert routing for Mixture-of-Experts layers: turns router logits into the chosen experts
// and their combine weights, in every variant the large open MoE families use.
#pragma once
#include <cstdint>

namespace tf::moe {

enum class Gating : int {
  Softmax = 1,  // probabilities = softmax(logits)          (qwen2moe, qwen3moe, mixtral, deepseek v2)
  Sigmoid = 2,  // scores = sigmoid(logits)                  (deepseek v3)
  SqrtSoftplus = 4,  // scores = sqrt(softplus(logits))     (deepseek v4; llama.cpp's value 4)
};

struct RouterConfig {
  int n_expert = 0;
  int n_used = 0;              // experts per token (top-k)
  Gating gating = Gating::Softmax;
  // true: weights renormalised over the chosen experts (norm_topk_prob; mixtral's
  // top-k-then-softmax is softmax + norm_topk).
  bool norm_topk = false;
  float scale = 1.0f;          // routed_scaling_factor, applied to the final weights
  // Per-expert score-correction bias (deepseek v3 e_score_correction_bias), or nullptr.
  // Added to the scores for *selection* only; weights use the uncorrected scores.
  const float* selection_bias = nullptr;
  // Group-limited routing: experts split into n_group equal groups; only experts in the
  // best n_group_used groups may be chosen. A group's score is the sum of its two best
  // (bias-corrected) scores for sigmoid and sqrtsoftplus gating (v3), its best score for
  // softmax (v2).
  int n_group = 1;
  int n_group_used = 1;
};

// Validates a configuration (throws tf::Error naming the problem).
void validate(const RouterConfig& cfg);

// Routes T tokens. logits: [T][n_expert]. Writes ids: [T][n_used] (best first) and
// weights: [T][n_used]. `scratch` must hold 3 * n_expert floats. No allocation.
// fixed (hash routing): [T][n_used] expert ids chosen by a table, copied to ids in their order;
// the weights are the gating scores at those ids (renormalised with norm_topk, then scaled);
// selection bias and groups play no part.
void route(const RouterConfig& cfg, const float* logits, int64_t T, int32_t* ids, float* weights,
           float* scratch, const int32_t* fixed = nullptr);

// Straightforward reference implementation of the same (double precision, full sorts).
void route_reference(const RouterConfig& cfg, const float* logits, int64_t T, int32_t* ids,
                     float* weights, const int32_t* fixed = nullptr);

}  // namespace tf::moe
