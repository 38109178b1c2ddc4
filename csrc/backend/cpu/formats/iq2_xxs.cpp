// IQ2_XXS: 256 weights per 66-byte block, eight sub-blocks of 32 —
//   bytes 0..1    fp16 d
//   bytes 2..65   eight 8-byte records, one per sub-block s (record at 2 + 8s):
//                   bytes 0..3  one 8-bit index into kIq2xxsGrid (magnitudes 8, 25, 43) per
//                               group l of 8 weights: weight 32s + 8l + m is byte m of
//                               grid[record[l]]
//                   bytes 4..7  little-endian uint32: bits 7l..7l+6 select kSignsIq2xs[]
//                               (7 sign bits + the parity bit) for group l, bit m set =
//                               weight 32s + 8l + m negative; bits 28..31 the scale u
// w = d * (0.5 + u) * 0.25 * grid * sign = (d/8) * (2u + 1) * (±grid).
#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::iq2_xxs {

namespace {
using detail::ld16;
using detail::ld32;
using namespace ::tf::quant::iq2_xxs;  // the block layout (quant/iq_layout.h)

void decode_scalar(const uint8_t* b, detail::Decoded256* u) {
  for (int s = 0; s < 8; ++s) {
    const uint8_t* rec = b + 2 + 8 * s;
    const uint32_t aux = ld32(rec + 4);
    u->sc[2 * s] = u->sc[2 * s + 1] = int16_t(2 * (aux >> 28) + 1);
    for (int l = 0; l < 4; ++l) {
      const uint8_t signs = iq::kSignsIq2xs[(aux >> (7 * l)) & 127];
      const uint64_t g = iq::kIq2xxsGrid[rec[l]];
      for (int m = 0; m < 8; ++m) {
        const int v = int((g >> (8 * m)) & 0xFF);
        u->q[32 * s + 8 * l + m] = int8_t(signs >> m & 1 ? -v : v);
      }
    }
  }
  u->d = fp16_to_fp32(ld16(b)) * 0.125f;  // exact: a power of two on a float32 from an fp16
}

#if defined(TF_HAVE_X86_KERNELS)
// The decoder is the cost of an IQ2_XXS product (the data is 2 bits per weight), and on
// current x86 cores its limit is the shuffle ports: everything below is arranged so that a
// sub-block needs only two in-lane shuffles (signs, scale) plus the grid inserts.

// The block's eight sign/scale words, from the two 32-byte halves of the records (words sit
// in the odd dwords). Lane order after shuffle_ps: sub-blocks 0 1 4 5 | 2 3 6 7.
TF_TARGET_AVX2 inline __m256i aux_words(const uint8_t* rec) {
  const __m256 a = _mm256_loadu_ps(reinterpret_cast<const float*>(rec));
  const __m256 b = _mm256_loadu_ps(reinterpret_cast<const float*>(rec + 32));
  return _mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
constexpr int kLane[8] = {0, 1, 4, 5, 2, 3, 6, 7};  // lane of sub-block s in aux_words

// kSignsIq2xs[] for all 32 groups at once (32 table look-ups cost more): the 7 sign bits of
// group l moved to byte l of their lane, their parity in bit 7. Then regrouped so that one
// in-lane shuffle spreads a sub-block's signs: the low 128-bit lane holds bytes 0, 1 of every
// word, the high lane bytes 2, 3 (sub-block s at byte pair kLane[s] of each).
TF_TARGET_AVX2 inline __m256i block_signs(__m256i a) {
  __m256i t = _mm256_and_si256(a, _mm256_set1_epi32(0x7F));
  t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(a, 1), _mm256_set1_epi32(0x7F00)));
  t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(a, 2), _mm256_set1_epi32(0x7F0000)));
  t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(a, 3), _mm256_set1_epi32(0x7F000000)));
  // bit 7 of each byte <- xor of its bits 0..6 (the shifted-in bits come from the same byte)
  __m256i p = _mm256_xor_si256(t, _mm256_slli_epi32(t, 4));
  p = _mm256_xor_si256(p, _mm256_slli_epi32(p, 2));
  p = _mm256_xor_si256(p, _mm256_slli_epi32(p, 1));
  t = _mm256_or_si256(t, _mm256_and_si256(p, _mm256_set1_epi32(int(0x80808080u))));
  const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,  //
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(t, pairs), _MM_SHUFFLE(3, 1, 2, 0));
}

// Scales 2u+1 as 16-bit words, all eight in each 128-bit lane (sub-block s at word kLane[s]).
TF_TARGET_AVX2 inline __m256i block_scales(__m256i a) {
  const __m256i s = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(a, 28), 1), _mm256_set1_epi32(1));
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(s, s), _MM_SHUFFLE(2, 0, 2, 0));
}

// Per sub-block shuffle patterns for block_signs (byte 2k / 2k+1 over the two groups of each
// lane) and block_scales (word k everywhere), k = kLane[s].
struct alignas(32) Patterns {
  int8_t sign[8][32];
  int8_t scale[8][32];
  constexpr Patterns() : sign(), scale() {
    for (int s = 0; s < 8; ++s)
      for (int i = 0; i < 32; ++i) {
        sign[s][i] = int8_t(2 * kLane[s] + ((i & 15) >= 8));
        scale[s][i] = int8_t(2 * kLane[s] + (i & 1));
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

// Magnitudes of one sub-block: four grid words (the 2 KB grid stays in L1; scalar loads beat
// a gather, and movq + movhpd beat pinsrq).
TF_TARGET_AVX2 inline __m256i grid32(const uint8_t* rec) {
  const double* g = reinterpret_cast<const double*>(iq::kIq2xxsGrid);
  const __m128d lo = _mm_loadh_pd(_mm_load_sd(g + rec[0]), g + rec[1]);
  const __m128d hi = _mm_loadh_pd(_mm_load_sd(g + rec[2]), g + rec[3]);
  return _mm256_castpd_si256(_mm256_set_m128d(hi, lo));
}

TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded256* u) {
  const __m256i aux = aux_words(b + 2);
  const __m256i signs = block_signs(aux);
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
    const __m256i neg = neg_mask(signs, s);
    const __m256i q = _mm256_sub_epi8(_mm256_xor_si256(grid32(b + 2 + 8 * s), neg), neg);
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 32 * s), q);
  }
  // back to sub-block order, each scale twice (sc[2s] = sc[2s+1])
  const __m256i s = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(aux, 28), 1), _mm256_set1_epi32(1));
  const __m256i sc = _mm256_permutevar8x32_epi32(_mm256_or_si256(s, _mm256_slli_epi32(s, 16)),
                                                 _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->sc), sc);
  u->d = _cvtsh_ss(ld16(b)) * 0.125f;
}

// The block as the fused narrow kernel (detail::fused_rows_avx2) reads it: per sub-block the
// grid magnitudes, the signs and the scale, built in registers.
struct Block {
  const uint8_t* b;
  __m256i signs, scales;
  TF_TARGET_AVX2 explicit Block(const uint8_t* blk) : b(blk) {
    const __m256i aux = aux_words(blk + 2);
    signs = block_signs(aux);
    scales = block_scales(aux);
  }
  TF_TARGET_AVX2 detail::SubBlock32 sub(int s) const {
    return {grid32(b + 2 + 8 * s), detail::sign_of_mask(neg_mask(signs, s)),
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

}  // namespace tf::cpu::iq2_xxs

TF_FUSED_DECODED_KERNELS(iq2_xxs, kBytes, decode_scalar, decode_avx2, Block, 0.125f, 43)
