// Shared machinery of the scale-and-level quantizers (legacy.cpp, kquants.cpp, iq4.cpp).
//
// The core is an exact sweep over the inverse scale t = 1/d. For a fixed t every value takes
// its nearest level L[k] to x*t; as t grows the level of value i changes only where x_i*t
// crosses a midpoint between two levels. Ordering those crossing points ("events") by t and
// walking through them visits every distinct level assignment reachable by rounding, each in
// O(1) (running weighted sums), and for each assignment the least-squares scale (and offset)
// gives its exact weighted error. The best assignment over the swept t range is (up to the
// bucket ordering, see Events) the optimum over all rounding-generated assignments there — a
// superset of any candidate-scale grid with least-squares refits. Near-ties go to the larger
// t (smaller scale): it suits a shared super-scale (a lone outlier could otherwise sit on level
// 1 with its own value as the scale). Every final scale is rounded to fp16 before the levels
// are chosen against it, since the decoder uses the rounded value.
//
// Header-only (inline / templates). All state is on the stack or in an Events scratch the
// caller owns (one per row), so the quantizers are thread-safe; no thread_local (its
// __tls_get_addr lookups cost ~30% inside the Python extension module).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/half.h"

namespace tf::quant::detail {

constexpr float kMaxHalf = 65504.0f;

// fp16 bits of v, clamped to the finite range (a scale must never become infinite).
inline uint16_t half_bits(float v) {
  v = std::min(kMaxHalf, std::max(-kMaxHalf, v));
  return fp32_to_fp16(v);
}
inline float half_val(uint16_t h) { return fp16_to_fp32(h); }

// The finite fp16 value `dir` steps away from h in value order (-0 and +0 are one value).
inline uint16_t half_step(uint16_t h, int dir) {
  const int mag = h & 0x7fff;
  int v = (h & 0x8000) ? -mag : mag;
  v = std::min(0x7bff, std::max(-0x7bff, v + dir));
  return v < 0 ? uint16_t(0x8000 | -v) : uint16_t(v);
}

// Round to nearest after clamping to [lo, hi] (|lo|, |hi| < 2^22); NaN -> lo.
inline int round_clamp(float v, float lo, float hi) {
  v = v >= lo ? v : lo;
  v = v <= hi ? v : hi;
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return int((v + kMagic) - kMagic);
}

// Evenly spaced integer levels lo..hi (index k <-> value lo + k).
struct UniformLevels {
  int lo, hi;
  int count() const { return hi - lo + 1; }
  float val(int k) const { return float(lo + k); }
  float mid(int k) const { return float(lo + k) + 0.5f; }  // between levels k and k+1
  float top() const { return float(hi); }
  float bottom() const { return float(lo); }
  int nearest(float v) const { return round_clamp(v, float(lo), float(hi)) - lo; }
};

// A sorted table of up to 16 levels (IQ4_NL's non-linear levels).
struct TableLevels {
  float v[16], m[16];
  int K;
  template <class T>
  TableLevels(const T* values, int k) : K(k) {
    for (int i = 0; i < K; ++i) v[i] = float(values[i]);
    std::sort(v, v + K);
    for (int i = 0; i + 1 < K; ++i) m[i] = 0.5f * (v[i] + v[i + 1]);
  }
  int count() const { return K; }
  float val(int k) const { return v[k]; }
  float mid(int k) const { return m[k]; }
  float top() const { return v[K - 1]; }
  float bottom() const { return v[0]; }
  int nearest(float x) const {
    int k = 0;
    for (int i = 0; i + 1 < K; ++i) k += x > m[i];
    return k;
  }
};

// Event list of a sweep: times t (> 0) and the value index each belongs to, ordered by t with
// one counting-sort pass into n buckets over [min t, max t] (times spread fairly evenly over
// the swept range). Events that share a bucket stay in generation order: the sweep then
// visits a slightly different sequence of assignments there, every one of them still a real
// assignment scored exactly, so results stay valid; finishing the order with an insertion
// sort cost ~25% of the run time for a change in the 4th digit of the error.
struct Events {
  std::vector<float> t, ts;
  std::vector<uint16_t> id, ids;
  std::vector<uint32_t> cnt;
  int n = 0;
  void clear() { n = 0; }
  void push(float tv, int i) {
    if (n == int(t.size())) {
      t.resize(size_t(n) * 2 + 256);
      id.resize(t.size());
    }
    t[n] = tv;
    id[n] = uint16_t(i);
    ++n;
  }
  // Orders the events into ts / ids.
  void sort() {
    if (int(ts.size()) < n + 1) {
      ts.resize(size_t(n) + 1);
      ids.resize(size_t(n) + 1);
    }
    if (n == 0) return;
    float lo = t[0], hi = t[0];
    for (int e = 1; e < n; ++e) {
      lo = std::min(lo, t[e]);
      hi = std::max(hi, t[e]);
    }
    const int B = n;
    cnt.assign(size_t(B) + 1, 0);
    const float sc = hi > lo ? float(B) * 0.999f / (hi - lo) : 0.0f;
    for (int e = 0; e < n; ++e) ++cnt[size_t((t[e] - lo) * sc) + 1];
    for (int b = 1; b <= B; ++b) cnt[b] += cnt[b - 1];
    for (int e = 0; e < n; ++e) {
      const uint32_t p = cnt[size_t((t[e] - lo) * sc)]++;
      ts[p] = t[e];
      ids[p] = id[e];
    }
  }
};


struct SymFit {
  double gain = 0;  // S1^2 / S2: the error is sum w x^2 - gain
  float d = 0;      // least-squares scale of the best assignment
};

// x ~= d * L[idx] (d > 0 searched; pass -x for the other sign). Sweeps t = 1/d over
// [t_lo, t_hi]; idx (n entries, n <= 256) receives the best assignment.
template <class Lv>
SymFit sweep_sym(Events& ev, const float* x, const float* w, int n, const Lv& L, float t_lo, float t_hi,
                 int16_t* idx) {
  ev.clear();
  int16_t cur[256];
  const int K = L.count();
  double S1 = 0, S2 = 0;
  const int k_zero = L.nearest(0.0f);
  for (int i = 0; i < n; ++i) {
    int k = L.nearest(x[i] * t_lo);
    // Make the start state agree exactly with the event times computed below (an event at
    // t is applied once the sweep reaches t), whatever the rounding of x * t_lo.
    if (x[i] > 0) {
      while (k > k_zero && L.mid(k - 1) / x[i] > t_lo) --k;
      while (k + 1 < K && L.mid(k) / x[i] <= t_lo) ++k;
    } else if (x[i] < 0) {
      while (k < k_zero && L.mid(k) / x[i] > t_lo) ++k;
      while (k > 0 && L.mid(k - 1) / x[i] <= t_lo) --k;
    }
    cur[i] = int16_t(k);
    if (w[i] <= 0.0f || x[i] == 0.0f) continue;
    const double lv = L.val(k);
    S1 += double(w[i]) * x[i] * lv;
    S2 += double(w[i]) * lv * lv;
    if (x[i] > 0) {
      for (; k + 1 < K; ++k) {
        const float t = L.mid(k) / x[i];
        if (t > t_hi) break;
        if (t > t_lo) ev.push(t, i);
      }
    } else {
      for (; k > 0; --k) {
        const float t = L.mid(k - 1) / x[i];
        if (t > t_hi) break;
        if (t > t_lo) ev.push(t, i);
      }
    }
  }
  ev.sort();
  // Ties (within kTie) go to the largest t: the smallest scale, which puts the largest values
  // on the end levels and suits a shared super-scale (a lone outlier can otherwise sit on
  // level 1 with its own value as the scale).
  constexpr double kTie = 1 - 1e-6;
  double bS1 = S1, bS2 = S2;
  int best = -1;
  if (!(bS2 > 0)) { bS1 = 0; bS2 = 1; }
  double nS1 = bS1, nS2 = bS2;
  int16_t* c = cur;
  const int ne = ev.n;
  const uint16_t* eid = ev.ids.data();
  // Second copy of the start state for the replay.
  int16_t start[256];
  std::memcpy(start, cur, sizeof(int16_t) * size_t(n));
  for (int e = 0; e < ne; ++e) {
    const int i = eid[e];
    const int k0 = c[i], k1 = x[i] > 0 ? k0 + 1 : k0 - 1;
    c[i] = int16_t(k1);
    const double v0 = L.val(k0), v1 = L.val(k1);
    S1 += double(w[i]) * x[i] * (v1 - v0);
    S2 += double(w[i]) * (v1 * v1 - v0 * v0);
    if (S2 > 0) {
      const double lhs = S1 * S1 * bS2, rhs = bS1 * bS1 * S2;
      if (lhs > rhs) {
        bS1 = nS1 = S1;
        bS2 = nS2 = S2;
        best = e;
      } else if (lhs >= rhs * kTie) {  // a near-tie at larger t: prefer the smaller scale
        nS1 = S1;
        nS2 = S2;
        best = e;
      }
    }
  }
  std::memcpy(idx, start, sizeof(int16_t) * size_t(n));
  for (int e = 0; e <= best; ++e) {
    const int i = eid[e];
    idx[i] = int16_t(x[i] > 0 ? idx[i] + 1 : idx[i] - 1);
  }
  SymFit f;
  f.gain = nS1 * nS1 / nS2;
  f.d = float(nS1 / nS2);
  return f;
}

// The t range of a symmetric sweep: t_end is where the first value reaches the end level
// on its side; the sweep covers [t_end * (1 - below), t_end * (1 + above)].
template <class Lv>
inline void sym_range(const float* x, const float* w, int n, const Lv& L, float below, float above,
                      float* t_lo, float* t_hi) {
  float pmax = 0, nmax = 0;
  for (int i = 0; i < n; ++i) {
    if (w[i] <= 0.0f) continue;
    pmax = std::max(pmax, x[i]);
    nmax = std::max(nmax, -x[i]);
  }
  float t_end = 1e30f;
  if (pmax > 0 && L.top() > 0) t_end = std::min(t_end, L.top() / pmax);
  if (nmax > 0 && L.bottom() < 0) t_end = std::min(t_end, -L.bottom() / nmax);
  if (t_end >= 1e30f) {  // nothing non-zero with weight, or no level of the right sign
    *t_lo = 0;
    *t_hi = 0;
    return;
  }
  *t_lo = below >= 1.0f ? 0.0f : t_end * (1.0f - below);
  *t_hi = above >= 1e6f ? 3.0e38f : t_end * (1.0f + above);
}

// Best signed scale for x ~= d * L[idx]: sweeps both signs of d. Returns the fit (d signed;
// d = 0 when nothing has weight) and the assignment in idx.
template <class Lv>
SymFit fit_sym(Events& ev, const float* x, const float* w, int n, const Lv& L, float below, float above,
               int16_t* idx, bool one_sign = false) {
  float neg[256];
  int16_t idx2[256];
  for (int i = 0; i < n; ++i) neg[i] = -x[i];
  // Which signs of d to sweep: a symmetric level set mirrors the two; with one_sign, only the
  // sign that puts the largest weighted value on the longer side.
  bool pos = true, ngt = L.bottom() != -L.top();
  if (ngt && one_sign) {
    float vmax = 0;
    for (int i = 0; i < n; ++i)
      if (w[i] > 0.0f && std::fabs(x[i]) > std::fabs(vmax)) vmax = x[i];
    const bool bottom_longer = -L.bottom() > L.top();
    pos = (vmax > 0) != bottom_longer;
    ngt = !pos;
  }
  SymFit best;
  float lo, hi;
  for (int i = 0; i < n; ++i) idx[i] = int16_t(L.nearest(0.0f));
  if (pos) {
    sym_range(x, w, n, L, below, above, &lo, &hi);
    if (hi > 0) best = sweep_sym(ev, x, w, n, L, lo, hi, idx);
  }
  if (ngt) {
    sym_range(neg, w, n, L, below, above, &lo, &hi);
    if (hi > 0) {
      SymFit f = sweep_sym(ev, neg, w, n, L, lo, hi, idx2);
      if (!pos || f.gain > best.gain * (1 + 1e-6) ||
          (f.gain >= best.gain * (1 - 1e-6) && std::fabs(f.d) < std::fabs(best.d))) {
        best = f;
        best.d = -f.d;
        std::memcpy(idx, idx2, sizeof(int16_t) * size_t(n));
      }
    }
  }
  return best;
}

// Weighted squared error of x against d * L[nearest(x / d)], and the assignment.
template <class Lv>
inline double err_sym(const float* x, const float* w, int n, const Lv& L, float d, int16_t* idx) {
  double e = 0;
  if (d == 0.0f) {
    const int k0 = L.nearest(0.0f);
    for (int i = 0; i < n; ++i) {
      idx[i] = int16_t(k0);
      const float r = x[i] - 0.0f * L.val(k0);
      e += double(w[i]) * r * r;
    }
    return e;
  }
  const float id = 1.0f / d;
  const bool tiny = std::fabs(d) < 1e-30f;  // 1 / d may overflow (MXFP4's smallest scales)
  for (int i = 0; i < n; ++i) {
    const int k = L.nearest(tiny ? x[i] / d : x[i] * id);
    idx[i] = int16_t(k);
    const float r = x[i] - d * L.val(k);
    e += double(w[i]) * r * r;
  }
  return e;
}

// Picks the fp16 scale among fp16(d) and its neighbours (and 0) with the least weighted error
// after re-rounding the levels against it; returns its bits and fills idx.
template <class Lv>
inline uint16_t choose_half_scale(const float* x, const float* w, int n, const Lv& L, float d,
                                  int16_t* idx, double* err_out = nullptr) {
  int16_t tmp[256];
  const uint16_t h0 = half_bits(d);
  uint16_t best_h = 0;
  double best_e = err_sym(x, w, n, L, 0.0f, idx);
  const uint16_t cand[3] = {h0, half_step(h0, -1), half_step(h0, 1)};
  for (uint16_t h : cand) {
    const float dv = half_val(h);
    if (dv == 0.0f) continue;
    const double e = err_sym(x, w, n, L, dv, tmp);
    if (e < best_e) {
      best_e = e;
      best_h = h;
      std::memcpy(idx, tmp, sizeof(int16_t) * size_t(n));
    }
  }
  if (err_out) *err_out = best_e;
  return best_h;
}

// ---- affine fits: x ~= d * q + m, q in [0, qmax] -------------------------------------------

struct AffineSums {
  double w = 0, x = 0, q = 0, qq = 0, xq = 0;
};

struct AffineFit {
  double gain = 0;  // error = sum w x^2 - gain
  float d = 0, m = 0;
};

// Least-squares (d >= 0, m) for fixed levels; with m_nonpos the offset is held <= 0 (the
// K-quants store it as a non-negative min that is subtracted).
inline AffineFit solve_affine(const AffineSums& s, bool m_nonpos) {
  AffineFit f;
  const double det = s.w * s.qq - s.q * s.q;
  if (det > 1e-9 * s.w * s.qq) {
    const double d = (s.w * s.xq - s.q * s.x) / det;
    const double m = (s.qq * s.x - s.q * s.xq) / det;
    if (d >= 0 && (!m_nonpos || m <= 0)) {
      f.d = float(d);
      f.m = float(m);
      f.gain = d * s.xq + m * s.x;
      return f;
    }
  }
  // On the boundary: m = 0 with the best d >= 0, or d = 0 with the best m.
  AffineFit a, b;
  if (s.qq > 0 && s.xq > 0) {
    a.d = float(s.xq / s.qq);
    a.gain = s.xq * s.xq / s.qq;
  }
  if (s.w > 0) {
    double m = s.x / s.w;
    if (m_nonpos && m > 0) m = 0;
    b.m = float(m);
    b.gain = 2 * m * s.x - m * m * s.w;
  }
  return a.gain >= b.gain ? a : b;
}

// Sweep over t of q_i = clamp(round(u_i * t), 0, qmax) with u_i = x_i - base (flip = false)
// or u_i = base - x_i and level qmax - q_i (flip = true); u_i >= 0 for every weighted value.
// Every assignment gets its least-squares (d, m); q (n <= 64) receives the best.
inline AffineFit sweep_affine(Events& ev, const float* x, const float* w, int n, int qmax, float base,
                              bool flip, float t_lo, float t_hi, bool m_nonpos, uint8_t* q) {
  ev.clear();
  float u[64];
  uint8_t start[64];
  AffineSums s;
  const float fq = float(qmax);
  for (int i = 0; i < n; ++i) {
    u[i] = flip ? base - x[i] : x[i] - base;
    int k = round_clamp(u[i] * t_lo, 0.0f, fq);
    if (u[i] > 0) {  // agree with the event times below
      while (k > 0 && (float(k) - 0.5f) / u[i] > t_lo) --k;
      while (k < qmax && (float(k) + 0.5f) / u[i] <= t_lo) ++k;
    }
    start[i] = uint8_t(k);
    if (w[i] <= 0.0f) continue;
    const double lv = flip ? qmax - k : k;
    s.w += w[i];
    s.x += double(w[i]) * x[i];
    s.q += double(w[i]) * lv;
    s.qq += double(w[i]) * lv * lv;
    s.xq += double(w[i]) * x[i] * lv;
    if (u[i] <= 0) continue;
    for (; k < qmax; ++k) {
      const float t = (float(k) + 0.5f) / u[i];
      if (t > t_hi) break;
      if (t > t_lo) ev.push(t, i);
    }
  }
  ev.sort();
  AffineFit best = solve_affine(s, m_nonpos);
  constexpr double kTie = 1 - 1e-6;
  double top = best.gain;
  int best_e = -1;
  const double dir = flip ? -1.0 : 1.0;
  uint8_t cur[64];
  std::memcpy(cur, start, size_t(n));
  const int ne = ev.n;
  const uint16_t* eid = ev.ids.data();
  for (int e = 0; e < ne; ++e) {
    const int i = eid[e];
    const double l0 = flip ? qmax - cur[i] : cur[i];
    const double l1 = l0 + dir;
    ++cur[i];
    const double wi = w[i];
    s.q += wi * dir;
    s.qq += wi * (l1 * l1 - l0 * l0);
    s.xq += wi * x[i] * dir;
    // The unconstrained least-squares gain num / det bounds the constrained one from above:
    // only when it beats the best so far is the (constrained) solve needed.
    const double det = s.w * s.qq - s.q * s.q;
    const double num = s.w * s.xq * s.xq - 2 * s.q * s.x * s.xq + s.qq * s.x * s.x;
    // Near-ties (within 1e-6) go to the larger t, the smaller scale, as in sweep_sym.
    if (!(det > 0) || num > top * kTie * det) {
      const AffineFit f = solve_affine(s, m_nonpos);
      if (f.gain >= top * kTie) {
        best = f;
        best_e = e;
        top = std::max(top, f.gain);
      }
    }
  }
  std::memcpy(q, start, size_t(n));
  for (int e = 0; e <= best_e; ++e) ++q[eid[e]];
  if (flip)
    for (int i = 0; i < n; ++i) q[i] = uint8_t(qmax - q[i]);
  return best;
}

// Levels for fixed (d, m): q = clamp(round((x - m) / d)); returns the weighted error.
inline double affine_assign(const float* x, const float* w, int n, int qmax, float d, float m,
                            uint8_t* q) {
  double e = 0;
  const float id = d > 0 ? 1.0f / d : 0.0f;
  for (int i = 0; i < n; ++i) {
    const int k = d > 0 ? round_clamp((x[i] - m) * id, 0.0f, float(qmax)) : 0;
    q[i] = uint8_t(k);
    const float r = x[i] - (d * float(k) + m);
    e += double(w[i]) * r * r;
  }
  return e;
}

inline AffineSums affine_sums(const float* x, const float* w, int n, const uint8_t* q) {
  AffineSums s;
  for (int i = 0; i < n; ++i) {
    const double wi = w[i];
    s.w += wi;
    s.x += wi * x[i];
    s.q += wi * q[i];
    s.qq += wi * q[i] * q[i];
    s.xq += wi * x[i] * q[i];
  }
  return s;
}

// For a fixed step d, sweeps the offset over one step around m_c: every value's level changes
// at most once, so the <= n events enumerate every assignment rounding can give at this d;
// each is scored by its least-squares (d, m). Returns the best (q receives it) if it beats
// `best`, else `best` unchanged.
inline AffineFit sweep_offset(Events& ev, const float* x, const float* w, int n, int qmax, float d, float m_c,
                              bool m_nonpos, AffineFit best, uint8_t* q) {
  if (!(d > 0)) return best;
  ev.clear();
  uint8_t start[64];
  AffineSums s;
  const float m_lo = m_c - 0.5f * d, m_hi = m_c + 0.5f * d, id = 1.0f / d;
  for (int i = 0; i < n; ++i) {
    int k = round_clamp((x[i] - m_lo) * id, 0.0f, float(qmax));
    while (k > 0 && x[i] - (float(k) - 0.5f) * d <= m_lo) --k;  // agree with the event rule
    while (k < qmax && x[i] - (float(k) + 0.5f) * d > m_lo) ++k;
    start[i] = uint8_t(k);
    if (w[i] <= 0.0f) continue;
    const double wi = w[i];
    s.w += wi;
    s.x += wi * x[i];
    s.q += wi * k;
    s.qq += wi * k * k;
    s.xq += wi * x[i] * k;
    if (k == 0) continue;
    const float mc = x[i] - (float(k) - 0.5f) * d;
    if (mc > m_lo && mc <= m_hi) ev.push(mc, i);
  }
  ev.sort();
  int best_e = -2;
  {
    const AffineFit f = solve_affine(s, m_nonpos);
    if (f.gain > best.gain) {
      best = f;
      best_e = -1;
    }
  }
  const int ne = ev.n;
  const uint16_t* eid = ev.ids.data();
  for (int e = 0; e < ne; ++e) {
    const int i = eid[e];
    const double wi = w[i], l0 = start[i];  // each value moves once: start -> start - 1
    s.q -= wi;
    s.qq += wi * (1 - 2 * l0);
    s.xq -= wi * x[i];
    const double det = s.w * s.qq - s.q * s.q;
    const double num = s.w * s.xq * s.xq - 2 * s.q * s.x * s.xq + s.qq * s.x * s.x;
    if (!(det > 0) || num > best.gain * det) {
      const AffineFit f = solve_affine(s, m_nonpos);
      if (f.gain > best.gain) {
        best = f;
        best_e = e;
      }
    }
  }
  if (best_e >= -1) {
    std::memcpy(q, start, size_t(n));
    for (int e = 0; e <= best_e; ++e) --q[eid[e]];
  }
  return best;
}

// Best affine fit of a block: sweeps anchored at the bottom and at the top of the weighted
// range over t in [t0 (1 - below), t0 (1 + above)], t0 = qmax / range, then alternates
// (levels | d, m) and (d, m | levels) while the error drops. q receives the levels of the
// returned (float) fit.
inline AffineFit fit_affine(Events& ev, const float* x, const float* w, int n, int qmax, float below,
                            float above, bool m_nonpos, uint8_t* q) {
  float lo = 0, hi = 0;
  bool any = false;
  double sxx = 0;
  for (int i = 0; i < n; ++i) {
    if (w[i] <= 0.0f) continue;
    if (!any) lo = hi = x[i];
    any = true;
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sxx += double(w[i]) * x[i] * x[i];
  }
  AffineFit best;
  if (!any) {
    std::memset(q, 0, size_t(n));
    return best;
  }
  if (m_nonpos) lo = std::min(lo, 0.0f);
  if (!(hi > lo)) {  // constant block
    std::memset(q, 0, size_t(n));
    best = solve_affine(affine_sums(x, w, n, q), m_nonpos);
    best.d = 0;
    return best;
  }
  const float t0 = float(qmax) / (hi - lo);
  const float t_lo = below >= 1.0f ? 0.0f : t0 * (1.0f - below);
  const float t_hi = above >= 1e6f ? 3.0e38f : t0 * (1.0f + above);
  uint8_t q2[64];
  best = sweep_affine(ev, x, w, n, qmax, lo, false, t_lo, t_hi, m_nonpos, q);
  if (!m_nonpos || hi > 0) {
    // Top-anchored (with m <= 0 forced, a block entirely <= 0 gains nothing from it).
    AffineFit f = sweep_affine(ev, x, w, n, qmax, hi, true, t_lo, t_hi, m_nonpos, q2);
    if (f.gain > best.gain) {
      best = f;
      std::memcpy(q, q2, size_t(n));
    }
  }
  {
    // Values already on a grid (a block that was dequantized from this format): the step is
    // the smallest gap between distinct values (gaps below 1e-3 of the range are rounding
    // noise), and the swept t range may miss it when the block uses few of the levels.
    float v[64];
    int nv = 0;
    for (int i = 0; i < n; ++i)
      if (w[i] > 0.0f) v[nv++] = x[i];
    std::sort(v, v + nv);
    const float tol = 1e-3f * (hi - lo);
    float gap = hi - lo;
    for (int i = 1; i < nv; ++i)
      if (v[i] - v[i - 1] > tol) gap = std::min(gap, v[i] - v[i - 1]);
    // Taken only when clearly better: on a tie the sweep's smaller scale suits a super-scale.
    if (gap * float(qmax) >= (hi - lo) * (1.0f - 1e-3f) && gap * float(qmax) * (1.0f - below) > hi - lo) {
      const AffineFit g = sweep_offset(ev, x, w, n, qmax, gap, v[0], m_nonpos, AffineFit{}, q2);
      if (g.gain > best.gain * (1 + 1e-6)) {
        best = g;
        std::memcpy(q, q2, size_t(n));
      }
    }
  }
  for (int it = 0; it < 4 && best.d > 0; ++it) {
    const double g0 = best.gain;
    best = sweep_offset(ev, x, w, n, qmax, best.d, best.m, m_nonpos, best, q);
    affine_assign(x, w, n, qmax, best.d, best.m, q2);
    const AffineFit f = solve_affine(affine_sums(x, w, n, q2), m_nonpos);
    if (f.gain > best.gain) {
      best = f;
      std::memcpy(q, q2, size_t(n));
    }
    if (!(best.gain > g0 * (1 + 1e-12) + 1e-300)) break;
  }
  (void)sxx;
  return best;
}

// Block weights: w, or ones when w is null.
struct Weights {
  float buf[256];
  const float* p;
  Weights(const float* w, int n) {
    if (w) {
      p = w;
    } else {
      for (int i = 0; i < n; ++i) buf[i] = 1.0f;
      p = buf;
    }
  }
};

}  // namespace tf::quant::detail

namespace tf::quant::detail {

// ---- super-blocks with symmetric sub-blocks: x ~= D * sc_j * L[idx] --------------------------
//
// 1. Each sub-block's best float scale s_j (fit_sym) and its curvature A_j = sum w L^2 (the
//    error grows by about A_j (s - s_j)^2 when its scale moves to s).
// 2. The super-scale D: the A_j-weighted sweep over the s_j with the integer scale levels.
// 3. Against the fp16 D the decoder will use, every sub-block picks its integer scale among
//    the neighbours of s_j / D by the true error of its re-rounded levels; then D is refitted
//    by least squares over the whole super-block, rounded, and step 3 repeats while it helps.
// Returns the weighted error; dh, sc[nsub] and idx[sub * nsub] receive the encoding.
template <class Lv>
double sym_superblock(Events& ev, const float* x, const float* w, int sub, int nsub, const Lv& L, float below,
                      float above, int slo, int shi, uint16_t* dh, int* sc, int16_t* idx,
                      bool one_sign = false) {
  float s[32] = {}, A[32] = {};
  int16_t tmp[256];
  for (int j = 0; j < nsub; ++j) {
    const SymFit f = fit_sym(ev, x + j * sub, w + j * sub, sub, L, below, above, idx + j * sub, one_sign);
    s[j] = f.d;
    double a = 0;
    for (int i = 0; i < sub; ++i) {
      const double lv = L.val(idx[j * sub + i]);
      a += double(w[j * sub + i]) * lv * lv;
    }
    A[j] = float(a);
  }
  const UniformLevels Ls{slo, shi};
  int16_t sidx[32];
  const SymFit F = fit_sym(ev, s, A, nsub, Ls, 0.3f, 0.5f, sidx);

  // Step 3 for one fp16 super-scale: returns the error, fills c_sc / c_idx.
  auto choose = [&](float D, int* c_sc, int16_t* c_idx) {
    double tot = 0;
    for (int j = 0; j < nsub; ++j) {
      const float* xj = x + j * sub;
      const float* wj = w + j * sub;
      int16_t* ij = c_idx + j * sub;
      if (D == 0.0f) {
        c_sc[j] = 0;
        tot += err_sym(xj, wj, sub, L, 0.0f, ij);
        continue;
      }
      const int c = round_clamp(s[j] / D, float(slo), float(shi));
      double best = -1;
      auto try_k = [&](int k) {
        const double e = err_sym(xj, wj, sub, L, D * float(k), tmp);
        if (best < 0 || e < best) {
          best = e;
          c_sc[j] = k;
          std::memcpy(ij, tmp, sizeof(int16_t) * size_t(sub));
        }
      };
      for (int k = std::max(slo, c - 1); k <= std::min(shi, c + 1); ++k) try_k(k);
      // The mirrored scale: a sub-block that fits inside the symmetric part of the levels is
      // represented equally well with either sign, and only one of them may suit D.
      const int cf = round_clamp(-s[j] / D, float(slo), float(shi));
      if (cf < c - 1 || cf > c + 1) try_k(cf);
      tot += best;
    }
    return tot;
  };

  int c_sc[32];
  int16_t c_idx[256];
  double best = -1;
  // Starting points: the curvature-weighted sweep, and the largest-magnitude sub-block scale
  // on the end integer slo (ggml's choice; it finds the lattice back in blocks that were
  // dequantized from this format), with either sign (a sub-block's own sign is ambiguous
  // when it fits inside the symmetric part of the levels).
  float smax = 0;
  for (int j = 0; j < nsub; ++j)
    if (std::fabs(s[j]) > std::fabs(smax)) smax = s[j];
  uint16_t h = half_bits(F.d);
  for (int it = 0; it < 4; ++it) {
    const uint16_t cand[3] = {h, half_bits(smax / float(slo)), half_bits(-smax / float(slo))};
    const int ncand = it == 0 ? 3 : 1;
    bool improved = false;
    for (int c = 0; c < ncand; ++c) {
      const float D = half_val(cand[c]);
      const double e = choose(D, c_sc, c_idx);
      if (best < 0 || e < best) {
        best = e;
        improved = true;
        *dh = cand[c];
        std::memcpy(sc, c_sc, sizeof(int) * size_t(nsub));
        std::memcpy(idx, c_idx, sizeof(int16_t) * size_t(sub * nsub));
      }
    }
    if (!improved && it > 0) break;
    // Least-squares super-scale for the chosen integer scales and levels.
    double num = 0, den = 0;
    for (int j = 0; j < nsub; ++j)
      for (int i = 0; i < sub; ++i) {
        const double v = double(sc[j]) * L.val(idx[j * sub + i]);
        num += double(w[j * sub + i]) * x[j * sub + i] * v;
        den += double(w[j * sub + i]) * v * v;
      }
    if (!(den > 0)) break;
    const uint16_t hn = half_bits(float(num / den));
    if (hn == *dh) break;
    h = hn;
  }
  return best;
}

}  // namespace tf::quant::detail
