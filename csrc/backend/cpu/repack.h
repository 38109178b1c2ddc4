// Row-interleaved ("R8") layouts of the K-quants, built in place at load.
//
// A decode GEMV on the file's layout unpacks each row's block on its own: per 32 weights a
// shift, a mask, a scale shuffle, two multiply-adds and a reduction per row at the end — about
// twice the vector instructions the memory system leaves room for on two cores. In R8 the
// blocks of eight consecutive rows are stored together as one super-block in which the 32-bit
// lane r of every 32-byte vector belongs to row r: four 2/4/6-bit values of a row meet four
// activation bytes broadcast to all lanes in one dot-product instruction (vpdpbusd, or
// maddubs + madd without VNNI), scales of eight rows load as one vector, and the eight lanes
// of the accumulator are the eight rows' results — no shuffles, no horizontal sums.
//
// A super-block holds exactly the bytes of its eight file blocks (only their order and bit
// positions change), so a weight is repacked in place: the plan's bytes are the file's bytes.
//
// Layouts (v[i]: the unsigned value i of a row's 256, as k_values gives it; "byte 4r+k" is byte
// k of lane r of a 32-byte vector):
//  Q2_K (672 B): d[8] f16 @0, dmin[8] f16 @16, scale bytes @32 (byte 8s+r: row r's scales[s]),
//        values @160: sub-block s (16 values) at +32s, byte 4r+k bits 2j..2j+1 = v[16s+4j+k].
//  Q3_K (880 B): d[8] f16 @0, 6-bit scales @16 (96 B, below; n = 8s+r), low value bits @112
//        (as Q2_K's values), high bits @624: sub-blocks 2p, 2p+1 at +32p, byte 4r+k bit
//        j + 4(s&1) = bit 2 of v[16s+4j+k].
//  Q4_K (1152 B): d[8] @0, dmin[8] @16, 6-bit scales @32 (n = 8s+r) and mins (n = 64+8s+r),
//        values @128: sub-block s (32 values) at +128s, vector t at +32t, byte 4r+k low nibble
//        v[32s+8t+k], high nibble v[32s+8t+4+k].
//  Q6_K (1680 B): d[8] @0, scales int8 @16 (byte 8s+r), then per sub-block s at 144+96s: two
//        vectors t = 0, 1 with byte 4r+k low nibble = low 4 bits of v[16s+8t+k], high nibble of
//        v[16s+8t+4+k]; one vector with byte 4r+k bits 2j..2j+1 = top 2 bits of v[16s+4j+k].
//  6-bit fields (128 of them, index n): low 4 bits in byte n % 64 (nibble n / 64) of 64 bytes,
//        top 2 bits in byte n % 32 (bits 2(n/32)) of the 32 bytes after them.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/cpu_features.h"
#include "core/dtype.h"

namespace tf::cpu::r8 {

inline constexpr int kRows = 8;

bool supported(GgmlType t);
// Whether the CPU backend of this ISA rewrites its models' product weights in R8 at load:
// where the AVX-512 VNNI prefill panels exist beside the decode kernel (a weight has one layout
// for both), unless TENSORFOLD_REPACK=off.
bool enabled_for(CpuIsa isa);
// Bytes of one file block / one super-block (8 file blocks).
size_t block_bytes(GgmlType t);

// One super-block from the blocks of eight rows, and back (exact inverses).
void pack_superblock(GgmlType t, const uint8_t* const rows[kRows], uint8_t* sb);
void unpack_superblock(GgmlType t, const uint8_t* sb, uint8_t* const rows[kRows]);

// Eight rows of nb blocks each, stored contiguously (row_stride = nb * block bytes), as nb
// super-blocks at `out` (the same number of bytes, elsewhere).
void pack_group(GgmlType t, const uint8_t* rows8, int64_t nb, uint8_t* out);
// Super-blocks [b0, b0 + nbv) of a group (`sb0` points at super-block b0) written as eight rows in
// the file's layout, row r at out + r * out_stride.
void unpack_group(GgmlType t, const uint8_t* sb0, int64_t nbv, uint8_t* out, size_t out_stride);

// The reference product of one group: y[c * ldy + r] = row r . activation row c (the ActK rows
// of ncols columns at xq + c * xs), nb super-blocks from sb0. The vector kernels give the same
// bits: integer sums per super-block, then the same float operations in the same order.
void gemv_ref(GgmlType t, int64_t nb, const uint8_t* sb0, const void* xq, size_t xs, int64_t ncols, float* y,
              int64_t ldy);

// The same through the vector kernels (AVX2, or AVX-512 VNNI's vpdpbusd); false when this
// build or CPU has neither.
using GemvFn = void (*)(GgmlType t, int64_t nb, const uint8_t* sb0, const void* xq, size_t xs, int64_t ncols,
                        float* y, int64_t ldy);
void gemv_avx2(GgmlType t, int64_t nb, const uint8_t* sb0, const void* xq, size_t xs, int64_t ncols, float* y,
               int64_t ldy);
void gemv_avx512(GgmlType t, int64_t nb, const uint8_t* sb0, const void* xq, size_t xs, int64_t ncols, float* y,
                 int64_t ldy);
// The fastest of the above on this CPU ("avx512", "avx2" or "scalar" for gemv_ref).
GemvFn best_gemv();
const char* best_gemv_name();

}  // namespace tf::cpu::r8
