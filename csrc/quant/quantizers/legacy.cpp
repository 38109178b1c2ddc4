// Importance-weighted quantizers of the legacy 32-weight formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
//
// Symmetric formats (x ~= d * q): an exact sweep over the inverse scale (scale_search.h) finds
// the level assignment with the least weighted error under its least-squares scale, for both
// signs of d; the scale is then rounded to fp16 (trying the neighbouring fp16 values too) and
// the levels are re-rounded against the value the decoder will use.
// Offset formats (x ~= d * q + m): sweeps of the inverse scale anchored at the bottom and at
// the top of the block's range, each assignment scored by its least-squares (d, m), then
// alternating refits; (d, m) are rounded to fp16 over a 3 x 3 neighbourhood, levels re-rounded.
// Values already on a Q4_1 / Q5_1 grid (d * q + m in fp16) come back (near-)exactly.
#include <algorithm>
#include <cstring>

#include "quant/blocks.h"
#include "quant/quantizers/quantizers.h"
#include "quant/quantizers/scale_search.h"

namespace tf::quant {

namespace {
using namespace detail;

// Symmetric block of 32: the fp16 scale bits and the level indices (into L).
template <class Lv>
uint16_t sym_block(Events& ev, const float* x, const float* w, const Lv& L, float below, float above, int16_t* idx) {
  const SymFit f = fit_sym(ev, x, w, 32, L, below, above, idx);
  return choose_half_scale(x, w, 32, L, f.d, idx);
}

// Offset block of 32: fp16 (d, m) bits and the levels 0..qmax.
void affine_block(Events& ev, const float* x, const float* w, int qmax, float below, float above, uint16_t* dh,
                  uint16_t* mh, uint8_t* q) {
  const AffineFit f = fit_affine(ev, x, w, 32, qmax, below, above, false, q);
  const uint16_t d0 = half_bits(f.d), m0 = half_bits(f.m);
  uint8_t tmp[32];
  double best = -1;
  // When the levels in use do not span 0..qmax, the same values are d * (q + j) + (m - j d)
  // for other shifts j; their fp16 offsets round differently, and one may be exact (values
  // that already lie on a Q4_1 / Q5_1 grid).
  int qlo = qmax, qhi = 0;
  for (int i = 0; i < 32; ++i)
    if (w[i] > 0.0f) {
      qlo = std::min(qlo, int(q[i]));
      qhi = std::max(qhi, int(q[i]));
    }
  if (f.d > 0.0f && qlo <= qhi)
    for (int j = -qlo; j <= qmax - qhi; ++j) {
      if (j == 0) continue;
      const uint16_t mc = half_bits(f.m - float(j) * f.d);
      const double e = affine_assign(x, w, 32, qmax, half_val(d0), half_val(mc), tmp);
      if (best < 0 || e < best) {
        best = e;
        *dh = d0;
        *mh = mc;
        std::memcpy(q, tmp, 32);
      }
    }
  const int order[3] = {0, -1, 1};  // unrounded first: it wins ties (all-zero weights -> zeros)
  for (int a : order) {
    const uint16_t dc = half_step(d0, a);
    const float dv = half_val(dc);
    if (dv < 0.0f || (a != 0 && dv == 0.0f)) continue;
    for (int b : order) {
      const uint16_t mc = half_step(m0, b);
      const double e = affine_assign(x, w, 32, qmax, dv, half_val(mc), tmp);
      if (best < 0 || e < best || (a == 0 && b == 0 && e <= best)) {
        best = e;
        *dh = dv > 0.0f ? dc : 0;
        *mh = mc;
        std::memcpy(q, tmp, 32);
      }
    }
  }
}

// Sweep ranges, as fractions of the inverse scale t_end at which the largest value reaches its
// end level: [t_end (1 - below), t_end (1 + above)]. Wide above-ranges matter with importance
// weights (clipping an unimportant large value); the values were tuned on Gaussian /
// Student-t / outlier rows against error and speed.
struct Range {
  float below, above;
};
constexpr Range kQ4_0{0.3f, 4.0f}, kQ5_0{0.2f, 1.5f}, kQ8_0{0.06f, 0.06f};
constexpr Range kQ4_1{0.5f, 0.5f}, kQ5_1{0.2f, 0.3f};

}  // namespace

void quantize_q4_0(const float* x, const float* w, void* dst, int64_t n) {
  block_q4_0* b = static_cast<block_q4_0*>(dst);
  const UniformLevels L{-8, 7};
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / QK4_0; ++ib) {
    const float* xb = x + ib * QK4_0;
    const Weights W(w ? w + ib * QK4_0 : nullptr, QK4_0);
    int16_t idx[32];
    b[ib].d = sym_block(ev, xb, W.p, L, kQ4_0.below, kQ4_0.above, idx);
    for (int j = 0; j < 16; ++j) b[ib].qs[j] = uint8_t(idx[j] | (idx[j + 16] << 4));
  }
}

void quantize_q5_0(const float* x, const float* w, void* dst, int64_t n) {
  block_q5_0* b = static_cast<block_q5_0*>(dst);
  const UniformLevels L{-16, 15};
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / QK5_0; ++ib) {
    const float* xb = x + ib * QK5_0;
    const Weights W(w ? w + ib * QK5_0 : nullptr, QK5_0);
    int16_t idx[32];
    b[ib].d = sym_block(ev, xb, W.p, L, kQ5_0.below, kQ5_0.above, idx);
    uint32_t qh = 0;
    for (int j = 0; j < 16; ++j) {
      b[ib].qs[j] = uint8_t((idx[j] & 0x0F) | ((idx[j + 16] & 0x0F) << 4));
      qh |= uint32_t((idx[j] >> 4) & 1) << j;
      qh |= uint32_t((idx[j + 16] >> 4) & 1) << (j + 16);
    }
    std::memcpy(b[ib].qh, &qh, 4);
  }
}

void quantize_q8_0(const float* x, const float* w, void* dst, int64_t n) {
  block_q8_0* b = static_cast<block_q8_0*>(dst);
  const UniformLevels L{-127, 127};  // -128 is left out, as ggml does (int8 sign tricks)
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / QK8_0; ++ib) {
    const float* xb = x + ib * QK8_0;
    const Weights W(w ? w + ib * QK8_0 : nullptr, QK8_0);
    int16_t idx[32];
    b[ib].d = sym_block(ev, xb, W.p, L, kQ8_0.below, kQ8_0.above, idx);
    for (int j = 0; j < 32; ++j) b[ib].qs[j] = int8_t(idx[j] - 127);
  }
}

void quantize_q4_1(const float* x, const float* w, void* dst, int64_t n) {
  block_q4_1* b = static_cast<block_q4_1*>(dst);
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / QK4_1; ++ib) {
    const float* xb = x + ib * QK4_1;
    const Weights W(w ? w + ib * QK4_1 : nullptr, QK4_1);
    uint8_t q[32];
    affine_block(ev, xb, W.p, 15, kQ4_1.below, kQ4_1.above, &b[ib].d, &b[ib].m, q);
    for (int j = 0; j < 16; ++j) b[ib].qs[j] = uint8_t(q[j] | (q[j + 16] << 4));
  }
}

void quantize_q5_1(const float* x, const float* w, void* dst, int64_t n) {
  block_q5_1* b = static_cast<block_q5_1*>(dst);
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / QK5_1; ++ib) {
    const float* xb = x + ib * QK5_1;
    const Weights W(w ? w + ib * QK5_1 : nullptr, QK5_1);
    uint8_t q[32];
    affine_block(ev, xb, W.p, 31, kQ5_1.below, kQ5_1.above, &b[ib].d, &b[ib].m, q);
    uint32_t qh = 0;
    for (int j = 0; j < 16; ++j) {
      b[ib].qs[j] = uint8_t((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
      qh |= uint32_t((q[j] >> 4) & 1) << j;
      qh |= uint32_t((q[j + 16] >> 4) & 1) << (j + 16);
    }
    std::memcpy(b[ib].qh, &qh, 4);
  }
}

}  // namespace tf::quant
