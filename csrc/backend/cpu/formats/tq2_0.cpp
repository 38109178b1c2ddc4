// TQ2_0: 256 ternary weights per 66-byte block — 64 bytes of 2-bit codes, then fp16 d.
// Byte m of half h (bytes 32h .. 32h+31) holds, in bits 2l..2l+1, the code of weight
// 128h + 32l + m; w = d * (code - 1).
#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"

namespace tf::cpu::tq2_0 {

namespace {
using detail::ld16;
using namespace ::tf::quant::tq2_0;  // the block layout (quant/iq_layout.h)

void decode_scalar(const uint8_t* b, detail::Decoded256* u) {
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 4; ++l)
      for (int m = 0; m < 32; ++m) u->q[128 * h + 32 * l + m] = int8_t(((b[32 * h + m] >> (2 * l)) & 3) - 1);
  for (int j = 0; j < 16; ++j) u->sc[j] = 1;
  u->d = fp16_to_fp32(ld16(b + 64));
}

#if defined(TF_HAVE_X86_KERNELS)
TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded256* u) {
  const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  for (int h = 0; h < 2; ++h) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * h));
    for (int l = 0; l < 4; ++l) {
      const __m256i v = _mm256_and_si256(_mm256_srli_epi16(x, 2 * l), three);
      _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 128 * h + 32 * l), _mm256_sub_epi8(v, one));
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->sc), _mm256_set1_epi16(1));
  u->d = _cvtsh_ss(ld16(b + 64));
}
#else
constexpr detail::Decode256Fn decode_avx2 = decode_scalar;
#endif
}  // namespace

#if defined(TF_HAVE_ARM_KERNELS)
// The reference decoder, for the aarch64 drivers (backend/cpu/arm) of formats without a NEON one.
void decode_ref(const uint8_t* b, detail::Decoded256* u) { decode_scalar(b, u); }
#endif

}  // namespace tf::cpu::tq2_0

TF_DECODED_KERNELS(tq2_0, 256, kBytes, decode_scalar, decode_avx2, 1)
