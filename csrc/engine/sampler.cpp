#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tf {

// NaN logits (a broken model or kernel) are never chosen over a number; all-NaN gives 0. The
// result is always in [0, n).
int32_t Sampler::argmax(const float* logits, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(logits[i])) continue;
    if (best < 0 || logits[i] > logits[best]) best = i;
  }
  return int32_t(best < 0 ? 0 : best);
}

float token_logprobs(const float* logits, int64_t n, int32_t token, int k,
                     std::vector<std::pair<int32_t, float>>& top) {
  // Online log-sum-exp: s = sum exp(x - m) over the finite logits, m their running maximum.
  double m = -std::numeric_limits<double>::infinity(), s = 0.0;
  int64_t n_inf = 0;  // +inf logits
  // "a is more likely than b" (ties: the lower id); the heap keeps the k best, worst on top.
  auto better = [](const std::pair<int32_t, float>& a, const std::pair<int32_t, float>& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  };
  top.clear();
  const size_t want = size_t(std::max<int64_t>(0, std::min<int64_t>(k, n)));
  top.reserve(want);
  for (int64_t i = 0; i < n; ++i) {
    const float x = std::isnan(logits[i]) ? -std::numeric_limits<float>::infinity() : logits[i];
    if (x == std::numeric_limits<float>::infinity()) {
      ++n_inf;
    } else if (x > -std::numeric_limits<float>::infinity()) {
      if (x > m) {
        s = s * std::exp(m - double(x)) + 1.0;
        m = x;
      } else {
        s += std::exp(double(x) - m);
      }
    }
    if (want == 0) continue;
    const std::pair<int32_t, float> c{int32_t(i), x};
    if (top.size() < want) {
      top.push_back(c);
      std::push_heap(top.begin(), top.end(), better);
    } else if (better(c, top.front())) {
      std::pop_heap(top.begin(), top.end(), better);
      top.back() = c;
      std::push_heap(top.begin(), top.end(), better);
    }
  }
  const double lse = m + std::log(s);  // -inf when no logit is finite
  auto logprob = [&](float x) -> float {
    if (n_inf > 0) return x == std::numeric_limits<float>::infinity() ? float(-std::log(double(n_inf)))
                                                                      : -std::numeric_limits<float>::infinity();
    if (!(s > 0.0) || !(x > -std::numeric_limits<float>::infinity())) return -std::numeric_limits<float>::infinity();
    return float(double(x) - lse);
  };
  std::sort_heap(top.begin(), top.end(), better);  // most likely first
  for (auto& t : top) t.second = logprob(t.second);
  if (token < 0 || token >= n) return -std::numeric_limits<float>::infinity();
  return logprob(std::isnan(logits[token]) ? -std::numeric_limits<float>::infinity() : logits[token]);
}

bool Sampler::distribution(const float* logits, int64_t n, size_t& keep_out, double& total_out) {
  // Invalid settings (NaN temperature, ...) are refused by Engine::add_request; here they
  // fall back to greedy rather than to an arbitrary candidate.
  if (!(p_.temperature > 0.f) || !std::isfinite(p_.temperature) || p_.top_k == 1) return false;
  auto& c = cand_;
  c.clear();
  c.reserve(size_t(n));
  bool pos_inf = false;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isfinite(logits[i])) c.emplace_back(logits[i], int32_t(i));
    pos_inf |= logits[i] == std::numeric_limits<float>::infinity();
  }
  // +inf outweighs every finite logit; no candidate at all leaves only argmax.
  if (pos_inf || c.empty()) return false;
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first; };
  size_t keep = c.size();
  if (p_.top_k > 0 && size_t(p_.top_k) < keep) {
    keep = size_t(p_.top_k);
    std::partial_sort(c.begin(), c.begin() + long(keep), c.end(), by_logit);
  } else {
    std::sort(c.begin(), c.end(), by_logit);
  }
  c.resize(keep);
  // Probabilities at temperature 1 for the nucleus / min-p filters.
  const float mx = c[0].first;
  auto& prob = prob_;
  prob.resize(keep);
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) sum += (prob[i] = std::exp(c[i].first - mx));
  if (p_.top_p > 0.f && p_.top_p < 1.f) {
    double cum = 0.0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += prob[i] / sum;
      if (cum >= p_.top_p) { cut = i + 1; break; }
    }
    keep = std::max<size_t>(1, cut);
  }
  if (p_.min_p > 0.f) {
    // prob[0] is the largest (exp(0) = 1): keep tokens with p >= min_p * p_max.
    size_t cut = 1;
    while (cut < keep && prob[cut] >= p_.min_p) ++cut;
    keep = cut;
  }
  // Temperature.
  auto& w = weight_;
  w.resize(keep);
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) total += (w[i] = std::exp(double(c[i].first - mx) / p_.temperature));
  keep_out = keep;
  total_out = total;
  return true;
}

int32_t Sampler::sample(const float* logits, int64_t n) {
  if (n <= 0) return 0;
  size_t keep = 0;
  double total = 0.0;
  if (!distribution(logits, n, keep, total)) return argmax(logits, n);
  std::uniform_real_distribution<double> uni(0.0, total);
  double r = uni(rng_);
  for (size_t i = 0; i < keep; ++i) {
    r -= weight_[i];
    if (r <= 0.0) return cand_[i].second;
  }
  return cand_[keep - 1].second;
}

int32_t Sampler::sample_given_draft(const float* logits, int64_t n, int32_t draft, bool& accepted) {
  accepted = false;
  if (n <= 0) return 0;
  size_t keep = 0;
  double total = 0.0;
  if (!distribution(logits, n, keep, total)) {
    const int32_t t = argmax(logits, n);
    accepted = t == draft;
    return t;
  }
  double w_draft = 0.0;
  size_t at = keep;
  for (size_t i = 0; i < keep; ++i)
    if (cand_[i].second == draft) {
      w_draft = weight_[i];
      at = i;
      break;
    }
  std::uniform_real_distribution<double> uni(0.0, total);
  if (uni(rng_) < w_draft) {  // probability p(draft)
    accepted = true;
    return draft;
  }
  // Rejected: a draw from p with the draft's weight removed.
  const double rest = total - w_draft;
  if (!(rest > 0.0)) return draft;  // p(draft) = 1 up to rounding: nothing else can come
  std::uniform_real_distribution<double> uni_rest(0.0, rest);
  double r = uni_rest(rng_);
  size_t last = keep;
  for (size_t i = 0; i < keep; ++i) {
    if (i == at) continue;
    last = i;
    r -= weight_[i];
    if (r <= 0.0) return cand_[i].second;
  }
  return cand_[last].second;
}

}  // namespace tf
