// How the CUDA backend lays out a grouped product (Backend::matmul_stack) for its kernels:
// plain C++, so the indexing is tested on the host (tests/test_cuda_host.py) against the CPU
// backend. Every activation row the product takes is packed (quantized or copied) in order:
// packed row p comes from x + src_off[p] and its outputs go to y + y_off(p) (per product: its ldy);
// tiles of at most `tile` packed rows of one matrix are the kernels' work items.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace tf::cuda {

struct MmItem {
  int32_t mat, row0, n;  // matrix (0 = the range's first), first packed row, rows (<= tile)
};

struct GroupPlan {
  std::vector<int64_t> src_off;  // per packed row: offset of its input row in x (floats)
  std::vector<int64_t> out_row;  // per packed row: list row i (lists), or matrix << 32 | row (batches)
  std::vector<MmItem> items;
  int64_t src_rows = 0;          // rows of ldx floats of x the product reads
  bool batches = false;
  int64_t y_mat = 0;
  int64_t size() const { return int64_t(src_off.size()); }
};

// Throws when a batched input does not interleave (ldx != matrices x x_mat), as the CPU does.
GroupPlan plan_groups(const Grouping& g, int64_t ldx, int tile);
// Output offsets (floats from y) of every packed row for a product writing rows ldy apart.
void output_offsets(const GroupPlan& p, int64_t ldy, std::vector<int64_t>& out);

}  // namespace tf::cuda
