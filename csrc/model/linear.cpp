// LlamaModel, part 3: the matrix products of a forward pass, through the CPU backend's one
// entry (cpu::matmul_rows by weight type): activations quantized once per layout a group of
// weights needs, every product of a group in one parallel section, and reductions split at
// TP=2's boundaries when asked (ksplit_matmul).
#include "model/llama_model.h"

#include <algorithm>
#include <cstring>

#include "backend/cpu/kernels.h"
#include "core/error.h"
#include "quant/traits.h"

namespace tf {

unsigned LlamaModel::quantize_acts(std::initializer_list<const Weight*> ws, const float* x, int64_t T,
                                   int64_t k, int64_t ldx, ActBuf* bufs, ThreadPool& pool) {
  // A weight type of each layout needed stands for all weights of that layout.
  GgmlType rep[kLayouts] = {};
  unsigned mask = 0;
  for (const Weight* w : ws) {
    const unsigned l = unsigned(w->layout);
    if (!(mask & (1u << l))) rep[l] = w->type;
    mask |= 1u << l;
  }
  quantize_layouts(mask, rep, x, T, k, ldx, bufs, pool);
  return mask;
}

void LlamaModel::quantize_layouts(unsigned mask, const GgmlType* rep, const float* x, int64_t T, int64_t k,
                                  int64_t ldx, ActBuf* bufs, ThreadPool& pool) {
  // One parallel section for all layouts: each thread quantizes its rows into each of them.
  pool.parallel_for(T, 8, [&](int64_t b, int64_t e) {
    for (size_t l = 0; l < kLayouts; ++l) {
      if (!(mask & (1u << l))) continue;
      uint8_t* dst = bufs[l].data.data();
      const size_t stride = bufs[l].stride;
      for (int64_t c = b; c < e; ++c) cpu::quantize_act_row(rep[l], x + c * ldx, dst + size_t(c) * stride, k);
    }
  });
}

void LlamaModel::project(std::initializer_list<Proj> ps, const float* x, int64_t T, int64_t ldx,
                         ThreadPool& pool) {
  GgmlType rep[kLayouts] = {};
  unsigned mask = 0;
  for (const Proj& p : ps) {
    const unsigned l = unsigned(p.w->layout);
    if (!(mask & (1u << l))) rep[l] = p.w->type;
    mask |= 1u << l;
  }
  quantize_layouts(mask, rep, x, T, ps.begin()->w->k, ldx, act_, pool);  // the group shares its input
  jobs_.clear();
  for (const Proj& p : ps) {
    const ActBuf& a = act_[size_t(p.w->layout)];
    jobs_.push_back({*p.w, a.data.data(), a.stride, T, p.y, p.w->rows});
  }
  run_jobs(jobs_, pool);
}

Weight LlamaModel::kview(const Weight& w, int64_t c0, int64_t c1) {
  Weight v = w;
  v.data = w.data + row_bytes(w.type, c0);
  v.k = c1 - c0;
  return v;  // row_stride unchanged: a column range of every row
}

void LlamaModel::ksplit_matmul(const Weight& w, const float* x, int64_t T, int64_t ldx, int64_t split,
                               float* y, float* scratch, ThreadPool& pool) {
  if (split <= 0) {
    project({{&w, y}}, x, T, ldx, pool);
    return;
  }
  const Weight a = kview(w, 0, split), b = kview(w, split, w.k);
  project({{&a, y}}, x, T, ldx, pool);
  project({{&b, scratch}}, x + split, T, ldx, pool);
  for (int64_t i = 0; i < T * w.rows; ++i) y[i] += scratch[i];  // partial + partial, as TP sums
}

void LlamaModel::run_jobs(const std::vector<MatmulJob>& jobs, ThreadPool& pool) {
  // Every job's rows are cut into chunks of whole 16-row tiles, about kChunksPerThread chunks
  // per thread over all jobs together; threads claim chunks as they come free, so a slow or
  // descheduled thread holds back one chunk, not a fixed share.
  int64_t total = 0;
  for (const MatmulJob& j : jobs) total += j.w.rows;
  if (total == 0) return;
  const int64_t target = int64_t(pool.size()) * ThreadPool::kChunksPerThread;
  const int64_t per = pool.size() == 1 ? total : std::max<int64_t>(16, ((total + target - 1) / target + 15) & ~int64_t(15));
  job_chunk_begin_.clear();
  int64_t n_chunks = 0;
  for (const MatmulJob& j : jobs) {
    job_chunk_begin_.push_back(n_chunks);
    n_chunks += (j.w.rows + per - 1) / per;
  }
  pool.run_chunks(n_chunks, [&](int64_t c, int) {
    const size_t ji = size_t(std::upper_bound(job_chunk_begin_.begin(), job_chunk_begin_.end(), c) -
                             job_chunk_begin_.begin()) - 1;
    const MatmulJob& j = jobs[ji];
    const int64_t r0 = (c - job_chunk_begin_[ji]) * per, r1 = std::min(j.w.rows, r0 + per);
    cpu::matmul_rows(j.w.type, j.w.k, j.w.data, j.w.row_stride, r0, r1, j.xq, j.xq_stride, j.ncols, j.y, j.ldy);
  });
}

}  // namespace tf
