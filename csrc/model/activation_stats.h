// Calibration statistics of the inputs of weight matrices (an importance matrix, as
// llama.cpp's llama-imatrix collects it): for every input channel j of a matrix, the sum over
// the tokens it saw of x_j^2, and how many tokens that was. A 3-D weight (routed experts,
// MLA's per-head W_kb / W_vb) has one row of sums and one count per matrix: an expert counts
// only the tokens routed to it.
//
// The blocks feed it from their matrix-product call sites when one is attached
// (Model::set_activation_stats; each block names its accumulators after its weights); nothing
// runs when none is. Several weights that take the same input (q/k/v, gate/up, ...) share one
// accumulator under several names. Sums are kept in double and added in token order, so
// results do not depend on threads or batch splits.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>


namespace tf {

class ActivationStats {
 public:
  struct Accumulator {
    int64_t in_dim = 0, n_mat = 0;
    std::vector<double> sum2;     // [n_mat][in_dim]
    std::vector<int64_t> counts;  // [n_mat] tokens
  };

  // A new accumulator of n_mat matrices with in_dim inputs each; returns its id.
  int add(int64_t in_dim, int64_t n_mat = 1);
  // `name` (a GGUF tensor name) reads accumulator `id`.
  void name(const std::string& name, int id) { names_.emplace_back(name, id); }

  // T token rows of x, ldx floats apart (the first in_dim values of each), into matrix `mat`.
  void record(int id, const float* x, int64_t T, int64_t ldx, int64_t mat = 0);
  // Per-head inputs: matrix h takes, for each of T tokens, the in_dim values at
  // x + t * ldx + h * hx.
  void record_heads(int id, const float* x, int64_t T, int64_t ldx, int64_t hx);
  // Grouped rows: matrix m takes rows offsets[m] .. offsets[m + 1] - 1 of a list whose row i
  // is x + (rows ? rows[i] : i) * ldx (the token lists of experts).
  void record_grouped(int id, const float* x, int64_t ldx, const int32_t* offsets, const int32_t* rows);

  const std::vector<std::pair<std::string, int>>& names() const { return names_; }
  const Accumulator& accumulator(int id) const { return accs_.at(size_t(id)); }
  size_t bytes() const;

 private:
  // fn(mat, i) -> the i-th input row of matrix mat, n_rows(mat) rows each.
  template <typename RowFn, typename CountFn>
  void accumulate(Accumulator& a, RowFn row, CountFn n_rows);

  std::vector<Accumulator> accs_;
  std::vector<std::pair<std::string, int>> names_;
};

}  // namespace tf
