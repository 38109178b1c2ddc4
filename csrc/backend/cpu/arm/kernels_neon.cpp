// aarch64 kernels at ISA level neon (see neon_common.h); built with this level's -march flags.
#define TF_ARM_LEVEL 0
#include "backend/cpu/arm/kernels_arm.inc"

namespace tf::cpu::detail {
namespace {

// The NEON twin of the scalar block quantizer (kernels_scalar.cpp): the same scale, the same
// products x * (127 / amax) and FCVTNS's ties-to-even rounding, so the bytes are identical.
void quant_block_neon(const float* x, int n, int8_t* q, float* d_out, int* sum_out) {
  float32x4_t vmax = vdupq_n_f32(0.f);
  for (int i = 0; i < n; i += 4) vmax = vmaxq_f32(vmax, vabsq_f32(vld1q_f32(x + i)));  // FMAX keeps NaN
  const float amax = vmaxvq_f32(vmax);
  if (!(amax <= 3.402823466e38f)) {  // NaN or inf somewhere: the scalar path's poisoned block
    std::memset(q, 0, size_t(n));
    *d_out = __builtin_nanf("");
    *sum_out = 0;
    return;
  }
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  const float32x4_t vid = vdupq_n_f32(id);
  int32x4_t vsum = vdupq_n_s32(0);
  for (int i = 0; i < n; i += 16) {
    int32x4_t v[4];
    for (int j = 0; j < 4; ++j) v[j] = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(x + i + 4 * j), vid));
    const int16x8_t h0 = vcombine_s16(vmovn_s32(v[0]), vmovn_s32(v[1]));
    const int16x8_t h1 = vcombine_s16(vmovn_s32(v[2]), vmovn_s32(v[3]));
    const int8x16_t b = vcombine_s8(vmovn_s16(h0), vmovn_s16(h1));
    vst1q_s8(q + i, b);
    vsum = vpadalq_s16(vsum, vpaddlq_s8(b));
  }
  *d_out = amax / 127.f;
  *sum_out = vaddvq_s32(vsum);
}

}  // namespace

void quantize_neon(ActKind kind, const float* x, void* xq, int64_t k) {
  quantize_row_with(kind, x, xq, k, quant_block_neon);
}

}  // namespace tf::cpu::detail
