// The CUDA backend: every op of the seam (backend/backend.h) on one CUDA stream of device 0.
//
// Memory. alloc() hands out managed memory (the model writes per-step metadata - token ids,
// positions, rotary angles - into its scratch from the host, and reads routing logits back), with
// the device as preferred location on a discrete GPU, so activations and the KV pool stay in
// device memory once touched there. Weights: the model hands the backend its mapped file and the
// loader's own arrays (adopt_host_range); a discrete device gets one upload of each, an integrated
// device (cudaDevAttrIntegrated) registers the mapping and reads it in place. Any other host
// pointer an op is given (the engine's logits, the op tests' numpy arrays) is staged through the
// backend's workspace for that call only.
//
// Products: activations quantized to int8 per 32 values on the device, one kernel per product
// (mm_*.cu: decode of a weight chunk once per tile of activation rows, __dp4a); F16 / BF16 in
// float. Formats without a kernel are refused by name at load (supports()).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/device_plan.h"
#include "backend/cuda/grouping.h"
#include "backend/cuda/host_emulation.h"
#include "core/error.h"
#include "kv/kv_cache.h"
#include "kv/kv_pool.h"
#include "moe/router.h"
#include "quant/tables/iq_tables.h"
#include "quant/traits.h"

namespace tf {
namespace cuda {

namespace {

// -- RAII device memory (move-only) ---------------------------------------------------------
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) { check(cudaMalloc(&p_, n ? n : 1), "cudaMalloc"); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = o.p_, n_ = o.n_;
      o.p_ = nullptr, o.n_ = 0;
    }
    return *this;
  }
  ~DeviceBuffer() { reset(); }
  void reset() {
    if (p_) cudaFree(p_);
    p_ = nullptr, n_ = 0;
  }
  void* get() const { return p_; }
  size_t size() const { return n_; }
  // Grows (contents dropped) to at least n bytes.
  void ensure(size_t n) {
    if (n <= n_) return;
    reset();
    *this = DeviceBuffer(n + n / 4);
  }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// The memory this backend handed out (managed or pinned), so an op tells device-usable pointers
// from host ones without asking the driver each time; entries leave when freed.
std::mutex g_ranges_mu;
std::map<const uint8_t*, size_t> g_ranges;

void add_range(const void* p, size_t n) {
  std::lock_guard<std::mutex> lock(g_ranges_mu);
  g_ranges[static_cast<const uint8_t*>(p)] = std::max<size_t>(n, 1);
}
bool in_ranges(const void* p) {
  const auto* b = static_cast<const uint8_t*>(p);
  std::lock_guard<std::mutex> lock(g_ranges_mu);
  auto it = g_ranges.upper_bound(b);
  if (it == g_ranges.begin()) return false;
  --it;
  return b < it->first + it->second;
}
void free_managed(void* p, size_t) {
  {
    std::lock_guard<std::mutex> lock(g_ranges_mu);
    g_ranges.erase(static_cast<const uint8_t*>(p));
  }
  cudaFree(p);
}
void free_pinned(void* p, size_t) {
  {
    std::lock_guard<std::mutex> lock(g_ranges_mu);
    g_ranges.erase(static_cast<const uint8_t*>(p));
  }
  cudaFreeHost(p);
}

size_t align256(size_t n) { return (n + 255) & ~size_t(255); }

DeviceInfo query_device(int dev) {
  DeviceInfo d;
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, dev), "cudaGetDeviceProperties");
  d.name = p.name;
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  d.sm_count = p.multiProcessorCount;
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrIntegrated, dev) == cudaSuccess) d.integrated = v != 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrPageableMemoryAccess, dev) == cudaSuccess) d.pageable_access = v != 0;
  int clk = 0, bus = 0;
  if (cudaDeviceGetAttribute(&clk, cudaDevAttrMemoryClockRate, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, dev) == cudaSuccess)
    d.bandwidth_gbs = 2.0 * double(clk) * 1e3 * double(bus) / 8.0 / 1e9;  // double data rate
  size_t free_b = 0, total_b = 0;
  if (cudaSetDevice(dev) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
    d.total_bytes = total_b;
    d.free_bytes = free_b;
  } else {
    cudaGetLastError();
    d.total_bytes = p.totalGlobalMem;
    d.free_bytes = p.totalGlobalMem;
  }
  return d;
}

// A host range the backend was told stays valid and unchanged (the mapped weights, the loader's
// arrays), and its device address.
struct Adopted {
  const uint8_t* host = nullptr;
  size_t bytes = 0;
  const uint8_t* dev = nullptr;
  DeviceBuffer copy;        // discrete: the uploaded copy
  bool registered = false;  // integrated: cudaHostRegister'ed in place
};

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    check(cudaSetDevice(dev_), "cudaSetDevice");
    info_ = query_device(dev_);
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    upload_tables();
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    for (auto& [k, a] : adopted_)
      if (a.registered) cudaHostUnregister(const_cast<uint8_t*>(a.host));
    adopted_.clear();
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }
  int threads() const override { return 1; }
  bool supports(GgmlType t) const override { return has_kernel(uint32_t(t)); }
  std::string supported_types() const override { return kernel_type_names(); }
  void set_interruptible(bool) override {}

  // -- memory ------------------------------------------------------------------------------
  Buffer alloc(size_t bytes, BufferKind kind) override {
    void* p = nullptr;
    if (kind == BufferKind::Host) {
      if (cudaMallocHost(&p, std::max<size_t>(bytes, 1)) != cudaSuccess) {
        cudaGetLastError();
        return Buffer();
      }
      add_range(p, bytes);
      return Buffer(p, bytes, BufferKind::Host, free_pinned);
    }
    if (cudaMallocManaged(&p, std::max<size_t>(bytes, 1), cudaMemAttachGlobal) != cudaSuccess) {
      cudaGetLastError();
      return Buffer();
    }
    if (!info_.integrated) {
      // Discrete GPU: activations and the KV pool (Device) live in device memory, the host
      // reaching them by migration only when it must; buffers the host touches every step
      // (Unified: metadata, router logits) stay in host memory, read by the device over the bus.
      const bool on_device = kind == BufferKind::Device;
#if CUDART_VERSION >= 13000
      cudaMemLocation dev{}, host{};
      dev.type = cudaMemLocationTypeDevice;
      dev.id = dev_;
      host.type = cudaMemLocationTypeHost;
      host.id = 0;
      cudaMemAdvise(p, bytes, cudaMemAdviseSetPreferredLocation, on_device ? dev : host);
      cudaMemAdvise(p, bytes, cudaMemAdviseSetAccessedBy, on_device ? host : dev);
#else
      cudaMemAdvise(p, bytes, cudaMemAdviseSetPreferredLocation, on_device ? dev_ : cudaCpuDeviceId);
      cudaMemAdvise(p, bytes, cudaMemAdviseSetAccessedBy, on_device ? cudaCpuDeviceId : dev_);
#endif
      cudaGetLastError();  // advice is best effort
    }
    add_range(p, bytes);
    return Buffer(p, bytes, BufferKind::Unified, free_managed);
  }

  uint64_t reserve_products(const std::vector<ProductShape>& shapes, int64_t max_rows, bool count_only) override {
    size_t q8 = 0, packed = 0;
    for (const ProductShape& s : shapes) {
      if (s.rows <= 0 || s.k <= 0) continue;
      const int64_t rows = std::max(s.rows, max_rows);
      q8 = std::max(q8, align256(size_t(rows) * size_t(s.k)) + align256(size_t(rows) * size_t(s.k / 32) * 4));
      if (s.grouped) packed = std::max(packed, align256(size_t(rows) * size_t(s.k) * 4));
    }
    const uint64_t bytes = q8 + packed + kParamBytes;
    if (!count_only) {
      q8_.ensure(q8);
      packed_.ensure(packed);
      params_.ensure(kParamBytes);
    }
    return bytes;
  }

  void to_host(void* dst, const void* src, size_t n) override {
    if (n == 0 || dst == src) return;
    check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
    sync();
  }
  void from_host(void* dst, const void* src, size_t n) override {
    if (n == 0 || dst == src) return;
    check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
    sync();
  }
  void copy(void* dst, const void* src, size_t n) override {
    if (n == 0 || dst == src) return;
    check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
  }

  void host_access() override { sync(); }

  void zero(void* dst, size_t n) override {
    if (n == 0) return;
    if (!device_ok(dst)) return (void)std::memset(dst, 0, n);
    check(cudaMemsetAsync(dst, 0, n, stream_), "cudaMemsetAsync");
    sync();
  }

  void adopt_host_range(const void* p, size_t bytes) override {
    if (!p || bytes == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    const auto* h = static_cast<const uint8_t*>(p);
    if (find_adopted(h, bytes)) return;
    Adopted a;
    a.host = h;
    a.bytes = bytes;
    if (info_.integrated && bytes >= kRegisterMin) {
      // In place: the mapping registered read-only (pages stay the file's page cache). Small
      // arrays are copied instead (their pages may be shared with other allocations).
      cudaError_t e = cudaHostRegister(const_cast<uint8_t*>(h), bytes, cudaHostRegisterMapped | cudaHostRegisterReadOnly);
      if (e != cudaSuccess) {
        cudaGetLastError();
        e = cudaHostRegister(const_cast<uint8_t*>(h), bytes, cudaHostRegisterMapped);
      }
      if (e == cudaSuccess) {
        void* dp = nullptr;
        check(cudaHostGetDevicePointer(&dp, const_cast<uint8_t*>(h), 0), "cudaHostGetDevicePointer");
        a.dev = static_cast<const uint8_t*>(dp);
        a.registered = true;
      } else {
        cudaGetLastError();
        // Not registrable: a device that reads pageable memory (ATS / HMM) uses it as it is; a copy
        // would count the weights twice in the one pool, so anything else is refused.
        if (!info_.pageable_access)
          fail(ErrorKind::Unsupported, "CUDA backend: cannot register the mapped weights with the integrated GPU (",
               cudaGetErrorString(e), ") and it cannot read pageable memory; copying them would double their "
               "share of the shared memory");
        a.dev = h;
      }
    }
    if (!a.dev) {
      a.copy = DeviceBuffer(bytes);
      // in pieces, so a huge mapping is read sequentially
      constexpr size_t kPiece = size_t(64) << 20;
      for (size_t off = 0; off < bytes; off += kPiece)
        check(cudaMemcpy(static_cast<uint8_t*>(a.copy.get()) + off, h + off, std::min(kPiece, bytes - off),
                         cudaMemcpyHostToDevice),
              "weight upload");
      a.dev = static_cast<const uint8_t*>(a.copy.get());
      uploaded_ += bytes;
    }
    adopted_.emplace(h, std::move(a));
  }

  void check_memory(uint64_t weights, uint64_t kv, uint64_t scratch, uint64_t budget) override {
    DeviceNeed n;
    n.weights = weights;
    n.kv = kv;
    n.scratch = scratch;
    n.workspace = kParamBytes + kStageReserve;
    n.budget = budget;
    const DevicePlan p = plan_device(info_, n);
    if (!p.fits())
      fail(ErrorKind::OutOfMemory, "the CUDA memory plan exceeds the device (", info_.name,
           "); lower kv_tokens, context or max_batch_tokens:\n", p.table());
  }

  // -- products ----------------------------------------------------------------------------
  void matmul(const float* x, int64_t T, int64_t ldx, const Product* ps, size_t n) override {
    if (n == 0 || T == 0) return;
    Op op(*this);
    const int64_t k = ps[0].w->k;
    bool any_q8 = false;
    for (size_t i = 0; i < n; ++i) {
      TF_CHECK(ps[i].w->k == k, "matmul: the products of a group take the same input");
      any_q8 |= !cudafmt::is_float_format(uint32_t(ps[i].w->type));
    }
    const float* xd = op.in(x, T, ldx, k);
    int8_t* q = nullptr;
    float* qd = nullptr;
    if (any_q8) {
      TF_CHECK(k % 32 == 0, "matmul: rows of ", k, " values (int8 formats need a multiple of 32)");
      act_q8(T, k, q, qd);
      k::quantize_q8(xd, ldx, nullptr, T, k, q, qd, stream_);
    }
    for (size_t i = 0; i < n; ++i) {
      const Weight& w = *ps[i].w;
      k::MmArgs a;
      a.type = uint32_t(w.type);
      if (w.rows == 0) continue;
      a.w = weight_ptr(w.data, w.row_stride * size_t(w.rows - 1) + row_bytes(w.type, w.k));
      a.row_stride = w.row_stride;
      a.rows = w.rows;
      a.k = k;
      a.xq = q;
      a.xd = qd;
      a.xf = xd;
      a.ldxf = ldx;
      a.n_rows = T;
      a.y = op.out(ps[i].y, T, ps[i].ldy, w.rows);
      a.ldy = ps[i].ldy;
      a.tile = T == 1 ? 1 : k::kTile;
      k::matmul(a, tables_, stream_);
    }
  }

  void matmul_stack(const float* x, int64_t ldx, const Grouping& g, const StackProduct* ps, size_t n) override {
    if (n == 0 || g.last <= g.first) return;
    Op op(*this);
    const int64_t k = ps[0].w->first.k;
    bool any_q8 = false, any_float = false;
    for (size_t i = 0; i < n; ++i) {
      TF_CHECK(ps[i].w->first.k == k, "matmul_stack: the products take the same input");
      const bool f = cudafmt::is_float_format(uint32_t(ps[i].w->first.type));
      any_q8 |= !f;
      any_float |= f;
    }
    // Packed activation rows, their outputs and the kernels' tiles (grouping.h).
    const int64_t M = g.last - g.first;
    plan_ = plan_groups(g, ldx, k::kTile);
    if (plan_.size() == 0) return;
    const int64_t max_src = plan_.src_rows;
    const int64_t N = plan_.size();
    const float* xd = op.in(x, max_src, ldx, g.offsets ? k : ldx);
    const int64_t* d_src = op.param(plan_.src_off.data(), plan_.src_off.size());
    const k::MmItem* d_items = op.param(plan_.items.data(), plan_.items.size());
    int8_t* q = nullptr;
    float* qd = nullptr;
    if (any_q8) {
      TF_CHECK(k % 32 == 0, "matmul_stack: rows of ", k, " values (int8 formats need a multiple of 32)");
      act_q8(N, k, q, qd);
      k::quantize_q8(xd, ldx, d_src, N, k, q, qd, stream_);
    }
    float* xf = nullptr;
    if (any_float) {
      packed_.ensure(size_t(N) * size_t(k) * 4);
      xf = static_cast<float*>(packed_.get());
      k::gather_rows(xd, ldx, d_src, N, k, xf, stream_);
    }
    for (size_t i = 0; i < n; ++i) {
      const WeightStack& s = *ps[i].w;
      const Weight& w = s.first;
      if (w.rows == 0) continue;
      output_offsets(plan_, ps[i].ldy, y_off_);
      int64_t max_out = 0;
      for (const int64_t o : y_off_) max_out = std::max(max_out, o + w.rows);
      k::MmArgs a;
      a.type = uint32_t(w.type);
      a.w = weight_ptr(w.data, s.stride * size_t(M - 1) + w.row_stride * size_t(w.rows - 1) + row_bytes(w.type, w.k));
      a.row_stride = w.row_stride;
      a.mat_stride = s.stride;
      a.rows = w.rows;
      a.k = k;
      a.xq = q;
      a.xd = qd;
      a.xf = xf;
      a.ldxf = k;
      a.n_rows = N;
      a.y = op.out_flat(ps[i].y, size_t(max_out));
      a.y_off = op.param(y_off_.data(), y_off_.size());
      a.items = d_items;
      a.n_items = int64_t(plan_.items.size());
      a.tile = k::kTile;
      k::matmul(a, tables_, stream_);
    }
  }

  // -- rows --------------------------------------------------------------------------------
  void rmsnorm(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t T, int64_t n,
               float eps) override {
    if (T == 0) return;
    Op op(*this);
    const float* xd = op.in(x, T, ldx, n);
    const float* wd = w ? op.in(w, 1, n, n) : nullptr;
    float* yd = op.inout(y, T, ldy, n, x == y ? xd : nullptr);
    k::rmsnorm(xd, ldx, wd, yd, ldy, T, n, eps, stream_);
  }

  void rope(float* v, int64_t T, int64_t ldv, int n_heads, int64_t head_stride, int64_t at, const float* cs,
            int64_t ldcs, int rope_dim, bool neox, bool inverse) override {
    if (T == 0) return;
    Op op(*this);
    float* vd = op.inout(v, T, ldv, int64_t(n_heads - 1) * head_stride + at + rope_dim);
    const float* csd = op.in(cs, T, ldcs, rope_dim);
    k::rope(vd, T, ldv, n_heads, head_stride, at, csd, ldcs, rope_dim, neox, inverse, stream_);
  }

  void silu_mul(float* g, int64_t ldg, const float* u, int64_t ldu, int64_t T, int64_t n, int64_t split,
                float limit) override {
    if (T == 0) return;
    Op op(*this);
    float* gd = op.inout(g, T, ldg, n);
    const float* ud = op.in(u, T, ldu, n);
    k::silu_mul(gd, ldg, ud, ldu, T, n, split, limit, stream_);
  }

  void add(float* y, const float* x, int64_t n) override {
    Op op(*this);
    float* yd = op.inout(y, 1, n, n);
    k::add(yd, op.in(x, 1, n, n), n, stream_);
  }

  void add_bias(float* y, int64_t ldy, const float* b, int64_t T, int64_t n) override {
    Op op(*this);
    float* yd = op.inout(y, T, ldy, n);
    k::add_bias(yd, ldy, op.in(b, 1, n, n), T, n, stream_);
  }

  void add_scaled(float* y, int64_t ldy, const float* x, int64_t ldx, const float* s, int64_t T, int64_t n,
                  bool sigmoid) override {
    Op op(*this);
    float* yd = op.inout(y, T, ldy, n);
    k::add_scaled(yd, ldy, op.in(x, T, ldx, n), ldx, op.in(s, 1, T, T), T, n, sigmoid, stream_);
  }

  void copy_rows(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t T, int64_t n) override {
    Op op(*this);
    float* dd = op.inout(dst, T, ldd, n);
    k::copy_rows(dd, ldd, op.in(src, T, lds, n), lds, T, n, stream_);
  }

  void fill(float* dst, int64_t n, float v) override {
    Op op(*this);
    k::fill(op.out(dst, 1, n, n), n, v, stream_);
  }

  void embed(const Weight& table, const int32_t* tokens, int64_t T, float* out, int64_t ldo) override {
    if (T == 0) return;
    const uint32_t type = uint32_t(table.type);
    const size_t tb = row_bytes(table.type, table.k);
    if (has_kernel(type) || type == 0) {
      // The rows read: up to the largest id (a TP rank's table holds only the batch's rows).
      // Token ids are host-visible memory (scratch metadata, or the caller's array).
      int32_t max_id = 0;
      for (int64_t t = 0; t < T; ++t) max_id = std::max(max_id, tokens[t]);
      Op op(*this);
      const uint8_t* dt = weight_ptr(table.data, table.row_stride * size_t(max_id) + tb);
      const int32_t* ids = op.in_raw(tokens, size_t(T));
      k::embed(type, dt, table.row_stride, table.k, ids, T, op.out(out, T, ldo, table.k), ldo, tables_, stream_);
      return;
    }
    {
      // A table type without a kernel (or not adopted): its rows dequantized on the host by the
      // reference, then uploaded - a lookup, not a product.
      const TypeTraits* tr = find_type_traits(type);
      TF_CHECK(tr && tr->dequantize_ref, "embed: no dequantization for the table's type");
      sync();
      host_rows_.resize(size_t(T) * size_t(table.k));
      for (int64_t t = 0; t < T; ++t)
        tr->dequantize_ref(table.data + size_t(tokens[t]) * table.row_stride, host_rows_.data() + t * table.k, table.k);
      Op op(*this);
      float* od = op.out(out, T, ldo, table.k);
      check(cudaMemcpy2DAsync(od, size_t(ldo) * 4, host_rows_.data(), size_t(table.k) * 4, size_t(table.k) * 4,
                              size_t(T), cudaMemcpyDefault, stream_),
            "embed upload");
    }
  }

  // -- cache and attention -----------------------------------------------------------------
  void store_rows(const float* src, int64_t lds, int64_t n, void* const* dst, int64_t count, KvType t) override {
    if (count == 0) return;
    Op op(*this);
    const float* sd = op.in(src, count, lds, n);
    void* const* dd = op.param(dst, size_t(count));
    k::store_rows(sd, lds, n, dd, count, t == KvType::F16, stream_);
  }

  void attention(const AttentionBatch& a, const KvLayer& kv) override {
    if (a.T == 0) return;
    if (a.extra)
      fail(ErrorKind::Unsupported, "CUDA backend: attention over a second cache layer (compressed / sparse "
           "attention of DeepSeek-V4) has no CUDA kernel yet; use backend='cpu'");
    Op op(*this);
    const KvPool& pool = *kv.pool;
    const KvSpec& spec = pool.spec();
    TF_CHECK(a.n_cache_heads == spec.n_heads, "attention: the batch's cache heads differ from the layer's");
    // The batch's block tables, one row per distinct sequence.
    tab_seq_.clear();
    tab_of_.assign(size_t(a.T), 0);
    begin_.resize(size_t(a.T));
    end_.resize(size_t(a.T));
    int max_blocks = 1;
    for (int64_t t = 0; t < a.T; ++t) {
      const int32_t s = a.seq[t];
      auto it = std::find(tab_seq_.begin(), tab_seq_.end(), s);
      if (it == tab_seq_.end()) {
        tab_seq_.push_back(s);
        it = tab_seq_.end() - 1;
        max_blocks = std::max<int>(max_blocks, int(pool.block_table(s).size()));
      }
      tab_of_[size_t(t)] = int32_t(it - tab_seq_.begin());
      end_[size_t(t)] = a.end[t];
      begin_[size_t(t)] = a.window > 0 ? std::max<int64_t>(0, a.end[t] - a.window) : 0;
      TF_CHECK((a.end[t] + pool.block_size() - 1) / pool.block_size() <= int64_t(pool.block_table(s).size()),
               "attention: token ", t, " reads past its sequence's blocks");
    }
    tables_host_.assign(tab_seq_.size() * size_t(max_blocks), -1);
    for (size_t i = 0; i < tab_seq_.size(); ++i) {
      const auto& tb = pool.block_table(tab_seq_[i]);
      std::copy(tb.begin(), tb.end(), tables_host_.begin() + i * size_t(max_blocks));
    }
    k::AttnArgs x;
    x.q = op.in(a.q, a.T, a.q_stride, int64_t(a.n_cache_heads) * a.group * a.head_dim);
    x.q_stride = a.q_stride;
    x.out = op.out(a.out, a.T, a.out_stride, int64_t(a.n_cache_heads) * a.group * a.v_dim);
    x.out_stride = a.out_stride;
    x.T = a.T;
    x.tables = op.param(tables_host_.data(), tables_host_.size());
    x.tab_of = op.param(tab_of_.data(), tab_of_.size());
    x.begin = op.param(begin_.data(), begin_.size());
    x.end = op.param(end_.data(), end_.size());
    x.max_blocks = max_blocks;
    x.base = pool.k_block(0, 0, 0);
    x.half = pool.type() == KvType::F16;
    x.layer = kv.layer;
    x.n_blocks = pool.n_blocks();
    x.page_stride = int64_t(pool.page_stride());
    x.block_size = pool.block_size();
    x.n_cache_heads = a.n_cache_heads;
    x.group = a.group;
    x.head_dim = a.head_dim;
    x.v_dim = a.v_dim;
    x.k_dim = spec.k_dim;
    x.spec_v_dim = spec.v_dim;
    x.scale = a.scale;
    x.sinks = a.sinks ? op.in(a.sinks, 1, 0, int64_t(a.n_cache_heads) * a.group) : nullptr;
    TF_CHECK(a.head_dim <= spec.k_dim, "attention: query heads wider than the cache rows");
    k::attention(x, stream_);
  }

  void gated_pool(const void* const*, const PoolSlot*, int, int64_t, int64_t, KvType, float*, int64_t) override {
    unsupported("gated_pool (the compressor of DeepSeek-V4 attention)");
  }
  void index_topk(const float*, int64_t, int, int64_t, const float*, int64_t, const KvLayer&, const int32_t*,
                  const int64_t*, int64_t, int, int32_t*) override {
    unsupported("index_topk (the lightning indexer of DeepSeek-V4)");
  }

  // -- hyper-connections -------------------------------------------------------------------
  void hyper_maps(const HyperMaps&, int64_t) override { unsupported("hyper_maps (DeepSeek-V4 hyper-connections)"); }
  void hyper_collapse(const float* streams, const float* pre, int n, int64_t E, int64_t T, float* out,
                      int64_t ldo) override {
    Op op(*this);
    const float* sd = op.in(streams, T, int64_t(n) * E, int64_t(n) * E);
    const float* pd = op.in(pre, T, n, n);
    k::hyper_collapse(sd, pd, n, E, T, op.out(out, T, ldo, E), ldo, stream_);
  }
  void hyper_expand(float* streams, const float* block_out, int64_t ldb, const float* post, const float* comb, int n,
                    int64_t E, int64_t T) override {
    TF_CHECK(n >= 1 && n <= 16, "hyper_expand: 1 to 16 streams");
    Op op(*this);
    float* sd = op.inout(streams, T, int64_t(n) * E, int64_t(n) * E);
    k::hyper_expand(sd, op.in(block_out, T, ldb, E), ldb, op.in(post, T, n, n), op.in(comb, T, int64_t(n) * n, int64_t(n) * n),
                    n, E, T, stream_);
  }

  // -- mixture of experts ------------------------------------------------------------------
  // Top-k on the host (the grouping the products take is host memory by the seam's contract,
  // so the logits come back anyway): the same routing code as the CPU backend, bit for bit.
  void route(const moe::RouterConfig& cfg, const float* logits, int64_t T, const Routing& r,
             const int32_t* fixed) override {
    const int NE = cfg.n_expert, K = cfg.n_used;
    sync();  // logits and the routing arrays are managed (or host) memory: host access after the stream
    if (route_scratch_.size() < size_t(3 * NE)) route_scratch_.resize(size_t(3 * NE));
    moe::route(cfg, logits, T, r.ids, r.weights, route_scratch_.data(), fixed);
    int32_t* off = r.offsets;
    std::fill(off, off + NE + 1, 0);
    for (int64_t i = 0; i < T * K; ++i) ++off[r.ids[i] + 1];
    for (int e = 0; e < NE; ++e) off[e + 1] += off[e];
    fill_.assign(off, off + NE);
    for (int64_t t = 0; t < T; ++t)
      for (int kk = 0; kk < K; ++kk) {
        const int32_t row = fill_[size_t(r.ids[t * K + kk])]++;
        r.rows[row] = int32_t(t);
        r.slot_of[t * K + kk] = row;
      }
  }

  void combine(float* out, int64_t ldo, const float* eo, int64_t lde, int64_t T, int64_t n, const Routing& r, int K,
               int lo, int hi) override {
    if (T == 0) return;
    Op op(*this);
    float* od = op.inout(out, T, ldo, n);
    const int32_t* ids = op.in_raw(r.ids, size_t(T * K));
    const float* w = op.in_raw(r.weights, size_t(T * K));
    const int32_t* slot = op.in_raw(r.slot_of, size_t(T * K));
    int64_t rows = 0;
    for (int64_t i = 0; i < T * K; ++i) rows = std::max<int64_t>(rows, int64_t(r.slot_of[i]) + 1);
    const float* ed = op.in(eo, rows, lde, n);
    k::combine(od, ldo, ed, lde, T, n, ids, w, slot, K, lo, hi, stream_);
  }

 private:
  static constexpr size_t kParamBytes = size_t(4) << 20;
  static constexpr size_t kRegisterMin = size_t(64) << 20;
  static constexpr size_t kStageReserve = size_t(64) << 20;

  // One op's host-memory arguments: inputs staged in before the kernels, outputs copied back
  // after them (then the op waits for the stream, as a host caller expects its arrays filled);
  // small parameter arrays (offsets, tables, pointer lists) go to a per-op arena.
  class Op {
   public:
    explicit Op(CudaBackend& b) : b_(b) { b_.begin_op(); }
    Op(const Op&) = delete;
    Op& operator=(const Op&) = delete;
    ~Op() noexcept(false) {
      if (outs_.empty() && !staged_) return;
      cudaError_t e = cudaSuccess;
      for (const Out& o : outs_)
        if (e == cudaSuccess) e = cudaMemcpyAsync(o.host, o.dev, o.bytes, cudaMemcpyDeviceToHost, b_.stream_);
      const cudaError_t e2 = cudaStreamSynchronize(b_.stream_);
      if (std::uncaught_exceptions() > 0) return;  // already failing: keep that error
      check(e, "cudaMemcpyAsync");
      check(e2, "cudaStreamSynchronize");
    }

    // rows x cols floats, ld apart.
    const float* in(const float* p, int64_t rows, int64_t ld, int64_t cols) {
      return static_cast<const float*>(stage_in(p, extent(rows, ld, cols) * 4));
    }
    template <typename T>
    const T* in_raw(const T* p, size_t n) { return static_cast<const T*>(stage_in(p, n * sizeof(T))); }
    float* out(float* p, int64_t rows, int64_t ld, int64_t cols) { return out_flat(p, extent(rows, ld, cols)); }
    float* out_flat(float* p, size_t n) {
      if (!p || b_.device_ok(p)) return p;
      float* d = static_cast<float*>(b_.stage(n * 4));
      outs_.push_back({p, d, n * 4});
      staged_ = true;
      return d;
    }
    // Read and written; `same`: the staged copy of an input at the same address.
    float* inout(float* p, int64_t rows, int64_t ld, int64_t cols, const float* same = nullptr) {
      if (!p || b_.device_ok(p)) return p;
      const size_t n = extent(rows, ld, cols);
      float* d = same ? const_cast<float*>(same) : const_cast<float*>(static_cast<const float*>(stage_in(p, n * 4)));
      outs_.push_back({p, d, n * 4});
      staged_ = true;
      return d;
    }
    template <typename T>
    const T* param(const T* host, size_t n) {
      if (n == 0) return nullptr;
      void* d = b_.param_space(n * sizeof(T));
      check(cudaMemcpyAsync(d, host, n * sizeof(T), cudaMemcpyHostToDevice, b_.stream_), "cudaMemcpyAsync");
      return static_cast<const T*>(d);
    }

   private:
    static size_t extent(int64_t rows, int64_t ld, int64_t cols) {
      return rows <= 0 ? 0 : size_t(rows - 1) * size_t(ld) + size_t(cols);
    }
    const void* stage_in(const void* p, size_t bytes) {
      if (!p || bytes == 0 || b_.device_ok(p)) return p;
      if (const uint8_t* a = b_.adopted_ptr(p, bytes)) return a;
      void* d = b_.stage(bytes);
      check(cudaMemcpyAsync(d, p, bytes, cudaMemcpyHostToDevice, b_.stream_), "cudaMemcpyAsync");
      staged_ = true;
      return d;
    }
    struct Out {
      void* host;
      const void* dev;
      size_t bytes;
    };
    CudaBackend& b_;
    std::vector<Out> outs_;
    bool staged_ = false;
  };

  void sync() { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

  [[noreturn]] void unsupported(const char* what) {
    fail(ErrorKind::Unsupported, "CUDA backend: ", what, " has no CUDA kernel yet; use backend='cpu'");
  }

  // Whether the device may read p as it is: device, managed or registered memory.
  bool device_ok(const void* p) const {
    if (in_ranges(p)) return true;
    cudaPointerAttributes at{};
    if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged ||
           (at.type == cudaMemoryTypeHost && at.devicePointer == p);
  }

  const Adopted* find_adopted(const uint8_t* h, size_t bytes) const {
    auto it = adopted_.upper_bound(h);
    if (it == adopted_.begin()) return nullptr;
    --it;
    const Adopted& a = it->second;
    return h >= a.host && h + bytes <= a.host + a.bytes ? &a : nullptr;
  }
  const uint8_t* adopted_ptr(const void* p, size_t bytes) {
    const auto* h = static_cast<const uint8_t*>(p);
    std::lock_guard<std::mutex> lock(mu_);
    const Adopted* a = find_adopted(h, bytes);
    return a ? a->dev + (h - a->host) : nullptr;
  }

  // A weight's device address: adopted (uploaded or registered), already device memory, or - a
  // weight the model never handed over (tests) - staged for this call.
  const uint8_t* weight_ptr(const uint8_t* p, size_t bytes) {
    if (const uint8_t* a = adopted_ptr(p, bytes)) return a;
    if (device_ok(p)) return p;
    void* d = stage(bytes);
    check(cudaMemcpyAsync(d, p, bytes, cudaMemcpyHostToDevice, stream_), "weight staging");
    return static_cast<const uint8_t*>(d);
  }

  // Staging space for one op (the stream orders its reuse by the next op).
  void* stage(size_t bytes) {
    const size_t need = stage_used_ + align256(bytes);
    if (need > stage_.size()) {
      // Growing drops what is staged: only between ops (stage_used_ == 0), else a fresh block.
      if (stage_used_ == 0) {
        sync();
        stage_.ensure(need);
      } else {
        extra_stage_.emplace_back(align256(bytes));
        return extra_stage_.back().get();
      }
    }
    void* p = static_cast<uint8_t*>(stage_.get()) + stage_used_;
    stage_used_ = need;
    return p;
  }
  void* param_space(size_t bytes) {
    const size_t need = param_used_ + align256(bytes);
    if (need > params_.size()) {
      if (param_used_ == 0) {
        sync();
        params_.ensure(std::max(need, kParamBytes));
      } else {
        extra_stage_.emplace_back(align256(bytes));
        return extra_stage_.back().get();
      }
    }
    void* p = static_cast<uint8_t*>(params_.get()) + param_used_;
    param_used_ = need;
    return p;
  }

  void act_q8(int64_t rows, int64_t k, int8_t*& q, float*& d) {
    const size_t qb = align256(size_t(rows) * size_t(k)), db = align256(size_t(rows) * size_t(k / 32) * 4);
    if (qb + db > q8_.size()) {
      sync();
      q8_.ensure(qb + db);
    }
    q = static_cast<int8_t*>(q8_.get());
    d = reinterpret_cast<float*>(static_cast<uint8_t*>(q8_.get()) + qb);
  }

  void upload_tables() {
    const size_t sizes[] = {256 * 8, 512 * 8, 1024 * 8, 256 * 4, 512 * 4, 128, 16, 16};
    const void* srcs[] = {iq::kIq2xxsGrid, iq::kIq2xsGrid, iq::kIq2sGrid, iq::kIq3xxsGrid,
                          iq::kIq3sGrid,   iq::kSignsIq2xs, iq::kValuesIq4nl, iq::kValuesMxfp4};
    size_t total = 0;
    for (size_t s : sizes) total += align256(s);
    table_mem_ = DeviceBuffer(total);
    uint8_t* p = static_cast<uint8_t*>(table_mem_.get());
    const void* dst[8];
    for (int i = 0; i < 8; ++i) {
      check(cudaMemcpy(p, srcs[i], sizes[i], cudaMemcpyHostToDevice), "table upload");
      dst[i] = p;
      p += align256(sizes[i]);
    }
    tables_.iq2xxs = static_cast<const uint64_t*>(dst[0]);
    tables_.iq2xs = static_cast<const uint64_t*>(dst[1]);
    tables_.iq2s = static_cast<const uint64_t*>(dst[2]);
    tables_.iq3xxs = static_cast<const uint32_t*>(dst[3]);
    tables_.iq3s = static_cast<const uint32_t*>(dst[4]);
    tables_.signs = static_cast<const uint8_t*>(dst[5]);
    tables_.iq4nl = static_cast<const int8_t*>(dst[6]);
    tables_.mxfp4 = static_cast<const int8_t*>(dst[7]);
  }

  friend class Op;
  int dev_ = 0;
  DeviceInfo info_;
  cudaStream_t stream_ = nullptr;
  cudafmt::Tables tables_;
  DeviceBuffer table_mem_, q8_, packed_, params_, stage_;
  std::vector<DeviceBuffer> extra_stage_;
  size_t stage_used_ = 0, param_used_ = 0;
  std::mutex mu_;
  std::map<const uint8_t*, Adopted> adopted_;
  uint64_t uploaded_ = 0;
  GroupPlan plan_;
  std::vector<int64_t> y_off_, begin_, end_;
  std::vector<int32_t> tab_seq_, tab_of_, tables_host_, fill_;
  std::vector<float> route_scratch_, host_rows_;

 public:
  // Every op resets the arenas when it starts (the previous op's kernels were queued before).
  void begin_op() {
    stage_used_ = 0;
    param_used_ = 0;
    if (!extra_stage_.empty()) {
      sync();
      extra_stage_.clear();
    }
  }
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const std::string& variant) {
  TF_CHECK(variant.empty(), "backend 'cuda' has no variants (got 'cuda:", variant, "')");
  TF_CHECK(device_count() > 0, "backend 'cuda': no CUDA device is visible; use backend='cpu'");
  return std::make_unique<CudaBackend>();
}

bool built_with_cuda() { return true; }

bool forward_supported() { return true; }

std::string compiled_archs() { return TF_CUDA_ARCHS; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  return p.name;
}

DeviceInfo device_info(int device) { return query_device(device); }

// Test entry points: one backend per process, host arrays in and out (staged by the ops).
namespace {
Backend& test_backend() {
  static std::unique_ptr<Backend> b = make_cuda_backend("");
  return *b;
}
}  // namespace

void dequantize(uint32_t type_id, const void* src, size_t src_bytes, float* dst, int64_t n) {
  TF_CHECK(has_kernel(type_id), "CUDA backend: type ", type_name(type_id) ? type_name(type_id) : "?",
           " has no kernel (it has: ", kernel_type_names(), ")");
  TF_CHECK(src_bytes == row_bytes(GgmlType(type_id), n), "dequantize: buffer size does not match n");
  Weight w{GgmlType(type_id), n, 1, static_cast<const uint8_t*>(src), src_bytes, BufferKind::Host};
  const int32_t zero = 0;
  test_backend().embed(w, &zero, 1, dst, n);
}

void gemv(uint32_t type_id, const void* w, size_t w_bytes, int64_t rows, int64_t k, const float* x, float* y) {
  TF_CHECK(has_kernel(type_id), "CUDA backend: type ", type_name(type_id) ? type_name(type_id) : "?",
           " has no kernel (it has: ", kernel_type_names(), ")");
  const size_t rb = row_bytes(GgmlType(type_id), k);
  TF_CHECK(w_bytes == rb * size_t(rows), "gemv: weight buffer size does not match rows x k");
  Weight wt{GgmlType(type_id), k, rows, static_cast<const uint8_t*>(w), rb, BufferKind::Host};
  Backend& b = test_backend();
  b.reserve_products({{wt.type, k, 1, false}}, 1, false);
  const Product p{&wt, y, rows};
  b.matmul(x, 1, k, &p, 1);
}

}  // namespace cuda
}  // namespace tf
