// The seam between the model and the hardware. Model code names weights, activations and
// cache rows; a backend decides where they live and how every operation of a forward pass
// runs. Operations work on batches of T rows at once (one call per layer and op, never per
// row), so a device backend launches a kernel per op and a CPU backend runs one parallel
// section per op on the threads it owns. Pointers given to an op are memory of this backend
// (Buffer: host, device or unified); weights are described by Weight and made usable by the
// backend at load (on a unified-memory machine, the mapped file in place).
//
// A backend is chosen when the engine is built (make_backend: "cpu", "cuda", "auto"). Adding
// one = implementing this interface; model code does not change. This header names no ISA and
// includes nothing of any backend.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/buffer.h"
#include "core/dtype.h"
#include "kv/kv_spec.h"
#include "moe/router.h"

namespace tf {

// A 2-D weight matrix: `rows` rows of `k` elements of `type`, row-major, rows row_stride bytes
// apart, in memory of kind `where`.
struct Weight {
  GgmlType type = GgmlType::F32;
  int64_t k = 0, rows = 0;
  const uint8_t* data = nullptr;
  size_t row_stride = 0;
  BufferKind where = BufferKind::Host;
  // A column view's first column in its matrix (WeightLoader::kview): the matrix's rows start
  // that many values before data.
  int64_t k0 = 0;
};

// A stack of matrices of one type and shape (routed experts, per-head projections): matrix e
// at first.data + e * stride.
struct WeightStack {
  Weight first;
  int64_t n = 0;
  size_t stride = 0;
  Weight at(int64_t e) const {
    Weight w = first;
    w.data = first.data + size_t(e) * stride;
    return w;
  }
};

// One product of a group that shares its input: y[t * ldy + r] = W[r] . x[t] for every row r of
// W and every input row t; x rows are W.k values (columns [k0, k0 + W.k) of the input rows when
// the weight is a column view).
struct Product {
  const Weight* w;
  float* y;
  int64_t ldy;
};

// Products of a weight stack over input rows grouped by matrix, in one of two forms:
// * lists (routed experts): matrix e takes the rows offsets[e] .. offsets[e + 1] - 1 of a list
//   whose row i is x + (gather ? gather[i] : i) * ldx, and writes output row i at y + i * ldy;
// * batches (per-head projections; offsets nullptr): matrix e takes `rows` input rows
//   x + e * x_mat + j * ldx and writes y + e * y_mat + j * ldy.
// Matrices [first, last) only (an expert-parallel rank's share: matrix `first` is the stack's
// matrix 0); several stacks taking the same rows share one pass over the input.
struct StackProduct {
  const WeightStack* w;
  float* y;
  int64_t ldy;
};
struct Grouping {
  const int32_t* offsets = nullptr;  // lists: n + 1 entries (host memory)
  const int32_t* gather = nullptr;   // lists: row of x for list row i (host memory), or nullptr
  int64_t rows = 0, x_mat = 0, y_mat = 0;  // batches
  int64_t first = 0, last = 0;       // the matrices to run
};

// The cache pages an attention batch reads: the layer's pool and its index in the pool.
class KvPool;
struct KvLayer;

// Attention of a batch of query tokens over one layer's paged cache. Token t has its query
// heads at q + t * q_stride (the heads of cache head g consecutive: `group` per cache head,
// head_dim values each) and reads the cache entries [begin, end[t]) of sequence seq[t] (its
// block table in the layer's pool), begin = max(0, end[t] - window) with a window, else 0;
// output at out + t * out_stride, v_dim values per head. Consecutive tokens of one sequence
// (a prefill chunk) are attended causally as a block.
struct AttentionBatch {
  const float* q = nullptr;
  int64_t q_stride = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  int64_t T = 0;
  const int32_t* seq = nullptr;  // host memory, T entries
  const int64_t* end = nullptr;  // host memory, T entries
  int64_t window = 0;            // 0: every entry before end
  int n_cache_heads = 0, group = 1, head_dim = 0, v_dim = 0;
  float scale = 1.f;
  // Attention sinks: one logit per query head (head i of the row at sinks[i]) that joins every
  // softmax's denominator and contributes no value; nullptr: none.
  const float* sinks = nullptr;
  // Entries of a second cache layer read beside the first (compressed entries: same row shape,
  // one cache head), in the same softmax: token t reads the entries [0, extra_count[t]), or,
  // with extra_list, the entries extra_list[t * extra_len + i] (-1: none) of sequence seq[t].
  const KvLayer* extra = nullptr;
  const int64_t* extra_count = nullptr;  // host memory, T entries
  const int32_t* extra_list = nullptr;   // host memory, T * extra_len entries
  int64_t extra_len = 0;
};

// One slot of a gated pooling (a compressor's windows): the slot's source row gives its values
// at kv_at and its gate logits at gate_at (D each); bias (D values) is added to the gate logits.
struct PoolSlot {
  int64_t kv_at = 0, gate_at = 0;
  const float* bias = nullptr;
};

// Hyper-connections (n residual streams per token, each n_embd values, stream-major per token).
// The maps come from each token's mixing logits mix[t] ((2 + n) * n values: pre, post, comb):
//   pre[t][i]  = sigmoid(mix_pre[i] * scale[0] + base[i]) + eps
//   post[t][i] = 2 * sigmoid(mix_post[i] * scale[1] + base[n + i])
//   comb[t]    = an n x n matrix (row j, column i at comb[t][j * n + i]) from
//                softmax over i of (mix_comb[j][i] * scale[2] + base[2n + j * n + i]) + eps,
//                then `iters` Sinkhorn steps: columns divided by their sum + eps once, then
//                (iters - 1) times rows then columns.
// With post == nullptr (the final collapse), mix[t] has n values and only pre is made, with scale[0].
struct HyperMaps {
  const float* mix = nullptr;
  int64_t ldm = 0;
  const float* base = nullptr;
  const float* scale = nullptr;
  int n = 0, iters = 0;
  float eps = 0.f;
  float* pre = nullptr;    // [T][n]
  float* post = nullptr;   // [T][n]
  float* comb = nullptr;   // [T][n * n]
};

// MoE routing results: per token, n_used expert ids (best first) and weights; grouped by expert
// for the products (counting sort, token order kept within an expert).
struct Routing {
  int32_t* ids = nullptr;       // [T][n_used]
  float* weights = nullptr;     // [T][n_used]
  int32_t* offsets = nullptr;   // [n_expert + 1]: expert e's rows in the grouped list
  int32_t* rows = nullptr;      // [T * n_used]: token of grouped row i
  int32_t* slot_of = nullptr;   // [T * n_used]: grouped row of (token, k)
};

// The working memory a backend needs for the products of one forward (quantized activations,
// gathered rows), declared by the blocks when scratch is planned: every (weight, rows) a
// product may have.
struct ProductShape {
  GgmlType type;
  int64_t k;
  int64_t rows;
  bool grouped;  // a product of a weight stack (StackProduct): its own rows, gathered or batched
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;     // the name make_backend takes: "<backend>:<variant>"
  virtual int threads() const = 0;
  // Whether weights of this type can be computed with (the others are refused by name at load).
  virtual bool supports(GgmlType t) const = 0;
  virtual std::string supported_types() const = 0;
  // Host work (loading, TP) may be interrupted by Ctrl-C inside long ops when on.
  virtual void set_interruptible(bool on) = 0;
  // fn(i) for i in [0, n) on the host, on the backend's host threads where it has them (the
  // engine's per-sequence work between forwards: sampling a batch). One caller at a time.
  virtual void host_parallel(int64_t n, const std::function<void(int64_t)>& fn) {
    for (int64_t i = 0; i < n; ++i) fn(i);
  }

  // The rows of this forward whose products must be computed as one-row products are (bit for
  // bit: BatchToken::exact), mask[t] != 0, over the forward's T rows; nullptr: none (every
  // product may take the fastest kernel for its shape). Products over another number of rows
  // (the logit rows) are then computed as one-row products. The mask stays valid until reset.
  virtual void set_exact_rows(const uint8_t* mask, int64_t T) {
    (void)mask;
    (void)T;
  }

  // -- memory ------------------------------------------------------------------------------
  virtual Buffer alloc(size_t bytes, BufferKind kind) = 0;
  // The backend's own working memory for products of these shapes; count_only: only the bytes.
  virtual uint64_t reserve_products(const std::vector<ProductShape>& shapes, int64_t max_rows,
                                    bool count_only) = 0;
  // Copies n bytes between this backend's memory and the host (either may be host memory).
  virtual void to_host(void* dst, const void* src, size_t n) = 0;
  virtual void from_host(void* dst, const void* src, size_t n) = 0;
  // Copies n bytes within this backend's memory.
  virtual void copy(void* dst, const void* src, size_t n) = 0;
  // Sets n bytes of this backend's memory to zero (where a device backend has it touched first).
  virtual void zero(void* dst, size_t n) { std::memset(dst, 0, n); }
  // Host memory that stays valid while the backend lives and that only the backend reads from
  // now on (the mapped model file, the loader's arrays): a device backend uploads it once or
  // registers it in place, and then reads weights and parameters there. The CPU backend uses it
  // as it is, but may rewrite a product's weight in it into a layout of its own (repack.h).
  virtual void adopt_host_range(const void* p, size_t bytes) {
    (void)p;
    (void)bytes;
  }
  // The weights a model's products read (a matrix as a stack of one; from adopted memory) and
  // the tables it reads row by row (embeddings), once its scratch is planned: a backend may
  // rewrite the former into a layout of its own now (the CPU's row-interleaved groups), never
  // the latter.
  virtual void prepare_products(const std::vector<WeightStack>& products, const std::vector<Weight>& tables) {
    (void)products;
    (void)tables;
  }
  // The same for a range mapped from the model file (MAP_PRIVATE): a backend that rewrites
  // weights moves new pages over it rather than writing through copy-on-write.
  virtual void adopt_mapped_range(const void* p, size_t bytes) { adopt_host_range(p, bytes); }
  // The host is about to read or write memory of this backend directly (per-step metadata in the
  // scratch, results an op left there): a device backend finishes its queued work first.
  virtual void host_access() {}
  // The engine's memory plan, before anything large is allocated: a backend with memory of its
  // own (a GPU) refuses a plan that does not fit it, naming the lines (throws). budget: the
  // engine's budget (0: none).
  virtual void check_memory(uint64_t weights, uint64_t kv, uint64_t scratch, uint64_t budget) {
    (void)weights, (void)kv, (void)scratch, (void)budget;
  }

  // -- products ----------------------------------------------------------------------------
  // Every product of the group over T input rows (x: ldx floats apart), the input read once per
  // representation the weights need, all products in one pass.
  virtual void matmul(const float* x, int64_t T, int64_t ldx, const Product* ps, size_t n) = 0;
  virtual void matmul_stack(const float* x, int64_t ldx, const Grouping& g, const StackProduct* ps, size_t n) = 0;

  // -- rows --------------------------------------------------------------------------------
  // y = x / rms(x) * w over n values, for T rows (w nullptr: unweighted; y may be x).
  virtual void rmsnorm(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t T, int64_t n,
                       float eps) = 0;
  // Rotates the first rope_dim values of every head (n_heads per row, head_stride apart, from
  // offset `at` within the head) of T rows by each row's angles (cs + t * ldcs: cos, sin pairs),
  // adjacent pairs or NeoX halves; inverse: the opposite rotation.
  virtual void rope(float* v, int64_t T, int64_t ldv, int n_heads, int64_t head_stride, int64_t at,
                    const float* cs, int64_t ldcs, int rope_dim, bool neox, bool inverse = false) = 0;
  // g = silu(g) * u over n values of T rows; split in (0, n): the two parts apart (as TP ranks do).
  // limit > 0 (clamped SwiGLU): g = min(g, limit) and u = clamp(u, -limit, limit) first.
  virtual void silu_mul(float* g, int64_t ldg, const float* u, int64_t ldu, int64_t T, int64_t n,
                        int64_t split = 0, float limit = 0.f) = 0;
  // y += x over n values (y, x contiguous).
  virtual void add(float* y, const float* x, int64_t n) = 0;
  // y[t] += b over n values of T rows.
  virtual void add_bias(float* y, int64_t ldy, const float* b, int64_t T, int64_t n) = 0;
  // y[t] += s[t] * x[t] (sigmoid(s[t]) when `sigmoid`) over n values of T rows.
  virtual void add_scaled(float* y, int64_t ldy, const float* x, int64_t ldx, const float* s, int64_t T, int64_t n,
                          bool sigmoid) = 0;
  // dst[t] = src[t] over n values of T rows; fill: dst[t][i] = v.
  virtual void copy_rows(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t T, int64_t n) = 0;
  virtual void fill(float* dst, int64_t n, float v) = 0;
  // out[t] = row tokens[t] of the table (dequantized), T rows of table.k values.
  virtual void embed(const Weight& table, const int32_t* tokens, int64_t T, float* out, int64_t ldo) = 0;

  // -- cache and attention -----------------------------------------------------------------
  // Row i of src (n values) into the cache row dst[i] (a pointer into a pool of this backend).
  virtual void store_rows(const float* src, int64_t lds, int64_t n, void* const* dst, int64_t count, KvType t) = 0;
  virtual void attention(const AttentionBatch& a, const KvLayer& kv) = 0;
  // Softmax-gated pooling (a compressor): entry e = per channel c < D, over the slots s whose row
  // rows[e * n_slots + s] is not null (a cache row of type t): sum_s softmax_s(row_s[gate_at + c] +
  // bias_s[c]) * row_s[kv_at + c]; written at out + e * ldo.
  virtual void gated_pool(const void* const* rows, const PoolSlot* slots, int n_slots, int64_t count, int64_t D,
                          KvType t, float* out, int64_t ldo) = 0;
  // Lightning indexer: token t scores the entries s < count[t] of sequence seq[t] in a cache layer
  // (one head of D values per entry) as sum_h w[t][h] * relu(q[t][h] . k_s) (q: n_heads heads of D
  // values, ldq apart; w: ldw apart) and writes its k best entries, best first, to idx[t * k ..]
  // (-1 where fewer than k). Ties keep the lower entry first.
  virtual void index_topk(const float* q, int64_t ldq, int n_heads, int64_t D, const float* w, int64_t ldw,
                          const KvLayer& kv, const int32_t* seq, const int64_t* count, int64_t T, int k,
                          int32_t* idx) = 0;

  // -- hyper-connections -------------------------------------------------------------------
  virtual void hyper_maps(const HyperMaps& m, int64_t T) = 0;
  // out[t] = sum_i pre[t][i] * streams[t][i] (n streams of E values).
  virtual void hyper_collapse(const float* streams, const float* pre, int n, int64_t E, int64_t T, float* out,
                              int64_t ldo) = 0;
  // streams[t][i] = post[t][i] * block_out[t] + sum_j comb[t][j * n + i] * streams[t][j].
  virtual void hyper_expand(float* streams, const float* block_out, int64_t ldb, const float* post,
                            const float* comb, int n, int64_t E, int64_t T) = 0;

  // -- mixture of experts ------------------------------------------------------------------
  // Routes T tokens from their router logits and groups the (token, k) pairs by expert.
  // fixed (hash routing): [T][n_used] expert ids chosen by a table; only their weights come
  // from the logits.
  virtual void route(const moe::RouterConfig& cfg, const float* logits, int64_t T, const Routing& r,
                     const int32_t* fixed = nullptr) = 0;
  // out[t] += sum over k with expert in [lo, hi) of weight[t][k] * expert_out[slot_of[t][k]].
  virtual void combine(float* out, int64_t ldo, const float* expert_out, int64_t lde, int64_t T, int64_t n,
                       const Routing& r, int n_used, int lo, int hi) = 0;
};

struct BackendOptions {
  std::string name = "cpu";  // "cpu", "cuda", "auto"
  int threads = 0;           // CPU threads (0: the CPUs this process may use)
  std::string variant;       // the backend's own variant (also "name:variant"); "": its default
};

// The backend named by the options; throws naming the available ones.
std::unique_ptr<Backend> make_backend(const BackendOptions& opts);
// Backends usable on this machine and build, as "name:variant" (every CPU instruction set, a GPU)
// (each entry a name[:isa] make_backend accepts): what the op tests run over.
std::vector<std::string> available_backends();

}  // namespace tf
