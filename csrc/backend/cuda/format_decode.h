// The weight formats of the CUDA backend, one chunk of 32 values at a time, written once for
// the device (nvcc: __host__ __device__) and the host (g++: plain inline functions), so the
// arithmetic every CUDA product kernel runs is checked on any machine against the reference
// dequantization (host_emulation.cpp, tests/test_cuda_host.py).
//
// A chunk of an int8 format decodes to 32 signed 8-bit levels q and, per half of 16 values,
// a scale s and a min m: value l = s[l / 16] * q[l] - m[l / 16]. Every format whose levels fit
// int8 takes this path (products: dp4a against activations quantized to int8 per 32 values):
// Q8_0, Q2_K .. Q6_K, the IQ2 / IQ3 / IQ4 family and MXFP4. F16 / BF16 are float formats.
// Layouts (byte offsets inside a block) follow csrc/quant/reference*.cpp, the block facts of
// ggml's formats; raw bytes are read (no packed structs), so no access is misaligned.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define TF_HD __host__ __device__ __forceinline__
#else
#define TF_HD inline
#endif

namespace tf::cudafmt {

// The lookup tables of the IQ and MXFP4 formats, wherever they live (device copies on the GPU,
// tf::iq's tables on the host).
struct Tables {
  const uint64_t* iq2xxs = nullptr;  // 256
  const uint64_t* iq2xs = nullptr;   // 512
  const uint64_t* iq2s = nullptr;    // 1024
  const uint32_t* iq3xxs = nullptr;  // 256
  const uint32_t* iq3s = nullptr;    // 512
  const uint8_t* signs = nullptr;    // 128
  const int8_t* iq4nl = nullptr;     // 16
  const int8_t* mxfp4 = nullptr;     // 16
};

// Formats by GGUF type id (tf::GgmlType values).
enum Fmt : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17,
  IQ3_XXS = 18, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, BF16 = 30, MXFP4 = 39,
};

TF_HD uint32_t u16(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8; }
TF_HD uint32_t u32(const uint8_t* p) { return u16(p) | u16(p + 2) << 16; }
TF_HD uint64_t u64(const uint8_t* p) { return uint64_t(u32(p)) | uint64_t(u32(p + 4)) << 32; }

TF_HD float bits_f32(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  union { uint32_t u; float f; } v{b};
  return v.f;
#endif
}

// IEEE half -> float, exact (subnormals, inf, nan), the same on host and device.
TF_HD float half_f32(uint32_t h) {
  const uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  if (e == 0) {
    // subnormal or zero: m * 2^-24
    const float v = float(m) * 5.9604644775390625e-08f;
    return s ? -v : v;
  }
  if (e == 31) return bits_f32(s | 0x7F800000u | (m << 13));
  return bits_f32(s | ((e + 112) << 23) | (m << 13));
}
TF_HD float bf16_f32(uint32_t h) { return bits_f32(h << 16); }
TF_HD float e8m0_half(uint32_t e) { return bits_f32(e < 2 ? uint32_t(0x00200000) << e : uint32_t(e - 1) << 23); }

// Bytes of one block and values per block.
TF_HD int block_bytes(uint32_t f) {
  switch (f) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case IQ2_XXS: return 66;
    case IQ2_XS: return 74;
    case IQ2_S: return 82;
    case IQ3_XXS: return 98;
    case IQ3_S: return 110;
    case IQ4_NL: return 18;
    case IQ4_XS: return 136;
    case MXFP4: return 17;
    default: return 0;
  }
}
TF_HD int block_values(uint32_t f) {
  switch (f) {
    case F32: case F16: case BF16: return 1;
    case Q8_0: case IQ4_NL: case MXFP4: case Q4_0: case Q4_1: case Q5_0: case Q5_1: return 32;
    default: return 256;
  }
}
TF_HD bool is_float_format(uint32_t f) { return f == F32 || f == F16 || f == BF16; }
// Whether a format's chunks have mins (m != 0): the products then need the activations' sums.
TF_HD bool has_min(uint32_t f) { return f == Q2_K || f == Q4_K || f == Q5_K || f == Q4_1 || f == Q5_1; }

// 6-bit scale and min j of a Q4_K / Q5_K super-block (12 packed bytes at q).
TF_HD void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}
TF_HD int scale_q3k(int k, const uint8_t* s) {
  const int lo = k < 8 ? (s[k] & 0x0F) : (s[k - 8] >> 4);
  const int hi = (s[8 + (k % 4)] >> (2 * (k / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

// One decoded chunk: value l = s[l >> 4] * q[l] - m[l >> 4].
struct Chunk {
  int8_t q[32];
  float s[2];
  float m[2];
};

// Chunk c (values 32c .. 32c + 31) of a row of an int8 format.
template <uint32_t F>
TF_HD void decode_chunk(const uint8_t* row, int64_t c, const Tables& tb, Chunk& o) {
  o.m[0] = o.m[1] = 0.f;
  if constexpr (F == Q8_0) {
    const uint8_t* b = row + c * 34;
    o.s[0] = o.s[1] = half_f32(u16(b));
#pragma unroll
    for (int l = 0; l < 32; ++l) o.q[l] = int8_t(b[2 + l]);
  } else if constexpr (F == Q4_0 || F == Q4_1 || F == Q5_0 || F == Q5_1) {
    // d, [m], [qh: 32 high bits], qs: 16 bytes (value j: low nibble, value j + 16: high nibble)
    const uint8_t* b = row + c * block_bytes(F);
    const bool has_m = F == Q4_1 || F == Q5_1, five = F == Q5_0 || F == Q5_1;
    o.s[0] = o.s[1] = half_f32(u16(b));
    if (has_m) o.m[0] = o.m[1] = -half_f32(u16(b + 2));
    const uint32_t qh = five ? u32(b + (has_m ? 4 : 2)) : 0;
    const uint8_t* qs = b + 2 + (has_m ? 2 : 0) + (five ? 4 : 0);
    const int off = has_m ? 0 : (five ? 16 : 8);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      int lo = qs[j] & 0xF, hi = qs[j] >> 4;
      if (five) {
        lo |= int((qh >> j) & 1) << 4;
        hi |= int((qh >> (j + 16)) & 1) << 4;
      }
      o.q[j] = int8_t(lo - off);
      o.q[j + 16] = int8_t(hi - off);
    }
  } else if constexpr (F == IQ4_NL || F == MXFP4) {
    const uint8_t* b = row + c * (F == IQ4_NL ? 18 : 17);
    const int8_t* lv = F == IQ4_NL ? tb.iq4nl : tb.mxfp4;
    const uint8_t* qs = b + (F == IQ4_NL ? 2 : 1);
    o.s[0] = o.s[1] = F == IQ4_NL ? half_f32(u16(b)) : e8m0_half(b[0]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o.q[j] = lv[qs[j] & 0xF];
      o.q[j + 16] = lv[qs[j] >> 4];
    }
  } else {
    const int j = int(c & 7);  // sub-block of 32 in the super-block
    const uint8_t* b = row + (c >> 3) * block_bytes(F);
    if constexpr (F == Q4_K || F == Q5_K) {
      const float d = half_f32(u16(b)), dmin = half_f32(u16(b + 2));
      int sc, m;
      scale_min_k4(j, b + 4, sc, m);
      o.s[0] = o.s[1] = d * float(sc);
      o.m[0] = o.m[1] = dmin * float(m);
      const uint8_t* qs = b + (F == Q4_K ? 16 : 48) + (j / 2) * 32;
      const int sh = 4 * (j % 2);
#pragma unroll
      for (int l = 0; l < 32; ++l) {
        int v = (qs[l] >> sh) & 0x0F;
        if constexpr (F == Q5_K) v |= ((b[16 + l] >> j) & 1) << 4;
        o.q[l] = int8_t(v);
      }
    } else if constexpr (F == Q6_K) {
      const float d = half_f32(u16(b + 208));
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      o.s[0] = d * float(sc[2 * j]);
      o.s[1] = d * float(sc[2 * j + 1]);
      const int h = j / 4, r0 = (j % 4) * 32;  // e = 128h + r, r = r0 + l
#pragma unroll
      for (int l = 0; l < 32; ++l) {
        const int r = r0 + l;
        const int lo = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
        const int hi = (b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
        o.q[l] = int8_t((lo | (hi << 4)) - 32);
      }
    } else if constexpr (F == Q2_K) {
      const float d = half_f32(u16(b + 80)), dmin = half_f32(u16(b + 82));
      const int h = j / 4, s = j % 4;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int sc = b[2 * j + k];
        o.s[k] = d * float(sc & 0x0F);
        o.m[k] = dmin * float(sc >> 4);
      }
#pragma unroll
      for (int l = 0; l < 32; ++l) o.q[l] = int8_t((b[16 + h * 32 + l] >> (2 * s)) & 3);
    } else if constexpr (F == Q3_K) {
      const float d = half_f32(u16(b + 108));
      o.s[0] = d * float(scale_q3k(2 * j, b + 96));
      o.s[1] = d * float(scale_q3k(2 * j + 1, b + 96));
      const int h = j / 4, s = j % 4;
#pragma unroll
      for (int l = 0; l < 32; ++l) {
        const int lo = (b[32 + h * 32 + l] >> (2 * s)) & 3;
        const int hi = (b[l] >> (h * 4 + s)) & 1;
        o.q[l] = int8_t(lo - (hi ? 0 : 4));
      }
    } else if constexpr (F == IQ2_XXS) {
      const float d = half_f32(u16(b));
      const uint8_t* rec = b + 2 + 8 * j;
      const uint32_t aux = u32(rec + 4);
      o.s[0] = o.s[1] = d * (0.5f + float(aux >> 28)) * 0.25f;
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const uint32_t signs = tb.signs[(aux >> (7 * l)) & 127];
        const uint64_t g = tb.iq2xxs[rec[l]];
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const int v = int((g >> (8 * m)) & 0xFF);
          o.q[8 * l + m] = int8_t((signs >> m) & 1 ? -v : v);
        }
      }
    } else if constexpr (F == IQ2_XS || F == IQ2_S) {
      const float d = half_f32(u16(b));
      const int sb = F == IQ2_XS ? 66 : 74;
      o.s[0] = d * (0.5f + float(b[sb + j] & 0xF)) * 0.25f;
      o.s[1] = d * (0.5f + float(b[sb + j] >> 4)) * 0.25f;
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const int g = 4 * j + l;
        uint32_t signs;
        uint64_t grid;
        if constexpr (F == IQ2_XS) {
          const uint32_t v = u16(b + 2 + 2 * g);
          signs = tb.signs[v >> 9];
          grid = tb.iq2xs[v & 511];
        } else {
          signs = b[34 + g];
          grid = tb.iq2s[b[2 + g] | ((b[66 + g / 4] >> (2 * (g % 4))) & 3u) << 8];
        }
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const int v = int((grid >> (8 * m)) & 0xFF);
          o.q[8 * l + m] = int8_t((signs >> m) & 1 ? -v : v);
        }
      }
    } else if constexpr (F == IQ3_XXS) {
      const float d = half_f32(u16(b));
      const uint32_t aux = u32(b + 66 + 4 * j);
      o.s[0] = o.s[1] = d * (0.5f + float(aux >> 28)) * 0.5f;
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const uint32_t signs = tb.signs[(aux >> (7 * l)) & 127];
        const uint32_t g0 = tb.iq3xxs[b[2 + 8 * j + 2 * l]], g1 = tb.iq3xxs[b[2 + 8 * j + 2 * l + 1]];
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const int v = int(((m < 4 ? g0 : g1) >> (8 * (m % 4))) & 0xFF);
          o.q[8 * l + m] = int8_t((signs >> m) & 1 ? -v : v);
        }
      }
    } else if constexpr (F == IQ3_S) {
      const float d = half_f32(u16(b));
      o.s[0] = o.s[1] = d * float(1 + 2 * ((b[106 + j / 2] >> (4 * (j % 2))) & 15));
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const int k = 8 * j + kk;
        const uint32_t g = tb.iq3s[b[2 + k] | ((b[66 + j] >> kk) & 1u) << 8];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int i = 4 * k + m;
          const int v = int((g >> (8 * m)) & 0xFF);
          o.q[4 * kk + m] = int8_t((b[74 + i / 8] >> (i % 8)) & 1 ? -v : v);
        }
      }
    } else if constexpr (F == IQ4_XS) {
      const float d = half_f32(u16(b));
      const int lo = (b[4 + j / 2] >> (4 * (j & 1))) & 0xF;
      const int hi = (int(u16(b + 2)) >> (2 * j)) & 3;
      o.s[0] = o.s[1] = d * float((lo | (hi << 4)) - 32);
      const uint8_t* qs = b + 8 + 16 * j;
#pragma unroll
      for (int l = 0; l < 16; ++l) {
        o.q[l] = tb.iq4nl[qs[l] & 0xF];
        o.q[l + 16] = tb.iq4nl[qs[l] >> 4];
      }
    } else {
      static_assert(F == Q4_K, "decode_chunk: not an int8 format");
    }
  }
}

// Value i of a row of a float format.
template <uint32_t F>
TF_HD float float_value(const uint8_t* row, int64_t i) {
  if constexpr (F == F32) return bits_f32(u32(row + 4 * i));
  else if constexpr (F == F16) return half_f32(u16(row + 2 * i));
  else return bf16_f32(u16(row + 2 * i));
}

// Activation quantization: 32 values to int8 levels with one scale (round half to even of
// x / d, d = max |x| / 127); the same arithmetic on both sides.
TF_HD float q8_scale(float amax) { return amax / 127.f; }
TF_HD int8_t q8_level(float x, float d) {
  if (d == 0.f) return 0;
  float v = x / d;
#if defined(__CUDA_ARCH__)
  int r = __float2int_rn(v);
#else
  // round half to even, as __float2int_rn
  float fl = float(int64_t(v < 0 ? v - 1.f : v));  // floor for |v| < 2^31
  if (fl > v) fl -= 1.f;
  const float diff = v - fl;
  int r = int(fl);
  if (diff > 0.5f || (diff == 0.5f && (r & 1))) r += 1;
#endif
  return int8_t(r < -127 ? -127 : r > 127 ? 127 : r);
}

}  // namespace tf::cudafmt

// The int8 formats, for dispatch tables: X(Fmt).
#define TF_CUDA_INT8_FORMATS(X) \
  X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K) X(IQ2_XXS) X(IQ2_XS) X(IQ2_S) X(IQ3_XXS) X(IQ3_S) X(IQ4_XS) \
  X(IQ4_NL) X(MXFP4)
#define TF_CUDA_FLOAT_FORMATS(X) X(F32) X(F16) X(BF16)
