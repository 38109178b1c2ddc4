// Python bindings of the CPU matmul kernels (tests and microbenchmarks only).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/cpu/kernel_choice.h"
#include "backend/cpu/kernel_table.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/repack.h"
#include "bindings/bindings.h"
#include "core/cpu_features.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "quant/traits.h"

namespace py = pybind11;

namespace tf {

SharedPool& pool_for(int threads) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<SharedPool>> pools;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = pools[threads];
  if (!slot) {
    slot = std::make_unique<SharedPool>();
    slot->pool = std::make_unique<ThreadPool>(threads);
  }
  return *slot;
}

namespace {

CpuIsa parse_impl(const std::string& impl) {
  CpuIsa isa;
  if (impl == "auto") isa = best_isa();
  else if (!parse_isa(impl.c_str(), &isa))
    fail(ErrorKind::InvalidInput, "impl must be auto, scalar, avx2, avx512, neon, dotprod or i8mm, got '", impl, "'");
  TF_CHECK(cpu::detail::isa_available(isa), "this CPU (or build) lacks the ISA '", impl, "'");
  return isa;
}

void check_threads(int threads) {
  TF_CHECK(threads >= 1 && threads <= 256, "threads must be in [1, 256], got ", threads);
}

// The R8 bindings' arguments: a format with an R8 layout, rows a positive multiple of 8, k of
// 256, and `bytes` the rows' bytes.
GgmlType r8_checked(uint32_t type_id, size_t bytes, int64_t rows, int64_t k) {
  TF_CHECK(type_id < kGgmlTypeIdLimit && cpu::r8::supported(GgmlType(type_id)), "r8: unsupported type id ", type_id);
  TF_CHECK(rows >= 8 && rows % 8 == 0, "r8: rows must be a positive multiple of 8, got ", rows);
  TF_CHECK(k >= 256 && k % 256 == 0, "r8: k must be a positive multiple of 256, got ", k);
  const size_t want = size_t(rows) * tf::row_bytes(GgmlType(type_id), k);
  TF_CHECK(bytes == want, "r8: the weight has ", bytes, " bytes, expected ", want);
  return GgmlType(type_id);
}

py::array_t<float> kernels_matmul(uint32_t type_id,
                                  py::array_t<uint8_t, py::array::c_style | py::array::forcecast> w,
                                  int64_t rows, int64_t k,
                                  py::array_t<float, py::array::c_style | py::array::forcecast> x,
                                  const std::string& impl, int threads) {
  check_threads(threads);
  TF_CHECK(type_id < kGgmlTypeIdLimit, "unknown type id ", type_id);
  const GgmlType wt = GgmlType(type_id);
  const TypeTraits* tr = find_type_traits(type_id);
  TF_CHECK(tr && tr->computable(), "type id ", type_id, " has no CPU matmul kernel (supported: ",
           computable_type_names(), ")");
  TF_CHECK(rows >= 1, "rows must be >= 1, got ", rows);
  TF_CHECK(k >= 1 && k % tr->block_size == 0, "k=", k, " must be a positive multiple of the block size ",
           tr->block_size);
  const size_t row_bytes = tf::row_bytes(wt, k);
  TF_CHECK(size_t(w.size()) == size_t(rows) * row_bytes, "w has ", w.size(), " bytes, expected rows*row_bytes = ",
           rows, "*", row_bytes, " = ", size_t(rows) * row_bytes);
  TF_CHECK(x.ndim() == 2, "x must be 2-D [ncols, k], got ", x.ndim(), " dimensions");
  TF_CHECK(x.shape(1) == k, "x has ", x.shape(1), " columns, expected k=", k);
  const int64_t ncols = x.shape(0);
  TF_CHECK(ncols >= 1, "x must have at least one row");
  // "avx512_panels": the format's prefill panels (CpuKernels::avx512_panels).
  const bool panels = impl == "avx512_panels";
  const CpuIsa isa = parse_impl(panels ? "avx512" : impl);
  if (panels) {
    const cpu::CpuKernels* kern = cpu::find_kernels(wt);
    TF_CHECK(kern && kern->avx512_panels, "no prefill panels for ", tr->name);
  }

  py::array_t<float> y({ncols, rows});
  const size_t act_bytes = cpu::act_row_bytes(wt, k);
  const size_t stride = (act_bytes + 63) / 64 * 64;
  const uint8_t* wp = w.data();
  const float* xp = x.data();
  float* yp = y.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<uint8_t> buf(stride * size_t(ncols) + 64);
    uint8_t* xq = buf.data() + ((64 - (reinterpret_cast<uintptr_t>(buf.data()) & 63)) & 63);
    SharedPool& slot = pool_for(threads);
    std::lock_guard<std::mutex> lock(slot.mu);
    slot.pool->parallel_for(ncols, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c)
        cpu::detail::quantize_act_row_isa(isa, wt, xp + c * k, xq + size_t(c) * stride, k);
    });
    const int64_t grain = rows >= 64 ? 16 : 1;
    slot.pool->parallel_for(rows, grain, [&](int64_t r0, int64_t r1) {
      if (!panels || !cpu::detail::matmul_rows_panels(isa, wt, k, wp, row_bytes, r0, r1, xq, stride, ncols, yp, rows))
        cpu::detail::matmul_rows_isa(isa, wt, k, wp, row_bytes, r0, r1, xq, stride, ncols, yp, rows);
    });
  }
  return y;
}

uint64_t kernels_read_bytes(py::array_t<uint8_t, py::array::c_style> a, int threads) {
  check_threads(threads);
  const uint8_t* p = a.data();
  const size_t n = size_t(a.size());
  uint64_t out = 0;
  {
    py::gil_scoped_release release;
    SharedPool& slot = pool_for(threads);
    std::lock_guard<std::mutex> lock(slot.mu);
    std::vector<uint64_t> part(size_t(threads), 0);
    const bool avx512 = cpu::detail::isa_available(CpuIsa::Avx512);
    // One chunk per thread on purpose: this measures the bandwidth of `threads` readers.
    const int nt = threads;
    slot.pool->run_chunks(nt, [&](int64_t t, int) {
      const size_t per = (n / size_t(nt) + 63) / 64 * 64;
      const size_t b = std::min(n, size_t(t) * per), e = std::min(n, size_t(t + 1) * per);
      if (b < e)
        part[size_t(t)] = avx512 ? cpu::detail::read_bytes_avx512(p + b, e - b)
                                 : cpu::detail::read_bytes(p + b, e - b);
    });
    for (uint64_t v : part) out ^= v;
  }
  return out;
}

}  // namespace

void bind_kernels(py::module_& m) {
  // Kernel choice per (format, shape class) for the tuned "cpu" backend (kernel_choice.h);
  // tensorfold.kernel_tuning measures, caches and sets it.
  auto cls = [](const std::string& name) {
    cpu::ShapeClass c;
    if (!cpu::parse_shape_class(name.c_str(), &c))
      fail(ErrorKind::InvalidInput, "shape class must be 'decode' or 'prefill', got '", name, "'");
    return c;
  };
  m.def("cpu_kernel_time",
        [cls](uint32_t type_id, const std::string& shape, const std::string& isa, int threads, size_t decode_bytes,
              int reps) {
          check_threads(threads);
          TF_CHECK(type_id < kGgmlTypeIdLimit, "unknown type id ", type_id);
          const cpu::ShapeClass c = cls(shape);
          const CpuIsa i = parse_impl(isa);
          py::gil_scoped_release nogil;
          return cpu::time_kernel(GgmlType(type_id), c, i, threads, decode_bytes, reps);
        },
        py::arg("type_id"), py::arg("shape"), py::arg("isa"), py::arg("threads"), py::arg("decode_bytes"),
        py::arg("reps") = 3,
        "Seconds per product of a format in a shape class ('decode': one column over decode_bytes of "
        "weights; 'prefill': 512 rows x 64 columns) with one ISA's kernel, best of reps.");
  m.def("set_cpu_kernel_choice",
        [cls](uint32_t type_id, const std::string& shape, const std::string& isa) {
          TF_CHECK(type_id < kGgmlTypeIdLimit, "unknown type id ", type_id);
          cpu::set_kernel_choice(GgmlType(type_id), cls(shape), parse_impl(isa));
        },
        py::arg("type_id"), py::arg("shape"), py::arg("isa"),
        "Run this format's products of this shape class with this ISA's kernel in the tuned 'cpu' backend.");
  m.def("cpu_kernel_choice",
        [cls](uint32_t type_id, const std::string& shape) -> py::object {
          TF_CHECK(type_id < kGgmlTypeIdLimit, "unknown type id ", type_id);
          const cpu::ShapeClass c = cls(shape);
          if (!cpu::has_kernel_choice(GgmlType(type_id), c)) return py::none();
          return py::str(isa_name(cpu::kernel_choice(GgmlType(type_id), c, best_isa())));
        },
        py::arg("type_id"), py::arg("shape"), "The ISA recorded for (format, shape class), or None.");
  m.def("clear_cpu_kernel_choices", &cpu::clear_kernel_choices, "Forget every recorded kernel choice.");

  m.def("kernels_matmul", &kernels_matmul, py::arg("type_id"), py::arg("w"), py::arg("rows"),
        py::arg("k"), py::arg("x"), py::arg("impl") = "auto", py::arg("threads") = 1,
        "y[ncols, rows] = x[ncols, k] @ dequant(W[rows, k]).T with x quantized per row the way "
        "the engine does (quantize_act_row + matmul_rows). impl: auto|scalar|avx2|avx512.");
  // Row-interleaved (R8) layouts: tests check them against the file layout and gguf's
  // dequantization, and the ISAs against the scalar reference.
  m.def("r8_pack",
        [](uint32_t type_id, py::array_t<uint8_t, py::array::c_style | py::array::forcecast> w, int64_t rows,
           int64_t k) {
          const GgmlType wt = r8_checked(type_id, size_t(w.size()), rows, k);
          const size_t row = tf::row_bytes(wt, k);
          py::array_t<uint8_t> out{py::ssize_t(w.size())};
          for (int64_t g = 0; g < rows / 8; ++g)
            cpu::r8::pack_group(wt, w.data() + size_t(g) * 8 * row, k / 256, out.mutable_data() + size_t(g) * 8 * row);
          return out;
        },
        py::arg("type_id"), py::arg("w"), py::arg("rows"), py::arg("k"),
        "the rows (file layout) rewritten as R8 groups of eight (csrc/backend/cpu/repack.h)");
  m.def("cpu_repacked_types",
        [] {
          py::list out;
          if (cpu::r8::enabled_for(best_isa()))
            for (GgmlType t : {GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K})
              if (cpu::r8::supported(t)) out.append(py::str(type_traits(t).name));
          return out;
        },
        "formats the default CPU backend rewrites into row-interleaved groups of eight (R8) at "
        "load on this machine (empty: none; TENSORFOLD_REPACK=off)");
  m.def("r8_unpack",
        [](uint32_t type_id, py::array_t<uint8_t, py::array::c_style | py::array::forcecast> p, int64_t rows,
           int64_t k) {
          const GgmlType wt = r8_checked(type_id, size_t(p.size()), rows, k);
          const size_t row = tf::row_bytes(wt, k);
          py::array_t<uint8_t> out{py::ssize_t(p.size())};
          for (int64_t g = 0; g < rows / 8; ++g)
            cpu::r8::unpack_group(wt, p.data() + size_t(g) * 8 * row, k / 256, out.mutable_data() + size_t(g) * 8 * row,
                                  row);
          return out;
        },
        py::arg("type_id"), py::arg("packed"), py::arg("rows"), py::arg("k"), "r8_pack undone");
  m.def("r8_matmul",
        [](uint32_t type_id, py::array_t<uint8_t, py::array::c_style | py::array::forcecast> p, int64_t rows,
           int64_t k, py::array_t<float, py::array::c_style | py::array::forcecast> x, const std::string& impl) {
          const GgmlType wt = r8_checked(type_id, size_t(p.size()), rows, k);
          const size_t row = tf::row_bytes(wt, k);
          TF_CHECK(x.ndim() == 2 && x.shape(1) == k && x.shape(0) >= 1, "x must be [ncols, k]");
          cpu::r8::GemvFn fn = cpu::r8::gemv_ref;
          const bool panels = impl == "avx512_panels";
          if (panels) {
            TF_CHECK(cpu::detail::isa_available(CpuIsa::Avx512), "this CPU lacks avx512");
          } else if (impl == "avx2" || impl == "avx512") {
            const CpuIsa isa = parse_impl(impl);
            TF_CHECK(cpu::detail::isa_available(isa), "this CPU lacks ", impl);
#if TF_HAVE_X86_KERNELS
            fn = isa == CpuIsa::Avx512 ? cpu::r8::gemv_avx512 : cpu::r8::gemv_avx2;
#endif
          } else if (impl == "auto") {
            fn = cpu::r8::best_gemv();
          } else {
            TF_CHECK(impl == "scalar", "impl must be auto|scalar|avx2|avx512|avx512_panels, got '", impl, "'");
          }
          const int64_t ncols = x.shape(0);
          const size_t xs = cpu::act_row_bytes(wt, k);
          std::vector<uint8_t> xq(size_t(ncols) * xs);
          for (int64_t c = 0; c < ncols; ++c)
            cpu::detail::quantize_act_row_isa(CpuIsa::Scalar, wt, x.data() + c * k, xq.data() + size_t(c) * xs, k);
          py::array_t<float> y({py::ssize_t(ncols), py::ssize_t(rows)});
#if TF_HAVE_X86_KERNELS
          if (panels) {
            cpu::detail::matmul_panels_r8_avx512(wt, k, p.data(), 8 * row, 0, rows, xq.data(), xs, ncols,
                                                 y.mutable_data(), rows);
            return y;
          }
#endif
          for (int64_t g = 0; g < rows / 8; ++g)
            fn(wt, k / 256, p.data() + size_t(g) * 8 * row, xq.data(), xs, ncols, y.mutable_data() + 8 * g, rows);
          return y;
        },
        py::arg("type_id"), py::arg("packed"), py::arg("rows"), py::arg("k"), py::arg("x"), py::arg("impl") = "auto",
        "y[ncols, rows] = x @ W.T with W in R8 groups (x quantized as the engine does)");
  m.def("kernels_quantize_act",
        [](uint32_t type_id, py::array_t<float, py::array::c_style | py::array::forcecast> x,
           const std::string& impl) {
          TF_CHECK(type_id < kGgmlTypeIdLimit, "unknown type id ", type_id);
          const GgmlType wt = GgmlType(type_id);
          const int64_t k = x.size();
          const size_t bytes = cpu::act_row_bytes(wt, k);  // checks the type and k
          const CpuIsa isa = parse_impl(impl);
          py::array_t<uint8_t> out{py::ssize_t(bytes)};
          cpu::detail::quantize_act_row_isa(isa, wt, x.data(), out.mutable_data(), k);
          return out;
        },
        py::arg("type_id"), py::arg("x"), py::arg("impl") = "auto",
        "the activation row x quantized for weights of type_id, as the matmul reads it (bytes)");
  m.def("kernel_isa", [] { return std::string(cpu::kernel_isa()); },
        "ISA of the matmul kernels' fast path: avx512, avx2 or scalar");
  m.def("kernels_act_row_bytes", [](uint32_t type_id, int64_t k) {
          TF_CHECK(type_id < kGgmlTypeIdLimit, "unknown type id ", type_id);
          return cpu::act_row_bytes(GgmlType(type_id), k);
        }, py::arg("type_id"), py::arg("k"));
  m.def("kernels_int8_peak",
        [](int threads, double seconds) {
          check_threads(threads);
          TF_CHECK(cpu::detail::isa_available(CpuIsa::Avx512), "the int8 peak probe needs AVX-512 VNNI");
          TF_CHECK(seconds > 0 && seconds <= 60, "seconds must be in (0, 60]");
          py::gil_scoped_release release;
          ThreadPool pool(threads);
          // Rounds sized to ~seconds / 5 each, best of 5: multiply-adds per second of `threads` cores.
          int64_t iters = 1 << 16;
          double best = 0.0;
          std::vector<int64_t> sink(static_cast<size_t>(threads), 0);
          for (int round = 0; round < 6; ++round) {
            const auto t0 = std::chrono::steady_clock::now();
            pool.run_chunks(threads, [&](int64_t c, int) { sink[size_t(c)] = cpu::detail::vnni_peak_avx512(iters); });
            const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            best = std::max(best, double(iters) * 12 * 64 * threads / dt);
            if (round == 0) iters = std::max<int64_t>(1, int64_t(double(iters) * seconds / 5 / std::max(dt, 1e-6)));
          }
          return best;
        },
        py::arg("threads") = 1, py::arg("seconds") = 1.0,
        "int8 multiply-adds per second at the VNNI peak (vpdpbusd on registers) of `threads` threads");
  m.def("kernels_read_bytes", &kernels_read_bytes, py::arg("a"), py::arg("threads") = 1,
        "Streams every byte of a (memory-bandwidth probe); returns a checksum.");
}

}  // namespace tf
