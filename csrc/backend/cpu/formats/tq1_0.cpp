// TQ1_0: 256 ternary weights per 54-byte block, five (or four) base-3 digits per byte —
//   bytes 0..31   qs0: byte m holds weights 32n + m,        n = 0..4
//   bytes 32..47  qs1: byte m holds weights 160 + 16n + m,  n = 0..4
//   bytes 48..51  qh:  byte m holds weights 240 + 4n + m,   n = 0..3
//   bytes 52..53  fp16 d
// Digit n of byte q is read as: v = uint8(q * 3^n) (mod 256), code = (3 * v) >> 8 in 0..2;
// w = d * (code - 1).
//
// Vector decode: (3v) >> 8 is [v >= 86] + [v >= 171]; with the sign bit flipped
// (w = v ^ 0x80, still multiplied by 3 mod 256 from digit to digit since 3 * 128 = 128
// mod 256) those are two signed byte compares.
#include <vector>

#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"

namespace tf::cpu::tq1_0 {

namespace {
using detail::ld16;
using namespace ::tf::quant::tq1_0;  // the block layout (quant/iq_layout.h)


void decode_scalar(const uint8_t* b, detail::Decoded256* u) {
  for (int i = 0; i < 256; ++i) u->q[i] = int8_t(trit(b, i));
  for (int j = 0; j < 16; ++j) u->sc[j] = 1;
  u->d = fp16_to_fp32(ld16(b + 52));
}

#if defined(TF_HAVE_X86_KERNELS)
// Codes - 1 of sign-flipped digit bytes w: -1 + [w > -43] + [w > 42] (compares give -1).
TF_TARGET_AVX2 inline __m256i trits256(__m256i w) {
  const __m256i t = _mm256_sub_epi8(_mm256_set1_epi8(-1), _mm256_cmpgt_epi8(w, _mm256_set1_epi8(-43)));
  return _mm256_sub_epi8(t, _mm256_cmpgt_epi8(w, _mm256_set1_epi8(42)));
}
TF_TARGET_AVX2 inline __m128i trits128(__m128i w) {
  const __m128i t = _mm_sub_epi8(_mm_set1_epi8(-1), _mm_cmpgt_epi8(w, _mm_set1_epi8(-43)));
  return _mm_sub_epi8(t, _mm_cmpgt_epi8(w, _mm_set1_epi8(42)));
}
TF_TARGET_AVX2 inline __m256i times3(__m256i w) { return _mm256_add_epi8(_mm256_add_epi8(w, w), w); }
TF_TARGET_AVX2 inline __m128i times3(__m128i w) { return _mm_add_epi8(_mm_add_epi8(w, w), w); }

TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded256* u) {
  __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), _mm256_set1_epi8(-128));
  for (int n = 0; n < 5; ++n, w0 = times3(w0))
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 32 * n), trits256(w0));
  __m128i w1 = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32)), _mm_set1_epi8(-128));
  for (int n = 0; n < 5; ++n, w1 = times3(w1))
    _mm_store_si128(reinterpret_cast<__m128i*>(u->q + 160 + 16 * n), trits128(w1));
  // qh: the 4 bytes repeated; group n (bytes 4n..4n+3) takes digit n.
  uint32_t qh;
  std::memcpy(&qh, b + 48, 4);
  const __m128i p0 = _mm_xor_si128(_mm_set1_epi32(int(qh)), _mm_set1_epi8(-128));
  const __m128i p1 = times3(p0), p2 = times3(p1), p3 = times3(p2);
  const __m128i h = _mm_blend_epi32(_mm_blend_epi32(p0, p1, 0x2), _mm_blend_epi32(p2, p3, 0x8), 0xC);
  _mm_store_si128(reinterpret_cast<__m128i*>(u->q + 240), trits128(h));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->sc), _mm256_set1_epi16(1));
  u->d = _cvtsh_ss(ld16(b + 52));
}

// Codes 0..2 (unsigned) of sign-flipped digit bytes: [w > -43] + [w > 42].
TF_TARGET_AVX2 inline __m256i codes256(__m256i w) {
  const __m256i t = _mm256_sub_epi8(_mm256_setzero_si256(), _mm256_cmpgt_epi8(w, _mm256_set1_epi8(-43)));
  return _mm256_sub_epi8(t, _mm256_cmpgt_epi8(w, _mm256_set1_epi8(42)));
}

// Single-column GEMV, fused. The codes c = w/d + 1 are unsigned, so maddubs(c, x) needs no
// sign fix-up; per block the int16 lanes sum sum(c * x) (|lane| <= 8 * 2 * 2 * 127), and the
// -1 is removed by subtracting the same lanes of maddubs(1, x), precomputed once per call
// (x is shared by all rows) — still exact integers lane by lane, so a row of zero weights
// gives exactly 0. The eight 32-value vectors of a block: 5 digits of qs0; [qs1 digit 0 |
// digit 1] and [digit 2 | digit 3] (qs1 broadcast to both lanes, the high lane one digit
// ahead); [qs1 digit 4 | qh digits 0..3] (weights 224..255).
TF_TARGET_AVX2 void gemv_avx2(int64_t k, const uint8_t* w, size_t ws, int64_t r0, int64_t r1,
                              const uint8_t* xq, float* y) {
  const int64_t nb = k / 256;
  thread_local std::vector<uint8_t> buf;
  if (buf.size() < size_t(nb) * 32 + 32) buf.resize(size_t(nb) * 32 + 32);
  auto* xsum = reinterpret_cast<__m256i*>((reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~uintptr_t(31));
  const auto* act = reinterpret_cast<const detail::ActK*>(xq);
  const __m256i one8 = _mm256_set1_epi8(1), flip = _mm256_set1_epi8(-128), ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i)
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(one8, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act[b].qs + 32 * i))));
    xsum[b] = s;
  }
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + size_t(r) * ws;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + size_t(b) * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + detail::kDecodedPrefetch), _MM_HINT_T0);
      const int8_t* x = act[b].qs;
      auto dot = [&](__m256i digits, int i) TF_TARGET_AVX2 {
        return _mm256_maddubs_epi16(codes256(digits), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * i)));
      };
      __m256i a = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)), flip);
      __m256i s = dot(a, 0);
      for (int n = 1; n < 5; ++n) {
        a = times3(a);
        s = _mm256_add_epi16(s, dot(a, n));
      }
      const __m256i b1 = _mm256_xor_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32))), flip);
      const __m256i b01 = _mm256_blend_epi32(b1, times3(b1), 0xF0);
      const __m256i b23 = times3(times3(b01));
      const __m256i b4 = times3(times3(b23));  // low lane: digit 4
      uint32_t qh;
      std::memcpy(&qh, blk + 48, 4);
      const __m256i h0 = _mm256_xor_si256(_mm256_set1_epi32(int(qh)), flip);
      const __m256i h1 = times3(h0), h2 = times3(h1), h3 = times3(h2);
      const __m256i last = _mm256_blend_epi32(_mm256_blend_epi32(b4, h0, 0x10), _mm256_blend_epi32(h1, h2, 0x40), 0x60);
      s = _mm256_add_epi16(s, dot(b01, 5));
      s = _mm256_add_epi16(s, dot(b23, 6));
      s = _mm256_add_epi16(s, dot(_mm256_blend_epi32(last, h3, 0x80), 7));
      const __m256i isum = _mm256_madd_epi16(_mm256_sub_epi16(s, xsum[b]), ones16);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(_cvtsh_ss(ld16(blk + 52)) * act[b].d), acc);
    }
    y[r] = detail::hsum8_avx2(acc);
  }
}

TF_TARGET_AVX2 void matmul_avx2(TF_MATMUL_PARAMS) {
  if (ncols == 1)
    gemv_avx2(k, static_cast<const uint8_t*>(w), ws, r0, r1, static_cast<const uint8_t*>(xq), y);
  else
    detail::matmul_d256_avx2<decode_avx2, kBytes, 1>(TF_MATMUL_ARGS);  // |q| <= 1
}
#else
constexpr detail::Decode256Fn decode_avx2 = decode_scalar;
#endif
}  // namespace

#if defined(TF_HAVE_ARM_KERNELS)
// The reference decoder, for the aarch64 drivers (backend/cpu/arm) of formats without a NEON one.
void decode_ref(const uint8_t* b, detail::Decoded256* u) { decode_scalar(b, u); }
#endif

}  // namespace tf::cpu::tq1_0

namespace tf::cpu::tq1_0 {
void scalar(TF_MATMUL_PARAMS) { detail::matmul_d256_scalar<decode_scalar, kBytes>(TF_MATMUL_ARGS); }
#if defined(TF_HAVE_X86_KERNELS)
TF_TARGET_AVX2 void avx2(TF_MATMUL_PARAMS) { matmul_avx2(TF_MATMUL_ARGS); }
TF_TARGET_AVX512 void avx512(TF_MATMUL_PARAMS) { detail::matmul_d256_avx512<decode_avx2, kBytes>(TF_MATMUL_ARGS); }
#endif
}  // namespace tf::cpu::tq1_0
