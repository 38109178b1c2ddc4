// LlamaModel, part 3: the matrix products of a forward pass, through the backend seam
// (Backend::matmul by weight type): activations quantized once per layout a group of weights
// needs, every product of a group in one parallel section, and reductions split at TP=2's
// boundaries when asked (ksplit_matmul).
#include "model/llama_model.h"

#include <algorithm>
#include <cstring>

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
  uint8_t* dst[kLayouts];
  size_t stride[kLayouts];
  for (size_t l = 0; l < kLayouts; ++l) {
    dst[l] = bufs[l].data.data();
    stride[l] = bufs[l].stride;
  }
  be_.quantize_acts(mask, rep, x, T, k, ldx, dst, stride, pool);
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

}  // namespace tf
