// Reference dequantization of the IQ, TQ and MXFP4 formats, bit-exact against the gguf
// package's numpy dequantizers: the same operations in the same order (each function says
// which). Layouts in quant/iq_layout.h.
#include "quant/iq_layout.h"
#include "quant/reference.h"

namespace tf {

using quant::ld16;
using quant::ld32;

// dl = d * (2 * scale + 1), then dl * (grid + delta).
void dequantize_row_iq1_s_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::iq1_s;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 256; ++b, p += kBytes) {
    const float d = fp16_to_fp32(ld16(p));
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t h = ld16(p + 34 + 2 * ib);
      const float dl = d * float(2 * ((h >> 12) & 7) + 1);
      const float delta = (h & 0x8000u) ? -0.125f : 0.125f;
      for (int l = 0; l < 4; ++l) {
        const uint64_t g = iq::kIq1sGrid[grid_index(p + 2 + 4 * ib, h, l)];
        for (int j = 0; j < 8; ++j)
          dst[256 * b + 32 * ib + 8 * l + j] = dl * (float(int8_t(g >> (8 * j))) + delta);
      }
    }
  }
}

void dequantize_row_iq1_m_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::iq1_m;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 256; ++b, p += kBytes) {
    const float d = fp16_to_fp32(d_bits(p));
    for (int g = 0; g < 32; ++g) {
      const float dl = d * float(2 * scale(p, g / 2) + 1);
      const uint32_t nb = nibble(p, g);
      const uint64_t grid = iq::kIq1sGrid[p[g] | (nb & 7) << 8];
      const float delta = (nb & 8) ? -0.125f : 0.125f;
      for (int j = 0; j < 8; ++j) dst[256 * b + 8 * g + j] = dl * (float(int8_t(grid >> (8 * j))) + delta);
    }
  }
}

// db = d * (0.5 + u) * 0.25, then (db * grid) * sign.
void dequantize_row_iq2_xxs_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::iq2_xxs;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 256; ++b, p += kBytes) {
    const float d = fp16_to_fp32(ld16(p));
    for (int s = 0; s < 8; ++s) {
      const uint8_t* rec = p + 2 + 8 * s;
      const uint32_t aux = ld32(rec + 4);
      const float db = d * (0.5f + float(aux >> 28)) * 0.25f;
      for (int l = 0; l < 4; ++l) {
        const uint8_t signs = iq::kSignsIq2xs[(aux >> (7 * l)) & 127];
        const uint64_t g = iq::kIq2xxsGrid[rec[l]];
        for (int m = 0; m < 8; ++m) {
          const float v = db * float((g >> (8 * m)) & 0xFF);
          dst[256 * b + 32 * s + 8 * l + m] = signs >> m & 1 ? -v : v;
        }
      }
    }
  }
}

void dequantize_row_iq2_xs_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::iq2_xs;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 256; ++b, p += kBytes) {
    const float d = fp16_to_fp32(ld16(p));
    for (int g = 0; g < 32; ++g) {
      const int u = (p[66 + g / 4] >> (4 * ((g / 2) & 1))) & 0xF;
      const float db = d * (0.5f + float(u)) * 0.25f;
      const uint16_t v = ld16(p + 2 + 2 * g);
      const uint8_t signs = iq::kSignsIq2xs[v >> 9];
      const uint64_t grid = iq::kIq2xsGrid[v & 511];
      for (int m = 0; m < 8; ++m) {
        const float w = db * float((grid >> (8 * m)) & 0xFF);
        dst[256 * b + 8 * g + m] = signs >> m & 1 ? -w : w;
      }
    }
  }
}

void dequantize_row_iq2_s_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::iq2_s;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 256; ++b, p += kBytes) {
    const float d = fp16_to_fp32(ld16(p));
    for (int g = 0; g < 32; ++g) {
      const int u = (p[74 + g / 4] >> (4 * ((g / 2) & 1))) & 0xF;
      const float db = d * (0.5f + float(u)) * 0.25f;
      const uint8_t signs = p[34 + g];
      const uint64_t grid = iq::kIq2sGrid[grid_index(p, g)];
      for (int m = 0; m < 8; ++m) {
        const float w = db * float((grid >> (8 * m)) & 0xFF);
        dst[256 * b + 8 * g + m] = signs >> m & 1 ? -w : w;
      }
    }
  }
}

// db = d * (0.5 + u) * 0.5, then (db * grid) * sign.
void dequantize_row_iq3_xxs_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::iq3_xxs;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 256; ++b, p += kBytes) {
    const float d = fp16_to_fp32(ld16(p));
    for (int s = 0; s < 8; ++s) {
      const uint32_t aux = ld32(p + 66 + 4 * s);
      const float db = d * (0.5f + float(aux >> 28)) * 0.5f;
      for (int l = 0; l < 4; ++l) {
        const uint8_t signs = iq::kSignsIq2xs[(aux >> (7 * l)) & 127];
        for (int m = 0; m < 8; ++m) {
          const float g = float((iq::kIq3xxsGrid[p[2 + 8 * s + 2 * l + m / 4]] >> (8 * (m % 4))) & 0xFF);
          const float v = db * g;
          dst[256 * b + 32 * s + 8 * l + m] = signs >> m & 1 ? -v : v;
        }
      }
    }
  }
}

// db = d * (1 + 2u), then (db * grid) * sign.
void dequantize_row_iq3_s_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::iq3_s;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 256; ++b, p += kBytes) {
    const float d = fp16_to_fp32(ld16(p));
    for (int k = 0; k < 64; ++k) {
      const float db = d * float(1 + 2 * scale_u(p, k / 8));
      const uint32_t g = grid_entry(p, k);
      for (int m = 0; m < 4; ++m) {
        const int i = 4 * k + m;
        const float v = db * float((g >> (8 * m)) & 0xFF);
        dst[256 * b + i] = (p[kSigns + i / 8] >> (i % 8)) & 1 ? -v : v;
      }
    }
  }
}

void dequantize_row_iq4_nl_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::iq4_nl;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 32; ++b, p += kBytes) {
    const float d = fp16_to_fp32(ld16(p));
    for (int j = 0; j < 16; ++j) {
      dst[32 * b + j] = d * float(iq::kValuesIq4nl[p[2 + j] & 0xF]);
      dst[32 * b + j + 16] = d * float(iq::kValuesIq4nl[p[2 + j] >> 4]);
    }
  }
}

// dl = d * (scale - 32), then dl * value.
void dequantize_row_iq4_xs_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::iq4_xs;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 256; ++b, p += kBytes) {
    const float d = fp16_to_fp32(ld16(p));
    for (int ib = 0; ib < 8; ++ib) {
      const float dl = d * float(scale6(p, ib));
      const uint8_t* qs = p + 8 + 16 * ib;
      float* o = dst + 256 * b + 32 * ib;
      for (int j = 0; j < 16; ++j) {
        o[j] = dl * float(iq::kValuesIq4nl[qs[j] & 0xF]);
        o[j + 16] = dl * float(iq::kValuesIq4nl[qs[j] >> 4]);
      }
    }
  }
}

void dequantize_row_mxfp4_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::mxfp4;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 32; ++b, p += kBytes) {
    const float d = e8m0_half(p[0]);
    for (int j = 0; j < 16; ++j) {
      dst[32 * b + j] = d * float(iq::kValuesMxfp4[p[1 + j] & 0xF]);
      dst[32 * b + j + 16] = d * float(iq::kValuesMxfp4[p[1 + j] >> 4]);
    }
  }
}

void dequantize_row_tq1_0_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::tq1_0;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 256; ++b, p += kBytes) {
    const float d = fp16_to_fp32(ld16(p + 52));
    for (int i = 0; i < 256; ++i) dst[256 * b + i] = d * float(trit(p, i));
  }
}

void dequantize_row_tq2_0_ref(const void* src, float* dst, int64_t n) {
  using namespace quant::tq2_0;
  const auto* p = static_cast<const uint8_t*>(src);
  for (int64_t b = 0; b < n / 256; ++b, p += kBytes) {
    const float d = fp16_to_fp32(ld16(p + 64));
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 4; ++l)
        for (int m = 0; m < 32; ++m)
          dst[256 * b + 128 * h + 32 * l + m] = d * float(((p[32 * h + m] >> (2 * l)) & 3) - 1);
  }
}

}  // namespace tf
