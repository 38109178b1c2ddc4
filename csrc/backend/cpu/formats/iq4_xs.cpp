// IQ4_XS: 256 weights per 136-byte block, 8 sub-blocks of 32 —
//   bytes 0..1    fp16 d
//   bytes 2..3    scales_h (uint16): bits 2ib..2ib+1 = high 2 bits of sub-block ib's scale
//   bytes 4..7    scales_l: nibble ib (low nibble of byte ib/2 for even ib) = its low 4 bits
//   bytes 8..135  4-bit indices into the IQ4_NL level table; sub-block ib owns bytes
//                 8+16ib .. 8+16ib+15: low nibbles are its weights 0..15, high nibbles 16..31.
// w = (d * (ls - 32)) * kValuesIq4nl[index], ls the 6-bit scale (so |sc| <= 32, |q| <= 127).
//
// Decode (batch >= 2 columns, and the AVX-512 path) goes through the generic Decoded256
// drivers. Single-column GEMV (token generation) has its own fused AVX2 kernel: the block is
// never stored; see gemv_avx2 below.
#include <vector>

#include "backend/cpu/decoded.h"
#include "quant/iq_layout.h"
#include "core/half.h"
#include "quant/tables/iq_tables.h"

namespace tf::cpu::iq4_xs {

namespace {
using detail::ld16;
using namespace ::tf::quant::iq4_xs;  // the block layout (quant/iq_layout.h)


void decode_scalar(const uint8_t* b, detail::Decoded256* u) {
  for (int ib = 0; ib < 8; ++ib) {
    const uint8_t* qs = b + 8 + 16 * ib;
    for (int j = 0; j < 16; ++j) {
      u->q[32 * ib + j] = iq::kValuesIq4nl[qs[j] & 0xF];
      u->q[32 * ib + j + 16] = iq::kValuesIq4nl[qs[j] >> 4];
    }
    u->sc[2 * ib] = u->sc[2 * ib + 1] = int16_t(scale6(b, ib));
  }
  u->d = fp16_to_fp32(ld16(b));
}

#if defined(TF_HAVE_X86_KERNELS)
// The 8 sub-block scales (ls - 32) as int32 lanes, from two dword broadcasts of the block
// header; lane i of the result holds sub-block perm[i] where cnt_l = 4*perm, cnt_h = 2*perm.
TF_TARGET_AVX2 inline __m256i scales_i32(const uint8_t* b, __m256i cnt_l, __m256i cnt_h) {
  uint32_t sl, sh;
  std::memcpy(&sl, b + 4, 4);
  std::memcpy(&sh, b + 2, 4);  // low 16 bits: scales_h (the rest is masked off below)
  const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(sl)), cnt_l), _mm256_set1_epi32(0xF));
  const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(sh << 4)), cnt_h), _mm256_set1_epi32(0x30));
  return _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32));
}

TF_TARGET_AVX2 void decode_avx2(const uint8_t* b, detail::Decoded256* u) {
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(iq::kValuesIq4nl)));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low lane) and 2p+1 (high lane)
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 + 32 * p));
    const __m256i lo = _mm256_shuffle_epi8(levels, _mm256_and_si256(v, m4));
    const __m256i hi = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 64 * p), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_store_si256(reinterpret_cast<__m256i*>(u->q + 64 * p + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
  // int32 lane i = scale of sub-block i; duplicate its low 16 bits into both halves so the
  // 16 int16 lanes read sc[2i] = sc[2i+1] = scale i.
  const __m256i s = scales_i32(b, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
  const __m256i dup = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                       0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(u->sc), _mm256_shuffle_epi8(s, dup));
  u->d = _cvtsh_ss(ld16(b));
}

// Single-column GEMV. A 32-byte load of packed indices covers sub-blocks 2p (low 128-bit
// lane) and 2p+1 (high lane); its low nibbles are their weights 0..15 and its high nibbles
// their weights 16..31, so both level vectors have sub-block 2p in the low lane and 2p+1 in
// the high lane and share one scale vector. The activations are permuted once per call to
// that order (per 64 values: swap the middle two 16-byte quarters), which keeps the inner
// loop free of cross-lane shuffles: per 64 weights 3 ops to split nibbles, 4 table lookups
// (signed levels and their magnitudes), 2 sign, 2 maddubs, 2 madd, 2 add.
TF_TARGET_AVX2 void gemv_avx2(int64_t k, const uint8_t* w, size_t ws, int64_t r0, int64_t r1,
                              const uint8_t* xq, float* y) {
  const int64_t nb = k / 256;
  // Permuted activations (256 bytes per block, 32-byte aligned) then the block scales.
  thread_local std::vector<uint8_t> buf;
  const size_t need = size_t(nb) * 260 + 32;
  if (buf.size() < need) buf.resize(need);
  auto* xv = reinterpret_cast<__m256i*>((reinterpret_cast<uintptr_t>(buf.data()) + 31) & ~uintptr_t(31));
  float* xd = reinterpret_cast<float*>(xv + nb * 8);
  const auto* act = reinterpret_cast<const detail::ActK*>(xq);
  for (int64_t b = 0; b < nb; ++b) {
    xd[b] = act[b].d;
    for (int p = 0; p < 4; ++p) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act[b].qs + 64 * p));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act[b].qs + 64 * p + 32));
      _mm256_store_si256(xv + b * 8 + 2 * p, _mm256_permute2x128_si256(x0, x1, 0x20));
      _mm256_store_si256(xv + b * 8 + 2 * p + 1, _mm256_permute2x128_si256(x0, x1, 0x31));
    }
  }
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(iq::kValuesIq4nl)));
  const __m256i mags = _mm256_abs_epi8(levels);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  // Scale lanes: low 128-bit lane holds sub-blocks 0,2,4,6, high lane 1,3,5,7, so pair p's
  // scales are int32 element p of each lane, broadcast to its words by one in-lane shuffle.
  const __m256i cnt_l = _mm256_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28);
  const __m256i cnt_h = _mm256_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14);
  const __m256i bc[4] = {_mm256_set1_epi32(0x01000100), _mm256_set1_epi32(0x05040504),
                         _mm256_set1_epi32(0x09080908), _mm256_set1_epi32(0x0D0C0D0C)};
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + size_t(r) * ws;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + size_t(b) * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + detail::kDecodedPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + detail::kDecodedPrefetch + 64), _MM_HINT_T0);
      const __m256i s = scales_i32(blk, cnt_l, cnt_h);
      const __m256i* x = xv + b * 8;
      __m256i isum0 = _mm256_setzero_si256(), isum1 = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 8 + 32 * p));
        const __m256i il = _mm256_and_si256(v, m4);
        const __m256i ih = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        const __m256i sc = _mm256_shuffle_epi8(s, bc[p]);
        const __m256i pl = _mm256_maddubs_epi16(_mm256_shuffle_epi8(mags, il),
                                                _mm256_sign_epi8(_mm256_load_si256(x + 2 * p), _mm256_shuffle_epi8(levels, il)));
        const __m256i ph = _mm256_maddubs_epi16(_mm256_shuffle_epi8(mags, ih),
                                                _mm256_sign_epi8(_mm256_load_si256(x + 2 * p + 1), _mm256_shuffle_epi8(levels, ih)));
        isum0 = _mm256_add_epi32(isum0, _mm256_madd_epi16(pl, sc));
        isum1 = _mm256_add_epi32(isum1, _mm256_madd_epi16(ph, sc));
      }
      const float dd = _cvtsh_ss(ld16(blk)) * xd[b];
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(isum0, isum1)), _mm256_set1_ps(dd), acc);
    }
    y[r] = detail::hsum8_avx2(acc);
  }
}

TF_TARGET_AVX2 void matmul_avx2(TF_MATMUL_PARAMS) {
  if (ncols == 1)
    gemv_avx2(k, static_cast<const uint8_t*>(w), ws, r0, r1, static_cast<const uint8_t*>(xq), y);
  else
    detail::matmul_d256_avx2<decode_avx2, kBytes>(TF_MATMUL_ARGS);
}
#endif
}  // namespace

#if defined(TF_HAVE_ARM_KERNELS)
// The reference decoder, for the aarch64 drivers (backend/cpu/arm) of formats without a NEON one.
void decode_ref(const uint8_t* b, detail::Decoded256* u) { decode_scalar(b, u); }
#endif

void scalar(TF_MATMUL_PARAMS) { detail::matmul_d256_scalar<decode_scalar, kBytes>(TF_MATMUL_ARGS); }
#if defined(TF_HAVE_X86_KERNELS)
TF_TARGET_AVX2 void avx2(TF_MATMUL_PARAMS) { matmul_avx2(TF_MATMUL_ARGS); }
TF_TARGET_AVX512 void avx512(TF_MATMUL_PARAMS) { detail::matmul_d256_avx512<decode_avx2, kBytes>(TF_MATMUL_ARGS); }
#endif

}  // namespace tf::cpu::iq4_xs
