// Token sampling: greedy, temperature, top-k, top-p, min-p, reproducible with a seed.
// Presence and frequency penalties first adjust the logits of the tokens generated so far;
// filters apply in llama.cpp's order (top-k, top-p, min-p on the unscaled distribution),
// then temperature, then a draw from the request's own RNG.
#pragma once
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace tf {

struct SamplingParams {
  float temperature = 0.8f;  // <= 0: greedy
  int top_k = 40;            // <= 0: off
  float top_p = 0.95f;       // >= 1: off
  float min_p = 0.05f;       // <= 0: off
  uint64_t seed = 0;
  // OpenAI's penalties over the tokens generated so far (as vLLM: the prompt's do not count):
  // logit[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]. 0: off.
  float presence_penalty = 0.f;
  float frequency_penalty = 0.f;
};

// Log-probabilities of a logits row as OpenAI and vLLM report them: the log-softmax of the raw
// logits (temperature 1, before any top-k / top-p / min-p filtering), whatever the request
// samples with, so they describe the model, not the sampling settings. One pass: an online
// log-sum-exp (in double) and a k-entry heap of the best tokens (ties: lower id first). Returns
// the log-probability of `token`; `top` receives the k most likely (token, log-probability),
// most likely first. NaN logits count as -inf; +inf logits share all the probability.
float token_logprobs(const float* logits, int64_t n_vocab, int32_t token, int k,
                     std::vector<std::pair<int32_t, float>>& top);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}
  int32_t sample(const float* logits, int64_t n_vocab);
  static int32_t argmax(const float* logits, int64_t n_vocab);
  // Speculative verification of a drafted token whose draft was deterministic (the draft's
  // distribution is all on `draft`): with p the distribution sample() draws from, `draft` is
  // accepted with probability p(draft); otherwise a token is drawn from p without `draft`
  // (renormalised) — the rejection-sampling residual max(0, p - q) for that q. The result is
  // distributed exactly as sample()'s. Greedy: the argmax, accepted when it is `draft`.
  int32_t sample_given_draft(const float* logits, int64_t n_vocab, int32_t draft, bool& accepted);
  // A token was generated (counts for the penalties; a no-op when they are off).
  void observe(int32_t token, int64_t n_vocab);

 private:
  // The logits after the penalties: `logits` itself when they are off or nothing was generated,
  // else a copy with the generated tokens' entries lowered (O(vocabulary) copy + O(distinct)).
  const float* penalized(const float* logits, int64_t n_vocab);
  // The distribution sample() draws from: candidates and their weights (sum `total`); false
  // when the settings or the logits leave no choice (greedy, +inf, no finite logit). O(n_vocab):
  // one pass for the maximum, one for the weights (a vectorisable exp), selection only where a
  // filter needs it (a k-heap for top-k, growing partial sorts for top-p) and never a full sort.
  bool distribution(const float* logits, int64_t n_vocab, double& total);
  // Appends to cand_ top-p's nucleus of the tokens x[0..n) (weights w = exp(x - mx), summing
  // to `mass`): the smallest most-likely set whose mass reaches top_p, less those below
  // min_logit, in no particular order; returns how many.
  size_t nucleus(const float* x, const float* w, int64_t n, float mx, double mass, float min_logit);
  // cand_ = the k largest finite logits of x[0..n) (k below their count), in no particular order.
  void top_k_by_buckets(const float* x, int64_t n, float mx, size_t k);
  static constexpr int kHeapTopK = 256;  // up to this k a heap selects (most logits fail one comparison)
  // The candidate whose cumulative weight first reaches r (r in [0, total)), skipping `skip`.
  size_t pick(double r, size_t skip) const;
  int32_t id_at(size_t i) const { return dense_ ? int32_t(i) : cand_[i].second; }
  SamplingParams p_;
  std::mt19937_64 rng_;
  // Reused between calls: no allocation per token once warmed up. dense_: every token is a
  // candidate (no filter), weight_[i] belongs to token i (0 for a non-finite logit), cand_ unused.
  bool dense_ = false;
  std::vector<std::pair<float, int32_t>> cand_;
  std::vector<float> weight_;
  std::vector<std::pair<float, int32_t>> boundary_;  // nucleus(): the cut bucket's candidates
  std::vector<double> bucket_mass_;                  // nucleus(): mass per logit bucket
  std::vector<float> top_x_, top_w_;                 // top-k then top-p: the k logits and weights
  std::vector<int32_t> top_id_;
  std::vector<size_t> bucket_count_;                 // top_k_by_buckets(): tokens per logit bucket
  std::vector<int32_t> counts_;     // per token: times generated (allocated once penalties apply)
  std::vector<int32_t> generated_;  // distinct tokens generated, in order of first appearance
  std::vector<float> penalized_;    // the adjusted copy of the logits
  std::vector<double> block_sum_;  // sums of weight_ over kPickBlock candidates: pick() skips blocks
  static constexpr size_t kPickBlock = 256;
};

}  // namespace tf
