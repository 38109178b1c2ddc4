// Shared declarations of the CPU matmul kernels (scalar / AVX2 / AVX-512 translation units).
//
// Quantized activation layouts (TensorFold's own; act_row_bytes/quantize_act_row/matmul_rows
// agree on them, and the scalar reference reads the same bytes):
//
//  * G32 — for the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). Blocks are paired
//    into groups of 64 values (an odd last block is padded with a zero block). A row is
//      int8  qs[ngroups * 64]            (all quantized values, in element order)
//      float sc[ngroups * 4]             (per group: d0, d1, s0, s1)
//    with x ~= d * q, q in [-127, 127], and s = d * sum(q of the block) (Q8_1's s, used
//    for the min term of Q4_1 / Q5_1).
//  * K — for the K-quants: one ActK per 256 values (float d, int16 bsums[16] = sums of 16
//    consecutive q, int8 qs[256]; q in [-127, 127]), 320 bytes so qs stays 64-byte aligned.
//  * F32 — plain floats, for F32 / F16 / BF16 weights.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "backend/cpu/cpu_kernels.h"
#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/half.h"
#include "quant/blocks.h"

namespace tf::cpu::detail {

struct alignas(4) ActK {
  float d;
  int16_t bsums[16];
  uint8_t pad[28];
  int8_t qs[256];
};
static_assert(sizeof(ActK) == 320, "ActK layout");

using ActKind = ActLayout;  // the layouts described at the top of this file

inline int64_t g32_groups(int64_t k) { return (k / 32 + 1) / 2; }
inline size_t g32_row_bytes(int64_t k) { return size_t(g32_groups(k)) * 80; }

using QuantFn = void (*)(ActKind kind, const float* x, void* xq, int64_t k);

// Writes one activation row in `kind`'s layout (see the top of this file). The layout logic
// is shared; `quant_block(x, n, q, &d, &sum)` is the calling ISA's block quantizer.
template <typename QuantBlock>
void quantize_row_with(ActKind kind, const float* x, void* xq, int64_t k, QuantBlock quant_block) {
  if (kind == ActKind::F32) {
    std::memcpy(xq, x, size_t(k) * 4);
    return;
  }
  if (kind == ActKind::Q8_32) {
    const int64_t nb = k / 32, ng = g32_groups(k);
    int8_t* qs = static_cast<int8_t*>(xq);
    float* sc = reinterpret_cast<float*>(qs + ng * 64);
    for (int64_t g = 0; g < ng; ++g) {
      for (int h = 0; h < 2; ++h) {
        const int64_t b = 2 * g + h;
        float d = 0.f;
        int sum = 0;
        if (b < nb)
          quant_block(x + b * 32, 32, qs + b * 32, &d, &sum);
        else
          std::memset(qs + b * 32, 0, 32);  // odd block count: a zero pad block
        sc[4 * g + h] = d;
        sc[4 * g + 2 + h] = d * float(sum);
      }
    }
    return;
  }
  ActK* out = static_cast<ActK*>(xq);
  for (int64_t b = 0; b < k / 256; ++b) {
    ActK& a = out[b];
    std::memset(a.pad, 0, sizeof(a.pad));
    int sum;
    quant_block(x + b * 256, 256, a.qs, &a.d, &sum);
    for (int j = 0; j < 16; ++j) {
      int s16 = 0;
      for (int i = 0; i < 16; ++i) s16 += a.qs[16 * j + i];
      a.bsums[j] = int16_t(s16);
    }
  }
}

void quantize_scalar(ActKind kind, const float* x, void* xq, int64_t k);
void quantize_avx2(ActKind kind, const float* x, void* xq, int64_t k);
void quantize_avx512(ActKind kind, const float* x, void* xq, int64_t k);
void quantize_neon(ActKind kind, const float* x, void* xq, int64_t k);

// Explicit-ISA entry points (tests / benchmarks). Throw tf::Error(InvalidInput) when the CPU
// (or this build) lacks the ISA or the format is not supported.
void quantize_act_row_isa(CpuIsa isa, GgmlType wt, const float* x, void* xq, int64_t k);
void matmul_rows_isa(CpuIsa isa, GgmlType wt, int64_t k, const void* w, size_t w_stride,
                     int64_t r0, int64_t r1, const void* xq, size_t xq_stride, int64_t ncols,
                     float* y, int64_t ldy);
bool isa_available(CpuIsa isa);
// The same product through the format's prefill panels (CpuKernels::avx512_panels) when `isa`
// has them for wt; false (nothing computed) otherwise.
bool matmul_rows_panels(CpuIsa isa, GgmlType wt, int64_t k, const void* w, size_t w_stride, int64_t r0, int64_t r1,
                        const void* xq, size_t xq_stride, int64_t ncols, float* y, int64_t ldy);

// The K-quant prefill panels over R8 groups (repack.h): rows [r0, r1), multiples of 8, of a
// weight whose row group g starts at sb0 + g * gs (AVX-512 VNNI only). The same bits as
// matmul_rows_panels on the file's layout.
void matmul_panels_r8_avx512(GgmlType t, int64_t k, const uint8_t* sb0, size_t gs, int64_t r0, int64_t r1,
                             const void* xq, size_t xs, int64_t ncols, float* y, int64_t ldy);

// Streams n bytes (a memory-bandwidth probe); returns a value depending on every byte.
uint64_t read_bytes(const void* p, size_t n);
uint64_t read_bytes_avx512(const void* p, size_t n);
// The int8 dot-product peak probe: iters x 12 x 64 multiply-adds of vpdpbusd (a checksum back).
int64_t vnni_peak_avx512(int64_t iters);

// ---- scalar helpers shared by the reference and the vector files' tails ----

// Generic K-quant decomposition: w[e] = d * sc[e/16] * q[e] - dmin * mn[e/16], q[e] >= 0.
struct KUnpacked {
  float d, dmin;
  int16_t sc[16];
  int16_t mn[16];
};
// Bytes per block of the formats the hand-written kernels in kernels_*.cpp cover.
template <GgmlType T>
constexpr size_t block_bytes();
template <> constexpr size_t block_bytes<GgmlType::Q4_0>() { return sizeof(block_q4_0); }
template <> constexpr size_t block_bytes<GgmlType::Q4_1>() { return sizeof(block_q4_1); }
template <> constexpr size_t block_bytes<GgmlType::Q5_0>() { return sizeof(block_q5_0); }
template <> constexpr size_t block_bytes<GgmlType::Q5_1>() { return sizeof(block_q5_1); }
template <> constexpr size_t block_bytes<GgmlType::Q8_0>() { return sizeof(block_q8_0); }
template <> constexpr size_t block_bytes<GgmlType::Q2_K>() { return sizeof(block_q2_K); }
template <> constexpr size_t block_bytes<GgmlType::Q3_K>() { return sizeof(block_q3_K); }
template <> constexpr size_t block_bytes<GgmlType::Q4_K>() { return sizeof(block_q4_K); }
template <> constexpr size_t block_bytes<GgmlType::Q5_K>() { return sizeof(block_q5_K); }
template <> constexpr size_t block_bytes<GgmlType::Q6_K>() { return sizeof(block_q6_K); }

// Scale/min decoding of one K block (no values); implemented in kernels_scalar.cpp.
void k_scales(GgmlType wt, const void* block, KUnpacked* out);
// Full scalar unpack of the q values (0..63) of one K block.
void k_values(GgmlType wt, const void* block, uint8_t* q256);

// Byte shuffle that spreads 16 int16 scales (one per 16 values, both 128-bit lanes holding the
// same eight: 0..7 or 8..15) over the maddubs lanes of 32-value chunk i (i % 4): lanes 0..7
// take scale 2i, lanes 8..15 scale 2i + 1. Used by the K-quant and decoded-block AVX2 paths.
alignas(32) inline constexpr uint8_t kScalePairShuffle[4][32] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15},
};

// Element i of a float weight row (F32, F16 or BF16): the scalar form every ISA's float
// product uses for its tail (half to float is exact, so every conversion agrees).
template <GgmlType T>
inline float float_weight(const uint8_t* row, int64_t i) {
  if constexpr (T == GgmlType::F32) {
    float v;
    std::memcpy(&v, row + 4 * i, 4);
    return v;
  } else {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, 2);
    if constexpr (T == GgmlType::F16) return fp16_to_fp32(h);
    else return bf16_to_fp32(h);
  }
}

}  // namespace tf::cpu::detail

// Defines tf::cpu::<ns>::<isa>(...) calling detail::<impl>: the entry points the traits table
// (quant/traits.cpp) names. Used at global scope at the end of a kernel file.
#define TF_EXPORT_KERNEL(ns, isa, ...)                                                        \
  namespace tf::cpu::ns {                                                                    \
  void isa(int64_t k, const void* w, size_t ws, int64_t r0, int64_t r1, const void* xq,      \
           size_t xs, int64_t ncols, float* y, int64_t ldy) {                                \
    detail::__VA_ARGS__(k, w, ws, r0, r1, xq, xs, ncols, y, ldy);                            \
  }                                                                                          \
  }
