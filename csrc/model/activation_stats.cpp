// ActivationStats: per-channel sums of squares of matrix inputs (see activation_stats.h).
#include "model/activation_stats.h"

#include <algorithm>

#include "core/error.h"

namespace tf {

int ActivationStats::add(int64_t in_dim, int64_t n_mat) {
  TF_CHECK(in_dim > 0 && n_mat > 0, "activation stats: invalid accumulator size ", in_dim, " x ", n_mat);
  Accumulator a;
  a.in_dim = in_dim;
  a.n_mat = n_mat;
  a.sum2.assign(size_t(in_dim * n_mat), 0.0);
  a.counts.assign(size_t(n_mat), 0);
  accs_.push_back(std::move(a));
  return int(accs_.size() - 1);
}

size_t ActivationStats::bytes() const {
  size_t n = 0;
  for (const auto& a : accs_) n += a.sum2.size() * sizeof(double) + a.counts.size() * sizeof(int64_t);
  return n;
}

template <typename RowFn, typename CountFn>
void ActivationStats::accumulate(Accumulator& a, RowFn row, CountFn n_rows) {
  for (int64_t m = 0; m < a.n_mat; ++m) {
    const int64_t n = n_rows(m);
    double* acc = a.sum2.data() + m * a.in_dim;
    for (int64_t i = 0; i < n; ++i) {
      const float* x = row(m, i);
      for (int64_t j = 0; j < a.in_dim; ++j) acc[j] += double(x[j]) * double(x[j]);
    }
    a.counts[size_t(m)] += n;
  }
}

void ActivationStats::record(int id, const float* x, int64_t T, int64_t ldx, int64_t mat) {
  Accumulator& a = accs_.at(size_t(id));
  TF_CHECK(mat >= 0 && mat < a.n_mat && ldx >= a.in_dim, "activation stats: bad record");
  if (T <= 0) return;
  double* acc = a.sum2.data() + mat * a.in_dim;
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * ldx;
    for (int64_t j = 0; j < a.in_dim; ++j) acc[j] += double(xt[j]) * double(xt[j]);
  }
  a.counts[size_t(mat)] += T;
}

void ActivationStats::record_heads(int id, const float* x, int64_t T, int64_t ldx, int64_t hx) {
  Accumulator& a = accs_.at(size_t(id));
  if (T <= 0) return;
  accumulate(a, [&](int64_t h, int64_t t) { return x + t * ldx + h * hx; }, [&](int64_t) { return T; });
}

void ActivationStats::record_grouped(int id, const float* x, int64_t ldx, const int32_t* offsets,
                                     const int32_t* rows) {
  Accumulator& a = accs_.at(size_t(id));
  accumulate(
      a,
      [&](int64_t m, int64_t i) {
        const int64_t r = int64_t(offsets[m]) + i;
        return x + (rows ? int64_t(rows[r]) : r) * ldx;
      },
      [&](int64_t m) { return int64_t(offsets[m + 1] - offsets[m]); });
}

}  // namespace tf
