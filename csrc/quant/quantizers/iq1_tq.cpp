// Importance-weighted quantizers of the ternary formats: TQ1_0, TQ2_0 (one fp16 scale per 256
// weights, levels -1, 0, 1) and the 1.5 / 1.75 bit grid formats IQ1_S, IQ1_M (groups of 8
// weights on a point of kIq1sGrid, shifted by +-1/8, times an odd 3-bit multiplier of the
// super-block scale). Layouts: quant/iq_layout.h.
//
// TQ: for a given scale d the best ternary level of each weight is a threshold on |x| (|x| >
// d/2), so the optimum over (d, levels) is attained by one of the sets "the k largest |x|",
// whose least-squares scale is sum w|x| / sum w over the set: one sort and a prefix scan give
// the exact optimum, then the fp16 values around it are tried exactly.
//
// IQ1: the error of a group of 8 for a given sub-block scale D and shift delta is
// D^2 * sum w (x/D - delta - g)^2, minimised over the 2048 grid points g by a search that
// starts at the rounded point (exact when it is on the grid) and visits its grid neighbours by
// increasing L1 distance, stopping when a lower bound of the remaining candidates' error (the
// cheapest coordinate moves) shows nothing better is left. The super-block scale d is
// searched over a sweep anchored on the sub-blocks' own best scales (an exact search over
// the 3-level partitions of the sorted values, grid ignored); for each d every sub-block
// picks its multiplier, shift(s) and grid points; the best d is refitted by weighted least
// squares, rounded to fp16 and the assignment redone until it stops improving.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "quant/quantizers/quantizers.h"
#include "quant/tables/iq_tables.h"

namespace tf::quant {

namespace {

constexpr int kQK = 256;

constexpr float kMinHalf = 5.9604645e-8f;  // smallest positive fp16

inline float weight_at(const float* w, int64_t i) { return w ? w[i] : 1.0f; }

// fp16 bits of a non-negative scale, clamped to the largest finite half.
inline uint16_t half_of(float d) { return fp32_to_fp16(std::min(d, 65504.0f)); }

// ---------------------------------------------------------------------------------------------
// TQ1_0 / TQ2_0
// ---------------------------------------------------------------------------------------------

// Best fp16 scale and ternary codes (0, 1, 2 = -1, 0, 1) of one 256-weight block.
uint16_t ternary_block(const float* x, const float* w, uint8_t* code) {
  struct Item { float a, w; };
  Item it[kQK];
  double sxx = 0;
  for (int i = 0; i < kQK; ++i) {
    it[i] = {std::fabs(x[i]), w[i]};
    sxx += double(w[i]) * x[i] * x[i];
  }
  if (!(sxx > 0)) {
    std::memset(code, 1, kQK);
    return 0;
  }
  std::sort(it, it + kQK, [](const Item& a, const Item& b) { return a.a > b.a; });
  // prefix sums over the sorted |x|: A_k = sum w|x|, B_k = sum w (k largest)
  double A[kQK + 1], B[kQK + 1];
  A[0] = B[0] = 0;
  double best_gain = -1;
  int best_k = 0;
  for (int k = 1; k <= kQK; ++k) {
    A[k] = A[k - 1] + double(it[k - 1].w) * it[k - 1].a;
    B[k] = B[k - 1] + it[k - 1].w;
    if (B[k] > 0) {
      const double g = A[k] * A[k] / B[k];
      if (g > best_gain) best_gain = g, best_k = k;
    }
  }
  // Exact gain sum_{|x| > d/2} w (2 d |x| - d^2) of a given d, by binary search on the sort.
  auto gain = [&](float d) {
    const float t = 0.5f * d;
    int lo = 0, hi = kQK;  // count of |x| > t
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (it[mid].a > t) lo = mid + 1; else hi = mid;
    }
    return 2.0 * d * A[lo] - double(d) * d * B[lo];
  };
  const float dc = best_k > 0 ? float(A[best_k] / B[best_k]) : 0.0f;
  const uint16_t h0 = half_of(dc);
  uint16_t hbest = 0;
  double gbest = 0;
  for (int o = -3; o <= 3; ++o) {
    const int h = int(h0) + o;
    if (h <= 0 || h >= 0x7c00) continue;
    const double g = gain(fp16_to_fp32(uint16_t(h)));
    if (g > gbest) gbest = g, hbest = uint16_t(h);
  }
  const float d = fp16_to_fp32(hbest);
  const float t = 0.5f * d;
  for (int i = 0; i < kQK; ++i) code[i] = hbest == 0 ? 1 : std::fabs(x[i]) > t ? (x[i] > 0 ? 2 : 0) : 1;
  return hbest;
}

template <class Pack>
void quantize_ternary(const float* x, const float* w, uint8_t* dst, int64_t n, size_t block_bytes, Pack pack) {
  float wb[kQK];
  uint8_t code[kQK];
  for (int64_t b = 0; b < n / kQK; ++b) {
    const float* xb = x + b * kQK;
    for (int i = 0; i < kQK; ++i) wb[i] = weight_at(w, b * kQK + i);
    const uint16_t dh = ternary_block(xb, wb, code);
    pack(code, dh, dst + b * block_bytes);
  }
}

// ---------------------------------------------------------------------------------------------
// IQ1 grid search
// ---------------------------------------------------------------------------------------------

// Search effort (quality is flat beyond these: more sweep points or wider bands change the
// error by < 0.1%).
constexpr int kSweep = 5;           // super-block scales tried: Dmax / 15 * 1.1^(k - 2)
constexpr float kSweepStep = 1.1f;
constexpr int kSweepFirst = 2;
constexpr float kBand = 1.4f;       // sweep: multipliers within a factor 1.4 of the wanted one
constexpr float kFinalBand = 0.0f;  // after the refit: all multipliers
constexpr int kRefitIters = 3;

constexpr int kPow3[9] = {1, 3, 9, 27, 81, 243, 729, 2187, 6561};
constexpr int kTiers = 3;  // neighbour lists kept per off-grid point: L1 distances t0 .. t0+2

struct Iq1Grid {
  uint8_t code[2048][8];        // grid value + 1 (0, 1, 2)
  uint8_t half[2048][2];        // base-3 numbers of values 0..3 and 4..7
  int16_t at[6561];             // grid index of ternary point p = sum code_j 3^j, or -1
  uint8_t t0[6561];             // L1 distance from p to the nearest grid point
  uint32_t off[6561][kTiers + 1];  // list[off[p][t] .. off[p][t+1]): grid points at distance t0+t
  std::vector<uint16_t> list;
};

const Iq1Grid& iq1_grid() {
  static const Iq1Grid* const g = [] {
    auto* G = new Iq1Grid;
    for (int k = 0; k < 2048; ++k)
      for (int j = 0; j < 8; ++j) G->code[k][j] = uint8_t(int8_t(iq::kIq1sGrid[k] >> (8 * j)) + 1);
    std::fill(G->at, G->at + 6561, int16_t(-1));
    for (int k = 0; k < 2048; ++k) {
      int p = 0;
      for (int j = 0; j < 8; ++j) p += G->code[k][j] * kPow3[j];
      G->at[p] = int16_t(k);
      G->half[k][0] = uint8_t(p % 81), G->half[k][1] = uint8_t(p / 81);
    }
    std::vector<uint8_t> dist(2048);
    for (int p = 0; p < 6561; ++p) {
      uint8_t c[8];
      for (int j = 0, q = p; j < 8; ++j, q /= 3) c[j] = uint8_t(q % 3);
      int mn = 99;
      for (int k = 0; k < 2048; ++k) {
        int s = 0;
        for (int j = 0; j < 8; ++j) s += std::abs(int(c[j]) - int(G->code[k][j]));
        dist[k] = uint8_t(s);
        mn = std::min(mn, s);
      }
      G->t0[p] = uint8_t(mn);
      for (int t = 0; t < kTiers; ++t) {
        G->off[p][t] = uint32_t(G->list.size());
        if (G->at[p] >= 0) continue;  // on the grid: no search
        for (int k = 0; k < 2048; ++k)
          if (dist[k] == mn + t) G->list.push_back(uint16_t(k));
      }
      G->off[p][kTiers] = uint32_t(G->list.size());
    }
    return G;
  }();
  return *g;
}

// Best grid point for targets y[8] with weights w[8]: returns the index, err = sum w (y - g)^2.
inline int search8(const Iq1Grid& G, const float* y, const float* w, float& err) {
  float e[8][3];
  int p = 0;
  float base = 0;
  uint8_t r[8];
  for (int j = 0; j < 8; ++j) {
    const float a = y[j] + 1, b = y[j], c = y[j] - 1;
    e[j][0] = w[j] * a * a, e[j][1] = w[j] * b * b, e[j][2] = w[j] * c * c;
    r[j] = y[j] < -0.5f ? 0 : y[j] > 0.5f ? 2 : 1;
    p += r[j] * kPow3[j];
    base += e[j][r[j]];
  }
  if (G.at[p] >= 0) {
    err = base;
    return G.at[p];
  }
  // Lower bounds: a candidate at L1 distance k from p costs at least the k cheapest unit moves
  // (a coordinate at +-1 may move twice, and a double move costs at least twice its first).
  float mv[16];
  int nm = 0;
  for (int j = 0; j < 8; ++j) {
    if (r[j] == 1) {
      mv[nm++] = std::min(e[j][0], e[j][2]) - e[j][1];
    } else {
      const float m = e[j][1] - e[j][r[j]];
      mv[nm++] = m, mv[nm++] = m;
    }
  }
  // the K smallest moves, ascending (insertion into a short sorted prefix)
  const int t0 = G.t0[p];
  const int K = std::min(nm, t0 + kTiers);
  float sm[16];
  int ns = 0;
  for (int i = 0; i < nm; ++i) {
    const float v = mv[i];
    if (ns == K && v >= sm[K - 1]) continue;
    int q = ns < K ? ns++ : K - 1;
    while (q > 0 && sm[q - 1] > v) sm[q] = sm[q - 1], --q;
    sm[q] = v;
  }
  float lb[16];  // lb[k] = base + sum of the k smallest moves
  lb[0] = base;
  for (int i = 0; i < K; ++i) lb[i + 1] = lb[i] + sm[i];
  auto lower_bound_at = [&](int k) { return lb[std::min(k, K)]; };
  float best = INFINITY;
  int bi = -1;
  for (int t = 0; t < kTiers; ++t) {
    if (bi >= 0 && best <= lower_bound_at(t0 + t)) {
      err = best;
      return bi;
    }
    for (uint32_t q = G.off[p][t]; q < G.off[p][t + 1]; ++q) {
      const uint8_t* g = G.code[G.list[q]];
      float s = 0;
      for (int j = 0; j < 8; ++j) s += e[j][g[j]];
      if (bi < 0 || s < best) best = s, bi = G.list[q];
    }
  }
  if (bi < 0 || best > lower_bound_at(t0 + kTiers)) {
    // rare (~1% of searches): all points, through the errors of the 81 codes of each half
    float h[2][81];
    for (int q = 0; q < 2; ++q) {
      const float(*eq)[3] = e + 4 * q;
      for (int a = 0; a < 3; ++a)
        for (int b = 0; b < 3; ++b) {
          const float ab = eq[0][a] + eq[1][b];
          for (int c = 0; c < 3; ++c) {
            const float abc = ab + eq[2][c];
            for (int dd = 0; dd < 3; ++dd) h[q][a + 3 * b + 9 * c + 27 * dd] = abc + eq[3][dd];
          }
        }
    }
    for (int k = 0; k < 2048; ++k) {
      const float s = h[0][G.half[k][0]] + h[1][G.half[k][1]];
      if (bi < 0 || s < best) best = s, bi = k;
    }
  }
  err = best;
  return bi;
}

// Best scale of n values (n <= 32) on the three levels {-1, 0, 1} + delta, grid ignored: the
// levels are monotone in x, so the best assignment splits the sorted values at two cuts.
// Returns the best gain (sum w x a)^2 / sum w a^2 over the cuts and both shifts, scale in D.
double free_scale(const float* x, const float* w, int n, float& D) {
  int idx[32];
  for (int i = 0; i < n; ++i) idx[i] = i;
  std::sort(idx, idx + n, [&](int a, int b) { return x[a] < x[b]; });
  double SW[33], SX[33];  // prefix sums of w and w x over the sorted values
  SW[0] = SX[0] = 0;
  for (int i = 0; i < n; ++i) {
    SW[i + 1] = SW[i] + w[idx[i]];
    SX[i + 1] = SX[i] + double(w[idx[i]]) * x[idx[i]];
  }
  double best = 0;
  D = 0;
  for (int sgn = -1; sgn <= 1; sgn += 2) {
    const double dl = 0.125 * sgn;
    const double l0 = -1 + dl, l1 = dl, l2 = 1 + dl;
    for (int i = 0; i <= n; ++i)
      for (int j = i; j <= n; ++j) {
        const double sxa = l0 * SX[i] + l1 * (SX[j] - SX[i]) + l2 * (SX[n] - SX[j]);
        const double saa = l0 * l0 * SW[i] + l1 * l1 * (SW[j] - SW[i]) + l2 * l2 * (SW[n] - SW[j]);
        if (sxa > 0 && saa > 0 && sxa * sxa > best * saa) best = sxa * sxa / saa, D = float(sxa / saa);
      }
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// IQ1_S: 8 sub-blocks of 32, one multiplier and one shift each
// ---------------------------------------------------------------------------------------------

struct Iq1sAssign {
  uint8_t m[8];    // multiplier index s (scale 2s + 1)
  uint8_t neg[8];  // shift -1/8
  uint16_t idx[32];
};

// Error of the best assignment for super-block scale d: per sub-block the best multiplier,
// shift and grid points (multipliers limited to within a factor band of the sub-block's own
// scale Dstar / d when band > 0).
double iq1s_assign(const Iq1Grid& G, const float* x, const float* w, float d, const float* Dstar, float band,
                   Iq1sAssign& out) {
  double total = 0;
  float y[8];
  for (int ib = 0; ib < 8; ++ib) {
    const float* xb = x + 32 * ib;
    const float* wb = w + 32 * ib;
    int s_lo = 0, s_hi = 7;
    if (band > 0) {
      const float t = Dstar[ib] / d;  // wanted multiplier 2s + 1
      s_lo = std::clamp(int(std::floor((t / band - 1) * 0.5f)), 0, 7);
      s_hi = std::clamp(int(std::ceil((t * band - 1) * 0.5f)), 0, 7);
    }
    double best = INFINITY;
    for (int s = s_lo; s <= s_hi; ++s) {
      const float D = d * float(2 * s + 1), iD = 1.0f / D;
      for (int ng = 0; ng < 2; ++ng) {
        const float dl = ng ? -0.125f : 0.125f;
        float e = 0;
        uint16_t id4[4];
        for (int l = 0; l < 4; ++l) {
          for (int j = 0; j < 8; ++j) y[j] = xb[8 * l + j] * iD - dl;
          float el;
          id4[l] = uint16_t(search8(G, y, wb + 8 * l, el));
          e += el;
        }
        const double err = double(e) * D * D;
        if (err < best || (s == s_lo && ng == 0)) {
          best = err;
          out.m[ib] = uint8_t(s), out.neg[ib] = uint8_t(ng);
          std::memcpy(out.idx + 4 * ib, id4, sizeof id4);
        }
      }
    }
    total += best;
  }
  return total;
}

// Least-squares super-block scale of a fixed assignment.
float iq1s_refit(const Iq1Grid& G, const float* x, const float* w, const Iq1sAssign& a) {
  double sxa = 0, saa = 0;
  for (int ib = 0; ib < 8; ++ib) {
    const float m = float(2 * a.m[ib] + 1), dl = a.neg[ib] ? -0.125f : 0.125f;
    for (int l = 0; l < 4; ++l) {
      const uint8_t* g = G.code[a.idx[4 * ib + l]];
      for (int j = 0; j < 8; ++j) {
        const int i = 32 * ib + 8 * l + j;
        const double q = m * (float(g[j]) - 1 + dl);
        sxa += w[i] * q * x[i], saa += w[i] * q * q;
      }
    }
  }
  return saa > 0 && sxa > 0 ? float(sxa / saa) : 0.0f;
}

void iq1s_block(const Iq1Grid& G, const float* x, const float* w, uint8_t* dst) {
  std::memset(dst, 0, 50);
  float Dstar[8];
  float Dmax = 0;
  double sxx = 0;
  for (int i = 0; i < kQK; ++i) sxx += double(w[i]) * x[i] * x[i];
  if (!(sxx > 0)) return;  // d = 0: zeros
  for (int ib = 0; ib < 8; ++ib) {
    free_scale(x + 32 * ib, w + 32 * ib, 32, Dstar[ib]);
    Dmax = std::max(Dmax, Dstar[ib]);
  }
  if (!(Dmax > 0)) return;
  Iq1sAssign a, best_a;
  double best = INFINITY;
  float best_d = 0;
  // sweep of d around Dmax / 15
  for (int k = 0; k < kSweep; ++k) {
    const float d = std::max(Dmax / 15.0f * std::pow(kSweepStep, float(k - kSweepFirst)), kMinHalf);
    const double e = iq1s_assign(G, x, w, d, Dstar, kBand, a);
    if (k == 0 || e < best) best = e, best_d = d, best_a = a;
  }
  // refit, round to fp16, full reassignment, until no improvement
  uint16_t hbest = 0;
  double ebest = sxx;  // error of d = 0
  uint16_t tried[8];
  int ntried = 0;
  float d = iq1s_refit(G, x, w, best_a);
  if (!(d > 0)) d = best_d;
  for (int it = 0; it < kRefitIters; ++it) {
    const uint16_t h = std::max<uint16_t>(half_of(d), 1);
    if (std::find(tried, tried + ntried, h) != tried + ntried) break;
    tried[ntried++] = h;
    const float dh = fp16_to_fp32(h);
    const double e = iq1s_assign(G, x, w, dh, Dstar, kFinalBand, a);
    if (!(e < ebest)) break;
    ebest = e, hbest = h, best_a = a;
    d = iq1s_refit(G, x, w, a);
    if (!(d > 0)) break;
  }
  if (hbest == 0) return;
  dst[0] = uint8_t(hbest), dst[1] = uint8_t(hbest >> 8);
  for (int ib = 0; ib < 8; ++ib) {
    uint32_t h = 0;
    for (int l = 0; l < 4; ++l) {
      const uint16_t id = best_a.idx[4 * ib + l];
      dst[2 + 4 * ib + l] = uint8_t(id & 255);
      h |= uint32_t(id >> 8) << (3 * l);
    }
    h |= uint32_t(best_a.m[ib]) << 12;
    if (best_a.neg[ib]) h |= 0x8000u;
    dst[34 + 2 * ib] = uint8_t(h), dst[35 + 2 * ib] = uint8_t(h >> 8);
  }
}

// ---------------------------------------------------------------------------------------------
// IQ1_M: 16 sub-blocks of 16 (one multiplier each), a shift per group of 8
// ---------------------------------------------------------------------------------------------

struct Iq1mAssign {
  uint8_t m[16];
  uint8_t neg[32];
  uint16_t idx[32];
};

double iq1m_assign(const Iq1Grid& G, const float* x, const float* w, float d, const float* Dstar, float band,
                   Iq1mAssign& out) {
  double total = 0;
  float y[8];
  for (int k = 0; k < 16; ++k) {
    int s_lo = 0, s_hi = 7;
    if (band > 0) {
      const float t = Dstar[k] / d;
      s_lo = std::clamp(int(std::floor((t / band - 1) * 0.5f)), 0, 7);
      s_hi = std::clamp(int(std::ceil((t * band - 1) * 0.5f)), 0, 7);
    }
    double best = INFINITY;
    for (int s = s_lo; s <= s_hi; ++s) {
      const float D = d * float(2 * s + 1), iD = 1.0f / D;
      float e = 0;
      uint16_t id2[2];
      uint8_t ng2[2];
      for (int l = 0; l < 2; ++l) {
        const int g = 2 * k + l;
        float eb = INFINITY;
        for (int ng = 0; ng < 2; ++ng) {
          const float dl = ng ? -0.125f : 0.125f;
          for (int j = 0; j < 8; ++j) y[j] = x[8 * g + j] * iD - dl;
          float el;
          const int id = search8(G, y, w + 8 * g, el);
          if (el < eb || ng == 0) eb = el, id2[l] = uint16_t(id), ng2[l] = uint8_t(ng);
        }
        e += eb;
      }
      const double err = double(e) * D * D;
      if (err < best || s == s_lo) {
        best = err;
        out.m[k] = uint8_t(s);
        for (int l = 0; l < 2; ++l) out.idx[2 * k + l] = id2[l], out.neg[2 * k + l] = ng2[l];
      }
    }
    total += best;
  }
  return total;
}

float iq1m_refit(const Iq1Grid& G, const float* x, const float* w, const Iq1mAssign& a) {
  double sxa = 0, saa = 0;
  for (int g = 0; g < 32; ++g) {
    const float m = float(2 * a.m[g / 2] + 1), dl = a.neg[g] ? -0.125f : 0.125f;
    const uint8_t* gp = G.code[a.idx[g]];
    for (int j = 0; j < 8; ++j) {
      const int i = 8 * g + j;
      const double q = m * (float(gp[j]) - 1 + dl);
      sxa += w[i] * q * x[i], saa += w[i] * q * q;
    }
  }
  return saa > 0 && sxa > 0 ? float(sxa / saa) : 0.0f;
}

void iq1m_block(const Iq1Grid& G, const float* x, const float* w, uint8_t* dst) {
  std::memset(dst, 0, 56);
  float Dstar[16];
  float Dmax = 0;
  double sxx = 0;
  for (int i = 0; i < kQK; ++i) sxx += double(w[i]) * x[i] * x[i];
  if (!(sxx > 0)) return;
  for (int k = 0; k < 16; ++k) {
    free_scale(x + 16 * k, w + 16 * k, 16, Dstar[k]);
    Dmax = std::max(Dmax, Dstar[k]);
  }
  if (!(Dmax > 0)) return;
  Iq1mAssign a, best_a;
  double best = INFINITY;
  float best_d = 0;
  for (int k = 0; k < kSweep; ++k) {
    const float d = std::max(Dmax / 15.0f * std::pow(kSweepStep, float(k - kSweepFirst)), kMinHalf);
    const double e = iq1m_assign(G, x, w, d, Dstar, kBand, a);
    if (k == 0 || e < best) best = e, best_d = d, best_a = a;
  }
  uint16_t hbest = 0;
  double ebest = sxx;
  uint16_t tried[8];
  int ntried = 0;
  float d = iq1m_refit(G, x, w, best_a);
  if (!(d > 0)) d = best_d;
  for (int it = 0; it < kRefitIters; ++it) {
    const uint16_t h = std::max<uint16_t>(half_of(d), 1);
    if (std::find(tried, tried + ntried, h) != tried + ntried) break;
    tried[ntried++] = h;
    const float dh = fp16_to_fp32(h);
    const double e = iq1m_assign(G, x, w, dh, Dstar, kFinalBand, a);
    if (!(e < ebest)) break;
    ebest = e, hbest = h, best_a = a;
    d = iq1m_refit(G, x, w, a);
    if (!(d > 0)) break;
  }
  if (hbest == 0) return;
  for (int g = 0; g < 32; ++g) {
    dst[g] = uint8_t(best_a.idx[g] & 255);
    const uint32_t nb = uint32_t(best_a.idx[g] >> 8) | (best_a.neg[g] ? 8u : 0u);
    dst[32 + g / 2] |= uint8_t(nb << (4 * (g & 1)));
  }
  uint16_t sc[4] = {0, 0, 0, 0};
  for (int k = 0; k < 16; ++k) sc[k / 4] |= uint16_t(best_a.m[k] << (3 * (k % 4)));
  for (int q = 0; q < 4; ++q) sc[q] |= uint16_t(((hbest >> (4 * q)) & 0xF) << 12);
  for (int q = 0; q < 4; ++q) dst[48 + 2 * q] = uint8_t(sc[q]), dst[49 + 2 * q] = uint8_t(sc[q] >> 8);
}

template <class BlockFn>
void quantize_iq1(const float* x, const float* w, uint8_t* dst, int64_t n, size_t block_bytes, BlockFn fn) {
  const Iq1Grid& G = iq1_grid();
  float wb[kQK];
  for (int64_t b = 0; b < n / kQK; ++b) {
    for (int i = 0; i < kQK; ++i) wb[i] = weight_at(w, b * kQK + i);
    fn(G, x + b * kQK, wb, dst + b * block_bytes);
  }
}

}  // namespace

void quantize_tq2_0(const float* x, const float* w, void* dst, int64_t n) {
  quantize_ternary(x, w, static_cast<uint8_t*>(dst), n, 66, [](const uint8_t* code, uint16_t dh, uint8_t* out) {
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < 32; ++m) {
        uint8_t q = 0;
        for (int l = 0; l < 4; ++l) q |= uint8_t(code[128 * h + 32 * l + m] << (2 * l));
        out[32 * h + m] = q;
      }
    out[64] = uint8_t(dh), out[65] = uint8_t(dh >> 8);
  });
}

void quantize_tq1_0(const float* x, const float* w, void* dst, int64_t n) {
  quantize_ternary(x, w, static_cast<uint8_t*>(dst), n, 54, [](const uint8_t* code, uint16_t dh, uint8_t* out) {
    // Byte holding digits c_0 .. c_4 (digit n read with multiplier 3^n): the base-3 number
    // sum c_n 3^(4-n), scaled to 0..255 rounding up.
    auto pack = [](const uint8_t* c, int nd, int stride) {
      uint32_t q = 0;
      for (int k = 0; k < 5; ++k) q = 3 * q + (k < nd ? c[k * stride] : 0);
      return uint8_t((q * 256 + 242) / 243);
    };
    for (int m = 0; m < 32; ++m) out[m] = pack(code + m, 5, 32);
    for (int m = 0; m < 16; ++m) out[32 + m] = pack(code + 160 + m, 5, 16);
    for (int m = 0; m < 4; ++m) out[48 + m] = pack(code + 240 + m, 4, 4);
    out[52] = uint8_t(dh), out[53] = uint8_t(dh >> 8);
  });
}

void quantize_iq1_s(const float* x, const float* w, void* dst, int64_t n) {
  quantize_iq1(x, w, static_cast<uint8_t*>(dst), n, 50, iq1s_block);
}

void quantize_iq1_m(const float* x, const float* w, void* dst, int64_t n) {
  quantize_iq1(x, w, static_cast<uint8_t*>(dst), n, 56, iq1m_block);
}

}  // namespace tf::quant
