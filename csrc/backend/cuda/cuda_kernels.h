// Launchers of the CUDA backend's kernels (the .cu files of this directory), called by
// cuda_backend.cu: they validate nothing (the backend did) and launch on the given stream.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/format_decode.h"
#include "backend/cuda/grouping.h"

namespace tf::cuda::k {

// One tile of a (possibly grouped) product: packed activation rows row0 .. row0 + n - 1 against
// matrix `mat` of a stack (0 for a plain weight); n <= kTile (grouping.h).
using MmItem = tf::cuda::MmItem;
constexpr int kTile = 8;       // activation rows per tile (prefill); decode uses 1
constexpr int kRowsPerBlock = 4;  // weight rows per thread block (one per warp)

struct MmArgs {
  uint32_t type = 0;
  const uint8_t* w = nullptr;  // matrix 0
  size_t row_stride = 0, mat_stride = 0;
  int64_t rows = 0, k = 0;
  // activations: int8 levels (row i at xq + i * k) and scales (xd + i * k / 32), or floats
  // (row i at xf + i * ldxf) for F16 / BF16
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const float* xf = nullptr;
  int64_t ldxf = 0;
  int64_t n_rows = 0;  // activation rows
  // output row i at y + (y_off ? y_off[i] : i * ldy)
  float* y = nullptr;
  int64_t ldy = 0;
  const int64_t* y_off = nullptr;
  // tiles: items (device memory, n_items), or nullptr: matrix 0 over rows in tiles of tile rows
  const MmItem* items = nullptr;
  int64_t n_items = 0;
  int tile = 1;  // 1 or kTile
};

void matmul(const MmArgs& a, const cudafmt::Tables& tb, cudaStream_t s);
// Int8 levels and per-32 scales of N rows of K floats: row i of src at src + (off ? off[i] : i * ld).
void quantize_q8(const float* src, int64_t ld, const int64_t* off, int64_t N, int64_t K, int8_t* q, float* d,
                 cudaStream_t s);
// Packed copies of N rows of K floats (row i from src + (off ? off[i] : i * ld)).
void gather_rows(const float* src, int64_t ld, const int64_t* off, int64_t N, int64_t K, float* dst, cudaStream_t s);
// Rows of a table (any type with a kernel, or F32 = 0) as floats: out row t = row ids[t].
void embed(uint32_t type, const uint8_t* table, size_t row_stride, int64_t k, const int32_t* ids, int64_t T,
           float* out, int64_t ldo, const cudafmt::Tables& tb, cudaStream_t s);

// Row ops.
void rmsnorm(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t T, int64_t n, float eps,
             cudaStream_t s);
void rope(float* v, int64_t T, int64_t ldv, int n_heads, int64_t head_stride, int64_t at, const float* cs,
          int64_t ldcs, int rope_dim, bool neox, bool inverse, cudaStream_t s);
void silu_mul(float* g, int64_t ldg, const float* u, int64_t ldu, int64_t T, int64_t n, int64_t split, float limit,
              cudaStream_t s);
void add(float* y, const float* x, int64_t n, cudaStream_t s);
void add_bias(float* y, int64_t ldy, const float* b, int64_t T, int64_t n, cudaStream_t s);
void add_scaled(float* y, int64_t ldy, const float* x, int64_t ldx, const float* sc, int64_t T, int64_t n,
                bool sigmoid, cudaStream_t s);
void copy_rows(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t T, int64_t n, cudaStream_t s);
void fill(float* dst, int64_t n, float v, cudaStream_t s);
void hyper_collapse(const float* streams, const float* pre, int n, int64_t E, int64_t T, float* out, int64_t ldo,
                    cudaStream_t s);
void hyper_expand(float* streams, const float* block_out, int64_t ldb, const float* post, const float* comb, int n,
                  int64_t E, int64_t T, cudaStream_t s);
// out[t] += sum_k (lo <= ids[t][k] < hi) weights[t][k] * expert_out[slot_of[t * n_used + k]].
void combine(float* out, int64_t ldo, const float* expert_out, int64_t lde, int64_t T, int64_t n, const int32_t* ids,
             const float* weights, const int32_t* slot_of, int n_used, int lo, int hi, cudaStream_t s);
// Cache rows: src row i (n values) into dst[i] (device pointers), as half or float.
void store_rows(const float* src, int64_t lds, int64_t n, void* const* dst, int64_t count, bool half, cudaStream_t s);

// Attention over a paged cache. The layer's rows: K of (block, head) at
// base + ((layer * n_blocks + block) * page_stride + head * block_size * k_dim) elements, V at
// base + ((layer * n_blocks + block) * page_stride + v_off + head * block_size * v_dim) (v_off:
// n_heads * k_dim * block_size; with no V rows, V is the first v_dim values of K).
struct AttnArgs {
  const float* q = nullptr;
  int64_t q_stride = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  int64_t T = 0;
  const int32_t* tables = nullptr;  // [n_tab][max_blocks] block ids (-1: none)
  const int32_t* tab_of = nullptr;  // [T] table row of token t
  const int64_t* begin = nullptr;   // [T]
  const int64_t* end = nullptr;     // [T]
  int max_blocks = 0;
  const void* base = nullptr;
  bool half = true;
  int layer = 0;
  int64_t n_blocks = 0;
  int64_t page_stride = 0;
  int block_size = 0;
  int n_cache_heads = 0, group = 1, head_dim = 0, v_dim = 0, k_dim = 0, spec_v_dim = 0;
  float scale = 1.f;
  const float* sinks = nullptr;
};
void attention(const AttnArgs& a, cudaStream_t s);

}  // namespace tf::cuda::k
