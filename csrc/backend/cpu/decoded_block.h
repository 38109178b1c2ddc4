// The decoded form of one weight block that the generic CPU drivers (decoded.h,
// panel_avx512.h) multiply with, the decoder signatures a format file supplies, and the
// function target attributes of the vector drivers.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(TF_HAVE_X86_KERNELS)
#include <immintrin.h>
#define TF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TF_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#endif

namespace tf::cpu::detail {

struct alignas(64) Decoded256 {
  int8_t q[256];
  int16_t sc[16];
  float d;
};

struct alignas(32) Decoded32 {
  int8_t q[32];
  float d;
};

// Unaligned little-endian loads of block fields (block sizes such as 66 or 110 bytes leave
// fields at any alignment).
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

using Decode256Fn = void (*)(const uint8_t* block, Decoded256* out);
using Decode32Fn = void (*)(const uint8_t* block, Decoded32* out);

}  // namespace tf::cpu::detail
