// IQ2_S: 256 weights per 82-byte block, eight sub-blocks of 32 —
//   bytes  0..1   fp16 d
//   bytes  2..33  low 8 bits of the kIq2sGrid index (magnitudes 8, 25, 43) of each group g of
//                 8 weights: weight 8g + m is byte m of grid[index]
//   bytes 34..65  one sign byte per group g: bit m set = weight 8g + m negative
//   bytes 66..73  one byte per sub-block s: bits 2l..2l+1 are bits 8..9 of the index of
//                 group 4s + l
//   bytes 74..81  one byte per sub-block s: low nibble the scale u of weights 32s..32s+15,
//                 high nibble that of weights 32s+16..32s+31
// w = d * (0.5 + u) * 0.25 * grid * sign = (d/8) * (2u + 1) * (±grid).
#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::iq2_s {

namespace {
using detail::ld16;
using namespace ::tf::quant::iq2_s;  // the block layout (quant/iq_layout.h)
using ::tf::quant::ld64;



void decode_scalar(const uint8_t* b, detail::Decoded256* u) {
  for (int g = 0; g < 32; ++g) {
    const uint8_t signs = b[34 + g];
    const uint64_t grid = iq::kIq2sGrid[grid_index(b, g)];
    for (int m = 0; m < 8; ++m) {
      const int q = int((grid >> (8 * m)) & 0xFF);
      u->q[8 * g + m] = int8_t(signs >> m & 1 ? -q : q);
    }
  }
  for (int s = 0; s < 8; ++s) {
    u->sc[2 * s] = int16_t(2 * (b[74 + s] & 0xF) + 1);
    u->sc[2 * s + 1] = int16_t(2 * (b[74 + s] >> 4) + 1);
  }
  u->d = fp16_to_fp32(ld16(b)) * 0.125f;  // exact: a power of two on a float32 from an fp16
}

#if defined(TF_HAVE_X86_KERNELS)
// As for IQ2_XXS, the decoder is the cost and the shuffle ports its limit: a sub-block needs
// two in-lane shuffles (signs, scales) plus the grid inserts.

// The 32 sign bytes regrouped so that one in-lane shuffle spreads a sub-block's signs: the
// low 128-bit lane holds bytes 0, 1 of every sub-block's four, the high one bytes 2, 3
// (sub-block s at byte pair s of each).
TF_TARGET_AVX2 inline __m256i block_signs(const uint8_t* signs) {
  const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(signs));
  const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,  //
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(t, pairs), _MM_SHUFFLE(3, 1, 2, 0));
}

// The sixteen scales 2u+1 as bytes, in sub-block order, in both 128-bit lanes.
TF_TARGET_AVX2 inline __m256i block_scales(const uint8_t* sc) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i v = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
  return _mm256_broadcastsi128_si256(_mm_or_si128(_mm_add_epi8(v, v), _mm_set1_epi8(1)));
}

// Per sub-block shuffle patterns: for block_signs (byte 2s / 2s+1 over the two groups of each
// 128-bit lane); for block_scales (scale 2s zero-extended to every word of the low lane, the
// weights 32s..32s+15 of maddubs' output; scale 2s+1 in the high lane).
struct alignas(32) Patterns {
  int8_t sign[8][32];
  int8_t scale[8][32];
  constexpr Patterns() : sign(), scale() {
    for (int s = 0; s < 8; ++s)
      for (int i = 0; i < 32; ++i) {
        sign[s][i] = int8_t(2 * s + ((i & 15) >= 8));
        scale[s][i] = int8_t(i & 1 ? -128 : 2 * s + (i >= 16));
      }
  }
};
constexpr Patterns kPat;

TF_TARGET_AVX2 inline __m256i pattern(const int8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }

// 0xFF where a weight of sub-block s is negative.
TF_TARGET_AVX2 inline __m256i neg_mask(__m256i signs, int s) {
  const __m256i bits = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(signs, pattern(kPat.sign[s])), bits), bits);
}

// The block's 32 grid indices (a qs byte plus two qh bits each) as 16-bit words, built in
// vector registers: groups 0..15 in `lo`, 16..31 in `hi`, sub-block s in 64-bit word s % 4.
// (Assembling them with scalar shifts needs more ALU work than the loop has room for.)
struct Indices {
  __m256i lo, hi;
};
TF_TARGET_AVX2 inline Indices block_indices(const uint8_t* b) {
  const __m256i h = _mm256_set1_epi64x(int64_t(ld64(b + 66)));
  // word g <- qh byte g/4 times 2^(8 - 2(g%4)): its two bits for group g land at bits 8..9
  const __m256i pick = _mm256_setr_epi8(0, -128, 0, -128, 0, -128, 0, -128, 1, -128, 1, -128, 1, -128, 1, -128,  //
                                        2, -128, 2, -128, 2, -128, 2, -128, 3, -128, 3, -128, 3, -128, 3, -128);
  const __m256i mul = _mm256_setr_epi16(256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4);
  const __m256i m = _mm256_set1_epi16(0x300);
  const __m256i hlo = _mm256_and_si256(_mm256_mullo_epi16(_mm256_shuffle_epi8(h, pick), mul), m);
  const __m256i hhi =
      _mm256_and_si256(_mm256_mullo_epi16(_mm256_shuffle_epi8(h, _mm256_add_epi8(pick, _mm256_set1_epi16(4))), mul), m);
  const __m256i llo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
  const __m256i lhi = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)));
  return {_mm256_or_si256(llo, hlo), _mm256_or_si256(lhi, hhi)};
}

// Magnitudes of sub-block s: its four indices moved to a scalar register (movq / pextrq:
// cheaper than reloading them from memory), then four grid words (the 8 KB grid stays in L1;
// scalar loads beat a gather, movq + movhpd beat pinsrq).
TF_TARGET_AVX2 inline __m256i grid32(const Indices& ix, int s) {
  const __m256i v = s < 4 ? ix.lo : ix.hi;
  const __m128i h = (s & 2) ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
  const uint64_t i = (s & 1) ? uint64_t(_mm_extract_epi64(h, 1)) : uint64_t(_mm_cvtsi128_si64(h));
  const double* g = reinterpret_cast<const double*>(iq::kIq2sGrid);
  const __m128d lo = _mm_loadh_pd(_mm_load_sd(g + (i & 0xFFFF)), g + ((i >> 16) & 0xFFFF));
  const __m128d hi = _mm_loadh_pd(_mm_load_sd(g + ((i >> 32) & 0xFFFF)), g + (i >> 48));
  return _mm256_castpd_si256(_mm256_set_m128d(hi, lo));
}

TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded256* u) {
  const Indices ix = block_indices(b);
  const __m256i signs = block_signs(b + 34);
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
    const __m256i neg = neg_mask(signs, s);
    const __m256i q = _mm256_sub_epi8(_mm256_xor_si256(grid32(ix, s), neg), neg);
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 32 * s), q);
  }
  const __m256i sc = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(block_scales(b + 74)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->sc), sc);
  u->d = _cvtsh_ss(ld16(b)) * 0.125f;
}

// The block as the fused narrow kernel (detail::fused_rows_avx2) reads it.
struct Block {
  const uint8_t* b;
  Indices ix;
  __m256i signs, scales;
  TF_TARGET_AVX2 explicit Block(const uint8_t* blk)
      : b(blk), ix(block_indices(blk)), signs(block_signs(blk + 34)), scales(block_scales(blk + 74)) {}
  TF_TARGET_AVX2 detail::SubBlock32 sub(int s) const {
    return {grid32(ix, s), detail::sign_of_mask(neg_mask(signs, s)),
            _mm256_shuffle_epi8(scales, pattern(kPat.scale[s]))};
  }
  TF_TARGET_AVX2 float d() const { return _cvtsh_ss(ld16(b)); }
};

#endif
}  // namespace

#if defined(TF_HAVE_ARM_KERNELS)
// The reference decoder, for the aarch64 drivers (backend/cpu/arm) of formats without a NEON one.
void decode_ref(const uint8_t* b, detail::Decoded256* u) { decode_scalar(b, u); }
#endif

}  // namespace tf::cpu::iq2_s

TF_FUSED_DECODED_KERNELS(iq2_s, kBytes, decode_scalar, decode_avx2, Block, 0.125f, 43)
