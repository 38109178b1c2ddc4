// Sign masks of the IQ2/IQ3 sign indices: byte m of kSignMask[i] is 0xFF when bit m of
// kSignsIq2xs[i] is set, so a grid vector g takes its signs as (g ^ mask) - mask.
#pragma once
#include <cstdint>

#include "quant/tables/iq_tables.h"

namespace tf::cpu::detail {
namespace {

struct SignMasks {
  uint64_t m[128];
  SignMasks() {
    for (int i = 0; i < 128; ++i) {
      m[i] = 0;
      for (int b = 0; b < 8; ++b)
        if (iq::kSignsIq2xs[i] >> b & 1) m[i] |= uint64_t(0xFF) << (8 * b);
    }
  }
};
const SignMasks kSignMask;

// 16 signed grid bytes from two 8-byte magnitude words and two 7-bit sign indices.
inline int8x16_t signed16(uint64_t g0, uint64_t g1, uint32_t s0, uint32_t s1) {
  const uint8x16_t g = vcombine_u8(vcreate_u8(g0), vcreate_u8(g1));
  const uint8x16_t m = vcombine_u8(vcreate_u8(kSignMask.m[s0]), vcreate_u8(kSignMask.m[s1]));
  return vreinterpretq_s8_u8(vsubq_u8(veorq_u8(g, m), m));
}

}  // namespace
}  // namespace tf::cpu::detail
