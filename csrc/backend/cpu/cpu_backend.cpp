// The CPU implementation of the backend seam: products and activation quantization on the
// thread pool through the runtime-dispatched kernels (kernels.h), attention through
// attention.h, the small per-row operations through vec_ops.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/vec_ops.h"

namespace tf {

namespace {

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }

  ActLayout act_layout(GgmlType wt) const override { return cpu::act_layout(wt); }
  size_t act_row_bytes(GgmlType wt, int64_t k) const override { return cpu::act_row_bytes(wt, k); }

  void quantize_acts(unsigned mask, const GgmlType* rep, const float* x, int64_t rows, int64_t k, int64_t ldx,
                     uint8_t* const* dst, const size_t* stride, ThreadPool& pool) const override {
    // One parallel section for all layouts: each thread quantizes its rows into each of them.
    pool.parallel_for(rows, 8, [&](int64_t b, int64_t e) {
      for (size_t l = 0; l < kActLayouts; ++l) {
        if (!(mask & (1u << l))) continue;
        for (int64_t c = b; c < e; ++c) cpu::quantize_act_row(rep[l], x + c * ldx, dst[l] + size_t(c) * stride[l], k);
      }
    });
  }

  void matmul(const MatmulJob* jobs, size_t n_jobs, ThreadPool& pool) const override {
    // Every job's rows are cut into chunks of whole 16-row tiles, about kChunksPerThread chunks
    // per thread over all jobs together; threads claim chunks as they come free, so a slow or
    // descheduled thread holds back one chunk, not a fixed share.
    int64_t total = 0;
    for (size_t i = 0; i < n_jobs; ++i) total += jobs[i].w.rows;
    if (total == 0) return;
    const int64_t target = int64_t(pool.size()) * ThreadPool::kChunksPerThread;
    const int64_t per =
        pool.size() == 1 ? total : std::max<int64_t>(16, ((total + target - 1) / target + 15) & ~int64_t(15));
    thread_local std::vector<int64_t> first_chunk;  // of each job (reused: no allocation per call)
    first_chunk.clear();
    int64_t n_chunks = 0;
    for (size_t i = 0; i < n_jobs; ++i) {
      first_chunk.push_back(n_chunks);
      n_chunks += (jobs[i].w.rows + per - 1) / per;
    }
    const std::vector<int64_t>& begin = first_chunk;  // the caller's, read by the workers
    pool.run_chunks(n_chunks, [&](int64_t c, int) {
      const size_t ji = size_t(std::upper_bound(begin.begin(), begin.end(), c) - begin.begin()) - 1;
      const MatmulJob& j = jobs[ji];
      const int64_t r0 = (c - begin[ji]) * per, r1 = std::min(j.w.rows, r0 + per);
      cpu::matmul_rows(j.w.type, j.w.k, j.w.data, j.w.row_stride, r0, r1, j.xq, j.xq_stride, j.ncols, j.y, j.ldy);
    });
  }

  void attention(const float* q, int n_heads, int head_dim, const PagedKv& kv, int64_t n, float scale,
                 float* out) const override {
    cpu::paged_attention(q, n_heads, head_dim, kv, n, scale, out);
  }
  void attention_causal(const float* q, int64_t token_stride, int n_tokens, int n_heads, int head_dim,
                        const PagedKv& kv, int64_t pos0, float scale, float* out,
                        int64_t out_token_stride) const override {
    cpu::paged_attention_causal(q, token_stride, n_tokens, n_heads, head_dim, kv, pos0, scale, out, out_token_stride);
  }

  void rmsnorm(const float* x, const float* w, float* y, int64_t n, float eps) const override {
    double sum = 0.0;  // double accumulation, like ggml
    for (int64_t i = 0; i < n; ++i) sum += double(x[i] * x[i]);
    const float scale = 1.0f / std::sqrt(float(sum / double(n)) + eps);
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * w[i];
  }

  void rope(float* v, const float* cs, int rope_dim, bool neox) const override {
    const int half = rope_dim / 2;
    for (int i = 0; i < half; ++i) {
      const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
      const float c = cs[2 * i], s = cs[2 * i + 1];
      const float x0 = v[a], x1 = v[b];
      v[a] = x0 * c - x1 * s;
      v[b] = x0 * s + x1 * c;
    }
  }

  void silu_mul(int64_t n, const float* g, const float* u, float* out) const override {
    cpu::vec_ops().silu_mul(n, g, u, out);
  }

  void store_row(const float* src, void* dst, int64_t n, bool f16) const override {
    if (f16)
      cpu::vec_ops().f32_to_f16(n, src, static_cast<uint16_t*>(dst));
    else
      std::memcpy(dst, src, size_t(n) * sizeof(float));
  }
};

}  // namespace

const Backend& cpu_backend() {
  static const CpuBackend backend;
  return backend;
}

}  // namespace tf
