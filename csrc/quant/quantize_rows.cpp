#include "quant/quantize_rows.h"

#include <atomic>
#include <cmath>

#include "core/error.h"
#include "core/thread_pool.h"
#include "quant/traits.h"

namespace tf {

bool can_quantize(GgmlType t) {
  const TypeTraits* tr = find_type_traits(static_cast<uint32_t>(t));
  return tr != nullptr && tr->quantize_weighted != nullptr;
}

void quantize_rows(GgmlType t, const float* src, int64_t nrows, int64_t ncols, const float* importance,
                   uint8_t* dst, ThreadPool& pool) {
  const TypeTraits* tr = find_type_traits(static_cast<uint32_t>(t));
  if (tr == nullptr || tr->quantize_weighted == nullptr)
    fail(ErrorKind::Unsupported, "writing weights as ", tr ? tr->name : "an unknown type",
         " is not implemented");
  TF_CHECK(nrows >= 0 && ncols >= 0, "quantize ", tr->name, ": negative shape");
  const size_t rb = row_bytes(t, ncols);  // checks the block size
  if (importance != nullptr)
    for (int64_t j = 0; j < ncols; ++j)
      TF_CHECK(std::isfinite(importance[j]) && importance[j] >= 0.0f, "quantize ", tr->name,
               ": importance of column ", j, " is ", importance[j], " (must be finite and >= 0)");
  std::atomic<int64_t> bad_row{-1};
  // Small grain: a row of the grid formats takes a while, and rows vary in cost.
  pool.parallel_for(nrows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = src + r * ncols;
      bool finite = true;
      for (int64_t j = 0; j < ncols; ++j) finite &= std::isfinite(x[j]);
      if (!finite) {
        int64_t expect = -1;
        bad_row.compare_exchange_strong(expect, r);
        continue;
      }
      tr->quantize_weighted(x, importance, dst + r * rb, ncols);
    }
  });
  if (bad_row.load() >= 0)
    fail(ErrorKind::InvalidInput, "quantize ", tr->name, ": row ", bad_row.load(),
         " holds a non-finite value (NaN or infinity); the source weights are corrupt");
}

}  // namespace tf
