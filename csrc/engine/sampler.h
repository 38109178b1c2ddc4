// Token sampling: greedy, temperature, top-k, top-p, min-p, reproducible with a seed.
// Filters apply in llama.cpp's order (top-k, top-p, min-p on the unscaled distribution),
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

 private:
  // The candidates (c[0..keep)) and their weights w (sum `total`) that sample() draws from;
  // false when the settings or the logits leave no choice (greedy, +inf, no finite logit).
  bool distribution(const float* logits, int64_t n_vocab, size_t& keep, double& total);
  SamplingParams p_;
  std::mt19937_64 rng_;
  // Reused between calls: no allocation per token once warmed up.
  std::vector<std::pair<float, int32_t>> cand_;
  std::vector<double> prob_, weight_;
};

}  // namespace tf
