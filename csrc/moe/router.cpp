// Expert routing: softmax / sigmoid / sqrtsoftplus gating, optional selection bias, group-limited
// top-k or ids fixed by a table (hash routing), renormalisation and routed scaling. See router.h
// for the contract.
//
// Selection order (both implementations): higher selection score first; when two scores are
// exactly equal the lower expert (or group) id wins. Output ids are ordered best first.
//
// Numerics of the fast path:
// - Softmax, sigmoid and sqrt(softplus) are strictly increasing, so without a selection bias experts (and
//   softmax groups, whose score is their best expert) are ranked on the raw logits: the same
//   order as the exact probabilities, without the ties float rounding of exp() could add.
// - With a bias the selection score is score + bias, computed in float (as HF does).
// - Sigmoid (and sqrtsoftplus) group scores are the sum of the group's two best bias-corrected
//   scores (one when a group holds a single expert); softmax group scores are the group's best.
// - Group limiting is skipped where it cannot change the outcome: one group, all groups used,
//   or one expert per group (then a group's score is its expert's score).
// - norm_topk divides by the sum of the chosen weights; for sigmoid and sqrtsoftplus gating 1e-20
//   is added to that sum (HF DeepSeek-V3/V4), for softmax nothing is (HF Qwen2/3-MoE, Mixtral).
// - softplus(x) = max(x, 0) + log1p(exp(-|x|)): no overflow for large x, no loss for small.
// - Float sigmoid saturates (exactly 1.0 for logits above ~17), so very large logits can make
//   group sums tie in float that the double reference still separates; ties go to the lower id.
// NaN logits give an unspecified (but duplicate-free, in-range) selection.
#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace tf::moe {

namespace {

constexpr double kSigmoidNormEps = 1e-20;

inline float sqrt_softplus(float x) { return std::sqrt(std::max(x, 0.f) + std::log1p(std::exp(-std::fabs(x)))); }
inline double sqrt_softplus(double x) { return std::sqrt(std::max(x, 0.0) + std::log1p(std::exp(-std::fabs(x)))); }

void check_fixed(const RouterConfig& cfg, const int32_t* ids) {
  for (int j = 0; j < cfg.n_used; ++j)
    TF_CHECK(ids[j] >= 0 && ids[j] < cfg.n_expert, "moe router: fixed expert id ", ids[j], " out of range [0, ",
             cfg.n_expert, ")");
}

// Inserts candidate (v, id) into the list vals/ids[0..count) kept sorted best first, capped at
// k entries. Candidates must arrive in increasing id order, so an equal value already in the
// list has the lower id and stays ahead: a candidate only overtakes strictly smaller values.
inline void topk_push(float v, int32_t id, int k, int& count, float* vals, int32_t* ids) {
  int pos;
  if (count < k) {
    pos = count++;
  } else {
    if (!(v > vals[k - 1])) return;
    pos = k - 1;
  }
  while (pos > 0 && v > vals[pos - 1]) {
    vals[pos] = vals[pos - 1];
    ids[pos] = ids[pos - 1];
    --pos;
  }
  vals[pos] = v;
  ids[pos] = id;
}

}  // namespace

void validate(const RouterConfig& cfg) {
  TF_CHECK(cfg.n_expert >= 1, "moe router: n_expert must be >= 1 (got ", cfg.n_expert, ")");
  TF_CHECK(cfg.n_used >= 1 && cfg.n_used <= cfg.n_expert, "moe router: n_used must be in [1, n_expert=",
           cfg.n_expert, "] (got ", cfg.n_used, ")");
  TF_CHECK(cfg.gating == Gating::Softmax || cfg.gating == Gating::Sigmoid || cfg.gating == Gating::SqrtSoftplus,
           "moe router: unknown gating function ", static_cast<int>(cfg.gating));
  TF_CHECK(std::isfinite(cfg.scale), "moe router: scale must be finite");
  TF_CHECK(cfg.n_group >= 1, "moe router: n_group must be >= 1 (got ", cfg.n_group, ")");
  TF_CHECK(cfg.n_expert % cfg.n_group == 0, "moe router: n_expert=", cfg.n_expert,
           " is not divisible by n_group=", cfg.n_group);
  TF_CHECK(cfg.n_group_used >= 1 && cfg.n_group_used <= cfg.n_group,
           "moe router: n_group_used must be in [1, n_group=", cfg.n_group, "] (got ", cfg.n_group_used,
           ")");
  const int per_group = cfg.n_expert / cfg.n_group;
  TF_CHECK(static_cast<int64_t>(cfg.n_used) <= static_cast<int64_t>(cfg.n_group_used) * per_group,
           "moe router: n_used=", cfg.n_used, " exceeds the experts in the used groups (n_group_used=",
           cfg.n_group_used, " x ", per_group, " experts per group)");
}

void route(const RouterConfig& cfg, const float* logits, int64_t T, int32_t* ids, float* weights,
           float* scratch, const int32_t* fixed) {
  validate(cfg);
  TF_CHECK(T >= 0, "moe router: negative token count");
  if (T == 0) return;
  TF_CHECK(logits && ids && weights && scratch, "moe router: null buffer");

  const int n = cfg.n_expert, k = cfg.n_used;
  const bool softmax = cfg.gating == Gating::Softmax;
  const float* bias = cfg.selection_bias;
  const int per_group = n / cfg.n_group;
  const bool grouped = cfg.n_group > 1 && cfg.n_group_used < cfg.n_group && per_group > 1;

  float* score = scratch;          // [n] gating scores (softmax: exp(l - max), unnormalised)
  float* biased = scratch + n;     // [n] score + bias, only with a bias
  float* gscore = scratch + 2 * n; // [n_group] group scores; [n_group, 2 n_group) group mask
  float* gmask = gscore + cfg.n_group;  // grouped => per_group >= 2 => 2 n_group <= n

  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * n;
    int32_t* out_id = ids + t * k;
    float* out_w = weights + t * k;

    // 1. Gating scores. Softmax keeps exp(l - max) and its inverse sum.
    float inv_sum = 1.0f;
    if (cfg.gating == Gating::Sigmoid) {
      for (int e = 0; e < n; ++e) score[e] = 1.0f / (1.0f + std::exp(-l[e]));
    } else if (cfg.gating == Gating::SqrtSoftplus) {
      for (int e = 0; e < n; ++e) score[e] = sqrt_softplus(l[e]);
    } else {
      float mx = l[0];
      for (int e = 1; e < n; ++e) mx = l[e] > mx ? l[e] : mx;
      float sum = 0.0f;
      for (int e = 0; e < n; ++e) {
        score[e] = std::exp(l[e] - mx);
        sum += score[e];
      }
      inv_sum = 1.0f / sum;
    }

    if (fixed) {  // hash routing: the table chose; straight to the weights
      check_fixed(cfg, fixed + t * k);
      std::copy(fixed + t * k, fixed + (t + 1) * k, out_id);
    } else {
      // 2. Selection keys: logits (order-equivalent) without a bias, score + bias with one.
      const float* sel = l;
      if (bias) {
        for (int e = 0; e < n; ++e) biased[e] = score[e] * inv_sum + bias[e];
        sel = biased;
      }

      // 3. Group limiting: keep the n_group_used best groups (by repeated argmax; tiny sizes).
      if (grouped) {
        for (int g = 0; g < cfg.n_group; ++g) {
          const float* s = sel + g * per_group;
          if (!softmax) {
            // Sum of the two best bias-corrected scores of the group.
            const float* val = bias ? biased + g * per_group : score + g * per_group;
            int b0 = 0, b1 = 1;
            if (s[1] > s[0]) std::swap(b0, b1);
            for (int j = 2; j < per_group; ++j) {
              if (s[j] > s[b0]) {
                b1 = b0;
                b0 = j;
              } else if (s[j] > s[b1]) {
                b1 = j;
              }
            }
            gscore[g] = val[b0] + val[b1];
          } else {
            float best = s[0];
            for (int j = 1; j < per_group; ++j) best = s[j] > best ? s[j] : best;
            gscore[g] = best;
          }
          gmask[g] = 0.0f;
        }
        for (int r = 0; r < cfg.n_group_used; ++r) {
          int best = -1;
          for (int g = 0; g < cfg.n_group; ++g) {
            if (gmask[g] != 0.0f) continue;
            if (best < 0 || gscore[g] > gscore[best]) best = g;
          }
          gmask[best] = 1.0f;
        }
      }

      // 4. Top-k experts (partial insertion selection into the output rows; out_w holds the
      //    selection keys until step 5).
      int count = 0;
      if (grouped) {
        for (int g = 0; g < cfg.n_group; ++g) {
          if (gmask[g] == 0.0f) continue;
          for (int e = g * per_group; e < (g + 1) * per_group; ++e) topk_push(sel[e], e, k, count, out_w, out_id);
        }
      } else {
        for (int e = 0; e < n; ++e) topk_push(sel[e], e, k, count, out_w, out_id);
      }
    }

    // 5. Weights from the unbiased scores.
    for (int j = 0; j < k; ++j) out_w[j] = score[out_id[j]];
    float mul = cfg.scale;
    if (cfg.norm_topk) {
      float s = 0.0f;
      for (int j = 0; j < k; ++j) s += out_w[j];
      mul = !softmax ? static_cast<float>(cfg.scale / (static_cast<double>(s) + kSigmoidNormEps))
                     : cfg.scale / s;
    } else if (softmax) {
      mul = cfg.scale * inv_sum;
    }
    for (int j = 0; j < k; ++j) out_w[j] *= mul;
  }
}

void route_reference(const RouterConfig& cfg, const float* logits, int64_t T, int32_t* ids,
                     float* weights, const int32_t* fixed) {
  validate(cfg);
  TF_CHECK(T >= 0, "moe router: negative token count");
  if (T == 0) return;
  TF_CHECK(logits && ids && weights, "moe router: null buffer");

  const int n = cfg.n_expert, k = cfg.n_used;
  const bool softmax = cfg.gating == Gating::Softmax;
  const int per_group = n / cfg.n_group;
  std::vector<double> score(n), sel(n);

  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * n;
    if (cfg.gating == Gating::Sigmoid) {
      for (int e = 0; e < n; ++e) score[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(l[e])));
    } else if (cfg.gating == Gating::SqrtSoftplus) {
      for (int e = 0; e < n; ++e) score[e] = sqrt_softplus(static_cast<double>(l[e]));
    } else {
      double mx = -std::numeric_limits<double>::infinity();
      for (int e = 0; e < n; ++e) mx = std::max(mx, static_cast<double>(l[e]));
      double sum = 0.0;
      for (int e = 0; e < n; ++e) sum += score[e] = std::exp(static_cast<double>(l[e]) - mx);
      for (int e = 0; e < n; ++e) score[e] /= sum;
    }
    std::vector<int> candidates;
    if (fixed) {
      check_fixed(cfg, fixed + t * k);
      candidates.assign(fixed + t * k, fixed + (t + 1) * k);
    } else {
      for (int e = 0; e < n; ++e) sel[e] = score[e] + (cfg.selection_bias ? cfg.selection_bias[e] : 0.0);

      auto better = [&](const std::vector<double>& v) {
        return [&v](int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
      };

      // Group scores from each group's experts sorted best first.
      std::vector<double> gscore(cfg.n_group);
      for (int g = 0; g < cfg.n_group; ++g) {
        std::vector<int> members(per_group);
        std::iota(members.begin(), members.end(), g * per_group);
        std::sort(members.begin(), members.end(), better(sel));
        gscore[g] = sel[members[0]];
        if (!softmax && per_group > 1) gscore[g] += sel[members[1]];
      }
      std::vector<int> groups(cfg.n_group);
      std::iota(groups.begin(), groups.end(), 0);
      std::sort(groups.begin(), groups.end(), better(gscore));

      for (int r = 0; r < cfg.n_group_used; ++r)
        for (int j = 0; j < per_group; ++j) candidates.push_back(groups[r] * per_group + j);
      std::sort(candidates.begin(), candidates.end(), better(sel));
    }

    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += score[candidates[j]];
    const double denom = cfg.norm_topk ? sum + (!softmax ? kSigmoidNormEps : 0.0) : 1.0;
    for (int j = 0; j < k; ++j) {
      ids[t * k + j] = candidates[j];
      weights[t * k + j] = static_cast<float>(score[candidates[j]] / denom * cfg.scale);
    }
  }
}

}  // namespace tf::moe
