// IQ2_XXS, IQ2_XS and IQ2_S quantizers (layouts: quant/iq_layout.h).
//
// All three store a weight as (d/8) * (2u+1) * (±g): d the block's fp16 scale, u a 4-bit
// sub-block scale (one per 32 weights in IQ2_XXS, per 16 in IQ2_XS / IQ2_S), g byte m of a grid
// entry chosen per group of 8 weights. Every grid uses the magnitudes 8, 25, 43 only, so a group
// is a point of the 3^8 lattice of level vectors and the grid a subset of it (256, 512 or 1024
// points). Signs are stored apart: 8 free bits in IQ2_S, 7 bits plus an implied even parity in
// IQ2_XXS / IQ2_XS (an odd number of negative weights costs one flipped sign).
//
// Nearest grid point under a weighted distance: the per-coordinate nearest level vector is the
// exact answer whenever it is a grid point (the distance is separable). Otherwise the candidates
// are the grid points within a margin of the nearest (in unweighted level-value distance) from
// that lattice point, listed once per lattice point, and they are evaluated exactly.
//
// Per block: (1) every sub-block gets its best continuous scale by a sweep of candidate scales,
// each followed by a choice of points and a weighted least-squares refit; (2) candidate block
// scales d (fp16-rounded) are ranked by a quadratic model of the sub-block errors, and the best
// few are evaluated exactly, trying the neighbouring 4-bit u of each sub-block with the points
// chosen afresh at the decoded scale; d is then refitted by least squares given u and the
// points, and re-evaluated while that improves the error.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "quant/quantizers/quantizers.h"
#include "quant/tables/iq_tables.h"

namespace tf::quant {

namespace {

constexpr int kLattice = 6561;  // 3^8
constexpr float kLevel[3] = {8.f, 25.f, 43.f};
constexpr int kPow3[8] = {1, 3, 9, 27, 81, 243, 729, 2187};
// Candidate grid points of an off-grid lattice point: those whose squared distance (in grid
// values) is within this of the nearest one's. One level step is 289 or 324.
constexpr float kMargin = 700.f;

struct Grid {
  int n = 0;
  std::vector<float> g;          // n * 8 values
  int16_t map[kLattice];         // lattice index -> grid index, or -1
  std::vector<int32_t> start;    // kLattice + 1 offsets into nb
  std::vector<uint16_t> nb;      // neighbour lists of the off-grid lattice points

  Grid(const uint64_t* grid, int count) : n(count), g(size_t(count) * 8), start(kLattice + 1, 0) {
    std::vector<uint8_t> lv(size_t(count) * 8);
    std::fill(map, map + kLattice, int16_t(-1));
    for (int j = 0; j < count; ++j) {
      int idx = 0;
      for (int m = 0; m < 8; ++m) {
        const int v = int((grid[j] >> (8 * m)) & 0xFF);
        const int l = v == 8 ? 0 : v == 25 ? 1 : 2;
        g[size_t(j) * 8 + m] = float(v);
        lv[size_t(j) * 8 + m] = uint8_t(l);
        idx += l * kPow3[m];
      }
      map[idx] = int16_t(j);
    }
    std::vector<float> dist(count);
    for (int p = 0; p < kLattice; ++p) {
      start[p] = int32_t(nb.size());
      if (map[p] >= 0) continue;
      float pv[8];
      for (int m = 0, r = p; m < 8; ++m, r /= 3) pv[m] = kLevel[r % 3];
      float dmin = 1e30f;
      for (int j = 0; j < count; ++j) {
        float d = 0;
        for (int m = 0; m < 8; ++m) {
          const float e = pv[m] - g[size_t(j) * 8 + m];
          d += e * e;
        }
        dist[j] = d;
        dmin = std::min(dmin, d);
      }
      for (int j = 0; j < count; ++j)
        if (dist[j] <= dmin + kMargin) nb.push_back(uint16_t(j));
    }
    start[kLattice] = int32_t(nb.size());
  }
};

const Grid& grid_xxs() {
  static const Grid g(iq::kIq2xxsGrid, 256);
  return g;
}
const Grid& grid_xs() {
  static const Grid g(iq::kIq2xsGrid, 512);
  return g;
}
const Grid& grid_s() {
  static const Grid g(iq::kIq2sGrid, 1024);
  return g;
}

inline float wdist(const float* gv, const float* t, const float* w, float s) {
  float e = 0;
  for (int m = 0; m < 8; ++m) {
    const float d = t[m] - s * gv[m];
    e += w[m] * d * d;
  }
  return e;
}

// The grid point nearest (weighted) to the targets t (signed: a negative target wants the
// smallest magnitude) at scale s > 0. Returns the index, *err the weighted squared error.
inline int nearest(const Grid& G, const float* t, const float* w, float s, float* err) {
  const float inv = 1.f / s;
  int p = 0;
  for (int m = 0; m < 8; ++m) {
    const float y = t[m] * inv;
    p += (y < 16.5f ? 0 : y < 34.f ? 1 : 2) * kPow3[m];
  }
  const int j = G.map[p];
  if (j >= 0) {
    *err = wdist(&G.g[size_t(j) * 8], t, w, s);
    return j;
  }
  int best = -1;
  float be = 3.4e38f;
  for (int k = G.start[p]; k < G.start[p + 1]; ++k) {
    const int c = G.nb[k];
    const float e = wdist(&G.g[size_t(c) * 8], t, w, s);
    if (e < be) be = e, best = c;
  }
  *err = be;
  return best;
}

struct GroupChoice {
  float err;
  int idx;
  uint8_t flip;  // sign flips against the sign of x (parity formats)
};

// Best grid point and flips for one group of 8 magnitudes a (weights w) at scale s. With
// parity, an odd count of negative x must flip one sign: the kFlipTries cheapest candidates
// (first-order cost w*a) are tried exactly.
constexpr int kFlipTries = 3;

inline GroupChoice solve_group(const Grid& G, const float* a, const float* w, float s, bool odd) {
  GroupChoice r;
  if (!odd) {
    r.idx = nearest(G, a, w, s, &r.err);
    r.flip = 0;
    return r;
  }
  int order[8];
  float cost[8];
  for (int m = 0; m < 8; ++m) order[m] = m, cost[m] = w[m] * a[m];
  std::partial_sort(order, order + kFlipTries, order + 8, [&](int i, int j) { return cost[i] < cost[j]; });
  r.err = 3.4e38f;
  r.idx = 0;
  r.flip = 0;
  float t[8];
  std::memcpy(t, a, sizeof t);
  for (int k = 0; k < kFlipTries; ++k) {
    const int m = order[k];
    t[m] = -a[m];
    float e;
    const int j = nearest(G, t, w, s, &e);
    t[m] = a[m];
    if (e < r.err) r.err = e, r.idx = j, r.flip = uint8_t(1u << m);
  }
  return r;
}

struct Format {
  const Grid* G;
  int sub;      // weights per 4-bit scale: 32 or 16
  bool parity;  // 7 sign bits + even parity
};

// Points of one sub-block (sub/8 groups) at scale s: total error, sums for the refit.
struct SubFit {
  float err, sxg, sgg;  // sum w*t*g, sum w*g*g over the chosen (signed) targets
  int idx[4];
  uint8_t flip[4];
};

inline SubFit fit_sub(const Format& F, const float* a, const float* w, const bool* odd, float s) {
  SubFit f{0, 0, 0, {}, {}};
  for (int k = 0; k < F.sub / 8; ++k) {
    const GroupChoice c = solve_group(*F.G, a + 8 * k, w + 8 * k, s, odd[k]);
    f.err += c.err;
    f.idx[k] = c.idx;
    f.flip[k] = c.flip;
    const float* gv = &F.G->g[size_t(c.idx) * 8];
    for (int m = 0; m < 8; ++m) {
      const float t = c.flip >> m & 1 ? -a[8 * k + m] : a[8 * k + m];
      f.sxg += w[8 * k + m] * t * gv[m];
      f.sgg += w[8 * k + m] * gv[m] * gv[m];
    }
  }
  return f;
}

// fp16 of a positive scale, saturating at the largest finite half.
inline uint16_t to_half(float d) { return fp32_to_fp16(std::min(d, 65504.f)); }

struct BlockState {
  float err = 3.4e38f;
  uint16_t d = 0;
  int u[16];
  int idx[32];
  uint8_t flip[32];
};

void quantize_block(const Format& F, const float* x, const float* wrow, BlockState* out) {
  const int nsub = 256 / F.sub, gps = F.sub / 8;
  float a[256], w[256];
  bool odd[32];
  for (int i = 0; i < 256; ++i) a[i] = std::fabs(x[i]), w[i] = wrow ? wrow[i] : 1.f;
  for (int k = 0; k < 32; ++k) {
    int neg = 0;
    for (int m = 0; m < 8; ++m) neg += x[8 * k + m] < 0;
    odd[k] = F.parity && (neg & 1);
  }
  BlockState& B = *out;
  B.err = 0;
  B.d = 0;
  for (int b = 0; b < nsub; ++b) B.u[b] = 0;
  for (int k = 0; k < 32; ++k) B.idx[k] = 0, B.flip[k] = 0;
  float swxx = 0;
  for (int i = 0; i < 256; ++i) swxx += w[i] * a[i] * a[i];
  B.err = swxx;  // the all-zero block
  if (!(swxx > 0)) return;

  // (1) continuous scale of every sub-block
  float sopt[16], A[16];
  float smax = 0;
  for (int b = 0; b < nsub; ++b) {
    const float* ab = a + F.sub * b;
    const float* wb = w + F.sub * b;
    float amax = 0, sxx = 0;
    for (int i = 0; i < F.sub; ++i) {
      if (wb[i] > 0) amax = std::max(amax, ab[i]);
      sxx += wb[i] * ab[i] * ab[i];
    }
    sopt[b] = 0;
    A[b] = 0;
    if (!(amax > 0) || !(sxx > 0)) continue;
    float best = sxx, bs = 0, bA = 0;
    constexpr int kCand = 10;
    for (int c = 0; c < kCand; ++c) {
      const float v = 26.f + float(c) * (60.f - 26.f) / float(kCand - 1);
      const SubFit f = fit_sub(F, ab, wb, odd + gps * b, amax / v);
      if (f.sxg > 0 && f.sgg > 0) {
        const float e = sxx - f.sxg * f.sxg / f.sgg;
        if (e < best) best = e, bs = f.sxg / f.sgg, bA = f.sgg;
      }
    }
    for (int it = 0; it < 2 && bs > 0; ++it) {
      const SubFit f = fit_sub(F, ab, wb, odd + gps * b, bs);
      if (!(f.sxg > 0 && f.sgg > 0)) break;
      const float e = sxx - f.sxg * f.sxg / f.sgg;
      if (!(e < best)) break;
      best = e, bs = f.sxg / f.sgg, bA = f.sgg;
    }
    sopt[b] = bs;
    A[b] = bA;
    smax = std::max(smax, bs);
  }
  if (!(smax > 0)) return;

  // (2) block scale: rank candidates by the quadratic model, evaluate the best exactly
  auto model_u = [&](float d, int b) {
    const int u = int(std::lround((8.f * sopt[b] / d - 1.f) * 0.5f));
    return std::clamp(u, 0, 15);
  };
  auto model_err = [&](float d) {
    float e = 0;
    for (int b = 0; b < nsub; ++b) {
      const float r = sopt[b] - d * float(2 * model_u(d, b) + 1) * 0.125f;
      e += A[b] * r * r;
    }
    return e;
  };
  constexpr int kD = 24, kExact = 2;
  float cand[kD + kD];
  int nc = 0;
  for (int c = 0; c < kD; ++c) {
    const float k = 31.f - float(c) * 0.25f;
    const float d = fp16_to_fp32(to_half(8.f * smax / k));
    if (!(d > 0) || !std::isfinite(d)) continue;
    cand[nc++] = d;
    // least-squares d for the model's u at this d
    float num = 0, den = 0;
    for (int b = 0; b < nsub; ++b) {
      const float cb = float(2 * model_u(d, b) + 1) * 0.125f;
      num += A[b] * sopt[b] * cb;
      den += A[b] * cb * cb;
    }
    if (den > 0) {
      const float d2 = fp16_to_fp32(to_half(num / den));
      if (d2 > 0 && std::isfinite(d2)) cand[nc++] = d2;
    }
  }
  std::sort(cand, cand + nc);
  nc = int(std::unique(cand, cand + nc) - cand);
  float me[kD + kD];
  for (int c = 0; c < nc; ++c) me[c] = model_err(cand[c]);
  int ord[kD + kD];
  for (int c = 0; c < nc; ++c) ord[c] = c;
  const int ne = std::min(kExact, nc);
  std::partial_sort(ord, ord + ne, ord + nc, [&](int i, int j) { return me[i] < me[j]; });

  BlockState T;
  // exact evaluation at d (fp16 value h): u of each sub-block from the neighbours of the
  // model's choice; returns the least-squares d given the choices.
  auto evaluate = [&](uint16_t h, BlockState* S) {
    const float d = fp16_to_fp32(h);
    S->d = h;
    S->err = 0;
    float num = 0, den = 0;
    for (int b = 0; b < nsub; ++b) {
      const float* ab = a + F.sub * b;
      const float* wb = w + F.sub * b;
      const int u0 = sopt[b] > 0 ? model_u(d, b) : 0;
      float be = 3.4e38f;
      SubFit bf{};
      int bu = u0;
      for (int u = std::max(0, u0 - 1); u <= std::min(15, u0 + 1); ++u) {
        const SubFit f = fit_sub(F, ab, wb, odd + gps * b, d * float(2 * u + 1) * 0.125f);
        if (f.err < be) be = f.err, bf = f, bu = u;
      }
      S->err += be;
      S->u[b] = bu;
      for (int k = 0; k < gps; ++k) S->idx[gps * b + k] = bf.idx[k], S->flip[gps * b + k] = bf.flip[k];
      const float cb = float(2 * bu + 1) * 0.125f;
      num += cb * bf.sxg;
      den += cb * cb * bf.sgg;
    }
    return den > 0 && num > 0 ? num / den : 0.f;
  };
  for (int c = 0; c < ne; ++c) {
    uint16_t h = to_half(cand[ord[c]]);
    for (int it = 0; it < 4; ++it) {
      const float dn = evaluate(h, &T);
      if (T.err < B.err) B = T;
      const uint16_t hn = to_half(dn);
      if (!(dn > 0) || hn == h) break;
      if (it > 0 && !(T.err <= B.err)) break;
      h = hn;
    }
  }
}

inline uint8_t sign_bits(const float* x, uint8_t flip) {
  uint8_t s = 0;
  for (int m = 0; m < 8; ++m) s |= uint8_t(((x[m] < 0) ^ (flip >> m & 1)) << m);
  return s;
}

inline void st16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
inline void st32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

}  // namespace

void quantize_iq2_xxs(const float* x, const float* w, void* dst, int64_t n) {
  const Format F{&grid_xxs(), 32, true};
  auto* out = static_cast<uint8_t*>(dst);
  BlockState B;
  for (int64_t ib = 0; ib < n / 256; ++ib, out += 66) {
    const float* xb = x + 256 * ib;
    quantize_block(F, xb, w ? w + 256 * ib : nullptr, &B);
    st16(out, B.d);
    for (int s = 0; s < 8; ++s) {
      uint8_t* rec = out + 2 + 8 * s;
      uint32_t aux = uint32_t(B.u[s]) << 28;
      for (int l = 0; l < 4; ++l) {
        const int g = 4 * s + l;
        rec[l] = uint8_t(B.idx[g]);
        aux |= uint32_t(sign_bits(xb + 8 * g, B.flip[g]) & 127) << (7 * l);
      }
      st32(rec + 4, aux);
    }
  }
}

void quantize_iq2_xs(const float* x, const float* w, void* dst, int64_t n) {
  const Format F{&grid_xs(), 16, true};
  auto* out = static_cast<uint8_t*>(dst);
  BlockState B;
  for (int64_t ib = 0; ib < n / 256; ++ib, out += 74) {
    const float* xb = x + 256 * ib;
    quantize_block(F, xb, w ? w + 256 * ib : nullptr, &B);
    st16(out, B.d);
    for (int g = 0; g < 32; ++g)
      st16(out + 2 + 2 * g, uint16_t(B.idx[g] | (sign_bits(xb + 8 * g, B.flip[g]) & 127) << 9));
    for (int s = 0; s < 8; ++s) out[66 + s] = uint8_t(B.u[2 * s] | B.u[2 * s + 1] << 4);
  }
}

void quantize_iq2_s(const float* x, const float* w, void* dst, int64_t n) {
  const Format F{&grid_s(), 16, false};
  auto* out = static_cast<uint8_t*>(dst);
  BlockState B;
  for (int64_t ib = 0; ib < n / 256; ++ib, out += 82) {
    const float* xb = x + 256 * ib;
    quantize_block(F, xb, w ? w + 256 * ib : nullptr, &B);
    st16(out, B.d);
    std::memset(out + 66, 0, 8);
    for (int g = 0; g < 32; ++g) {
      out[2 + g] = uint8_t(B.idx[g] & 0xFF);
      out[34 + g] = sign_bits(xb + 8 * g, 0);
      out[66 + g / 4] |= uint8_t((B.idx[g] >> 8) << (2 * (g % 4)));
    }
    for (int s = 0; s < 8; ++s) out[74 + s] = uint8_t(B.u[2 * s] | B.u[2 * s + 1] << 4);
  }
}

}  // namespace tf::quant
