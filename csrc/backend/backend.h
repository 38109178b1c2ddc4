// The seam between the model and the hardware: every operation the forward pass computes
// goes through a Backend. Model code names weights, activations and cache rows; a backend
// decides how products, attention, norms and RoPE run (CPU: runtime-dispatched AVX-512 / AVX2
// / scalar kernels on the thread pool). A new backend (CUDA, NEON) implements this interface;
// the model does not change.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend/cpu/attention.h"
#include "backend/cpu/cpu_kernels.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

namespace tf {

// The activation layout a weight type multiplies with (activations quantized to it once per
// row; weights of different types that share a layout share the row).
using ActLayout = cpu::ActLayout;
constexpr size_t kActLayouts = 3;  // ActLayout values
// Paged K/V rows of one (layer, cache head) as attention reads them.
using PagedKv = cpu::PagedKv;
constexpr int kAttentionBlockRows = cpu::kAttentionBlockRows;

// A 2-D weight matrix: `rows` rows of `k` elements, row-major.
struct Weight {
  GgmlType type = GgmlType::F32;
  ActLayout layout = ActLayout::F32;  // of the activations it multiplies with
  int64_t k = 0, rows = 0;
  const uint8_t* data = nullptr;
  size_t row_stride = 0;
};

// One matrix product of a batch: y[c * ldy + r] = W[r] . xq[c] for the rows of W.
struct MatmulJob {
  Weight w;
  const uint8_t* xq;
  size_t xq_stride;
  int64_t ncols;
  float* y;
  int64_t ldy;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  virtual ActLayout act_layout(GgmlType wt) const = 0;
  virtual size_t act_row_bytes(GgmlType wt, int64_t k) const = 0;
  // Quantizes `rows` rows of x (k values each, ldx floats apart) into every layout whose bit is
  // set in `mask` (rep[l]: a weight type of layout l; dst[l] rows stride[l] bytes apart), all
  // layouts in one pass over the rows.
  virtual void quantize_acts(unsigned mask, const GgmlType* rep, const float* x, int64_t rows, int64_t k,
                             int64_t ldx, uint8_t* const* dst, const size_t* stride, ThreadPool& pool) const = 0;
  // Every product of `jobs`, together (one parallel section).
  virtual void matmul(const MatmulJob* jobs, size_t n_jobs, ThreadPool& pool) const = 0;

  // Attention of one token's n_heads query heads (head_dim each) over positions [0, n) of one
  // cache head; out: n_heads rows of kv.v_dim (or head_dim).
  virtual void attention(const float* q, int n_heads, int head_dim, const PagedKv& kv, int64_t n, float scale,
                         float* out) const = 0;
  // The same for n_tokens consecutive tokens of a sequence from pos0, causally
  // (n_tokens * n_heads <= kAttentionBlockRows); bit for bit what attention() gives each.
  virtual void attention_causal(const float* q, int64_t token_stride, int n_tokens, int n_heads, int head_dim,
                                const PagedKv& kv, int64_t pos0, float scale, float* out,
                                int64_t out_token_stride) const = 0;

  // y = x / rms(x) * w over n values (y may be x).
  virtual void rmsnorm(const float* x, const float* w, float* y, int64_t n, float eps) const = 0;
  // Rotates the first rope_dim values of v by the angles cs (cos, sin pairs), adjacent pairs
  // or NeoX halves.
  virtual void rope(float* v, const float* cs, int rope_dim, bool neox) const = 0;
  // out = silu(g) * u.
  virtual void silu_mul(int64_t n, const float* g, const float* u, float* out) const = 0;
  // n floats into a cache row of half (f16 = true) or float.
  virtual void store_row(const float* src, void* dst, int64_t n, bool f16) const = 0;
};

// The CPU backend (the kernels of the ISA this machine has).
const Backend& cpu_backend();

}  // namespace tf
