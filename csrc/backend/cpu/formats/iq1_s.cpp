// IQ1_S: 256 weights per 50-byte block — fp16 d, qs[32], then 8 little-endian 16-bit qh.
// Sub-block ib (weights 32ib .. 32ib+31) is four groups of 8; group l's 11-bit index into
// kIq1sGrid (values -1, 0, 1) is qs[4ib + l] | ((qh[ib] >> 3l) & 7) << 8. qh[ib] bits 12..14
// give s, bit 15 the sign of the shift delta = ±1/8:
//   w = d * (2s + 1) * (grid + delta).
// Decoded as q = 8 * grid ± 1 (|q| <= 9), sc = 2s + 1 (per 32 weights: both 16-halves),
// d / 8 — all exact.
#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::iq1_s {

namespace {
using detail::ld16;
using namespace ::tf::quant::iq1_s;  // the block layout (quant/iq_layout.h)


void decode_scalar(const uint8_t* b, detail::Decoded256* u) {
  const uint8_t* qs = b + 2;
  for (int ib = 0; ib < 8; ++ib) {
    const uint32_t h = ld16(b + 34 + 2 * ib);
    const int delta = (h & 0x8000u) ? -1 : 1;
    u->sc[2 * ib] = u->sc[2 * ib + 1] = int16_t(2 * ((h >> 12) & 7) + 1);
    for (int l = 0; l < 4; ++l) {
      const uint64_t g = iq::kIq1sGrid[grid_index(qs + 4 * ib, h, l)];
      for (int j = 0; j < 8; ++j) u->q[32 * ib + 8 * l + j] = int8_t(8 * int8_t(g >> (8 * j)) + delta);
    }
  }
  u->d = fp16_to_fp32(ld16(b)) * 0.125f;
}

#if defined(TF_HAVE_X86_KERNELS)
// One 32-weight sub-block per vector: four 64-bit grid loads, 8 * grid via sign(8, grid),
// then the ±1 shift. The high index bits are moved straight into place (<< (8 - 3l)).
TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded256* u) {
  const uint8_t* qs = b + 2;
  const __m256i eight = _mm256_set1_epi8(8);
  alignas(32) int16_t sc[16];
#pragma GCC unroll 8
  for (int ib = 0; ib < 8; ++ib, qs += 4) {
    const uint32_t h = ld16(b + 34 + 2 * ib);
    const __m256i g = _mm256_set_epi64x(
        int64_t(iq::kIq1sGrid[qs[3] | ((h >> 1) & 0x700u)]), int64_t(iq::kIq1sGrid[qs[2] | ((h << 2) & 0x700u)]),
        int64_t(iq::kIq1sGrid[qs[1] | ((h << 5) & 0x700u)]), int64_t(iq::kIq1sGrid[qs[0] | ((h << 8) & 0x700u)]));
    const __m256i delta = _mm256_set1_epi8(char(1 - int((h >> 14) & 2)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 32 * ib), _mm256_add_epi8(_mm256_sign_epi8(eight, g), delta));
    sc[2 * ib] = sc[2 * ib + 1] = int16_t(2 * ((h >> 12) & 7) + 1);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->sc), _mm256_load_si256(reinterpret_cast<const __m256i*>(sc)));
  u->d = _cvtsh_ss(ld16(b)) * 0.125f;
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
// A fused kernel, since decoding is the cost here. The grid values
// g in {-1, 0, 1} become unsigned u = g + 1 for maddubs, and per 32-weight sub-block (s, the
// shift sign e = ±1, P = sum u*x, S = sum x = two of the activation's 16-value bsums):
//   sum 8*w/d * x = (2s + 1) * (8 * sum g*x + e * S) = 8(2s + 1) * P + (2s + 1)(e - 8) * S.
// The S terms of all 8 sub-blocks are one madd of the bsums.
// The fused kernel serves every column count on AVX2; AVX-512 CPUs use the decoded-block
// driver.
template <int NC>
TF_TARGET_AVX2 void fused_row(const uint8_t* row, int64_t nb, const uint8_t* xq, size_t xs, float* y, int64_t ldy) {
  const __m256i one = _mm256_set1_epi8(1);
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + size_t(b) * kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(blk + detail::kDecodedPrefetch), _MM_HINT_T0);
    // (2s + 1)(e - 8) per sub-block, duplicated onto its two 16-value bsums
    const __m128i qh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 34));
    const __m128i ls = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qh, 11), _mm_set1_epi16(0xE)), _mm_set1_epi16(1));
    const __m128i em8 = _mm_sub_epi16(_mm_set1_epi16(-7), _mm_and_si128(_mm_srli_epi16(qh, 14), _mm_set1_epi16(2)));
    const __m128i m = _mm_mullo_epi16(ls, em8);
    const __m256i m2 = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
    const detail::ActK* a[NC];
    __m256i isum[NC];
    for (int c = 0; c < NC; ++c) {
      a[c] = reinterpret_cast<const detail::ActK*>(xq + size_t(c) * xs) + b;
      isum[c] = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[c]->bsums)), m2);
    }
    const uint8_t* qs = blk + 2;
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ++ib, qs += 4) {
      const uint32_t h = ld16(blk + 34 + 2 * ib);
      const __m256i u = _mm256_add_epi8(
          _mm256_set_epi64x(int64_t(iq::kIq1sGrid[qs[3] | ((h >> 1) & 0x700u)]),
                            int64_t(iq::kIq1sGrid[qs[2] | ((h << 2) & 0x700u)]),
                            int64_t(iq::kIq1sGrid[qs[1] | ((h << 5) & 0x700u)]),
                            int64_t(iq::kIq1sGrid[qs[0] | ((h << 8) & 0x700u)])),
          one);
      const __m256i sc = _mm256_set1_epi16(int16_t(((h >> 8) & 0x70u) | 8u));  // 8(2s + 1)
      for (int c = 0; c < NC; ++c) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[c]->qs + 32 * ib));
        isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sc));
      }
    }
    const float d = _cvtsh_ss(ld16(blk)) * 0.125f;
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

}  // namespace tf::cpu::iq1_s
