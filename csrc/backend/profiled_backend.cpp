#include "backend/profiled_backend.h"

#include <algorithm>
#include <chrono>
#include <mutex>

#include "quant/traits.h"

namespace tf {

namespace {

std::mutex g_mu;
std::map<std::string, OpCost> g_profile;

void record(const std::string& key, double seconds, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(g_mu);
  OpCost& c = g_profile[key];
  ++c.calls;
  c.seconds += seconds;
  c.weight_bytes += bytes;
}

std::string product_key(const char* op, GgmlType t, int64_t rows) {
  const TypeTraits* tr = find_type_traits(uint32_t(t));
  // The CPU kernels' shape classes (backend/cpu/kernel_choice.h): up to 4 activation rows decode.
  return std::string(op) + " " + (tr ? tr->name : "?") + (rows <= 4 ? " decode" : " prefill");
}

// Times one call of the wrapped backend's op and records it under `key`.
class Timer {
 public:
  Timer(std::string key, uint64_t bytes = 0) : key_(std::move(key)), bytes_(bytes), t0_(Clock::now()) {}
  ~Timer() { record(key_, std::chrono::duration<double>(Clock::now() - t0_).count(), bytes_); }

 private:
  using Clock = std::chrono::steady_clock;
  std::string key_;
  uint64_t bytes_;
  Clock::time_point t0_;
};

class ProfiledBackend final : public Backend {
 public:
  explicit ProfiledBackend(std::unique_ptr<Backend> inner) : b_(std::move(inner)) {}

  std::string name() const override { return b_->name(); }
  int threads() const override { return b_->threads(); }
  bool supports(GgmlType t) const override { return b_->supports(t); }
  std::string supported_types() const override { return b_->supported_types(); }
  void set_interruptible(bool on) override { b_->set_interruptible(on); }
  void host_parallel(int64_t n, const std::function<void(int64_t)>& fn) override {
    Timer t("host_parallel");
    b_->host_parallel(n, fn);
  }
  Buffer alloc(size_t bytes, BufferKind kind) override { return b_->alloc(bytes, kind); }
  uint64_t reserve_products(const std::vector<ProductShape>& shapes, int64_t max_rows, bool count_only) override {
    return b_->reserve_products(shapes, max_rows, count_only);
  }
  void to_host(void* dst, const void* src, size_t n) override { b_->to_host(dst, src, n); }
  void from_host(void* dst, const void* src, size_t n) override { b_->from_host(dst, src, n); }
  void copy(void* dst, const void* src, size_t n) override { b_->copy(dst, src, n); }
  void zero(void* dst, size_t n) override { b_->zero(dst, n); }
  void adopt_host_range(const void* p, size_t bytes) override { b_->adopt_host_range(p, bytes); }
  void adopt_mapped_range(const void* p, size_t bytes) override { b_->adopt_mapped_range(p, bytes); }
  void prepare_products(const std::vector<WeightStack>& products, const std::vector<Weight>& tables) override {
    b_->prepare_products(products, tables);
  }
  void host_access() override { b_->host_access(); }
  void check_memory(uint64_t weights, uint64_t kv, uint64_t scratch, uint64_t budget) override {
    b_->check_memory(weights, kv, scratch, budget);
  }

  void matmul(const float* x, int64_t T, int64_t ldx, const Product* ps, size_t n) override {
    // A group of products shares one pass: keyed by its first weight, every weight's bytes counted.
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; ++i) bytes += uint64_t(ps[i].w->rows) * ps[i].w->row_stride;
    Timer t(n ? product_key("matmul", ps[0].w->type, T) : "matmul", bytes);
    b_->matmul(x, T, ldx, ps, n);
  }
  void matmul_stack(const float* x, int64_t ldx, const Grouping& g, const StackProduct* ps, size_t n) override {
    int64_t used = 0, max_rows = 0;
    for (int64_t e = g.first; e < g.last; ++e) {
      const int64_t r = g.offsets ? int64_t(g.offsets[e + 1] - g.offsets[e]) : g.rows;
      used += r > 0;
      max_rows = std::max(max_rows, r);
    }
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; ++i) bytes += uint64_t(used) * uint64_t(ps[i].w->first.rows) * ps[i].w->first.row_stride;
    Timer t(n ? product_key("matmul_stack", ps[0].w->first.type, max_rows) : "matmul_stack", bytes);
    b_->matmul_stack(x, ldx, g, ps, n);
  }
  void rmsnorm(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t T, int64_t n,
               float eps) override {
    Timer t("rmsnorm");
    b_->rmsnorm(x, ldx, w, y, ldy, T, n, eps);
  }
  void rope(float* v, int64_t T, int64_t ldv, int n_heads, int64_t head_stride, int64_t at, const float* cs,
            int64_t ldcs, int rope_dim, bool neox, bool inverse) override {
    Timer t("rope");
    b_->rope(v, T, ldv, n_heads, head_stride, at, cs, ldcs, rope_dim, neox, inverse);
  }
  void silu_mul(float* g, int64_t ldg, const float* u, int64_t ldu, int64_t T, int64_t n, int64_t split,
                float limit) override {
    Timer t("silu_mul");
    b_->silu_mul(g, ldg, u, ldu, T, n, split, limit);
  }
  void add(float* y, const float* x, int64_t n) override {
    Timer t("add");
    b_->add(y, x, n);
  }
  void add_bias(float* y, int64_t ldy, const float* b, int64_t T, int64_t n) override {
    Timer t("add_bias");
    b_->add_bias(y, ldy, b, T, n);
  }
  void add_scaled(float* y, int64_t ldy, const float* x, int64_t ldx, const float* s, int64_t T, int64_t n,
                  bool sigmoid) override {
    Timer t("add_scaled");
    b_->add_scaled(y, ldy, x, ldx, s, T, n, sigmoid);
  }
  void copy_rows(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t T, int64_t n) override {
    Timer t("copy_rows");
    b_->copy_rows(dst, ldd, src, lds, T, n);
  }
  void fill(float* dst, int64_t n, float v) override {
    Timer t("fill");
    b_->fill(dst, n, v);
  }
  void embed(const Weight& table, const int32_t* tokens, int64_t T, float* out, int64_t ldo) override {
    Timer t("embed");
    b_->embed(table, tokens, T, out, ldo);
  }
  void store_rows(const float* src, int64_t lds, int64_t n, void* const* dst, int64_t count, KvType kt) override {
    Timer t("store_rows");
    b_->store_rows(src, lds, n, dst, count, kt);
  }
  void attention(const AttentionBatch& a, const KvLayer& kv) override {
    Timer t(a.T <= 4 ? "attention decode" : "attention prefill");
    b_->attention(a, kv);
  }
  void gated_pool(const void* const* rows, const PoolSlot* slots, int n_slots, int64_t count, int64_t D, KvType kt,
                  float* out, int64_t ldo) override {
    Timer t("gated_pool");
    b_->gated_pool(rows, slots, n_slots, count, D, kt, out, ldo);
  }
  void index_topk(const float* q, int64_t ldq, int n_heads, int64_t D, const float* w, int64_t ldw,
                  const KvLayer& kv, const int32_t* seq, const int64_t* count, int64_t T, int k,
                  int32_t* idx) override {
    Timer t("index_topk");
    b_->index_topk(q, ldq, n_heads, D, w, ldw, kv, seq, count, T, k, idx);
  }
  void hyper_maps(const HyperMaps& m, int64_t T) override {
    Timer t("hyper_maps");
    b_->hyper_maps(m, T);
  }
  void hyper_collapse(const float* streams, const float* pre, int n, int64_t E, int64_t T, float* out,
                      int64_t ldo) override {
    Timer t("hyper_collapse");
    b_->hyper_collapse(streams, pre, n, E, T, out, ldo);
  }
  void hyper_expand(float* streams, const float* block_out, int64_t ldb, const float* post, const float* comb,
                    int n, int64_t E, int64_t T) override {
    Timer t("hyper_expand");
    b_->hyper_expand(streams, block_out, ldb, post, comb, n, E, T);
  }
  void route(const moe::RouterConfig& cfg, const float* logits, int64_t T, const Routing& r,
             const int32_t* fixed) override {
    Timer t("route");
    b_->route(cfg, logits, T, r, fixed);
  }
  void combine(float* out, int64_t ldo, const float* expert_out, int64_t lde, int64_t T, int64_t n,
               const Routing& r, int n_used, int lo, int hi) override {
    Timer t("combine");
    b_->combine(out, ldo, expert_out, lde, T, n, r, n_used, lo, hi);
  }

 private:
  std::unique_ptr<Backend> b_;
};

}  // namespace

std::map<std::string, OpCost> op_profile() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_profile;
}

void reset_op_profile() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_profile.clear();
}

std::unique_ptr<Backend> make_profiled_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<ProfiledBackend>(std::move(inner));
}

}  // namespace tf
