#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

namespace {

// exp(t) for t <= 0, 0 where t < -87 or t is NaN (no normal float is that small): Cody-Waite
// reduction t = n ln2 + r, |r| <= ln2 / 2, and a degree-7 polynomial, relative error ~1e-7.
// Written once over a vector type (GCC/Clang vector extensions: SSE/AVX on x86, NEON on arm64,
// whatever the target has) and used for single floats too, so that the vocabulary-wide passes
// run 8 lanes at a time where libm's exp is one call per value.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vectors inside this file only, never across an ABI
#endif
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

inline i32x8 to_int(f32x8 v) { return __builtin_convertvector(v, i32x8); }
inline int32_t to_int(float v) { return int32_t(v); }
inline f32x8 bits_as_float(i32x8 v) { return (f32x8)v; }
inline float bits_as_float(int32_t v) {
  float f;
  std::memcpy(&f, &v, sizeof f);
  return f;
}
inline f32x8 select(i32x8 m, f32x8 a, f32x8 b) { return m ? a : b; }
inline float select(bool m, float a, float b) { return m ? a : b; }

// One body for 8 lanes (F = f32x8) and for one value (F = float).
template <typename F>
__attribute__((always_inline)) inline F exp_nonpositive(F t) {
  const auto ok = t >= -87.f;  // true where t is a usable number
  t = select(ok, t, F{});
  const F n = (t * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  const F r = (t - n * 0.693359375f) + n * 2.12194440e-4f;
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const F scale = bits_as_float((to_int(n) + 127) << 23);  // 2^n
  return select(ok, p * scale, F{});
}

// The vocabulary-wide loops are built twice on x86-64, for the baseline and for AVX2 + FMA, and
// the loader picks the clone the CPU runs (GCC/Clang function multi-versioning): 8-lane vectors
// emulated on SSE2 cost 8x more. Elsewhere (arm64: NEON is the baseline) once.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define TF_VOCAB_LOOP __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define TF_VOCAB_LOOP
#endif

// The largest finite logit of x[0..n) (-inf when none), how many are finite and whether any is +inf.
TF_VOCAB_LOOP float finite_max(const float* x, int64_t n, int64_t& n_finite, bool& pos_inf) {
  const float inf = std::numeric_limits<float>::infinity();
  f32x8 m = f32x8{} - inf;
  i32x8 count = {}, posinf = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f32x8 v;
    std::memcpy(&v, x + i, sizeof v);
    const i32x8 finite = (v - v) == 0.f;  // false for inf and NaN
    m = finite && v > m ? v : m;
    count -= finite;
    posinf |= v == inf;
  }
  float mx = -inf;
  n_finite = 0;
  pos_inf = false;
  for (int l = 0; l < 8; ++l) {
    mx = std::max(mx, m[l]);
    n_finite += count[l];
    pos_inf |= posinf[l] != 0;
  }
  for (; i < n; ++i) {
    if (std::isfinite(x[i])) {
      ++n_finite;
      mx = std::max(mx, x[i]);
    } else {
      pos_inf |= x[i] == inf;
    }
  }
  return mx;
}

// w[i] = exp((x[i] - mx) * inv_t), the weights of the whole vocabulary (0 for -inf and NaN).
TF_VOCAB_LOOP void exp_weights(const float* x, int64_t n, float mx, float inv_t, float* w) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f32x8 v;
    std::memcpy(&v, x + i, sizeof v);
    v = exp_nonpositive((v - mx) * inv_t);
    std::memcpy(w + i, &v, sizeof v);
  }
  for (; i < n; ++i) w[i] = exp_nonpositive((x[i] - mx) * inv_t);
}

// Sum of w[0..n) in 8 lanes (the order of a vector loop, whatever the build vectorises).
TF_VOCAB_LOOP float sum_lanes(const float* w, size_t n) {
  f32x8 acc = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f32x8 v;
    std::memcpy(&v, w + i, sizeof v);
    acc += v;
  }
  float s = 0.f;
  for (int l = 0; l < 8; ++l) s += acc[l];
  for (; i < n; ++i) s += w[i];
  return s;
}

bool by_logit_desc(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first;
}

}  // namespace

bool Sampler::distribution(const float* logits, int64_t n, double& total) {
  // Invalid settings (NaN temperature, ...) are refused by Engine::add_request; here they
  // fall back to greedy rather than to an arbitrary candidate.
  if (!(p_.temperature > 0.f) || !std::isfinite(p_.temperature) || p_.top_k == 1) return false;
  // Pass 1: the largest finite logit; +inf outweighs every finite logit and no finite logit at
  // all leaves only argmax.
  int64_t n_finite = 0;
  bool pos_inf = false;
  const float mx = finite_max(logits, n, n_finite, pos_inf);
  if (pos_inf || n_finite == 0) return false;
  const float inv_t = 1.f / p_.temperature;
  const bool top_k = p_.top_k > 0 && int64_t(p_.top_k) < n_finite;
  const bool top_p = p_.top_p > 0.f && p_.top_p < 1.f;
  const bool min_p = p_.min_p > 0.f;
  auto& w = weight_;
  if (!top_k && !top_p && !min_p) {
    // No filter: every token is a candidate in place (non-finite ones weigh 0).
    dense_ = true;
    w.resize(size_t(n));
    exp_weights(logits, n, mx, inv_t, w.data());
  } else {
    dense_ = false;
    auto& c = cand_;
    c.clear();
    // min-p keeps p >= min_p * p_max, i.e. x - mx >= log(min_p) (a prefix of the sorted order,
    // like top-p's, so the two cuts commute: the result is the shorter prefix).
    const float min_logit = min_p ? mx + std::log(std::min(p_.min_p, 1.f)) : -std::numeric_limits<float>::infinity();
    if (top_k && p_.top_k > kHeapTopK) {
      top_k_by_buckets(logits, n, mx, size_t(p_.top_k));
    } else if (top_k) {
      // The k largest by a min-heap (smallest on top): most logits fail the first comparison.
      const size_t k = size_t(p_.top_k);
      c.reserve(k);
      auto smaller_first = [](const auto& a, const auto& b) { return a.first > b.first; };
      for (int64_t i = 0; i < n; ++i) {
        const float x = logits[i];
        if (!std::isfinite(x)) continue;
        if (c.size() < k) {
          c.emplace_back(x, int32_t(i));
          std::push_heap(c.begin(), c.end(), smaller_first);
        } else if (x > c.front().first) {
          std::pop_heap(c.begin(), c.end(), smaller_first);
          c.back() = {x, int32_t(i)};
          std::push_heap(c.begin(), c.end(), smaller_first);
        }
      }
    }
    if (top_k) {
      if (top_p) {
        // top-p over the k: the same buckets over a copy of the heap's logits.
        top_x_.resize(c.size());
        top_w_.resize(c.size());
        top_id_.resize(c.size());
        double mass = 0.0;
        for (size_t i = 0; i < c.size(); ++i) {
          top_x_[i] = c[i].first;
          top_id_[i] = c[i].second;
          mass += double(top_w_[i] = exp_nonpositive(c[i].first - mx));
        }
        c.clear();
        nucleus(top_x_.data(), top_w_.data(), int64_t(top_x_.size()), mx, mass, min_logit);
        for (auto& e : c) e.second = top_id_[size_t(e.second)];  // positions in the copy -> token ids
      } else if (min_p) {
        c.erase(std::remove_if(c.begin(), c.end(), [&](const auto& e) { return e.first < min_logit; }), c.end());
      }
    } else if (top_p) {
      w.resize(size_t(n));
      exp_weights(logits, n, mx, 1.f, w.data());
      const double mass = sum_lanes(w.data(), w.size());
      nucleus(logits, w.data(), n, mx, mass, min_logit);
    } else {
      for (int64_t i = 0; i < n; ++i)
        if (logits[i] >= min_logit) c.emplace_back(logits[i], int32_t(i));  // false for NaN
    }
    // Temperature.
    w.resize(c.size());
    for (size_t i = 0; i < c.size(); ++i) w[i] = exp_nonpositive((c[i].first - mx) * inv_t);
  }
  // Block sums (pick() skips whole blocks) and the total.
  const size_t m = w.size();
  block_sum_.resize((m + kPickBlock - 1) / kPickBlock);
  total = 0.0;
  for (size_t b = 0; b < block_sum_.size(); ++b) {
    const size_t e = std::min(m, (b + 1) * kPickBlock);
    const float s = sum_lanes(w.data() + b * kPickBlock, e - b * kPickBlock);
    block_sum_[b] = double(s);
    total += double(s);
  }
  return total > 0.0;
}

namespace {

// top-p's buckets: by logit below the maximum (the sorted order, coarsely); the last one holds
// everything whose weight underflows (and -inf / NaN, weight 0).
constexpr int kBuckets = 4096;
constexpr float kBucketsPerUnit = float(kBuckets - 1) / 87.f;  // exp(-87): about the smallest normal float

inline int bucket_of(float x, float mx) {
  const float d = (mx - x) * kBucketsPerUnit;
  return d < float(kBuckets - 1) ? int(d) : kBuckets - 1;  // NaN compares false
}

// mass[b] += w[i] for every token i of bucket b (two interleaved tables: consecutive tokens of
// one bucket do not wait on each other's additions).
TF_VOCAB_LOOP void add_bucket_mass(const float* x, const float* w, int64_t n, float mx, double* mass) {
  double* other = mass + kBuckets;
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    mass[bucket_of(x[i], mx)] += double(w[i]);
    other[bucket_of(x[i + 1], mx)] += double(w[i + 1]);
  }
  for (; i < n; ++i) mass[bucket_of(x[i], mx)] += double(w[i]);
  for (int b = 0; b < kBuckets; ++b) mass[b] += other[b];
}

}  // namespace

size_t Sampler::nucleus(const float* x, const float* w, int64_t n, float mx, double mass, float min_logit) {
  // One pass adds each token's weight to its logit bucket; a walk down the buckets finds the one
  // where the mass reaches the target; every token above it is kept as it is, and only that
  // bucket's tokens are sorted to find the exact cut. O(n) with no sort of the vocabulary (a
  // sort or a quickselect mispredicts on every other element). Appends the kept tokens (those at
  // or above min_logit: min-p's cut commutes with top-p's) to cand_; returns how many.
  auto& c = cand_;
  const double target = double(p_.top_p) * mass;
  bucket_mass_.assign(2 * size_t(kBuckets), 0.0);
  add_bucket_mass(x, w, n, mx, bucket_mass_.data());
  double before = 0.0;  // mass of the buckets above the cut's bucket
  int cut = 0;
  while (cut < kBuckets - 1 && before + bucket_mass_[size_t(cut)] < target) before += bucket_mass_[size_t(cut++)];
  auto& at = boundary_;
  at.clear();
  const size_t first = c.size();
  for (int64_t i = 0; i < n; ++i) {
    const int b = bucket_of(x[i], mx);
    if (b > cut || !(x[i] >= min_logit)) continue;
    if (b < cut) c.emplace_back(x[i], int32_t(i));
    else at.emplace_back(x[i], int32_t(i));
  }
  std::sort(at.begin(), at.end(), by_logit_desc);
  for (const auto& e : at) {
    if (before >= target && c.size() > first) break;
    c.push_back(e);
    before += double(w[e.second]);
  }
  return c.size() - first;
}

void Sampler::top_k_by_buckets(const float* x, int64_t n, float mx, size_t k) {
  // Count the finite logits per bucket, find the bucket where the count reaches k, keep every
  // token above it and the best of that bucket's (sorted): O(n), where a heap of a large k costs
  // O(n log k) and mispredicts.
  auto& c = cand_;
  bucket_count_.assign(kBuckets, 0);
  for (int64_t i = 0; i < n; ++i) bucket_count_[size_t(bucket_of(x[i], mx))] += std::isfinite(x[i]) ? 1 : 0;
  size_t above = 0;
  int cut = 0;
  while (cut < kBuckets - 1 && above + bucket_count_[size_t(cut)] < k) above += bucket_count_[size_t(cut++)];
  auto& at = boundary_;
  at.clear();
  c.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) continue;
    const int b = bucket_of(x[i], mx);
    if (b < cut) c.emplace_back(x[i], int32_t(i));
    else if (b == cut) at.emplace_back(x[i], int32_t(i));
  }
  const size_t need = std::min(at.size(), k - c.size());
  std::partial_sort(at.begin(), at.begin() + long(need), at.end(), by_logit_desc);
  c.insert(c.end(), at.begin(), at.begin() + long(need));
}

size_t Sampler::pick(double r, size_t skip) const {
  const auto& w = weight_;
  const size_t m = w.size();
  size_t last = m;  // the last candidate with weight, for rounding at the very end
  for (size_t b = 0; b < block_sum_.size(); ++b) {
    const size_t lo = b * kPickBlock, hi = std::min(m, lo + kPickBlock);
    const double bs = block_sum_[b] - (skip >= lo && skip < hi ? double(w[skip]) : 0.0);
    if (r >= bs && b + 1 < block_sum_.size()) {
      r -= bs;
      continue;
    }
    for (size_t i = lo; i < hi; ++i) {
      if (i == skip || !(w[i] > 0.f)) continue;
      last = i;
      r -= double(w[i]);
      if (r < 0.0) return i;
    }
  }
  if (last < m) return last;
  // Nothing after the chosen block had weight: the last weighted candidate of all.
  for (size_t i = m; i-- > 0;)
    if (i != skip && w[i] > 0.f) return i;
  return skip < m ? skip : 0;
}

void Sampler::observe(int32_t token, int64_t n) {
  if ((p_.presence_penalty == 0.f && p_.frequency_penalty == 0.f) || token < 0 || token >= n) return;
  if (counts_.size() != size_t(n)) counts_.assign(size_t(n), 0);
  if (counts_[size_t(token)]++ == 0) generated_.push_back(token);
}

const float* Sampler::penalized(const float* logits, int64_t n) {
  if (generated_.empty() || counts_.size() != size_t(n)) return logits;
  penalized_.assign(logits, logits + n);
  for (int32_t t : generated_)
    penalized_[size_t(t)] -= p_.presence_penalty + p_.frequency_penalty * float(counts_[size_t(t)]);
  return penalized_.data();
}

int32_t Sampler::sample(const float* raw, int64_t n) {
  if (n <= 0) return 0;
  const float* logits = penalized(raw, n);
  double total = 0.0;
  if (!distribution(logits, n, total)) return argmax(logits, n);
  std::uniform_real_distribution<double> uni(0.0, total);
  return id_at(pick(uni(rng_), size_t(-1)));
}

int32_t Sampler::sample_given_draft(const float* raw, int64_t n, int32_t draft, bool& accepted) {
  accepted = false;
  if (n <= 0) return 0;
  const float* logits = penalized(raw, n);
  double total = 0.0;
  if (!distribution(logits, n, total)) {
    const int32_t t = argmax(logits, n);
    accepted = t == draft;
    return t;
  }
  size_t at = size_t(-1);
  if (dense_) {
    if (draft >= 0 && draft < n) at = size_t(draft);
  } else {
    for (size_t i = 0; i < cand_.size(); ++i)
      if (cand_[i].second == draft) {
        at = i;
        break;
      }
  }
  const double w_draft = at < weight_.size() ? double(weight_[at]) : 0.0;
  std::uniform_real_distribution<double> uni(0.0, total);
  if (uni(rng_) < w_draft) {  // probability p(draft)
    accepted = true;
    return draft;
  }
  // Rejected: a draw from p with the draft's weight removed.
  const double rest = total - w_draft;
  if (!(rest > 0.0)) return draft;  // p(draft) = 1 up to rounding: nothing else can come
  std::uniform_real_distribution<double> uni_rest(0.0, rest);
  return id_at(pick(uni_rest(rng_), at));
}

}  // namespace tf
