// IQ3_XXS: 256 weights per 98-byte block, eight sub-blocks of 32 —
//   bytes  0..1   fp16 d
//   bytes  2..65  qs: one 8-bit index into kIq3xxsGrid (4 magnitudes, 4..62) per 4 weights;
//                 weight 32s + 4j + m is byte m of grid[qs[8s + j]]
//   bytes 66..97  eight little-endian uint32, one per sub-block s: bits 7l..7l+6 (l = 0..3)
//                 select kSignsIq2xs[] (7 sign bits + the parity bit) for weights 32s+8l ..
//                 32s+8l+7, bit m set = weight 32s+8l+m negative; bits 28..31 the scale u
// w = d * (0.5 + u) * 0.5 * grid * sign = (d/4) * (2u + 1) * (±grid).
#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::iq3_xxs {

namespace {
using detail::ld16;
using detail::ld32;
using namespace ::tf::quant::iq3_xxs;  // the block layout (quant/iq_layout.h)

void decode_scalar(const uint8_t* b, detail::Decoded256* u) {
  for (int s = 0; s < 8; ++s) {
    const uint32_t aux = ld32(b + 66 + 4 * s);
    u->sc[2 * s] = u->sc[2 * s + 1] = int16_t(2 * (aux >> 28) + 1);
    for (int l = 0; l < 4; ++l) {
      const uint8_t signs = iq::kSignsIq2xs[(aux >> (7 * l)) & 127];
      for (int m = 0; m < 8; ++m) {
        const int g = int((iq::kIq3xxsGrid[b[2 + 8 * s + 2 * l + m / 4]] >> (8 * (m % 4))) & 0xFF);
        u->q[32 * s + 8 * l + m] = int8_t(signs >> m & 1 ? -g : g);
      }
    }
  }
  u->d = fp16_to_fp32(ld16(b)) * 0.25f;  // exact: a power of two on a float32 from an fp16
}

#if defined(TF_HAVE_X86_KERNELS)
// Magnitudes of sub-block s: eight grid words (the grid is 1 KB and stays in L1; a gather is
// slower than eight scalar loads on current x86 cores).
// Magnitudes of sub-block s: eight grid words from the 1 KB grid (L1-resident). The eight
// indices come from one 64-bit load (ALU byte extracts are cheaper than eight byte loads
// here, which compete with the grid loads), and scalar loads beat a gather on current x86.
TF_TARGET_AVX2 inline __m256i grid32(const uint8_t* qs) {
  const uint32_t* g = iq::kIq3xxsGrid;
  uint64_t v;
  std::memcpy(&v, qs, 8);
  return _mm256_set_epi32(int(g[v >> 56]), int(g[(v >> 48) & 255]), int(g[(v >> 40) & 255]),
                          int(g[(v >> 32) & 255]), int(g[(v >> 24) & 255]), int(g[(v >> 16) & 255]),
                          int(g[(v >> 8) & 255]), int(g[v & 255]));
}

// The eight sub-blocks' sign words: dword s holds, in byte l, the 7 sign bits of group l of
// sub-block s plus their parity in bit 7 (what kSignsIq2xs[] tabulates), computed for all
// sub-blocks at once instead of 32 table look-ups.
TF_TARGET_AVX2 inline __m256i sign_words(__m256i aux) {
  __m256i t = _mm256_and_si256(aux, _mm256_set1_epi32(0x7F));
  t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(aux, 1), _mm256_set1_epi32(0x7F00)));
  t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(aux, 2), _mm256_set1_epi32(0x7F0000)));
  t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(aux, 3), _mm256_set1_epi32(0x7F000000)));
  // bit 7 of each byte <- xor of its bits 0..6 (shifts by 4, 2, 1 stay inside the byte there)
  __m256i p = _mm256_xor_si256(t, _mm256_slli_epi32(t, 4));
  p = _mm256_xor_si256(p, _mm256_slli_epi32(p, 2));
  p = _mm256_xor_si256(p, _mm256_slli_epi32(p, 1));
  return _mm256_or_si256(t, _mm256_and_si256(p, _mm256_set1_epi32(int(0x80808080u))));
}

// Per-sub-block byte shuffles of a vector whose two 128-bit halves both hold the dwords of
// sub-blocks 4h .. 4h+3 (so one in-lane shuffle replaces a cross-lane permute + shuffle):
// kSpread[t] spreads byte l of dword t over bytes 8l..8l+7, kBcast16[t] repeats its low
// 16 bits.
alignas(32) constexpr uint8_t kSpread[4][32] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15},
};
alignas(32) constexpr uint8_t kBcast16[4][32] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13},
};

TF_TARGET_AVX2 inline __m256i lane_dup(__m256i v, int h) {
  return h == 0 ? _mm256_permute2x128_si256(v, v, 0x00) : _mm256_permute2x128_si256(v, v, 0x11);
}

// Sign operand for _mm256_sign_epi8 for the 32 weights of sub-block 4h+t, from
// lane_dup(sign_words, h): byte 8l+m tests bit m of byte l; (bit ? 2^m : 0) + 127 is
// negative exactly when the bit is set and never 0.
TF_TARGET_AVX2 inline __m256i signs32(__m256i words_h, int t) {
  const __m256i bits = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  const __m256i w = _mm256_shuffle_epi8(words_h, _mm256_load_si256(reinterpret_cast<const __m256i*>(kSpread[t])));
  return _mm256_add_epi8(_mm256_and_si256(w, bits), _mm256_set1_epi8(127));
}

// Sub-block scales 2u+1, one per dword.
TF_TARGET_AVX2 inline __m256i scale_words(__m256i aux) {
  return _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(aux, 28), 1), _mm256_set1_epi32(1));
}

// Scale of sub-block 4h+t in every 16-bit lane, from lane_dup(scale_words, h).
TF_TARGET_AVX2 inline __m256i scale16(__m256i scales_h, int t) {
  return _mm256_shuffle_epi8(scales_h, _mm256_load_si256(reinterpret_cast<const __m256i*>(kBcast16[t])));
}

TF_TARGET_AVX2 inline __m256i load_aux(const uint8_t* b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 66));
}

TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded256* u) {
  const __m256i aux = load_aux(b);
  const __m256i words = sign_words(aux);
  for (int h = 0; h < 2; ++h) {
    const __m256i wh = lane_dup(words, h);
    for (int t = 0; t < 4; ++t) {
      const int s = 4 * h + t;
      const __m256i q = _mm256_sign_epi8(grid32(b + 2 + 8 * s), signs32(wh, t));
      _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 32 * s), q);
    }
  }
  const __m256i sc = scale_words(aux);  // dword s = 2u+1 = sc[2s] (low half) = sc[2s+1]
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->sc), _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)));
  u->d = _cvtsh_ss(ld16(b)) * 0.25f;
}

// The block as the fused narrow kernel (detail::fused_rows_avx2) reads it: the sign words
// and scales of all sub-blocks computed once, each sub-block's magnitudes from the grid.
struct Block {
  const uint8_t* b;
  __m256i words[2], scales[2];  // lane_dup of the sign words / scale words, halves 0 and 1
  TF_TARGET_AVX2 explicit Block(const uint8_t* blk) : b(blk) {
    const __m256i aux = load_aux(blk);
    const __m256i w = sign_words(aux), sc = scale_words(aux);
    words[0] = lane_dup(w, 0), words[1] = lane_dup(w, 1);
    scales[0] = lane_dup(sc, 0), scales[1] = lane_dup(sc, 1);
  }
  TF_TARGET_AVX2 detail::SubBlock32 sub(int s) const {
    return {grid32(b + 2 + 8 * s), signs32(words[s / 4], s % 4), scale16(scales[s / 4], s % 4)};
  }
  TF_TARGET_AVX2 float d() const { return _cvtsh_ss(ld16(b)); }
};

#endif
}  // namespace

#if defined(TF_HAVE_ARM_KERNELS)
// The reference decoder, for the aarch64 drivers (backend/cpu/arm) of formats without a NEON one.
void decode_ref(const uint8_t* b, detail::Decoded256* u) { decode_scalar(b, u); }
#endif

}  // namespace tf::cpu::iq3_xxs

TF_FUSED_DECODED_KERNELS(iq3_xxs, kBytes, decode_scalar, decode_avx2, Block, 0.25f, 62)
