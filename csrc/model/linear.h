// Products the blocks share: a product whose reduction is split where TP=2 splits it.
#pragma once
#include "backend/backend.h"
#include "model/weights.h"

namespace tf {

// y = W . x over T rows (x: ldx floats apart), the reduction split at `split` (<= 0: not split)
// into two partial sums added in one fixed order, exactly as TP=2 ranks and their All-Reduce
// compute them (part: scratch of T x W.rows floats).
inline void split_matmul(Backend& be, const Weight& w, const float* x, int64_t T, int64_t ldx, int64_t split,
                         float* y, float* part) {
  if (split <= 0) {
    const Product p{&w, y, w.rows};
    be.matmul(x, T, ldx, &p, 1);
    return;
  }
  const Weight a = WeightLoader::kview(w, 0, split), b = WeightLoader::kview(w, split, w.k);
  const Product pa{&a, y, w.rows}, pb{&b, part, w.rows};
  be.matmul(x, T, ldx, &pa, 1);
  be.matmul(x + split, T, ldx, &pb, 1);
  be.add(y, part, T * w.rows);  // partial + partial, as TP sums
}

}  // namespace tf
