// IQ1_M: 256 weights per 56-byte block — qs[32], qh[16], then 4 little-endian 16-bit scale
// words sc[4]. Group g (weights 8g .. 8g+7, g = 0..31) uses nibble n = qh[g/2] >> 4(g&1):
// index qs[g] | (n & 7) << 8 into kIq1sGrid (values -1, 0, 1), delta = (n & 8) ? -1/8 : 1/8.
// The 16 three-bit scales s_k (k = 0..15, one per 16 weights = groups 2k, 2k+1) are
// (sc[k/4] >> 3(k%4)) & 7; the fp16 d is split over the top nibbles of sc[0..3] (low first):
//   w = d * (2 s_k + 1) * (grid + delta).
// Decoded as q = 8 * grid ± 1 (|q| <= 9), sc = 2 s_k + 1, d / 8 — all exact.
#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::iq1_m {

namespace {
using detail::ld16;
using namespace ::tf::quant::iq1_m;  // the block layout (quant/iq_layout.h)


void decode_scalar(const uint8_t* b, detail::Decoded256* u) {
  for (int g = 0; g < 32; ++g) {
    const uint32_t n = nibble(b, g);
    const uint64_t grid = iq::kIq1sGrid[b[g] | (n & 7) << 8];
    const int delta = (n & 8) ? -1 : 1;
    for (int j = 0; j < 8; ++j) u->q[8 * g + j] = int8_t(8 * int8_t(grid >> (8 * j)) + delta);
  }
  for (int k = 0; k < 16; ++k) u->sc[k] = int16_t(2 * scale(b, k) + 1);
  u->d = fp16_to_fp32(d_bits(b)) * 0.125f;
}

#if defined(TF_HAVE_X86_KERNELS)
// The 16 scales 2 s_k + 1 as int16, in order: broadcast word k/4 to four 32-bit lanes, shift
// lane k by 3(k%4). lo = scales 0..3 | 8..11, hi = 4..7 | 12..15 (per 128-bit lane), which
// packus puts back in order.
TF_TARGET_AVX2 inline __m256i scales16(const uint8_t* b) {
  const __m128i w = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 48));
  const __m256i words = _mm256_cvtepu16_epi32(_mm_unpacklo_epi16(w, w));  // w0 w0 w1 w1 | w2 w2 w3 w3
  const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9);
  const __m256i lo = _mm256_srlv_epi32(_mm256_unpacklo_epi32(words, words), sh);
  const __m256i hi = _mm256_srlv_epi32(_mm256_unpackhi_epi32(words, words), sh);
  const __m256i seven = _mm256_set1_epi32(7), one = _mm256_set1_epi32(1);
  return _mm256_packus_epi32(_mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(lo, seven), 1), one),
                             _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(hi, seven), 1), one));
}

// Grid values of the 32 weights of vector i (groups 4i .. 4i+3) as int8 -1 / 0 / 1: four
// 64-bit loads, the high index bits moved straight into place.
TF_TARGET_AVX2 inline __m256i grid32(const uint8_t* b, int i) {
  const uint8_t* qs = b + 4 * i;
  const uint32_t h = ld16(b + 32 + 2 * i);  // nibbles of groups 4i .. 4i+3
  return _mm256_set_epi64x(
      int64_t(iq::kIq1sGrid[qs[3] | ((h >> 4) & 0x700u)]), int64_t(iq::kIq1sGrid[qs[2] | (h & 0x700u)]),
      int64_t(iq::kIq1sGrid[qs[1] | ((h << 4) & 0x700u)]), int64_t(iq::kIq1sGrid[qs[0] | ((h << 8) & 0x700u)]));
}

// 0xFF on the bytes of vector i whose shift is +1/8, 0 elsewhere. Byte j lies in group
// 4i + j/8, whose sign bit is bit 3 or 7 of qh[2i + j/16]: pick that qh byte (lane 0: qh[2i],
// lane 1: qh[2i+1]; qh16 holds qh[0..15] in both lanes) and test the bit.
TF_TARGET_AVX2 inline __m256i plus_mask(__m256i qh16, int i) {
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m256i bit = _mm256_setr_epi8(8, 8, 8, 8, 8, 8, 8, 8, -128, -128, -128, -128, -128, -128, -128, -128,
                                       8, 8, 8, 8, 8, 8, 8, 8, -128, -128, -128, -128, -128, -128, -128, -128);
  const __m256i sel = _mm256_shuffle_epi8(qh16, _mm256_add_epi8(pick, _mm256_set1_epi8(char(2 * i))));
  return _mm256_cmpeq_epi8(_mm256_and_si256(sel, bit), _mm256_setzero_si256());
}

TF_TARGET_AVX2 inline __m256i load_qh16(const uint8_t* b) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32)));
}

// q = 8 * grid ± 1: sign(8, grid) minus (mask | 1), which is -1 where the shift is +1/8.
TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded256* u) {
  const __m256i eight = _mm256_set1_epi8(8), one = _mm256_set1_epi8(1);
  const __m256i qh16 = load_qh16(b);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const __m256i q = _mm256_sub_epi8(_mm256_sign_epi8(eight, grid32(b, i)), _mm256_or_si256(plus_mask(qh16, i), one));
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 32 * i), q);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->sc), scales16(b));
  u->d = _cvtsh_ss(d_bits(b)) * 0.125f;
}
#else
constexpr detail::Decode256Fn decode_avx2 = decode_scalar;
#endif
}  // namespace

#if defined(TF_HAVE_ARM_KERNELS)
// The reference decoder, for the aarch64 drivers (backend/cpu/arm) of formats without a NEON one.
void decode_ref(const uint8_t* b, detail::Decoded256* u) { decode_scalar(b, u); }
#endif

#if defined(TF_HAVE_X86_KERNELS)
namespace {
// Few columns (decode): a fused kernel, since decoding is the cost there. The shift sign
// changes every 8 weights but the activation sums (bsums) cover 16, so the sign stays in the
// values: u = 8g + e + 9 in {0, 2, 8, 10, 16, 18} is unsigned for maddubs, and per 16-weight
// group j (scale l_j = 2 s_j + 1, S_j = bsums[j]):
//   sum 8*w/d * x = l_j * (sum u*x - 9 * S_j).
// The S terms are one madd of the bsums with -9 l.
// The fused kernel serves every column count on AVX2; AVX-512 CPUs use the decoded-block
// driver.
template <int NC>
TF_TARGET_AVX2 void fused_row(const uint8_t* row, int64_t nb, const uint8_t* xq, size_t xs, float* y, int64_t ldy) {
  const __m256i eight = _mm256_set1_epi8(8), ten = _mm256_set1_epi8(10);
  // Broadcast (l_2i, l_2i+1), the int16 pair in 32-bit lane i, to the low / high 16 bytes.
  const __m256i pair_bcast = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                              2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + size_t(b) * kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(blk + detail::kDecodedPrefetch), _MM_HINT_T0);
    const __m256i ls = scales16(blk);
    const __m256i qh16 = load_qh16(blk);
    const __m256i m9 = _mm256_mullo_epi16(ls, _mm256_set1_epi16(-9));
    const detail::ActK* a[NC];
    __m256i isum[NC];
    for (int c = 0; c < NC; ++c) {
      a[c] = reinterpret_cast<const detail::ActK*>(xq + size_t(c) * xs) + b;
      isum[c] = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[c]->bsums)), m9);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256i u = _mm256_add_epi8(_mm256_sign_epi8(eight, grid32(blk, i)),
                                        _mm256_blendv_epi8(eight, ten, plus_mask(qh16, i)));  // 8g + 9 + e
      const __m256i sc = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(ls, _mm256_set1_epi32(i)), pair_bcast);
      for (int c = 0; c < NC; ++c) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[c]->qs + 32 * i));
        isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sc));
      }
    }
    const float d = _cvtsh_ss(d_bits(blk)) * 0.125f;
    for (int c = 0; c < NC; ++c)
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), _mm256_set1_ps(d * a[c]->d), acc[c]);
  }
  for (int c = 0; c < NC; ++c) y[c * ldy] = detail::hsum8_avx2(acc[c]);
}
}  // namespace

// The fused kernel as a row functor for detail::fused_row_tiles_avx2.
struct FusedRow {
  template <int NC>
  TF_TARGET_AVX2 static void run(const uint8_t* row, int64_t nb, const uint8_t* xq, size_t xs, float* y, int64_t ldy) {
    fused_row<NC>(row, nb, xq, xs, y, ldy);
  }
};

TF_TARGET_AVX2 void avx2(TF_MATMUL_PARAMS) { detail::fused_row_tiles_avx2<FusedRow>(TF_MATMUL_ARGS); }

TF_TARGET_AVX512 void avx512(TF_MATMUL_PARAMS) { detail::matmul_d256_avx512<decode_avx2, kBytes>(TF_MATMUL_ARGS); }
#endif

void scalar(TF_MATMUL_PARAMS) { detail::matmul_d256_scalar<decode_scalar, kBytes>(TF_MATMUL_ARGS); }

}  // namespace tf::cpu::iq1_m
