// Signs of the IQ2/IQ3 sign indices as bytes: byte m of kSignMask[i] is -1 when bit m of
// kSignsIq2xs[i] is set, else +1, so a grid vector takes its signs with one multiply.
#pragma once
#include <cstdint>

#include "quant/iq_layout.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::detail {
namespace {

struct SignMasks {
  uint64_t m[128];
  SignMasks() {
    for (int i = 0; i < 128; ++i) {
      m[i] = 0;
      for (int b = 0; b < 8; ++b)
        m[i] |= uint64_t(iq::kSignsIq2xs[i] >> b & 1 ? 0xFF : 0x01) << (8 * b);
    }
  }
};
const SignMasks kSignMask;

// 16 signed grid bytes from two 8-byte magnitude words and two 7-bit sign indices.
inline int8x16_t signed16(uint64_t g0, uint64_t g1, uint32_t s0, uint32_t s1) {
  const uint8x16_t g = vcombine_u8(vcreate_u8(g0), vcreate_u8(g1));
  const uint8x16_t m = vcombine_u8(vcreate_u8(kSignMask.m[s0]), vcreate_u8(kSignMask.m[s1]));
  return vreinterpretq_s8_u8(vmulq_u8(g, m));  // |g| <= 62: the product is the signed value
}

}  // namespace
}  // namespace tf::cpu::detail
