// Bit layouts of the IQ, TQ and MXFP4 blocks: the field accessors that the reference
// dequantization (quant/reference_iq.cpp) and every backend's decoder share, so a layout is
// written down once. Pure functions of a block's bytes; no backend code.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/half.h"
#include "quant/tables/iq_tables.h"

namespace tf::quant {

// Unaligned little-endian loads (block sizes such as 66 or 110 bytes leave fields anywhere).
inline uint16_t ld16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t ld32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t ld64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// IQ1_S: 50 bytes per 256: fp16 d, 32 grid index low bytes, 8 uint16 of (3 high index bits per
// group of 8, a 3-bit sub-block scale, the delta sign).
namespace iq1_s {
constexpr size_t kBytes = 50;
// Grid index of group l (0..3) of a sub-block: 8 low bits from qs, 3 high bits from qh.
inline uint32_t grid_index(const uint8_t* qs, uint32_t h, int l) { return qs[l] | ((h >> (3 * l)) & 7u) << 8; }
}  // namespace iq1_s

// IQ1_M: 56 bytes per 256: 32 grid index low bytes, 16 nibbles (3 high bits + delta sign), four
// uint16 of 3-bit scales whose top nibbles together hold the fp16 d.
namespace iq1_m {
constexpr size_t kBytes = 56;
inline uint16_t d_bits(const uint8_t* b) {
  return uint16_t((ld16(b + 48) >> 12) | ((ld16(b + 50) >> 8) & 0x00F0u) | ((ld16(b + 52) >> 4) & 0x0F00u) |
                  (ld16(b + 54) & 0xF000u));
}
inline int scale(const uint8_t* b, int k) { return (ld16(b + 48 + 2 * (k / 4)) >> (3 * (k % 4))) & 7; }
inline uint32_t nibble(const uint8_t* b, int g) { return (b[32 + g / 2] >> (4 * (g & 1))) & 0xFu; }
}  // namespace iq1_m

// IQ2_XXS: 66 bytes per 256: fp16 d, eight 8-byte records (4 grid bytes, a uint32 of 4 x 7 sign
// bits and the 4-bit scale).
namespace iq2_xxs {
constexpr size_t kBytes = 66;
}

// IQ2_XS: 74 bytes per 256: fp16 d, 32 uint16 (9-bit grid index, 7-bit sign index), 8 bytes of
// two 4-bit scales.
namespace iq2_xs {
constexpr size_t kBytes = 74;
}

// IQ2_S: 82 bytes per 256: fp16 d, 32 grid index low bytes, 32 sign bytes, 8 bytes of 2 high
// index bits per group, 8 bytes of two 4-bit scales.
namespace iq2_s {
constexpr size_t kBytes = 82;
inline uint32_t grid_index(const uint8_t* b, int g) { return b[2 + g] | ((b[66 + g / 4] >> (2 * (g % 4))) & 3u) << 8; }
}  // namespace iq2_s

// IQ3_XXS: 98 bytes per 256: fp16 d, 64 grid bytes, eight uint32 of 4 x 7 sign bits and a 4-bit
// scale.
namespace iq3_xxs {
constexpr size_t kBytes = 98;
}

// IQ3_S: 110 bytes per 256: fp16 d, 64 grid index low bytes, 8 bytes of high index bits, 32
// sign bytes, 4 bytes of 4-bit scales.
namespace iq3_s {
constexpr size_t kBytes = 110;
constexpr int kQs = 2, kQh = 66, kSigns = 74, kScales = 106;
inline uint32_t grid_entry(const uint8_t* b, int k) {
  return iq::kIq3sGrid[b[kQs + k] | ((b[kQh + k / 8] >> (k % 8)) & 1) << 8];
}
inline int scale_u(const uint8_t* b, int s) { return (b[kScales + s / 2] >> (4 * (s % 2))) & 15; }
}  // namespace iq3_s

// IQ4_NL: 18 bytes per 32: fp16 d, 16 bytes of two 4-bit indices into kValuesIq4nl.
namespace iq4_nl {
constexpr size_t kBytes = 18;
}

// IQ4_XS: 136 bytes per 256: fp16 d, uint16 of 2 high scale bits per sub-block, 4 bytes of low
// scale nibbles, 128 bytes of 4-bit indices.
namespace iq4_xs {
constexpr size_t kBytes = 136;
inline int scale6(const uint8_t* b, int ib) {
  const int lo = (b[4 + ib / 2] >> (4 * (ib & 1))) & 0xF;
  const int hi = (ld16(b + 2) >> (2 * ib)) & 3;
  return (lo | (hi << 4)) - 32;
}
}  // namespace iq4_xs

// MXFP4: 17 bytes per 32: an e8m0 exponent, 16 bytes of two 4-bit E2M1 codes.
namespace mxfp4 {
constexpr size_t kBytes = 17;
// ggml's "e8m0 to fp32 half", computed on the bit pattern exactly as gguf.quants does.
inline float e8m0_half(uint8_t e) { return bits_to_f32(e < 2 ? uint32_t(0x00200000) << e : uint32_t(e - 1) << 23); }
}  // namespace mxfp4

// TQ1_0: 54 bytes per 256: base-3 packed trits (5 per byte, then 4 per byte), fp16 d.
namespace tq1_0 {
constexpr size_t kBytes = 54;
constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};
// Weight i's code - 1 (in -1..1).
inline int trit(const uint8_t* b, int i) {
  uint8_t q, m;
  if (i < 160) q = b[i % 32], m = kPow3[i / 32];
  else if (i < 240) q = b[32 + (i - 160) % 16], m = kPow3[(i - 160) / 16];
  else q = b[48 + (i - 240) % 4], m = kPow3[(i - 240) / 4];
  const uint8_t v = uint8_t(q * m);
  return ((uint16_t(v) * 3) >> 8) - 1;
}
}  // namespace tq1_0

// TQ2_0: 66 bytes per 256: 2-bit codes (4 per byte), fp16 d.
namespace tq2_0 {
constexpr size_t kBytes = 66;
}

}  // namespace tf::quant
