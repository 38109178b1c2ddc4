// IQ3_S: 256 weights per 110-byte block, eight sub-blocks of 32 —
//   bytes   0..1    fp16 d
//   bytes   2..65   qs: low 8 bits of a 9-bit index into kIq3sGrid (4 magnitudes, 1..15 odd)
//                   per 4 weights; weight 4k + m is byte m of grid[qs[k] | hi(k) << 8]
//   bytes  66..73   qh: bit k % 8 of byte k / 8 is hi(k), the index's 9th bit
//   bytes  74..105  signs: bit i % 8 of byte i / 8 set = weight i negative
//   bytes 106..109  scales: nibble s (low nibble first) is u of sub-block s
// w = d * (1 + 2u) * grid * sign.
#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::iq3_s {

namespace {
using detail::ld16;
using namespace ::tf::quant::iq3_s;  // the block layout (quant/iq_layout.h)



void decode_scalar(const uint8_t* b, detail::Decoded256* u) {
  for (int k = 0; k < 64; ++k) {
    const uint32_t g = grid_entry(b, k);
    for (int m = 0; m < 4; ++m) {
      const int i = 4 * k + m;
      const int v = int((g >> (8 * m)) & 0xFF);
      u->q[i] = int8_t((b[kSigns + i / 8] >> (i % 8)) & 1 ? -v : v);
    }
  }
  for (int s = 0; s < 8; ++s) u->sc[2 * s] = u->sc[2 * s + 1] = int16_t(1 + 2 * scale_u(b, s));
  u->d = fp16_to_fp32(ld16(b));
}

#if defined(TF_HAVE_X86_KERNELS)
// Byte i of the result is 0xFF where bit i of the 32-bit word `bits` is set.
TF_TARGET_AVX2 inline __m256i bit_mask32(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  const __m256i w = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(w, select), select);
}

// The grid magnitudes of sub-block s (weights 32s .. 32s+31): eight 9-bit indices, the low
// bytes from one 64-bit load and the 9th bits from qh[s]; scalar loads from the 2 KB grid.
TF_TARGET_AVX2 inline __m256i magnitudes(const uint8_t* b, int s) {
  const uint32_t* g = iq::kIq3sGrid;
  uint64_t lo;
  std::memcpy(&lo, b + kQs + 8 * s, 8);
  const unsigned hi = b[kQh + s];
  auto idx = [&](int j) { return unsigned((lo >> (8 * j)) & 0xFF) | ((hi >> j) & 1u) << 8; };
  return _mm256_setr_epi32(int(g[idx(0)]), int(g[idx(1)]), int(g[idx(2)]), int(g[idx(3)]), int(g[idx(4)]),
                           int(g[idx(5)]), int(g[idx(6)]), int(g[idx(7)]));
}

// 0xFF in the bytes of sub-block s's negative weights.
TF_TARGET_AVX2 inline __m256i negatives(const uint8_t* b, int s) {
  uint32_t bits;
  std::memcpy(&bits, b + kSigns + 4 * s, 4);
  return bit_mask32(bits);
}

// (v ^ neg) - neg negates the bytes whose mask is 0xFF.
TF_TARGET_AVX2 inline __m256i apply_sign(__m256i v, __m256i neg) {
  return _mm256_sub_epi8(_mm256_xor_si256(v, neg), neg);
}

TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded256* u) {
  for (int s = 0; s < 8; ++s)
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 32 * s), apply_sign(magnitudes(b, s), negatives(b, s)));
  for (int s = 0; s < 8; ++s) u->sc[2 * s] = u->sc[2 * s + 1] = int16_t(1 + 2 * scale_u(b, s));
  u->d = _cvtsh_ss(ld16(b));
}

// The block as the fused narrow kernel (detail::fused_rows_avx2) reads it.
struct Block {
  const uint8_t* b;
  TF_TARGET_AVX2 explicit Block(const uint8_t* blk) : b(blk) {}
  TF_TARGET_AVX2 detail::SubBlock32 sub(int s) const {
    return {magnitudes(b, s), detail::sign_of_mask(negatives(b, s)),
            _mm256_set1_epi16(int16_t(1 + 2 * scale_u(b, s)))};
  }
  TF_TARGET_AVX2 float d() const { return _cvtsh_ss(ld16(b)); }
};
#else
constexpr detail::Decode256Fn decode_avx2 = decode_scalar;
#endif
}  // namespace

#if defined(TF_HAVE_ARM_KERNELS)
// The reference decoder, for the aarch64 drivers (backend/cpu/arm) of formats without a NEON one.
void decode_ref(const uint8_t* b, detail::Decoded256* u) { decode_scalar(b, u); }
#endif

}  // namespace tf::cpu::iq3_s

TF_FUSED_DECODED_KERNELS(iq3_s, kBytes, decode_scalar, decode_avx2, Block, 1.0f, 15)
