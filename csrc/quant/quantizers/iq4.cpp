// Importance-weighted quantizers of IQ4_NL, IQ4_XS (non-linear 4-bit levels) and MXFP4.
//
// IQ4_NL: the exact inverse-scale sweep over the 16 non-linear levels (both signs of the
// scale, scale_search.h), the fp16 scale chosen among its neighbours by the true error.
// IQ4_XS: sym_superblock with those levels: sub-block sweeps, a curvature-weighted sweep for
// the fp16 super-scale, the 6-bit sub-block scales re-chosen against it, least-squares refits.
// MXFP4: the scale is a power of two (E8M0), so every plausible exponent is tried with the
// values rounded to the nearest E2M1 level, and the least weighted error wins.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant/quantizers/quantizers.h"
#include "quant/quantizers/scale_search.h"
#include "quant/tables/iq_tables.h"

namespace tf::quant {

namespace {
using namespace detail;

// kValuesIq4nl is sorted ascending, so a level's index in TableLevels is its 4-bit code.
const TableLevels& iq4nl_levels() {
  static const TableLevels L(iq::kValuesIq4nl, 16);
  return L;
}

constexpr float kNlBelow = 0.3f, kNlAbove = 4.0f;  // IQ4_NL block sweep
constexpr float kXsBelow = 0.3f, kXsAbove = 1.0f;  // IQ4_XS sub-block sweeps

// ggml's "e8m0 to fp32 half": 2^(e - 128) as a float bit pattern (subnormal for e < 2).
float e8m0_half(int e) {
  return bits_to_f32(e < 2 ? uint32_t(0x00200000) << e : uint32_t(e - 1) << 23);
}

}  // namespace

void quantize_iq4_nl(const float* x, const float* w, void* dst, int64_t n) {
  const TableLevels& L = iq4nl_levels();
  uint8_t* p = static_cast<uint8_t*>(dst);
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / 32; ++ib, p += 18) {
    const float* xb = x + ib * 32;
    const Weights W(w ? w + ib * 32 : nullptr, 32);
    int16_t idx[32];
    const SymFit f = fit_sym(ev, xb, W.p, 32, L, kNlBelow, kNlAbove, idx);
    const uint16_t h = choose_half_scale(xb, W.p, 32, L, f.d, idx);
    std::memcpy(p, &h, 2);
    for (int j = 0; j < 16; ++j) p[2 + j] = uint8_t(idx[j] | (idx[j + 16] << 4));
  }
}

void quantize_iq4_xs(const float* x, const float* w, void* dst, int64_t n) {
  const TableLevels& L = iq4nl_levels();
  uint8_t* p = static_cast<uint8_t*>(dst);
  Events ev;  // sweep scratch, reused by every block of the row
  for (int64_t ib = 0; ib < n / 256; ++ib, p += 136) {
    const float* xb = x + ib * 256;
    const Weights W(w ? w + ib * 256 : nullptr, 256);
    int sc[8];
    int16_t idx[256];
    uint16_t h = 0;
    sym_superblock(ev, xb, W.p, 32, 8, L, kXsBelow, kXsAbove, -32, 31, &h, sc, idx);
    std::memcpy(p, &h, 2);
    uint16_t sh = 0;
    std::memset(p + 4, 0, 4);
    for (int j = 0; j < 8; ++j) {
      const int u = sc[j] + 32;  // 0..63
      p[4 + j / 2] |= uint8_t((u & 0xF) << (4 * (j & 1)));
      sh |= uint16_t(((u >> 4) & 3) << (2 * j));
    }
    std::memcpy(p + 2, &sh, 2);
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 16; ++i)
        p[8 + 16 * j + i] = uint8_t(idx[32 * j + i] | (idx[32 * j + i + 16] << 4));
  }
}

void quantize_mxfp4(const float* x, const float* w, void* dst, int64_t n) {
  // The distinct E2M1 values (doubled) in ascending order and their 4-bit codes.
  static constexpr int8_t kVal[15] = {-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12};
  static constexpr uint8_t kCode[15] = {15, 14, 13, 12, 11, 10, 9, 0, 1, 2, 3, 4, 5, 6, 7};
  const TableLevels L(kVal, 15);
  uint8_t* p = static_cast<uint8_t*>(dst);
  for (int64_t ib = 0; ib < n / 32; ++ib, p += 17) {
    const float* xb = x + ib * 32;
    const Weights W(w ? w + ib * 32 : nullptr, 32);
    float amax = 0;
    for (int i = 0; i < 32; ++i)
      if (W.p[i] > 0.0f) amax = std::max(amax, std::fabs(xb[i]));
    int16_t idx[32], best_idx[32];
    int best_e = 0;
    if (amax == 0.0f) {
      for (int i = 0; i < 32; ++i) best_idx[i] = 7;  // code 0
    } else {
      // The exponent at which amax lands on the top level 12 (scale = 2^(e - 128)), and a few
      // below it (clipping the largest values), one above.
      int ec;
      std::frexp(amax / 12.0f, &ec);  // amax / 12 in [2^(ec-1), 2^ec)
      ec += 128;
      double best = -1;
      const int e_lo = std::min(254, std::max(0, ec - 4)), e_hi = std::min(254, std::max(0, ec + 1));
      for (int e = e_lo; e <= e_hi; ++e) {
        const double err = err_sym(xb, W.p, 32, L, e8m0_half(e), idx);
        if (best < 0 || err < best) {
          best = err;
          best_e = e;
          std::memcpy(best_idx, idx, sizeof(idx));
        }
      }
    }
    p[0] = uint8_t(best_e);
    for (int j = 0; j < 16; ++j) p[1 + j] = uint8_t(kCode[best_idx[j]] | (kCode[best_idx[j + 16]] << 4));
  }
}

}  // namespace tf::quant
