#include "backend/cuda/grouping.h"

#include <algorithm>

#include "core/error.h"

namespace tf::cuda {

GroupPlan plan_groups(const Grouping& g, int64_t ldx, int tile) {
  GroupPlan p;
  TF_CHECK(tile >= 1, "plan_groups: tile >= 1");
  const int64_t M = g.last - g.first;
  if (M <= 0) return p;
  if (g.offsets) {
    const int64_t base = g.offsets[g.first], rows = g.offsets[g.last] - base;
    for (int64_t i = base; i < base + rows; ++i) {
      const int64_t src = g.gather ? g.gather[i] : i;
      p.src_off.push_back(src * ldx);
      p.out_row.push_back(i);
      p.src_rows = std::max(p.src_rows, src + 1);
    }
    for (int64_t e = g.first; e < g.last; ++e)
      for (int64_t r0 = g.offsets[e]; r0 < g.offsets[e + 1]; r0 += tile)
        p.items.push_back({int32_t(e - g.first), int32_t(r0 - base), int32_t(std::min<int64_t>(tile, g.offsets[e + 1] - r0))});
    return p;
  }
  TF_CHECK(ldx == M * g.x_mat, "matmul_stack: batched inputs must interleave (ldx = matrices x x_mat)");
  p.batches = true;
  p.y_mat = g.y_mat;
  for (int64_t e = 0; e < M; ++e) {
    for (int64_t j = 0; j < g.rows; ++j) {
      p.src_off.push_back(e * g.x_mat + j * ldx);
      p.out_row.push_back((e << 32) | j);
    }
    for (int64_t j0 = 0; j0 < g.rows; j0 += tile)
      p.items.push_back({int32_t(e), int32_t(e * g.rows + j0), int32_t(std::min<int64_t>(tile, g.rows - j0))});
  }
  p.src_rows = g.rows;
  return p;
}

void output_offsets(const GroupPlan& p, int64_t ldy, std::vector<int64_t>& out) {
  out.resize(p.out_row.size());
  for (size_t r = 0; r < p.out_row.size(); ++r) {
    const int64_t o = p.out_row[r];
    out[r] = p.batches ? (o >> 32) * p.y_mat + (o & 0xFFFFFFFF) * ldy : o * ldy;
  }
}

}  // namespace tf::cuda
