// The lightning indexer's scoring and top-k selection (Backend::index_topk) on the CPU.
#pragma once
#include <cstdint>

#include "backend/backend.h"
#include "backend/cpu/vec_ops.h"

namespace tf {
class ThreadPool;
namespace cpu {

// Backend::index_topk's contract. Items are (token, range of its entries): a token with many
// entries and few tokens beside it (decode) is scored by every thread, each range keeping its
// own k best, merged per token afterwards. The order is total (score, then lower entry first),
// so the ranges' picks merge to exactly the token's k best.
void index_topk(const float* q, int64_t ldq, int n_heads, int64_t D, const float* w, int64_t ldw, const KvLayer& kv,
                const int32_t* seq, const int64_t* count, int64_t T, int k, int32_t* idx, ThreadPool& pool,
                const VecOps& ops);

}  // namespace cpu
}  // namespace tf
