// The CPU backend: every op of the seam on a thread pool it owns, through the kernels of one
// instruction set (the best this CPU has, or a cap for tests): the low-bit products of the
// kernel table (activations quantized once per layout a group of weights needs), paged
// attention (attention.h; with sinks or a second source of entries: attention_sparse.h), the
// lightning indexer (index_topk.h), the vector primitives (vec_ops.h), routing (moe/router).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/attention.h"
#include "backend/cpu/attention_sparse.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/index_topk.h"
#include "backend/cpu/kernel_choice.h"
#include "backend/cpu/kernel_table.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/repack.h"
#include "backend/cpu/vec_ops.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "kv/kv_cache.h"
#include "quant/traits.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace tf {

namespace {

constexpr size_t kLayouts = 3;  // cpu::ActLayout values
constexpr int kMaxStreams = 16;  // hyper-connection streams (DeepSeek-V4: 4)

struct MatmulJob {
  Weight w;
  const uint8_t* xq;
  size_t xq_stride;
  int64_t ncols;
  float* y;
  int64_t ldy;
  // With a mask (Backend::set_exact_rows) a column's kernel follows its row's role, never the
  // column count: exact rows as one-column products are (the decode class's row kernel), the
  // others through the prefill class's kernel (the panels where the format has them), so no
  // token's rounding depends on what else is in the batch. Without one, by column count.
  bool exact;
  bool by_role;
  // Rows [0, r8_rows) of the weight in R8 groups (repack.h): group g at r8 + g * r8_gs, its
  // super-blocks from the weight's first column on; rows past them in the file's layout.
  const uint8_t* r8 = nullptr;
  size_t r8_gs = 0;
  int64_t r8_rows = 0;
  const uint8_t* r8_tail = nullptr;  // the rows past the groups, as one zero-padded group
};

// A matrix rewritten in R8 groups in place: rows [0, rows) of `row_stride` bytes from its key.
struct R8Matrix {
  const uint8_t* end;  // the whole matrix, groups and the rows past them
  GgmlType type;
  int64_t rows;        // rows in groups
  size_t row_stride;
  const uint8_t* tail;  // the rows past them (fewer than eight) as one zero-padded group, or null
};

void free_host(void* p, size_t) { ::operator delete(p, std::align_val_t(64)); }

class CpuBackend final : public Backend {
 public:
  // tuned: products run the kernel measured fastest per (format, shape class) up to `isa`
  // (backend/cpu/kernel_choice.h); otherwise always `isa`'s (an explicit "cpu:avx2" etc.).
  CpuBackend(int threads, CpuIsa isa, bool tuned)
      : isa_(isa),
        tuned_(tuned),
        repack_(cpu::r8::enabled_for(isa)),  // on other CPUs, or under a lower ISA, the file's layout
        ops_(cpu::vec_ops_for(isa)),
        pool_(threads) {}

  void host_parallel(int64_t n, const std::function<void(int64_t)>& fn) override {
    if (n <= 1) return n == 1 ? fn(0) : void();
    pool_.parallel_for(n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) fn(i);
    });
  }
  std::string name() const override { return std::string("cpu:") + isa_name(isa_); }
  int threads() const override { return pool_.size(); }
  bool supports(GgmlType t) const override { return cpu::find_kernels(t) != nullptr; }
  std::string supported_types() const override { return computable_type_names(); }
  void set_interruptible(bool on) override { pool_.set_interruptible(on); }

  // -- memory ------------------------------------------------------------------------------
  Buffer alloc(size_t bytes, BufferKind) override {
    // Host memory whatever the kind: on a CPU the three are the same memory.
    void* p = ::operator new(std::max<size_t>(bytes, 1), std::align_val_t(64), std::nothrow);
    return p ? Buffer(p, bytes, BufferKind::Host, free_host) : Buffer();
  }

  uint64_t reserve_products(const std::vector<ProductShape>& shapes, int64_t max_rows, bool count_only) override {
    size_t stride[kLayouts] = {}, gstride[kLayouts] = {};
    int64_t grows[kLayouts] = {};
    for (const ProductShape& s : shapes) {
      if (s.rows <= 0 || s.k <= 0) continue;
      const size_t l = layout(s.type);
      const size_t b = cpu::act_row_bytes(s.type, s.k);
      if (s.grouped) {
        gstride[l] = std::max(gstride[l], b);
        grows[l] = std::max(grows[l], s.rows);
      }
      stride[l] = std::max(stride[l], b);  // a gathered list quantizes its source rows first
    }
    uint64_t bytes = 0;
    for (size_t l = 0; l < kLayouts; ++l) {
      const size_t st = (stride[l] + 63) & ~size_t(63), gst = (gstride[l] + 63) & ~size_t(63);
      bytes += uint64_t(st) * uint64_t(st ? max_rows : 0) + uint64_t(gst) * uint64_t(grows[l]);
      if (count_only) continue;
      // Grown, never shrunk: models sharing this backend (a draft model beside its target)
      // each reserve what they need, and every one keeps room for its products.
      grow(act_[l], st, st ? max_rows : 0);
      grow(grouped_[l], gst, grows[l]);
    }
    if (!count_only) jobs_.reserve(256);
    return bytes;
  }

  void to_host(void* dst, const void* src, size_t n) override {
    if (dst != src) std::memcpy(dst, src, n);
  }
  void from_host(void* dst, const void* src, size_t n) override {
    if (dst != src) std::memcpy(dst, src, n);
  }
  void copy(void* dst, const void* src, size_t n) override {
    if (dst != src) std::memmove(dst, src, n);
  }

  // -- products ----------------------------------------------------------------------------
  void set_exact_rows(const uint8_t* mask, int64_t T) override {
    exact_mask_ = mask;
    exact_T_ = mask ? T : 0;
  }

  void matmul(const float* x, int64_t T, int64_t ldx, const Product* ps, size_t n) override {
    if (n == 0 || T == 0) return;
    GgmlType rep[kLayouts] = {};
    unsigned mask = 0;
    const int64_t k = ps[0].w->k;
    for (size_t i = 0; i < n; ++i) {
      TF_CHECK(ps[i].w->k == k, "matmul: the products of a group take the same input");
      const size_t l = layout(ps[i].w->type);
      if (!(mask & (1u << l))) rep[l] = ps[i].w->type;
      mask |= 1u << l;
    }
    for (size_t i = 0; i < n; ++i) repack(*ps[i].w);
    quantize(mask, rep, x, T, k, ldx, act_, nullptr);
    jobs_.clear();
    for (size_t i = 0; i < n; ++i) {
      const Act& a = act_[layout(ps[i].w->type)];
      add_jobs(*ps[i].w, a.data.data(), a.stride, T, ps[i].y, ps[i].ldy, [&](int64_t c) { return c; }, T);
    }
    run_jobs();
  }

  void matmul_stack(const float* x, int64_t ldx, const Grouping& g, const StackProduct* ps, size_t n) override {
    if (n == 0 || g.last <= g.first) return;
    if (!g.offsets) return matmul_batched(x, ldx, g, ps, n);
    const int64_t base = g.offsets[g.first], rows = g.offsets[g.last] - base;
    if (rows == 0) return;
    for (size_t i = 0; i < n; ++i) repack(*ps[i].w);
    GgmlType rep[kLayouts] = {};
    unsigned mask = 0;
    const int64_t k = ps[0].w->first.k;
    for (size_t i = 0; i < n; ++i) {
      TF_CHECK(ps[i].w->first.k == k, "matmul_stack: the products take the same input");
      const size_t l = layout(ps[i].w->first.type);
      if (!(mask & (1u << l))) rep[l] = ps[i].w->first.type;
      mask |= 1u << l;
    }
    int64_t n_src = 0;  // gathered lists: the source rows (the forward's tokens)
    if (g.gather) {
      // Each source row quantized once, then copied into list order for every layout.
      for (int64_t i = base; i < base + rows; ++i) n_src = std::max<int64_t>(n_src, g.gather[i] + 1);
      quantize(mask, rep, x, n_src, k, ldx, act_, nullptr);
      for (size_t l = 0; l < kLayouts; ++l) {
        if (!(mask & (1u << l))) continue;
        check_rows(grouped_[l], rows, rep[l], k);
        const size_t S = grouped_[l].stride, A = act_[l].stride, B = cpu::act_row_bytes(rep[l], k);
        for (int64_t i = 0; i < rows; ++i)
          std::memcpy(grouped_[l].data.data() + size_t(i) * S, act_[l].data.data() + size_t(g.gather[base + i]) * A, B);
      }
    } else {
      quantize(mask, rep, x + base * ldx, rows, k, ldx, grouped_, nullptr);
    }
    jobs_.clear();
    // A list row's forward row: its source row (the gathered token, of the forward's rows when a
    // mask is set), or itself.
    const int64_t n_rows = g.gather ? (exact_T_ > 0 ? exact_T_ : n_src) : g.offsets[g.last];
    for (size_t i = 0; i < n; ++i) {
      const Act& a = grouped_[layout(ps[i].w->first.type)];
      for (int64_t e = g.first; e < g.last; ++e) {
        const int64_t off = g.offsets[e], c = g.offsets[e + 1] - off;
        if (c == 0) continue;
        add_jobs(ps[i].w->at(e - g.first), a.data.data() + size_t(off - base) * a.stride, a.stride, c,
                 ps[i].y + off * ps[i].ldy, ps[i].ldy,
                 [&](int64_t j) { return g.gather ? int64_t(g.gather[off + j]) : off + j; }, n_rows);
      }
    }
    run_jobs();
  }

  // Per-head products: when the heads' input rows interleave (row t of matrix e at
  // x + t * ldx + e * x_mat, ldx = n_mat * x_mat) all T x n_mat rows are quantized as one batch
  // and each matrix reads every n_mat-th of them.
  void matmul_batched(const float* x, int64_t ldx, const Grouping& g, const StackProduct* ps, size_t n) {
    const int64_t M = g.last - g.first;
    TF_CHECK(ldx == M * g.x_mat, "matmul_stack: batched inputs must interleave (ldx = matrices x x_mat)");
    GgmlType rep[kLayouts] = {};
    unsigned mask = 0;
    const int64_t k = ps[0].w->first.k;
    for (size_t i = 0; i < n; ++i) {
      const size_t l = layout(ps[i].w->first.type);
      if (!(mask & (1u << l))) rep[l] = ps[i].w->first.type;
      mask |= 1u << l;
    }
    for (size_t i = 0; i < n; ++i) repack(*ps[i].w);
    quantize(mask, rep, x, g.rows * M, k, g.x_mat, grouped_, nullptr);
    jobs_.clear();
    for (size_t i = 0; i < n; ++i) {
      const Act& a = grouped_[layout(ps[i].w->first.type)];
      for (int64_t e = 0; e < M; ++e)
        add_jobs(ps[i].w->at(e), a.data.data() + size_t(e) * a.stride, size_t(M) * a.stride, g.rows,
                 ps[i].y + e * g.y_mat, ps[i].ldy, [](int64_t j) { return j; }, g.rows);
    }
    run_jobs();
  }

  // -- rows --------------------------------------------------------------------------------
  void rmsnorm(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t T, int64_t n,
               float eps) override {
    rows(T, n, [&](int64_t t) {
      const float* xr = x + t * ldx;
      float* yr = y + t * ldy;
      double sum = 0.0;  // double accumulation, like ggml
      for (int64_t i = 0; i < n; ++i) sum += double(xr[i] * xr[i]);
      const float scale = 1.0f / std::sqrt(float(sum / double(n)) + eps);
      if (w)
        for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] * scale) * w[i];
      else
        for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * scale;
    });
  }

  void rope(float* v, int64_t T, int64_t ldv, int n_heads, int64_t head_stride, int64_t at, const float* cs,
            int64_t ldcs, int rope_dim, bool neox, bool inverse) override {
    const int half = rope_dim / 2;
    rows(T, int64_t(n_heads) * rope_dim, [&](int64_t t) {
      const float* c = cs + t * ldcs;
      for (int h = 0; h < n_heads; ++h) {
        float* p = v + t * ldv + h * head_stride + at;
        for (int i = 0; i < half; ++i) {
          const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
          const float co = c[2 * i], si = inverse ? -c[2 * i + 1] : c[2 * i + 1];
          const float x0 = p[a], x1 = p[b];
          p[a] = x0 * co - x1 * si;
          p[b] = x0 * si + x1 * co;
        }
      }
    });
  }

  void silu_mul(float* g, int64_t ldg, const float* u, int64_t ldu, int64_t T, int64_t n, int64_t split,
                float limit) override {
    if (limit > 0.f) return silu_mul_clamped(g, ldg, u, ldu, T, n, split, limit);
    rows(T, n, [&](int64_t t) {
      float* gr = g + t * ldg;
      const float* ur = u + t * ldu;
      if (split > 0 && split < n) {  // each TP rank's part on its own (vector body and tail as there)
        ops_.silu_mul(split, gr, ur, gr);
        ops_.silu_mul(n - split, gr + split, ur + split, gr + split);
      } else {
        ops_.silu_mul(n, gr, ur, gr);
      }
    });
  }

  // Clamped SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit), then silu(g) * u, through
  // the same vector op on pieces of kClampPiece values (a multiple of every vector width, so the
  // pieces' bodies and tails fall where the whole row's would).
  void silu_mul_clamped(float* g, int64_t ldg, const float* u, int64_t ldu, int64_t T, int64_t n, int64_t split,
                        float limit) {
    constexpr int64_t kClampPiece = 1024;
    auto part = [&](float* gp, const float* up, int64_t m) {
      float uc[kClampPiece];
      for (int64_t i0 = 0; i0 < m; i0 += kClampPiece) {
        const int64_t c = std::min(kClampPiece, m - i0);
        for (int64_t i = 0; i < c; ++i) {
          gp[i0 + i] = std::min(gp[i0 + i], limit);
          uc[i] = std::clamp(up[i0 + i], -limit, limit);
        }
        ops_.silu_mul(c, gp + i0, uc, gp + i0);
      }
    };
    rows(T, n, [&](int64_t t) {
      float* gr = g + t * ldg;
      const float* ur = u + t * ldu;
      if (split > 0 && split < n) {
        part(gr, ur, split);
        part(gr + split, ur + split, n - split);
      } else {
        part(gr, ur, n);
      }
    });
  }

  void add(float* y, const float* x, int64_t n) override {
    chunks(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) y[i] += x[i];
    });
  }

  void add_bias(float* y, int64_t ldy, const float* b, int64_t T, int64_t n) override {
    rows(T, n, [&](int64_t t) {
      float* yr = y + t * ldy;
      for (int64_t i = 0; i < n; ++i) yr[i] += b[i];
    });
  }

  void add_scaled(float* y, int64_t ldy, const float* x, int64_t ldx, const float* s, int64_t T, int64_t n,
                  bool sigmoid) override {
    rows(T, n, [&](int64_t t) {
      const float g = sigmoid ? 1.f / (1.f + std::exp(-s[t])) : s[t];
      float* yr = y + t * ldy;
      const float* xr = x + t * ldx;
      for (int64_t i = 0; i < n; ++i) yr[i] += g * xr[i];
    });
  }

  void copy_rows(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t T, int64_t n) override {
    rows(T, n, [&](int64_t t) { std::memcpy(dst + t * ldd, src + t * lds, size_t(n) * sizeof(float)); });
  }

  void fill(float* dst, int64_t n, float v) override { std::fill(dst, dst + n, v); }

  void embed(const Weight& table, const int32_t* tokens, int64_t T, float* out, int64_t ldo) override {
    const TypeTraits* tr = find_type_traits(uint32_t(table.type));
    TF_CHECK(tr && tr->dequantize_ref, "embed: no dequantization for the table's type");
    // Tables keep the file's layout (prepare_products); one rewritten as a product before that
    // (a weight first met in a product, then read as a table) is read through its groups.
    MatmulJob view{};
    view.w = table;
    r8_view(&view);
    std::vector<uint8_t> group;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = tokens[t];
      if (row < view.r8_rows) {  // repacked before it was first read as a table
        const size_t rb = size_t(table.k / 256) * cpu::r8::block_bytes(table.type);
        group.resize(cpu::r8::kRows * rb);
        cpu::r8::unpack_group(table.type, view.r8 + size_t(row / 8) * view.r8_gs, table.k / 256, group.data(), rb);
        tr->dequantize_ref(group.data() + size_t(row % 8) * rb, out + t * ldo, table.k);
        continue;
      }
      tr->dequantize_ref(table.data + size_t(row) * table.row_stride, out + t * ldo, table.k);
    }
  }

  // -- cache and attention -----------------------------------------------------------------
  void store_rows(const float* src, int64_t lds, int64_t n, void* const* dst, int64_t count, KvType t) override {
    rows(count, n, [&](int64_t i) {
      if (t == KvType::F16)
        ops_.f32_to_f16(n, src + i * lds, static_cast<uint16_t*>(dst[i]));
      else
        std::memcpy(dst[i], src + i * lds, size_t(n) * sizeof(float));
    });
  }

  void attention(const AttentionBatch& a, const KvLayer& kv) override;

  void gated_pool(const void* const* src, const PoolSlot* slots, int n_slots, int64_t count, int64_t D, KvType t,
                  float* out, int64_t ldo) override {
    TF_CHECK(n_slots >= 0 && D >= 0 && count >= 0, "gated_pool: bad sizes");
    const bool f32 = t == KvType::F32;
    rows(count, int64_t(n_slots) * D, [&](int64_t e) {
      // The present slots' gate logits (bias added) per channel, their per-channel maximum, then
      // one pass of exp(gate - max) summed and weighting the values.
      thread_local std::vector<float> buf;
      if (buf.size() < size_t(n_slots + 3) * size_t(D)) buf.resize(size_t(n_slots + 3) * size_t(D));
      float* mx = buf.data();
      float* sum = mx + D;
      float* val = sum + D;
      float* gates = val + D;
      float* o = out + e * ldo;
      const void* const* rs = src + e * n_slots;
      auto load = [&](const void* row, int64_t at, float* dst) {
        if (f32)
          std::memcpy(dst, static_cast<const float*>(row) + at, size_t(D) * sizeof(float));
        else
          ops_.f16_to_f32(D, static_cast<const uint16_t*>(row) + at, dst);
      };
      std::fill(mx, mx + D, -INFINITY);
      int present = 0;
      for (int s = 0; s < n_slots; ++s) {
        if (!rs[s]) continue;
        float* gl = gates + size_t(present++) * size_t(D);
        load(rs[s], slots[s].gate_at, gl);
        if (slots[s].bias)
          for (int64_t c = 0; c < D; ++c) gl[c] += slots[s].bias[c];
        for (int64_t c = 0; c < D; ++c) mx[c] = std::max(mx[c], gl[c]);
      }
      std::fill(o, o + D, 0.f);
      if (present == 0) return;  // no slot: zeros
      std::fill(sum, sum + D, 0.f);
      present = 0;
      for (int s = 0; s < n_slots; ++s) {
        if (!rs[s]) continue;
        float* gl = gates + size_t(present++) * size_t(D);
        for (int64_t c = 0; c < D; ++c) gl[c] -= mx[c];
        ops_.exp_sub_sum(D, gl, 0.f);
        load(rs[s], slots[s].kv_at, val);
        for (int64_t c = 0; c < D; ++c) {
          sum[c] += gl[c];
          o[c] += gl[c] * val[c];
        }
      }
      for (int64_t c = 0; c < D; ++c) o[c] /= sum[c];
    });
  }

  void index_topk(const float* q, int64_t ldq, int n_heads, int64_t D, const float* w, int64_t ldw, const KvLayer& kv,
                  const int32_t* seq, const int64_t* count, int64_t T, int k, int32_t* idx) override {
    cpu::index_topk(q, ldq, n_heads, D, w, ldw, kv, seq, count, T, k, idx, pool_, ops_);
  }

  // -- hyper-connections -------------------------------------------------------------------
  void hyper_maps(const HyperMaps& m, int64_t T) override {
    const int n = m.n;
    TF_CHECK(n >= 1 && n <= kMaxStreams && (m.post == nullptr || (m.comb != nullptr && m.iters >= 1)),
             "hyper_maps: bad sizes");
    // Tiny per token (n <= 16): computed in double, rounded once.
    rows(T, int64_t(n) * (n + 2) * 16, [&](int64_t t) {
      const float* x = m.mix + t * m.ldm;
      auto sigmoid = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
      for (int i = 0; i < n; ++i)
        m.pre[t * n + i] = float(sigmoid(double(x[i]) * m.scale[0] + m.base[i]) + m.eps);
      if (!m.post) return;
      for (int i = 0; i < n; ++i)
        m.post[t * n + i] = float(2.0 * sigmoid(double(x[n + i]) * m.scale[1] + m.base[n + i]));
      double c[kMaxStreams * kMaxStreams];
      const double eps = m.eps;
      for (int j = 0; j < n; ++j) {  // row j: softmax over its columns, plus eps
        double* row = c + j * n;
        double mx = -INFINITY;
        for (int i = 0; i < n; ++i) {
          row[i] = double(x[2 * n + j * n + i]) * m.scale[2] + m.base[2 * n + j * n + i];
          mx = std::max(mx, row[i]);
        }
        double s = 0;
        for (int i = 0; i < n; ++i) s += row[i] = std::exp(row[i] - mx);
        for (int i = 0; i < n; ++i) row[i] = row[i] / s + eps;
      }
      auto columns = [&] {
        for (int i = 0; i < n; ++i) {
          double s = 0;
          for (int j = 0; j < n; ++j) s += c[j * n + i];
          for (int j = 0; j < n; ++j) c[j * n + i] /= s + eps;
        }
      };
      columns();
      for (int it = 1; it < m.iters; ++it) {
        for (int j = 0; j < n; ++j) {
          double s = 0;
          for (int i = 0; i < n; ++i) s += c[j * n + i];
          for (int i = 0; i < n; ++i) c[j * n + i] /= s + eps;
        }
        columns();
      }
      for (int i = 0; i < n * n; ++i) m.comb[t * n * n + i] = float(c[i]);
    });
  }

  void hyper_collapse(const float* streams, const float* pre, int n, int64_t E, int64_t T, float* out,
                      int64_t ldo) override {
    rows(T, int64_t(n) * E, [&](int64_t t) {
      const float* st = streams + t * n * E;
      const float* p = pre + t * n;
      float* o = out + t * ldo;
      for (int64_t c = 0; c < E; ++c) o[c] = p[0] * st[c];
      for (int i = 1; i < n; ++i)
        for (int64_t c = 0; c < E; ++c) o[c] += p[i] * st[i * E + c];
    });
  }

  void hyper_expand(float* streams, const float* block_out, int64_t ldb, const float* post, const float* comb, int n,
                    int64_t E, int64_t T) override {
    TF_CHECK(n >= 1 && n <= kMaxStreams, "hyper_expand: at most ", kMaxStreams, " streams");
    rows(T, int64_t(n) * n * E, [&](int64_t t) {
      // In place: every new stream reads every old one, so a piece of the old streams is kept
      // aside while the new values of that piece are written.
      constexpr int64_t kPiece = 256;
      float old[kMaxStreams * kPiece];
      float* st = streams + t * n * E;
      const float* b = block_out + t * ldb;
      const float* p = post + t * n;
      const float* cm = comb + t * n * n;
      for (int64_t c0 = 0; c0 < E; c0 += kPiece) {
        const int64_t w = std::min(kPiece, E - c0);
        for (int j = 0; j < n; ++j) std::memcpy(old + j * kPiece, st + j * E + c0, size_t(w) * sizeof(float));
        for (int i = 0; i < n; ++i) {
          float* o = st + i * E + c0;
          for (int64_t c = 0; c < w; ++c) o[c] = p[i] * b[c0 + c];
          for (int j = 0; j < n; ++j) {
            const float f = cm[j * n + i];
            const float* oj = old + j * kPiece;
            for (int64_t c = 0; c < w; ++c) o[c] += f * oj[c];
          }
        }
      }
    });
  }

  // -- mixture of experts ------------------------------------------------------------------
  void route(const moe::RouterConfig& cfg, const float* logits, int64_t T, const Routing& r,
             const int32_t* fixed) override {
    const int NE = cfg.n_expert, K = cfg.n_used;
    if (route_scratch_.size() < size_t(3 * NE)) route_scratch_.resize(size_t(3 * NE));  // once per model
    moe::route(cfg, logits, T, r.ids, r.weights, route_scratch_.data(), fixed);
    // Counting sort of the (token, slot) pairs by expert (token order kept within an expert).
    int32_t* off = r.offsets;
    std::fill(off, off + NE + 1, 0);
    for (int64_t i = 0; i < T * K; ++i) ++off[r.ids[i] + 1];
    for (int e = 0; e < NE; ++e) off[e + 1] += off[e];
    if (fill_.size() < size_t(NE)) fill_.resize(size_t(NE));
    std::copy(off, off + NE, fill_.begin());
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        const int32_t row = fill_[size_t(r.ids[t * K + k])]++;
        r.rows[row] = int32_t(t);
        r.slot_of[t * K + k] = row;
      }
  }

  void combine(float* out, int64_t ldo, const float* eo, int64_t lde, int64_t T, int64_t n, const Routing& r,
               int K, int lo, int hi) override {
    rows(T, n * K, [&](int64_t t) {
      float* xt = out + t * ldo;
      for (int k = 0; k < K; ++k) {
        const int32_t e = r.ids[t * K + k];
        if (e < lo || e >= hi) continue;  // another rank's (or part's) expert
        const float w = r.weights[t * K + k];
        const float* o = eo + int64_t(r.slot_of[t * K + k]) * lde;
        for (int64_t i = 0; i < n; ++i) xt[i] += w * o[i];
      }
    });
  }

 private:
  struct Act {
    std::vector<uint8_t> data;
    size_t stride = 0;
    int64_t rows = 0;
  };

  size_t layout(GgmlType t) const {
    const cpu::CpuKernels* k = cpu::find_kernels(t);
    if (!k) cpu::act_layout(t);  // throws, naming the type
    return size_t(k->act);
  }
  static void grow(Act& a, size_t stride, int64_t rows) {
    stride = std::max(stride, a.stride);
    rows = std::max(rows, a.rows);
    if (stride == a.stride && rows == a.rows) return;
    a.stride = stride;
    a.rows = rows;
    a.data.assign(stride * size_t(rows), 0);
  }
  static void check_rows(const Act& a, int64_t rows, GgmlType t, int64_t k) {
    TF_CHECK(rows <= a.rows && cpu::act_row_bytes(t, k) <= a.stride, "cpu backend: ", rows,
             " activation rows exceed the reserved working memory");
  }

  // Rows of x quantized into every layout of `mask`, one parallel section for all of them.
  void quantize(unsigned mask, const GgmlType* rep, const float* x, int64_t T, int64_t k, int64_t ldx, Act* bufs,
                const int32_t*) {
    for (size_t l = 0; l < kLayouts; ++l)
      if (mask & (1u << l)) check_rows(bufs[l], T, rep[l], k);
    pool_.parallel_for(T, 8, [&](int64_t b, int64_t e) {
      for (size_t l = 0; l < kLayouts; ++l) {
        if (!(mask & (1u << l))) continue;
        for (int64_t c = b; c < e; ++c)
          cpu::detail::quantize_act_row_isa(isa_, rep[l], x + c * ldx, bufs[l].data.data() + size_t(c) * bufs[l].stride,
                                            k);
      }
    });
  }

  // Jobs for columns [0, ncols) of one weight, cut into runs of equal exactness: column j is
  // forward row row_of(j) of a product over n_rows rows (a product over other rows than the
  // forward's, the logit rows, is exact whenever a mask is set).
  template <typename RowOf>
  void add_jobs(const Weight& w, const uint8_t* xq, size_t xs, int64_t ncols, float* y, int64_t ldy, RowOf row_of,
                int64_t n_rows) {
    auto exact = [&](int64_t j) {
      if (!exact_mask_) return false;
      if (n_rows != exact_T_) return true;
      const int64_t r = row_of(j);
      return r < 0 || r >= exact_T_ || exact_mask_[r] != 0;
    };
    int64_t c0 = 0;
    while (c0 < ncols) {
      const bool e = exact(c0);
      int64_t c1 = c0 + 1;
      while (c1 < ncols && exact(c1) == e) ++c1;
      jobs_.push_back({w, xq + size_t(c0) * xs, xs, c1 - c0, y + c0 * ldy, ldy, e, exact_mask_ != nullptr});
      r8_view(&jobs_.back());
      c0 = c1;
    }
  }

  void run_jobs() {
    // Every job's rows are cut into chunks of whole 16-row tiles, about kChunksPerThread chunks
    // per thread over all jobs together; threads claim chunks as they come free, so a slow or
    // descheduled thread holds back one chunk, not a fixed share.
    int64_t total = 0;
    for (const MatmulJob& j : jobs_) total += j.w.rows;
    if (total == 0) return;
    const int64_t target = int64_t(pool_.size()) * ThreadPool::kChunksPerThread;
    const int64_t per =
        pool_.size() == 1 ? total : std::max<int64_t>(16, ((total + target - 1) / target + 15) & ~int64_t(15));
    first_chunk_.clear();
    int64_t n_chunks = 0;
    for (const MatmulJob& j : jobs_) {
      first_chunk_.push_back(n_chunks);
      n_chunks += (j.w.rows + per - 1) / per;
    }
    pool_.run_chunks(n_chunks, [&](int64_t c, int) {
      const size_t ji = size_t(std::upper_bound(first_chunk_.begin(), first_chunk_.end(), c) - first_chunk_.begin()) - 1;
      const MatmulJob& j = jobs_[ji];
      int64_t r0 = (c - first_chunk_[ji]) * per;
      const int64_t r1 = std::min(j.w.rows, r0 + per);
      // Exact columns take the decode class's row kernel (it gives a column the same result for any
      // column count); the others the prefill class's, through the panels where the format has them.
      const cpu::ShapeClass cls = j.exact     ? cpu::ShapeClass::Decode
                                  : j.by_role ? cpu::ShapeClass::Prefill
                                              : cpu::shape_class(j.ncols);
      if (j.r8) return r8_rows(j, cls, r0, r1);
      const CpuIsa isa = tuned_ ? cpu::kernel_choice(j.w.type, cls, isa_) : isa_;
      if (!j.exact && cls == cpu::ShapeClass::Prefill && (j.by_role || j.ncols >= cpu::kPanelMinColumns) &&
          cpu::detail::matmul_rows_panels(isa, j.w.type, j.w.k, j.w.data, j.w.row_stride, r0, r1, j.xq, j.xq_stride,
                                          j.ncols, j.y, j.ldy))
        return;
      cpu::detail::matmul_rows_isa(isa, j.w.type, j.w.k, j.w.data, j.w.row_stride, r0, r1, j.xq, j.xq_stride,
                                   j.ncols, j.y, j.ldy);
    });
  }

  // fn(t) for T rows of about `width` values each: in parallel when there is enough work.
  template <typename Fn>
  void rows(int64_t T, int64_t width, Fn fn) {
    if (T <= 1 || T * width < (int64_t(1) << 14)) {
      for (int64_t t = 0; t < T; ++t) fn(t);
      return;
    }
    pool_.parallel_for(T, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) fn(t);
    });
  }
  template <typename Fn>
  void chunks(int64_t n, Fn fn) {
    if (n < (int64_t(1) << 16)) return fn(0, n);
    pool_.parallel_for(n, 4096, fn);
  }

  // -- row-interleaved weights (repack.h) ---------------------------------------------------
  // A product's weight is rewritten into R8 groups in place at load (prepare_products), or else
  // the first time it is multiplied: its bytes stay where the plan put them.
  void adopt_host_range(const void* p, size_t bytes) override {
    if (repack_) adopted_.emplace_back(static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + bytes);
  }
  // At load, every product's weight rewritten now rather than at its first product, and the
  // tables read row by row kept as they are.
  void prepare_products(const std::vector<WeightStack>& products, const std::vector<Weight>& tables) override {
    if (!repack_) return;
    for (const Weight& t : tables)
      if (t.data) r8_never_.emplace_back(t.data, t.data + size_t(t.rows) * t.row_stride);
    for (const WeightStack& p : products) {
      if (cpu::r8::supported(p.first.type)) repack(p);
      else to_huge_pages(p);
    }
  }

  // A mapped weight the groups do not cover (its format has no R8 layout) copied into fresh
  // huge pages moved over the file's (the same bytes): its decode stream then meets a TLB miss
  // per 2 MiB rather than per 4 KiB, as the repacked ones do.
  void to_huge_pages(const WeightStack& p) {
    if (p.n < 1 || p.first.rows < 1 || p.first.where != BufferKind::Host) return;
    const uint8_t* begin = p.first.data;
    const uint8_t* end = begin + size_t(p.n - 1) * p.stride + size_t(p.first.rows) * p.first.row_stride;
    if (!inside(mapped_, begin, end)) return;
    for (const auto& [b, e] : moved_)
      if (begin < e && b < end) return;  // moved already (a view of it, or the matrix itself)
    const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t P0 = (uintptr_t(begin) + page - 1) & ~(page - 1), P1 = uintptr_t(end) & ~(page - 1);
    if (P1 < P0 + (uintptr_t(2) << 20)) return;  // less than one huge page inside
    uint8_t* fresh = fresh_pages(P0, P1 - P0);
    if (!fresh) return;
    std::memcpy(fresh, reinterpret_cast<const void*>(P0), P1 - P0);
    if (mremap(fresh, P1 - P0, P1 - P0, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(P0)) == MAP_FAILED) {
      munmap(fresh, P1 - P0);
      return;
    }
    moved_.emplace_back(begin, end);
  }
  void adopt_mapped_range(const void* p, size_t bytes) override {
    adopt_host_range(p, bytes);
    if (repack_) mapped_.emplace_back(static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + bytes);
  }

  void repack(const Weight& w) {
    WeightStack one;
    one.first = w;
    one.n = 1;
    repack(one);
  }

  // A matrix or a stack; a column view stands for its whole matrices (Weight::k0).
  void repack(const WeightStack& s) {
    if (!repack_ || adopted_.empty() || !cpu::r8::supported(s.first.type) || s.n < 1 || s.first.rows < 1 ||
        s.first.where != BufferKind::Host)
      return;
    Weight w = s.first;
    const size_t bb = cpu::r8::block_bytes(w.type);
    if (w.k0 % 256 != 0 || w.k % 256 != 0 || w.row_stride % bb != 0) return;
    w.data -= size_t(w.k0 / 256) * bb;
    w.k = int64_t(w.row_stride / bb) * 256;
    w.k0 = 0;
    // Matrices one after another are rewritten in one pass (one range of fresh pages).
    const bool packed = s.n == 1 || s.stride == size_t(w.rows) * w.row_stride;
    for (int64_t e = 0; e < (packed ? 1 : s.n); ++e) {
      MatmulJob probe{};
      probe.w = w;
      probe.w.data = w.data + size_t(e) * s.stride;
      if (r8_view(&probe)) continue;  // repacked already
      repack_matrices(probe.w, packed ? s.n : 1, packed ? s.stride : 0);
    }
  }

  // n bytes of anonymous memory, populated, at an address congruent to `at` modulo 2 MiB and
  // marked for transparent huge pages: moved to `at` (mremap) its whole 2 MiB extents stay huge
  // pages, so a decode streaming a matrix meets a TLB miss per 2 MiB rather than per 4 KiB.
  static uint8_t* fresh_pages(uintptr_t at, size_t n) {
    constexpr uintptr_t kHuge = uintptr_t(2) << 20;
    void* m = mmap(nullptr, n + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    const uintptr_t base = uintptr_t(m), start = base + ((at - base) & (kHuge - 1));
    if (start > base) munmap(m, start - base);
    if (base + n + kHuge > start + n) munmap(reinterpret_cast<void*>(start + n), base + n + kHuge - (start + n));
    madvise(reinterpret_cast<void*>(start), n, MADV_HUGEPAGE);
    if (madvise(reinterpret_cast<void*>(start), n, MADV_POPULATE_WRITE) != 0)
      for (uintptr_t p = start; p < start + n; p += 4096) *reinterpret_cast<volatile uint8_t*>(p) = 0;
    return reinterpret_cast<uint8_t*>(start);
  }

  static bool inside(const std::vector<std::pair<const uint8_t*, const uint8_t*>>& ranges, const uint8_t* b,
                     const uint8_t* e) {
    return std::any_of(ranges.begin(), ranges.end(), [&](const auto& r) { return r.first <= b && e <= r.second; });
  }

  // Matrices 0..n-1 of w's shape at w.data + e * stride (whole rows, contiguous), each rewritten
  // in R8 groups where it lies (the rows past its groups as they are), then registered.
  // The file's mapped pages are not written: the groups of their whole pages go to fresh
  // anonymous memory moved over them when done (mremap), so no page is first copied for
  // copy-on-write and the file's pages leave the process; only the two partial pages at the
  // ends are written in place. Memory of the loader's (TP slices) is written in place.
  void repack_matrices(const Weight& w, int64_t n, size_t stride) {
    constexpr int R = cpu::r8::kRows;
    const size_t row = w.row_stride, gbytes = R * row, bb = cpu::r8::block_bytes(w.type);
    const int64_t groups = w.rows / R, nb = w.k / 256;
    const uint8_t* begin = w.data;
    const uint8_t* end = w.data + size_t(n - 1) * stride + size_t(w.rows) * row;
    for (const auto& [b, e] : r8_never_)
      if (begin < e && b < end) return;  // read as a table (embeddings): keeps the file's layout
    // Only the model's own weights (Backend::adopt_host_range): memory a caller merely lends
    // for one product is never rewritten.
    if (!inside(adopted_, begin, end)) return;
    if (groups > 0) {
      const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
      const uintptr_t lo = uintptr_t(begin) & ~(page - 1), hi = (uintptr_t(end) + page - 1) & ~(page - 1);
      const uintptr_t P0 = (uintptr_t(begin) + page - 1) & ~(page - 1), P1 = uintptr_t(end) & ~(page - 1);
      uint8_t* fresh = nullptr;
      if (inside(mapped_, begin, end) && P1 > P0) fresh = fresh_pages(P0, P1 - P0);
      auto writable = [](uintptr_t a, uintptr_t b) {
        return b <= a || mprotect(reinterpret_cast<void*>(a), b - a, PROT_READ | PROT_WRITE) == 0;
      };
      if (!(fresh ? writable(lo, P0) && writable(P1, hi) : writable(lo, hi))) {
        if (fresh) munmap(fresh, P1 - P0);
        r8_never_.emplace_back(begin, end);
        return;
      }
      uint8_t* base = const_cast<uint8_t*>(begin);
      // A group's bytes to where they go: the fresh pages, or in place.
      auto put = [&](uint8_t* at, const uint8_t* src, size_t len) {
        const uintptr_t a = uintptr_t(at), e = a + len;
        if (!fresh) return void(std::memcpy(at, src, len));
        const uintptr_t h = std::min(e, P0), f0 = std::max(a, P0), f1 = std::min(e, P1), t = std::max(a, P1);
        if (h > a) std::memcpy(at, src, h - a);                                    // before the whole pages
        if (f1 > f0) std::memcpy(fresh + (f0 - P0), src + (f0 - a), f1 - f0);      // on them
        if (e > t) std::memcpy(reinterpret_cast<uint8_t*>(t), src + (t - a), e - t);  // after them
      };
      pool_.parallel_for(n * groups, 1, [&](int64_t i0, int64_t i1) {
        if (!fresh) {  // this thread's copies of its pages made in one call, not a fault per page
          const uint8_t* first = base + size_t(i0 / groups) * stride + size_t(i0 % groups) * gbytes;
          const uint8_t* last = base + size_t((i1 - 1) / groups) * stride + size_t((i1 - 1) % groups + 1) * gbytes;
          const uintptr_t a = uintptr_t(first) & ~(page - 1), b = (uintptr_t(last) + page - 1) & ~(page - 1);
          madvise(reinterpret_cast<void*>(a), b - a, MADV_POPULATE_WRITE);
        }
        std::vector<uint8_t> out(gbytes);
        for (int64_t i = i0; i < i1; ++i) {  // a group's bytes are read, then overwritten, by one thread
          uint8_t* at = base + size_t(i / groups) * stride + size_t(i % groups) * gbytes;
          cpu::r8::pack_group(w.type, at, nb, out.data());
          put(at, out.data(), gbytes);
        }
      });
      if (fresh && mremap(fresh, P1 - P0, P1 - P0, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(P0)) ==
                       MAP_FAILED) {
        // Not movable (an old kernel, a locked range): copied over the mapped pages instead.
        if (!writable(P0, P1)) fail(ErrorKind::Runtime, "cpu backend: cannot write the repacked weights in place");
        std::memcpy(reinterpret_cast<void*>(P0), fresh, P1 - P0);
        munmap(fresh, P1 - P0);
      }
    }
    // Registered even with no group (see r8_rows). The rows past the groups stay in place for
    // the prefill panels, and get a zero-padded group of their own for decodes: packed once
    // here, at most eight rows per matrix outside the plan's bytes.
    for (int64_t e = 0; e < n; ++e) {
      const uint8_t* m = w.data + size_t(e) * stride;
      uint8_t* tail = nullptr;
      if (w.rows % R != 0) {
        tails_.emplace_back(new uint8_t[size_t(nb) * R * bb]);
        tail = tails_.back().get();
        const std::vector<uint8_t> zero(bb, 0);
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* rows[R];
          for (int r = 0; r < R; ++r)
            rows[r] = groups * R + r < w.rows ? m + size_t(groups * R + r) * row + size_t(b) * bb : zero.data();
          cpu::r8::pack_superblock(w.type, rows, tail + size_t(b) * R * bb);
        }
      }
      r8_.emplace(m, R8Matrix{m + size_t(w.rows) * row, w.type, groups * R, row, tail});
    }
  }

  // Rows [r0, r1) of a product whose weight is repacked. Every row takes the R8 arithmetic,
  // whatever its place: the last rows past the groups (fewer than eight) have a zero-padded
  // group of their own for a decode, and take the same prefill panels (which give the
  // file's and the groups' rows the same bits), so a row's result does not depend on how its
  // matrix was cut (TP slices, column views).
  void r8_rows(const MatmulJob& j, cpu::ShapeClass cls, int64_t r0, int64_t r1) {
    constexpr int R = cpu::r8::kRows;
    const bool decode = j.exact || cls == cpu::ShapeClass::Decode;
    const int64_t nb = j.w.k / 256, re = std::max(r0, std::min(r1, j.r8_rows));
    const cpu::r8::GemvFn gemv = cpu::r8::best_gemv();
    if (r0 < re) {
      if (decode) {
        for (int64_t g = r0 / R; g < re / R; ++g)
          gemv(j.w.type, nb, j.r8 + size_t(g) * j.r8_gs, j.xq, j.xq_stride, j.ncols, j.y + g * R, j.ldy);
      } else {
#if TF_HAVE_X86_KERNELS
        cpu::detail::matmul_panels_r8_avx512(j.w.type, j.w.k, j.r8, j.r8_gs, r0, re, j.xq, j.xq_stride, j.ncols, j.y,
                                             j.ldy);
#endif
      }
    }
    if (re >= r1) return;
    if (!decode) {  // the file's rows through the same panels
      cpu::detail::matmul_rows_panels(CpuIsa::Avx512, j.w.type, j.w.k, j.w.data, j.w.row_stride, re, r1, j.xq,
                                      j.xq_stride, j.ncols, j.y, j.ldy);
      return;
    }
    // The rows past the groups through their zero-padded group (packed at load).
    TF_CHECK(j.r8_tail != nullptr, "cpu backend: a repacked matrix's last rows have no group");
    thread_local std::vector<float> out;
    out.resize(size_t(j.ncols) * R);
    gemv(j.w.type, nb, j.r8_tail, j.xq, j.xq_stride, j.ncols, out.data(), R);
    for (int64_t c = 0; c < j.ncols; ++c)
      for (int64_t r = re; r < r1; ++r) j.y[c * j.ldy + r] = out[size_t(c) * R + size_t(r - j.r8_rows)];
  }

  // Fills j's R8 fields when its weight lies in a repacked matrix; true then. A view the R8
  // groups cannot serve (not on a group's first row) is an error: its bytes have moved.
  bool r8_view(MatmulJob* j) const {
    if (r8_.empty()) return false;
    auto it = r8_.upper_bound(j->w.data);
    if (it == r8_.begin()) return false;
    --it;
    const R8Matrix& m = it->second;
    if (j->w.data >= m.end) return false;
    const size_t off = size_t(j->w.data - it->first), bb = cpu::r8::block_bytes(m.type);
    const int64_t r = int64_t(off / m.row_stride);
    const size_t in_row = off % m.row_stride;
    TF_CHECK(j->w.type == m.type && j->w.row_stride == m.row_stride && r % cpu::r8::kRows == 0 && in_row % bb == 0,
             "cpu backend: a view of a weight rewritten in row-interleaved groups does not start on a group "
             "(set TENSORFOLD_REPACK=off to keep the file's layout)");
    j->r8 = it->first + size_t(r) * m.row_stride + (in_row / bb) * cpu::r8::kRows * bb;
    j->r8_gs = cpu::r8::kRows * m.row_stride;
    j->r8_rows = std::max<int64_t>(0, std::min(j->w.rows, m.rows - r));
    j->r8_tail = m.tail ? m.tail + (in_row / bb) * cpu::r8::kRows * bb : nullptr;
    return true;
  }

  CpuIsa isa_;
  bool tuned_;
  bool repack_;
  std::map<const uint8_t*, R8Matrix> r8_;                            // repacked matrices by first byte
  std::vector<std::pair<const uint8_t*, const uint8_t*>> r8_never_;  // ranges kept in the file's layout
  std::vector<std::pair<const uint8_t*, const uint8_t*>> adopted_;   // the models' weight memory
  std::vector<std::pair<const uint8_t*, const uint8_t*>> mapped_;    // the parts of it mapped from files
  std::vector<std::pair<const uint8_t*, const uint8_t*>> moved_;     // moved to huge pages as they are
  std::vector<std::unique_ptr<uint8_t[]>> tails_;                    // R8Matrix::tail
  const uint8_t* exact_mask_ = nullptr;  // set_exact_rows
  int64_t exact_T_ = 0;
  const cpu::VecOps& ops_;
  ThreadPool pool_;
  Act act_[kLayouts], grouped_[kLayouts];
  std::vector<MatmulJob> jobs_;
  std::vector<int64_t> first_chunk_;
  std::vector<float> route_scratch_;
  std::vector<int32_t> fill_;
  std::vector<std::pair<int64_t, int>> blocks_;  // attention: runs of one sequence's tokens
};

void CpuBackend::attention(const AttentionBatch& a, const KvLayer& kv) {
  if (a.sinks || a.extra) return cpu::attention_sparse(a, kv, pool_, ops_);  // its own path (DeepSeek-V4)
  const KvPool& pool = *kv.pool;
  const int group = a.group, HK = a.n_cache_heads;
  // Tokens go in blocks: a run of consecutive positions of one sequence (a prefill chunk), up
  // to kAttentionBlockRows query rows, is attended at once (its K/V tiles converted once); a
  // lone token (decode) takes the single-query kernel. One item per (block, cache head): the
  // `group` query heads that share the cache head read its pages together. Items go in
  // contiguous runs, many more runs than threads: causal prefill's triangular cost evens out
  // because threads claim runs as they come free.
  const int max_block = std::max(1, cpu::kAttentionBlockRows / group);
  blocks_.clear();
  for (int64_t t = 0; t < a.T; ++t) {
    if (!blocks_.empty()) {
      auto& [t0, nt] = blocks_.back();
      if (nt < max_block && a.seq[t] == a.seq[t0] && a.end[t] == a.end[t0] + nt) {
        ++nt;
        continue;
      }
    }
    blocks_.emplace_back(t, 1);
  }
  // Fewer items than threads (decode of one sequence under MLA, whose one cache head serves
  // every query head): the query heads of a cache head are split into parts, each read against
  // the pages on its own. The kernels give every head the same bits whichever heads it is
  // computed with, so this changes no result.
  const int64_t base_items = int64_t(blocks_.size()) * HK;
  const int parts = int(std::min<int64_t>(group, std::max<int64_t>(1, int64_t(pool_.size()) / base_items)));
  const int64_t items = base_items * parts;
  const int64_t runs = std::min<int64_t>(items, int64_t(pool_.size()) * 16);
  const bool f32 = pool.type() == KvType::F32;
  pool_.run_chunks(runs, [&](int64_t r, int) {
    for (int64_t it = r * items / runs; it < (r + 1) * items / runs; ++it) {
      const int part = int(it % parts);
      const auto [t, nt] = blocks_[size_t(it / parts / HK)];
      const int g = int(it / parts % HK);
      const int h0 = group * part / parts, h1 = group * (part + 1) / parts;  // this item's query heads
      const cpu::PagedKv pages{pool.k_block(kv.layer, 0, g), pool.v_block(kv.layer, 0, g), pool.page_stride(),
                               pool.block_table(a.seq[t]).data(), pool.block_size(), f32, a.v_dim};
      const float* qt = a.q + t * a.q_stride + (int64_t(g) * group + h0) * a.head_dim;
      float* ot = a.out + t * a.out_stride + (int64_t(g) * group + h0) * a.v_dim;
      const int64_t end = a.end[t], begin = a.window > 0 ? std::max<int64_t>(0, end - a.window) : 0;
      if (nt == 1)
        cpu::paged_attention(qt, h1 - h0, a.head_dim, pages, begin, end, a.scale, ot, ops_);
      else
        cpu::paged_attention_causal(qt, a.q_stride, nt, h1 - h0, a.head_dim, pages, end - 1, a.window, a.scale, ot,
                                    a.out_stride, ops_);
    }
  });
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads, const std::string& variant) {
  CpuIsa isa = best_isa();
  if (!variant.empty() && !parse_isa(variant.c_str(), &isa))
    fail(ErrorKind::InvalidInput, "unknown instruction set '", variant,
         "' for backend 'cpu' (expected scalar, avx2, avx512, neon, dotprod or i8mm)");
  TF_CHECK(cpu::detail::isa_available(isa), "cpu backend: this CPU (or build) lacks ", isa_name(isa));
  return std::make_unique<CpuBackend>(std::max(1, threads), isa, variant.empty());
}

std::vector<std::string> cpu_backend_variants() {
  std::vector<std::string> out;
  for (CpuIsa isa : {CpuIsa::Avx512, CpuIsa::Avx2, CpuIsa::I8mm, CpuIsa::Dotprod, CpuIsa::Neon, CpuIsa::Scalar})
    if (cpu::detail::isa_available(isa)) out.push_back(isa_name(isa));
  return out;
}

}  // namespace tf
