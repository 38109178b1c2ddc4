#include "backend/cpu/kernel_choice.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cpu/kernels_internal.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "quant/quantize_rows.h"
#include "quant/traits.h"

namespace tf::cpu {

namespace {

// -1: none recorded; else a CpuIsa. Read on every product job, written rarely: relaxed atomics.
std::atomic<int8_t> g_choice[kGgmlTypeIdLimit][2] = {};
struct Init {
  Init() {
    for (auto& row : g_choice)
      for (auto& c : row) c.store(-1, std::memory_order_relaxed);
  }
} g_init;

void check_type(GgmlType t) {
  const TypeTraits* tr = find_type_traits(uint32_t(t));
  TF_CHECK(uint32_t(t) < kGgmlTypeIdLimit && tr != nullptr, "kernel choice: unknown weight type id ", uint32_t(t));
  act_layout(t);  // throws, naming the type, when the CPU cannot compute with it
}

}  // namespace

const char* shape_class_name(ShapeClass c) { return c == ShapeClass::Decode ? "decode" : "prefill"; }

bool parse_shape_class(const char* name, ShapeClass* out) {
  if (std::strcmp(name, "decode") == 0) return *out = ShapeClass::Decode, true;
  if (std::strcmp(name, "prefill") == 0) return *out = ShapeClass::Prefill, true;
  return false;
}

void set_kernel_choice(GgmlType t, ShapeClass c, CpuIsa isa) {
  check_type(t);
  TF_CHECK(detail::isa_available(isa), "kernel choice: this CPU (or build) lacks ", isa_name(isa));
  g_choice[uint32_t(t)][int(c)].store(int8_t(isa), std::memory_order_relaxed);
}

void clear_kernel_choices() {
  for (auto& row : g_choice)
    for (auto& c : row) c.store(-1, std::memory_order_relaxed);
}

bool has_kernel_choice(GgmlType t, ShapeClass c) {
  return uint32_t(t) < kGgmlTypeIdLimit && g_choice[uint32_t(t)][int(c)].load(std::memory_order_relaxed) >= 0;
}

CpuIsa kernel_choice(GgmlType t, ShapeClass c, CpuIsa cap) {
  if (uint32_t(t) >= kGgmlTypeIdLimit) return cap;
  const int8_t v = g_choice[uint32_t(t)][int(c)].load(std::memory_order_relaxed);
  if (v < 0) return cap;
  // Levels of one family are ordered (cpu_features.h); never above the backend's own.
  return CpuIsa(v) <= cap ? CpuIsa(v) : cap;
}

double time_kernel(GgmlType t, ShapeClass c, CpuIsa isa, int threads, size_t decode_bytes, int reps) {
  check_type(t);
  TF_CHECK(detail::isa_available(isa), "kernel timing: this CPU (or build) lacks ", isa_name(isa));
  TF_CHECK(threads >= 1 && reps >= 1, "kernel timing: threads and reps must be >= 1");
  constexpr int64_t k = 4096;
  const size_t rb = row_bytes(t, k);
  ThreadPool pool(threads);
  // A few distinct quantized rows, repeated to the matrix size.
  constexpr int64_t kDistinct = 16;
  std::vector<float> src(size_t(kDistinct * k));
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (float& v : src) v = normal(rng);
  std::vector<uint8_t> distinct(size_t(kDistinct) * rb);
  if (can_quantize(t)) {
    quantize_rows(t, src.data(), kDistinct, k, nullptr, distinct.data(), pool);
  } else {
    // No quantizer (a float type without one): the rows' bits as they come, made finite.
    for (size_t i = 0; i < distinct.size(); ++i) distinct[i] = uint8_t(rng() & 0x3f);
  }
  const int64_t rows = c == ShapeClass::Decode ? std::max<int64_t>(64, int64_t(decode_bytes / rb) / 16 * 16) : 512;
  const int64_t ncols = c == ShapeClass::Decode ? 1 : 64;
  std::vector<uint8_t> w(size_t(rows) * rb);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(w.data() + size_t(r) * rb, distinct.data() + size_t(r % kDistinct) * rb, rb);
  const size_t xs = act_row_bytes(t, k);
  std::vector<uint8_t> xq(size_t(ncols) * xs);
  for (int64_t col = 0; col < ncols; ++col)
    detail::quantize_act_row_isa(isa, t, src.data() + size_t(col % kDistinct) * size_t(k), xq.data() + size_t(col) * xs, k);
  std::vector<float> y(size_t(rows * ncols));
  // Rows cut as the backend cuts them: whole 16-row tiles, a few chunks per thread.
  const int64_t target = int64_t(threads) * ThreadPool::kChunksPerThread;
  const int64_t per = threads == 1 ? rows : std::max<int64_t>(16, ((rows + target - 1) / target + 15) & ~int64_t(15));
  const int64_t n_chunks = (rows + per - 1) / per;
  auto once = [&] {
    pool.run_chunks(n_chunks, [&](int64_t ch, int) {
      const int64_t r0 = ch * per, r1 = std::min(rows, r0 + per);
      // As the backend runs it: prefill through the format's panels where the ISA has them.
      if (c == ShapeClass::Prefill &&
          detail::matmul_rows_panels(isa, t, k, w.data(), rb, r0, r1, xq.data(), xs, ncols, y.data(), rows))
        return;
      detail::matmul_rows_isa(isa, t, k, w.data(), rb, r0, r1, xq.data(), xs, ncols, y.data(), rows);
    });
  };
  once();
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    once();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace tf::cpu
