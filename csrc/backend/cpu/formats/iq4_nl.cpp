// IQ4_NL: 32 weights per 18-byte block — fp16 scale d, then 16 bytes of 4-bit indices into a
// non-linear level table (low nibbles: weights 0..15, high nibbles: 16..31);
// w = d * kValuesIq4nl[index].
#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::iq4_nl {

namespace {
using detail::ld16;
using namespace ::tf::quant::iq4_nl;  // the block layout (quant/iq_layout.h)

void decode_scalar(const uint8_t* b, detail::Decoded32* u) {
  u->d = fp16_to_fp32(ld16(b));
  for (int j = 0; j < 16; ++j) {
    u->q[j] = iq::kValuesIq4nl[b[2 + j] & 0xF];
    u->q[j + 16] = iq::kValuesIq4nl[b[2 + j] >> 4];
  }
}

#if defined(TF_HAVE_X86_KERNELS)
TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded32* u) {
  const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(iq::kValuesIq4nl));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_shuffle_epi8(levels, _mm_and_si128(packed, mask));
  const __m128i hi = _mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(packed, 4), mask));
  _mm256_store_si256(reinterpret_cast<__m256i*>(u->q), _mm256_set_m128i(hi, lo));
  u->d = _cvtsh_ss(ld16(b));
}
#else
constexpr detail::Decode32Fn decode_avx2 = decode_scalar;
#endif
}  // namespace

}  // namespace tf::cpu::iq4_nl

TF_DECODED_KERNELS(iq4_nl, 32, kBytes, decode_scalar, decode_avx2, 127)

#if defined(TF_HAVE_X86_KERNELS)
namespace tf::cpu::iq4_nl {
TF_TARGET_AVX512 void avx512_panels(TF_MATMUL_PARAMS) {
  detail::matmul_d32_panels_avx512<decode_avx2, kBytes>(TF_MATMUL_ARGS);
}
}  // namespace tf::cpu::iq4_nl
#endif
