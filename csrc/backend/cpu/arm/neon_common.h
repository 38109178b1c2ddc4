// aarch64 kernel building blocks, compiled once per ISA level. Included only by the level
// translation units (kernels_neon.cpp, kernels_dotprod.cpp, kernels_i8mm.cpp), each built with
// its own -march flags and defining TF_ARM_LEVEL first:
//   0  NEON (Armv8.0 Advanced SIMD)            — SMULL/SMLAL2/SADALP int8 dot products
//   1  + dotprod (SDOT, Armv8.2 FEAT_DotProd)   — one SDOT per 16 int8 pairs
//   2  + i8mm (SMMLA, Armv8.6 FEAT_I8MM)        — 2x8 by 8x2 int8 tiles for 2 rows x 2 columns
// Everything here has internal linkage (anonymous namespace): the same inline functions built
// with different -march flags must never be merged by the linker.
#pragma once
#if !defined(TF_ARM_LEVEL)
#error "define TF_ARM_LEVEL (0 neon, 1 dotprod, 2 i8mm) before including neon_common.h"
#endif
#include <arm_neon.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "backend/cpu/decoded_block.h"
#include "backend/cpu/kernels_internal.h"

namespace tf::cpu::detail {
namespace {

constexpr int kArmLevel = TF_ARM_LEVEL;

// acc lanes += products of 16 int8 pairs; only the total over the four lanes is meaningful
// (lanes differ between levels). Without dotprod, two products share an int16 lane before
// widening: |a*b| <= 128*127, so a pair stays below 32767 while one side is at most 127 in
// magnitude (activations are in [-127, 127]).
inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if TF_ARM_LEVEL >= 1
  return vdotq_s32(acc, a, b);
#else
  const int16x8_t p = vmlal_high_s8(vmull_s8(vget_low_s8(a), vget_low_s8(b)), a, b);
  return vpadalq_s16(acc, p);
#endif
}

// fp16 bits to float with the FCVT instruction (exact, like core/half.h's portable
// fp16_to_fp32, which costs a dozen instructions and branches per call).
inline float h2f(uint16_t bits) {
  __fp16 h;
  std::memcpy(&h, &bits, 2);
  return float(h);
}

// [total(p0), total(p1), total(p2), total(p3)]
inline int32x4_t sum4(int32x4_t p0, int32x4_t p1, int32x4_t p2, int32x4_t p3) {
  return vpaddq_s32(vpaddq_s32(p0, p1), vpaddq_s32(p2, p3));
}

// Sum over 16 int16 pairs (K-quant min terms: mn * bsums).
inline int32_t dot_i16x16(const int16_t* a, const int16_t* b) {
  const int16x8_t a0 = vld1q_s16(a), a1 = vld1q_s16(a + 8), b0 = vld1q_s16(b), b1 = vld1q_s16(b + 8);
  int32x4_t s = vmull_s16(vget_low_s16(a0), vget_low_s16(b0));
  s = vmlal_high_s16(s, a0, b0);
  s = vmlal_s16(s, vget_low_s16(a1), vget_low_s16(b1));
  s = vmlal_high_s16(s, a1, b1);
  return vaddvq_s32(s);
}

// Per-thread scratch that only grows (activation repacks, accumulators).
inline uint8_t* scratch(size_t bytes, int slot) {
  struct Buf {
    std::unique_ptr<uint8_t[]> p;
    size_t n = 0;
  };
  thread_local Buf bufs[2];
  Buf& b = bufs[slot];
  if (b.n < bytes) {
    b.p.reset(new uint8_t[bytes + 64]);
    b.n = bytes;
  }
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(b.p.get()) + 63) & ~uintptr_t(63));
}

inline const ActK* act_k(const void* xq, size_t xs, int64_t c) {
  return reinterpret_cast<const ActK*>(static_cast<const uint8_t*>(xq) + size_t(c) * xs);
}

}  // namespace
}  // namespace tf::cpu::detail
