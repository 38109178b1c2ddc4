// Which instruction set's kernel runs a weight format's products, per shape class, when the CPU
// backend is asked for "the best this CPU has" (variant "cpu", not "cpu:avx2" etc.): chosen by
// measurement, not assumed. On Zen 4 the AVX-512 K-quant decode products lose to the AVX2 ones
// (512-bit work is split in two there while the unpacking costs the same); on a CPU with full
// 512-bit units they may not. The choice is process-wide (a property of the machine); the Python
// layer measures each format once and caches the result per CPU and build (tensorfold.kernel_tuning).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/cpu_features.h"
#include "core/dtype.h"

namespace tf::cpu {

// Decode: a few activation columns (one token per sequence), the weights streamed once;
// prefill: many columns, tiles reused from cache.
enum class ShapeClass { Decode = 0, Prefill = 1 };
constexpr int64_t kDecodeMaxColumns = 4;
// Products of at least this many (non-exact) columns may take a format's prefill panels.
constexpr int64_t kPanelMinColumns = 8;
inline ShapeClass shape_class(int64_t ncols) { return ncols <= kDecodeMaxColumns ? ShapeClass::Decode : ShapeClass::Prefill; }
const char* shape_class_name(ShapeClass c);
bool parse_shape_class(const char* name, ShapeClass* out);

// Records the ISA for (t, c); it must be available on this CPU and build. Throws otherwise.
void set_kernel_choice(GgmlType t, ShapeClass c, CpuIsa isa);
// Forgets every recorded choice.
void clear_kernel_choices();
// The recorded ISA for (t, c), lowered to `cap` (a backend never runs above its own level), or
// `cap` when nothing was recorded.
CpuIsa kernel_choice(GgmlType t, ShapeClass c, CpuIsa cap);
// Whether a choice was recorded for (t, c).
bool has_kernel_choice(GgmlType t, ShapeClass c);

// Seconds per product of format t in class c with `isa`'s kernel on `threads` threads, best of
// `reps` after one warm-up: decode multiplies a matrix of about `decode_bytes` (make it larger
// than the last-level cache: decode reads from DRAM) by one column; prefill 512 rows by 64
// columns, k = 4096 both. The weights are real quantized rows (random normal, the format's own
// quantizer), a few distinct rows repeated.
double time_kernel(GgmlType t, ShapeClass c, CpuIsa isa, int threads, size_t decode_bytes, int reps);

}  // namespace tf::cpu
