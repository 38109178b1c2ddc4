// MXFP4: 32 weights per 17-byte block — one E8M0 exponent byte e, then 16 bytes of 4-bit
// E2M1 codes (low nibbles: weights 0..15, high nibbles: 16..31). kValuesMxfp4 holds the
// E2M1 values doubled (integers -12..12), so the scale is half of 2^(e - 127):
// w = e8m0_half(e) * kValuesMxfp4[code], e8m0_half(e) = 2^(e - 128) as a float32 bit
// pattern (subnormal for e < 2; every byte value is a finite scale).
#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::mxfp4 {

namespace {
using namespace ::tf::quant::mxfp4;  // the block layout (quant/iq_layout.h)


void decode_scalar(const uint8_t* b, detail::Decoded32* u) {
  u->d = e8m0_half(b[0]);
  for (int j = 0; j < 16; ++j) {
    u->q[j] = iq::kValuesMxfp4[b[1 + j] & 0xF];
    u->q[j + 16] = iq::kValuesMxfp4[b[1 + j] >> 4];
  }
}

#if defined(TF_HAVE_X86_KERNELS)
TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded32* u) {
  const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(iq::kValuesMxfp4));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_shuffle_epi8(levels, _mm_and_si128(packed, mask));
  const __m128i hi = _mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(packed, 4), mask));
  _mm256_store_si256(reinterpret_cast<__m256i*>(u->q), _mm256_set_m128i(hi, lo));
  u->d = e8m0_half(b[0]);
}

// Every E8M0 byte's scale (a table: the branchy bit construction would sit in the GEMV loop).
struct E8m0Table {
  float v[256];
  E8m0Table() {
    for (int e = 0; e < 256; ++e) v[e] = e8m0_half(uint8_t(e));
  }
};
const E8m0Table kE8m0;

// Single-column GEMV, fused (the decoded block is never stored). One block per step: its 16
// packed bytes broadcast to both 128-bit lanes, the high lane shifted right by 4, so after
// masking the low lane holds the codes of weights 0..15 and the high lane those of 16..31 —
// the activation order, no cross-lane shuffle. Magnitudes and signed values come from two
// table lookups; maddubs(|q|, sign(x, q)) then madd with ones gives the block's int32 dot.
// Two blocks per iteration into two accumulators (the pair shares one activation group).
TF_TARGET_AVX2 void gemv_avx2(int64_t k, const uint8_t* w, size_t ws, int64_t r0, int64_t r1,
                              const uint8_t* xq, float* y) {
  const int64_t nb = k / 32, ng = detail::g32_groups(k);
  const int8_t* xs = reinterpret_cast<const int8_t*>(xq);
  const float* xd = reinterpret_cast<const float*>(xs + ng * 64);
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(iq::kValuesMxfp4)));
  const __m256i mags = _mm256_abs_epi8(levels);
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  const float* e8 = kE8m0.v;
  auto block = [&](const uint8_t* blk, const int8_t* x) TF_TARGET_AVX2 {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1)));
    const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(v, shift), m4);
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i p = _mm256_maddubs_epi16(_mm256_shuffle_epi8(mags, idx), _mm256_sign_epi8(xv, _mm256_shuffle_epi8(levels, idx)));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
  };
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + size_t(r) * ws;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t g = 0;
    for (; 2 * g + 1 < nb; ++g) {
      const uint8_t* blk = row + size_t(2 * g) * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + detail::kDecodedPrefetch), _MM_HINT_T0);
      acc0 = _mm256_fmadd_ps(block(blk, xs + 64 * g), _mm256_set1_ps(e8[blk[0]] * xd[4 * g]), acc0);
      acc1 = _mm256_fmadd_ps(block(blk + kBytes, xs + 64 * g + 32), _mm256_set1_ps(e8[blk[kBytes]] * xd[4 * g + 1]), acc1);
    }
    if (2 * g < nb) {  // odd block count: the last group holds one block
      const uint8_t* blk = row + size_t(2 * g) * kBytes;
      acc0 = _mm256_fmadd_ps(block(blk, xs + 64 * g), _mm256_set1_ps(e8[blk[0]] * xd[4 * g]), acc0);
    }
    y[r] = detail::hsum8_avx2(_mm256_add_ps(acc0, acc1));
  }
}

TF_TARGET_AVX2 void matmul_avx2(TF_MATMUL_PARAMS) {
  if (ncols == 1)
    gemv_avx2(k, static_cast<const uint8_t*>(w), ws, r0, r1, static_cast<const uint8_t*>(xq), y);
  else
    detail::matmul_d32_avx2<decode_avx2, kBytes>(TF_MATMUL_ARGS);
}
#endif
}  // namespace

#if defined(TF_HAVE_ARM_KERNELS)
// The reference decoder, for the aarch64 drivers (backend/cpu/arm) of formats without a NEON one.
void decode_ref(const uint8_t* b, detail::Decoded32* u) { decode_scalar(b, u); }
#endif

}  // namespace tf::cpu::mxfp4

namespace tf::cpu::mxfp4 {
void scalar(TF_MATMUL_PARAMS) { detail::matmul_d32_scalar<decode_scalar, kBytes>(TF_MATMUL_ARGS); }
#if defined(TF_HAVE_X86_KERNELS)
TF_TARGET_AVX2 void avx2(TF_MATMUL_PARAMS) { matmul_avx2(TF_MATMUL_ARGS); }
TF_TARGET_AVX512 void avx512(TF_MATMUL_PARAMS) { detail::matmul_d32_avx512<decode_avx2, kBytes>(TF_MATMUL_ARGS); }
TF_TARGET_AVX512 void avx512_panels(TF_MATMUL_PARAMS) {
  detail::matmul_d32_panels_avx512<decode_avx2, kBytes>(TF_MATMUL_ARGS);
}
#endif
}  // namespace tf::cpu::mxfp4
