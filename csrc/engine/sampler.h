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

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}
  int32_t sample(const float* logits, int64_t n_vocab);
  static int32_t argmax(const float* logits, int64_t n_vocab);

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  // Reused between calls: no allocation per token once warmed up.
  std::vector<std::pair<float, int32_t>> cand_;
  std::vector<double> prob_, weight_;
};

}  // namespace tf
