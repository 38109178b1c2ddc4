// IQ3_XXS and IQ3_S quantizers (layouts: quant/iq_layout.h).
//
// Both store a weight as D * (2u+1) * (±g): u a 4-bit scale per sub-block of 32 weights, g byte
// m of a grid entry chosen per group of 4 weights, D = d/4 (IQ3_XXS) or d (IQ3_S) with d the
// super-block's fp16 scale. The grid values are 8 levels per coordinate (IQ3_XXS 4, 12, .., 52,
// 62; IQ3_S 1, 3, .., 15), so a group is a point of the 8^4 level cube and the grid a subset of
// it (256 / 512 points). IQ3_S stores every sign and a 9th index bit; IQ3_XXS stores 7 sign
// bits per 8 weights with an implied even parity: an odd number of negative weights in a group
// of 8 costs one flipped sign.
//
// Nearest grid point under a weighted distance, exact: the per-coordinate nearest level vector
// is the answer when it is on the grid (the distance is separable); otherwise a branch and
// bound over a trie of the grid (by level of coordinate 0, 1, 2, 3), started from the grid
// point nearest that cube point in plain level distance, cuts a branch when its partial error
// plus the unconstrained minimum of the remaining coordinates reaches the best found.
//
// Parity (IQ3_XXS): flipping more than one sign never helps (for any grid point a flipped
// target is farther), so the best odd-parity choice flips exactly one weight of the 8. Each
// weight's flip has a lower bound (the other coordinates at their unconstrained nearest
// levels, the flipped one at the smallest level); flips are evaluated exactly in order of that
// bound until it exceeds the best found, which makes the choice exact given the search.
//
// Per super-block: (1) every sub-block gets candidate assignments (grid points and flips) at a
// sweep of scales, each refitted by weighted least squares, and the best refit is iterated;
// each assignment's error is an exact quadratic in the scale. (2) Candidate fp16 super-scales
// d are ranked by the lower envelope of those quadratics at the decoded sub-block scales
// D * (2u+1) (with the best u of each sub-block), and the best few are evaluated exactly,
// re-searching the grid points at the decoded scale for the neighbouring u. (3) d is refitted
// by least squares given u and the points and re-evaluated while that lowers the error.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "quant/quantizers/quantizers.h"
#include "quant/tables/iq_tables.h"

namespace tf::quant {

namespace {

constexpr int kCube = 4096;  // 8^4

struct Grid {
  float lv[8];                 // level values, increasing
  float mid[7];                // midpoints between consecutive levels
  std::vector<float> g;        // n * 4 values
  std::vector<uint8_t> gl;     // n * 4 level indices
  int16_t map[kCube];          // cube index (l0 | l1 << 3 | l2 << 6 | l3 << 9) -> grid index or -1
  uint16_t seed[kCube];        // a grid point nearest each cube point in plain level distance

  // Trie node: children nodes[first .. first + cnt) in increasing level order, each with its
  // level l; a depth-4 node is the grid point `leaf`.
  struct Node {
    uint8_t l = 0;
    uint8_t cnt = 0;
    uint16_t first = 0;
    uint16_t leaf = 0;
  };
  std::vector<Node> nodes;

  Grid(const uint32_t* grid, int count) : g(size_t(count) * 4), gl(size_t(count) * 4) {
    int nl = 0;  // levels: the sorted distinct values
    for (int j = 0; j < count; ++j)
      for (int m = 0; m < 4; ++m) {
        const float v = float((grid[j] >> (8 * m)) & 0xFF);
        bool seen = false;
        for (int k = 0; k < nl; ++k) seen |= lv[k] == v;
        if (!seen && nl < 8) lv[nl++] = v;
      }
    std::sort(lv, lv + 8);
    for (int k = 0; k < 7; ++k) mid[k] = 0.5f * (lv[k] + lv[k + 1]);
    std::fill(map, map + kCube, int16_t(-1));
    for (int j = 0; j < count; ++j) {
      int c = 0;
      for (int m = 0; m < 4; ++m) {
        const float v = float((grid[j] >> (8 * m)) & 0xFF);
        int l = 0;
        while (lv[l] != v) ++l;
        g[size_t(j) * 4 + m] = v;
        gl[size_t(j) * 4 + m] = uint8_t(l);
        c |= l << (3 * m);
      }
      map[c] = int16_t(j);
    }
    for (int c = 0; c < kCube; ++c) {
      int dmin = 1 << 30;
      for (int j = 0; j < count; ++j) {
        int d = 0;
        for (int m = 0; m < 4; ++m) {
          const int e = int((c >> (3 * m)) & 7) - int(gl[size_t(j) * 4 + m]);
          d += e * e;
        }
        if (d < dmin) dmin = d, seed[c] = uint16_t(j);
      }
    }
    std::vector<int> all(count);
    for (int j = 0; j < count; ++j) all[j] = j;
    nodes.emplace_back();
    fill(0, all, 0);
  }

  void fill(int nd, const std::vector<int>& ids, int depth) {
    if (depth == 4) {
      nodes[nd].leaf = uint16_t(ids[0]);
      return;
    }
    std::vector<int> by[8];
    for (int j : ids) by[gl[size_t(j) * 4 + depth]].push_back(j);
    const int first = int(nodes.size());
    int cnt = 0;
    for (int k = 0; k < 8; ++k)
      if (!by[k].empty()) {
        nodes.emplace_back();
        nodes.back().l = uint8_t(k);
        ++cnt;
      }
    nodes[nd].first = uint16_t(first);
    nodes[nd].cnt = uint8_t(cnt);
    for (int r = 0; r < cnt; ++r) fill(first + r, by[nodes[first + r].l], depth + 1);
  }

  // Index of the nearest level to v.
  int level(float v) const {
    int l = 0;
    for (int k = 0; k < 7; ++k) l += v > mid[k];
    return l;
  }
};

const Grid& grid_xxs() {
  static const Grid g(iq::kIq3xxsGrid, 256);
  return g;
}
const Grid& grid_s() {
  static const Grid g(iq::kIq3sGrid, 512);
  return g;
}

inline float wdist4(const float* gv, const float* y, const float* w) {
  float e = 0;
  for (int m = 0; m < 4; ++m) {
    const float d = y[m] - gv[m];
    e += w[m] * d * d;
  }
  return e;
}

// Branch and bound over the trie from the grid point `seed` (see the top): c[m][k] is the
// error of coordinate m at level k, l[m] its nearest level.
inline int nearest_off_grid(const Grid& G, const float* y, const float* w, const int* l, int seed, float* err) {
  float c[4][8];
  for (int m = 0; m < 4; ++m)
    for (int k = 0; k < 8; ++k) {
      const float d = y[m] - G.lv[k];
      c[m][k] = w[m] * d * d;
    }
  const float R2 = c[3][l[3]], R1 = c[2][l[2]] + R2, R0 = c[1][l[1]] + R1;
  const uint8_t* ls = &G.gl[size_t(seed) * 4];
  float best = c[0][ls[0]] + c[1][ls[1]] + c[2][ls[2]] + c[3][ls[3]];
  int bi = seed;
  const Grid::Node* N = G.nodes.data();
  const Grid::Node& root = N[0];
  for (int a = root.first; a < root.first + root.cnt; ++a) {
    const float p0 = c[0][N[a].l];
    if (p0 + R0 >= best) {
      if (N[a].l > l[0]) break;  // the error only grows beyond the nearest level
      continue;
    }
    for (int b = N[a].first; b < N[a].first + N[a].cnt; ++b) {
      const float p1 = p0 + c[1][N[b].l];
      if (p1 + R1 >= best) {
        if (N[b].l > l[1]) break;
        continue;
      }
      for (int e = N[b].first; e < N[b].first + N[b].cnt; ++e) {
        const float p2 = p1 + c[2][N[e].l];
        if (p2 + R2 >= best) {
          if (N[e].l > l[2]) break;
          continue;
        }
        for (int f = N[e].first; f < N[e].first + N[e].cnt; ++f) {
          const float p3 = p2 + c[3][N[f].l];
          if (p3 < best) best = p3, bi = N[f].leaf;
          else if (N[f].l > l[3]) break;
        }
      }
    }
  }
  *err = best;
  return bi;
}

// The grid point nearest (weights w) to y (targets in grid units; a negative target wants the
// smallest level). Returns its index; *err = sum w (y - g)^2, emin[m] (if given) the error of
// coordinate m at its own nearest level.
inline int nearest(const Grid& G, const float* y, const float* w, float* err, float* emin = nullptr) {
  int c = 0;
  int l[4];
  for (int m = 0; m < 4; ++m) {
    l[m] = G.level(y[m]);
    c |= l[m] << (3 * m);
  }
  if (emin)
    for (int m = 0; m < 4; ++m) {
      const float d = y[m] - G.lv[l[m]];
      emin[m] = w[m] * d * d;
    }
  const int j = G.map[c];
  if (j >= 0) {
    *err = wdist4(&G.g[size_t(j) * 4], y, w);
    return j;
  }
  return nearest_off_grid(G, y, w, l, G.seed[c], err);
}

struct Format {
  const Grid* G;
  bool parity;   // IQ3_XXS: 7 sign bits + even parity per 8 weights
  float dmul;    // D = d * dmul
};

// One sub-block's assignment: the grid point of each group of 4 and the flipped signs (bit i:
// weight i's sign is the opposite of x's). sxg = sum w a' g, sgg = sum w g^2 (a' = |x|, negated
// where flipped): the error at sub-block scale s is sxx - 2 s sxg + s^2 sgg.
struct Assign {
  double sxg = 0, sgg = 0;
  uint16_t gi[8] = {};
  uint32_t flip = 0;
};

inline double quad_err(double sxx, const Assign& a, double s) { return sxx - 2 * s * a.sxg + s * s * a.sgg; }

// Sub-block data: magnitudes, weights, sign parity of each group of 8.
struct Sub {
  float a[32], w[32];
  double sxx;
  bool odd[4];
  bool active;  // some weight > 0 on a non-zero value
};

// The assignment of sub-block b at scale s > 0 (grid units y = a / s).
void assign_at(const Format& F, const Sub& b, float s, Assign* out) {
  const Grid& G = *F.G;
  const float inv = 1.0f / s;
  float y[32], emin[32], e4[8];
  int gi[8];
  for (int i = 0; i < 32; ++i) y[i] = b.a[i] * inv;
  for (int q = 0; q < 8; ++q) gi[q] = nearest(G, y + 4 * q, b.w + 4 * q, &e4[q], emin + 4 * q);
  uint32_t flip = 0;
  if (F.parity) {
    for (int k = 0; k < 4; ++k) {
      if (!b.odd[k]) continue;
      // Exactly one flip among weights 8k .. 8k+7.
      float lb[8];
      int order[8];
      for (int m = 0; m < 8; ++m) {
        const int i = 8 * k + m, q = i / 4;
        float rest = 0;
        for (int r = 4 * q; r < 4 * q + 4; ++r)
          if (r != i) rest += emin[r];
        const float d = y[i] + G.lv[0];
        lb[m] = rest + b.w[i] * d * d + e4[q == 2 * k ? 2 * k + 1 : 2 * k];  // + the other quad
        order[m] = m;
      }
      std::sort(order, order + 8, [&](int p, int r) { return lb[p] < lb[r]; });
      float best = 3.4e38f;
      int best_m = order[0], best_g = 0;
      for (int t = 0; t < 8; ++t) {
        const int m = order[t];
        if (lb[m] >= best) break;
        const int i = 8 * k + m, q = i / 4, qo = q == 2 * k ? 2 * k + 1 : 2 * k;
        float yy[4];
        std::memcpy(yy, y + 4 * q, sizeof yy);
        yy[i - 4 * q] = -yy[i - 4 * q];
        float e;
        const int j = nearest(G, yy, b.w + 4 * q, &e);
        e += e4[qo];
        if (e < best) best = e, best_m = m, best_g = j;
      }
      const int i = 8 * k + best_m;
      gi[i / 4] = best_g;
      flip |= 1u << i;
    }
  }
  double sxg = 0, sgg = 0;
  for (int q = 0; q < 8; ++q) {
    const float* gv = &G.g[size_t(gi[q]) * 4];
    for (int m = 0; m < 4; ++m) {
      const int i = 4 * q + m;
      const double t = flip >> i & 1 ? -double(b.a[i]) : double(b.a[i]);
      sxg += double(b.w[i]) * t * gv[m];
      sgg += double(b.w[i]) * double(gv[m]) * gv[m];
    }
    out->gi[q] = uint16_t(gi[q]);
  }
  out->flip = flip;
  out->sxg = sxg;
  out->sgg = sgg;
}

// The sub-block sweep: scales s = (amax / top) / f for kSweep values of f, geometric in
// [kSweepLo, kSweepHi] (f = 1 puts the largest weighted magnitude on the top level, f > 1 clips
// it), then up to kRefits rounds of (least-squares scale | points) from the best.
constexpr int kSweep = 12;
constexpr float kSweepLo = 0.5f, kSweepHi = 2.5f;
constexpr int kRefits = 4;
constexpr int kMaxCand = kSweep + kRefits + 1;

struct SubCands {
  Assign c[kMaxCand];
  int n = 0;
  double best_s = 0;  // least-squares scale of the best candidate
};

void sub_candidates(const Format& F, const Sub& b, SubCands* sc) {
  const Grid& G = *F.G;
  sc->n = 0;
  sc->best_s = 0;
  float amax = 0;
  for (int i = 0; i < 32; ++i)
    if (b.w[i] > 0) amax = std::max(amax, b.a[i]);
  if (!(amax > 0)) {  // nothing to fit: every weighted value is 0 and gets level 0
    Assign& a = sc->c[sc->n++];
    assign_at(F, b, 1.0f, &a);
    return;
  }
  double best_gain = -1;
  int best = 0;
  const float s0 = amax / G.lv[7];
  const float r = std::pow(kSweepHi / kSweepLo, 1.0f / float(kSweep - 1));
  float f = kSweepLo;
  for (int k = 0; k < kSweep; ++k, f *= r) {
    Assign& a = sc->c[sc->n];
    assign_at(F, b, s0 / f, &a);
    ++sc->n;
    if (a.sgg > 0 && a.sxg > 0) {
      const double gain = a.sxg * a.sxg / a.sgg;
      if (gain > best_gain) best_gain = gain, best = sc->n - 1;
    }
  }
  for (int it = 0; it < kRefits && best_gain > 0; ++it) {
    const double s = sc->c[best].sxg / sc->c[best].sgg;
    Assign& a = sc->c[sc->n];
    assign_at(F, b, float(s), &a);
    ++sc->n;
    if (!(a.sgg > 0 && a.sxg > 0)) break;
    const double gain = a.sxg * a.sxg / a.sgg;
    if (gain > best_gain * (1 + 1e-9)) {
      best_gain = gain;
      best = sc->n - 1;
    } else {
      break;
    }
  }
  if (best_gain > 0) sc->best_s = sc->c[best].sxg / sc->c[best].sgg;
}

constexpr float kMaxHalf = 65504.0f;

inline uint16_t half_bits(float v) { return fp32_to_fp16(std::min(kMaxHalf, std::max(0.0f, v))); }

// Best u and assignment of every sub-block for super-scale D by the candidates' quadratics;
// returns the modelled error.
double model_eval(const Sub* subs, const SubCands* sc, double D, int* u_out, int* k_out) {
  double tot = 0;
  for (int j = 0; j < 8; ++j) {
    const Sub& b = subs[j];
    double best = 1e300;
    int bu = 0, bk = 0;
    if (!b.active || !(D > 0)) {
      for (int k = 0; k < sc[j].n; ++k) {
        const double e = quad_err(b.sxx, sc[j].c[k], D);
        if (e < best) best = e, bu = 0, bk = k;
      }
    } else {
      // u around the one nearest the sub-block's own best scale
      const int c = int(std::lround(std::min(15.0, std::max(0.0, (sc[j].best_s / D - 1) * 0.5))));
      for (int u = std::max(0, c - 1); u <= std::min(15, c + 1); ++u) {
        const double s = D * (2 * u + 1);
        for (int k = 0; k < sc[j].n; ++k) {
          const double e = quad_err(b.sxx, sc[j].c[k], s);
          if (e < best) best = e, bu = u, bk = k;
        }
      }
    }
    u_out[j] = bu;
    k_out[j] = bk;
    tot += best;
  }
  return tot;
}

struct Choice {
  double err = 1e300;
  uint16_t dh = 0;
  int u[8] = {};
  Assign a[8];
};

// Exact evaluation of fp16 super-scale dh: each sub-block tries u0 - 1 .. u0 + 1 around the
// modelled u0 with the grid points searched at the decoded scale, and keeps the modelled
// assignment when that is better.
void exact_eval(const Format& F, const Sub* subs, const SubCands* sc, uint16_t dh, Choice* out) {
  const double D = double(fp16_to_fp32(dh)) * F.dmul;
  int u0[8], k0[8];
  model_eval(subs, sc, D, u0, k0);
  out->dh = dh;
  out->err = 0;
  for (int j = 0; j < 8; ++j) {
    const Sub& b = subs[j];
    double best = quad_err(b.sxx, sc[j].c[k0[j]], D * (2 * u0[j] + 1));
    out->u[j] = u0[j];
    out->a[j] = sc[j].c[k0[j]];
    if (b.active && D > 0) {
      for (int u = std::max(0, u0[j] - 1); u <= std::min(15, u0[j] + 1); ++u) {
        const double s = D * (2 * u + 1);
        Assign a;
        assign_at(F, b, float(s), &a);
        const double e = quad_err(b.sxx, a, s);
        if (e < best) best = e, out->u[j] = u, out->a[j] = a;
      }
    }
    out->err += best;
  }
}

// Number of fp16 super-scale candidates ranked by the model, and how many go to the exact
// evaluation.
constexpr int kDCands = 40;
constexpr int kExact = 2;
// The ranked range: the largest sub-block scale at 2u+1 between these.
constexpr double kDLo = 22.0, kDHi = 33.0;

void quantize_superblock(const Format& F, const float* x, const float* w, Choice* best) {
  Sub subs[8];
  SubCands sc[8];
  bool any = false;
  for (int j = 0; j < 8; ++j) {
    Sub& b = subs[j];
    b.sxx = 0;
    b.active = false;
    for (int i = 0; i < 32; ++i) {
      const float v = x[32 * j + i];
      b.a[i] = std::fabs(v);
      b.w[i] = w ? w[32 * j + i] : 1.0f;
      b.sxx += double(b.w[i]) * v * v;
      b.active |= b.w[i] > 0 && v != 0;
    }
    for (int k = 0; k < 4; ++k) {
      int neg = 0;
      for (int m = 0; m < 8; ++m) neg += std::signbit(x[32 * j + 8 * k + m]) ? 1 : 0;
      b.odd[k] = neg & 1;
    }
    any |= b.active;
  }
  // All zeros (d = 0): the answer when nothing has weight, and the bar for every scale.
  Choice zeros;
  zeros.err = 0;
  for (int j = 0; j < 8; ++j) zeros.err += subs[j].sxx;
  *best = zeros;
  if (!any) return;
  double smax = 0;
  for (int j = 0; j < 8; ++j) {
    if (!subs[j].active) continue;
    sub_candidates(F, subs[j], &sc[j]);
    smax = std::max(smax, sc[j].best_s);
  }
  for (int j = 0; j < 8; ++j)
    if (!subs[j].active) sub_candidates(F, subs[j], &sc[j]);
  if (!(smax > 0)) smax = 1e-30;

  // Rank fp16 super-scales: D from smax / kDHi up to smax / kDLo (the largest sub-block scale
  // near the top u), geometric, deduplicated after fp16 rounding.
  struct DC {
    double e;
    uint16_t h;
  };
  DC dc[kDCands];
  int nd = 0;
  {
    const double lo = smax / kDHi, hi = smax / kDLo;
    const double r = std::pow(hi / lo, 1.0 / (kDCands - 1));
    double D = lo;
    uint16_t last = 0xffff;
    int u[8], k[8];
    for (int t = 0; t < kDCands; ++t, D *= r) {
      // (below fp16's range: its smallest subnormal, with the small u that then fit)
      const uint16_t h = std::max<uint16_t>(1, half_bits(float(D / F.dmul)));
      if (h == last) continue;
      last = h;
      dc[nd].h = h;
      dc[nd].e = model_eval(subs, sc, double(fp16_to_fp32(h)) * F.dmul, u, k);
      ++nd;
    }
  }
  std::sort(dc, dc + nd, [](const DC& p, const DC& q) { return p.e < q.e; });
  Choice c;
  for (int t = 0; t < std::min(nd, kExact); ++t) {
    exact_eval(F, subs, sc, dc[t].h, &c);
    if (c.err < best->err) *best = c;
  }
  if (best->dh == 0) return;  // zeros are better
  // Least-squares refit of D given u and the points.
  for (int it = 0; it < 4; ++it) {
    double num = 0, den = 0;
    for (int j = 0; j < 8; ++j) {
      const double m = 2 * best->u[j] + 1;
      num += m * best->a[j].sxg;
      den += m * m * best->a[j].sgg;
    }
    if (!(den > 0) || !(num > 0)) break;
    const uint16_t h = std::max<uint16_t>(1, half_bits(float(num / den / F.dmul)));
    if (h == best->dh) break;
    exact_eval(F, subs, sc, h, &c);
    if (c.err < best->err) *best = c;
    else break;
  }
}

// fp16 at byte p.
inline void st16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
}

inline uint32_t signs_of(const float* x, uint32_t flip) {
  uint32_t s = 0;
  for (int i = 0; i < 32; ++i) s |= uint32_t(std::signbit(x[i]) ? 1 : 0) << i;
  return s ^ flip;
}

}  // namespace

void quantize_iq3_xxs(const float* x, const float* w, void* dst, int64_t n) {
  const Format F{&grid_xxs(), true, 0.25f};
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t b = 0; b < n / 256; ++b, out += 98) {
    const float* xb = x + 256 * b;
    Choice c;
    quantize_superblock(F, xb, w ? w + 256 * b : nullptr, &c);
    std::memset(out, 0, 98);
    if (c.dh == 0) continue;
    st16(out, c.dh);
    for (int j = 0; j < 8; ++j) {
      for (int q = 0; q < 8; ++q) out[2 + 8 * j + q] = uint8_t(c.a[j].gi[q]);
      const uint32_t neg = signs_of(xb + 32 * j, c.a[j].flip);
      uint32_t aux = uint32_t(c.u[j]) << 28;
      for (int l = 0; l < 4; ++l) aux |= ((neg >> (8 * l)) & 127u) << (7 * l);
      for (int k = 0; k < 4; ++k) out[66 + 4 * j + k] = uint8_t(aux >> (8 * k));
    }
  }
}

void quantize_iq3_s(const float* x, const float* w, void* dst, int64_t n) {
  const Format F{&grid_s(), false, 1.0f};
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t b = 0; b < n / 256; ++b, out += 110) {
    const float* xb = x + 256 * b;
    Choice c;
    quantize_superblock(F, xb, w ? w + 256 * b : nullptr, &c);
    std::memset(out, 0, 110);
    if (c.dh == 0) continue;
    st16(out, c.dh);
    for (int j = 0; j < 8; ++j) {
      for (int q = 0; q < 8; ++q) {
        const int k = 8 * j + q, gi = c.a[j].gi[q];
        out[2 + k] = uint8_t(gi & 255);
        out[66 + k / 8] |= uint8_t((gi >> 8) << (k % 8));
      }
      const uint32_t neg = signs_of(xb + 32 * j, c.a[j].flip);
      for (int k = 0; k < 4; ++k) out[74 + 4 * j + k] = uint8_t(neg >> (8 * k));
      out[106 + j / 2] |= uint8_t(c.u[j] << (4 * (j % 2)));
    }
  }
}

}  // namespace tf::quant
