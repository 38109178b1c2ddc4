// Attention with sinks and a second source of entries (DeepSeek-V4: a sliding window of the
// layer's own rows plus compressed entries, all of them or an indexer's per-token pick), the
// path CpuBackend::attention takes for batches that set AttentionBatch::sinks or ::extra.
// Batches without either keep the paged kernels of attention.h.
#pragma once

#include "backend/backend.h"
#include "backend/cpu/vec_ops.h"

namespace tf {
class ThreadPool;
namespace cpu {

// The whole batch, on the pool's threads: one item per (token, cache head, range of its query
// heads), each reading its entries tile by tile (online softmax over both sources and the
// sink). Reads what the token attends to and nothing more: at most window + extra entries.
void attention_sparse(const AttentionBatch& a, const KvLayer& kv, ThreadPool& pool, const VecOps& ops);

}  // namespace cpu
}  // namespace tf
