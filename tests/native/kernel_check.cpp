// Standalone kernel check (no Python): every format the CPU kernel table computes with, at
// every vector ISA level this CPU and build have, against the scalar reference — the way
// tests/test_kernels.py checks the x86 levels, for builds without the Python module (the
// aarch64 cross build run under qemu-user by tests/test_arm_qemu.py).
//
// Per format, ISA and shape (odd rows, columns and block counts, a row range not starting at
// 0, ldy > rows):
//   * the ISA's activation quantizer writes the scalar quantizer's bytes exactly;
//   * |y_isa - y_scalar| <= 1e-5 * sum|x||w| + 1e-7 * scale: the integer sums are exact, only
//     float rounding order may differ;
//   * |y_isa - x.W| <= (activation-quantization bound) * 1.0001 + the same slack, W the
//     reference dequantization (the bound of tests/test_kernels.py).
// Also the vector ops (F16 conversions exact, block products within the float slack).
// Prints one line per format and ISA; exit status 1 on any failure.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernel_table.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/vec_ops.h"
#include "core/cpu_features.h"
#include "quant/traits.h"

using namespace tf;

namespace {

struct Shape {
  int rows, kb, ncols;
};

int g_failures = 0;

void fail(const std::string& what) {
  ++g_failures;
  std::printf("FAIL %s\n", what.c_str());
}

// Returns the worst ratio err / bound seen (<= 1 when passing); worst_by_isa[2i], [2i+1]: ISA
// i's worst ratio against the scalar kernel and against the float reference.
double check_format(GgmlType t, const TypeTraits& tr, const std::vector<CpuIsa>& isas, std::mt19937& rng,
                    std::vector<double>* worst_by_isa) {
  const bool is_float = tr.block_size == 1;
  const Shape shapes[] = {{1, 1, 1}, {3, 3, 2}, {17, 2, 5}, {33, 1, 8}, {6, 5, 3}, {2, 1, 7}, {9, 2, 1}, {4, 3, 4}};
  std::normal_distribution<float> nd(0.f, 1.f);
  double worst = 0.0;
  for (const Shape& s : shapes) {
    const int64_t k = is_float ? 37 * s.kb + 3 : s.kb * tr.block_size;
    const int rows = s.rows, nc = s.ncols;
    const size_t rb = row_bytes(t, k);
    std::vector<uint8_t> W(rb * size_t(rows));
    std::vector<float> wf(static_cast<size_t>(k)), ones(static_cast<size_t>(k), 1.f);
    for (int r = 0; r < rows; ++r) {
      const float rs = std::exp(nd(rng));  // rows of different magnitude
      for (auto& v : wf) v = nd(rng) * rs;
      tr.quantize_weighted(wf.data(), ones.data(), W.data() + size_t(r) * rb, k);
    }
    std::vector<float> Wd(size_t(rows) * size_t(k));
    for (int r = 0; r < rows; ++r) tr.dequantize_ref(W.data() + size_t(r) * rb, Wd.data() + size_t(r) * size_t(k), k);
    std::vector<float> x(size_t(nc) * size_t(k));
    for (auto& v : x) v = nd(rng);
    for (int i = 0; i < k; i += 7) x[size_t(i)] *= 4.f;  // outliers make the blocks' scales differ

    const int64_t ldy = rows + 3;
    const int64_t r0 = rows > 2 ? 1 : 0;  // a row range not starting at 0
    const size_t xs = cpu::act_row_bytes(t, k);
    std::vector<uint8_t> xq_s(xs * size_t(nc)), xq_i(xs * size_t(nc));
    for (int c = 0; c < nc; ++c)
      cpu::quantize_act_row_scalar(t, x.data() + size_t(c) * size_t(k), xq_s.data() + size_t(c) * xs, k);
    std::vector<float> y_s(size_t(ldy) * size_t(nc), -1.f), y_i(y_s.size());
    cpu::matmul_rows_scalar(t, k, W.data(), rb, r0, rows, xq_s.data(), xs, nc, y_s.data(), ldy);

    // Reference and bounds in double.
    const int64_t ab = cpu::act_layout(t) == cpu::ActLayout::Q8_256 ? 256 : (cpu::act_layout(t) == cpu::ActLayout::Q8_32 ? 32 : 0);
    std::vector<double> ref(size_t(nc) * size_t(rows)), absprod(ref.size()), qbound(ref.size());
    double scale = 1e-30;
    for (int c = 0; c < nc; ++c)
      for (int r = 0; r < rows; ++r) {
        double acc = 0, ap = 0, qb = 0;
        const float* xr = x.data() + size_t(c) * size_t(k);
        const float* wr = Wd.data() + size_t(r) * size_t(k);
        for (int64_t i = 0; i < k; ++i) {
          acc += double(xr[i]) * wr[i];
          ap += std::fabs(double(xr[i]) * wr[i]);
        }
        if (ab > 0)
          for (int64_t b = 0; b < k / ab; ++b) {
            double amax = 0, wabs = 0;
            for (int64_t i = b * ab; i < (b + 1) * ab; ++i) {
              amax = std::fmax(amax, std::fabs(double(xr[i])));
              wabs += std::fabs(double(wr[i]));
            }
            qb += amax / 254.0 * wabs;
          }
        ref[size_t(c) * rows + r] = acc;
        absprod[size_t(c) * rows + r] = ap;
        qbound[size_t(c) * rows + r] = qb;
        scale = std::fmax(scale, ap);
      }

    for (size_t ii = 0; ii < isas.size(); ++ii) {
      const CpuIsa isa = isas[ii];
      const std::string tag = std::string(tr.name) + " " + isa_name(isa) + " rows=" + std::to_string(rows) +
                              " k=" + std::to_string(k) + " ncols=" + std::to_string(nc);
      for (int c = 0; c < nc; ++c)
        cpu::detail::quantize_act_row_isa(isa, t, x.data() + size_t(c) * size_t(k), xq_i.data() + size_t(c) * xs, k);
      if (std::memcmp(xq_i.data(), xq_s.data(), xq_s.size()) != 0) fail(tag + ": activation bytes differ from the scalar quantizer");
      std::fill(y_i.begin(), y_i.end(), -1.f);
      cpu::detail::matmul_rows_isa(isa, t, k, W.data(), rb, r0, rows, xq_s.data(), xs, nc, y_i.data(), ldy);
      for (int c = 0; c < nc; ++c)
        for (int64_t r = 0; r < ldy; ++r) {
          const size_t at = size_t(c) * size_t(ldy) + size_t(r);
          if (r < r0 || r >= rows) {
            if (y_i[at] != -1.f) fail(tag + ": wrote outside its rows");
            continue;
          }
          const size_t ri = size_t(c) * rows + size_t(r);
          const double slack = 1e-5 * absprod[ri] + 1e-7 * scale;
          const double e_s = std::fabs(double(y_i[at]) - y_s[at]);
          const double e_r = std::fabs(double(y_i[at]) - ref[ri]);
          const double b_r = qbound[ri] * 1.0001 + slack;
          if (!(e_s <= slack)) fail(tag + ": differs from scalar by " + std::to_string(e_s) + " > " + std::to_string(slack));
          if (!(e_r <= b_r)) fail(tag + ": error vs reference " + std::to_string(e_r) + " > bound " + std::to_string(b_r));
          worst = std::fmax(worst, std::fmax(e_s / slack, e_r / b_r));
          (*worst_by_isa)[2 * ii] = std::fmax((*worst_by_isa)[2 * ii], e_s / slack);
          (*worst_by_isa)[2 * ii + 1] = std::fmax((*worst_by_isa)[2 * ii + 1], e_r / b_r);
        }
    }
  }
  return worst;
}

void check_vec_ops(const std::vector<CpuIsa>& isas, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const cpu::VecOps& ref = cpu::vec_ops_scalar();
  for (CpuIsa isa : isas) {
    const cpu::VecOps& ops = cpu::vec_ops_for(isa);
    const std::string tag = std::string("vec_ops ") + isa_name(isa);
    for (int n : {1, 7, 64, 131}) {
      std::vector<float> x(size_t(n) * 5), a(size_t(n) * 3), s0(15), s1(15), y0(size_t(n) * 3, 0.f), y1 = y0;
      for (auto& v : x) v = nd(rng) * 3.f;
      for (auto& v : a) v = nd(rng);
      std::vector<uint16_t> h0(static_cast<size_t>(n)), h1(static_cast<size_t>(n));
      ref.f32_to_f16(n, x.data(), h0.data());
      ops.f32_to_f16(n, x.data(), h1.data());
      if (h0 != h1) fail(tag + ": f32_to_f16 differs");
      std::vector<float> f0(static_cast<size_t>(n)), f1(static_cast<size_t>(n));
      ref.f16_to_f32(n, h0.data(), f0.data());
      ops.f16_to_f32(n, h0.data(), f1.data());
      if (std::memcmp(f0.data(), f1.data(), f0.size() * 4) != 0) fail(tag + ": f16_to_f32 differs");
      ref.dot_block_f32(n, a.data(), n, 3, x.data(), n, 5, s0.data(), 5);
      ops.dot_block_f32(n, a.data(), n, 3, x.data(), n, 5, s1.data(), 5);
      for (int i = 0; i < 15; ++i) {
        double ap = 0;
        for (int j = 0; j < n; ++j) ap += std::fabs(double(a[size_t(i / 5) * n + j]) * x[size_t(i % 5) * n + j]);
        if (!(std::fabs(double(s0[size_t(i)]) - s1[size_t(i)]) <= 1e-5 * ap + 1e-30)) fail(tag + ": dot_block_f32");
      }
      ref.axpy_block_f32(n, s0.data(), 5, 3, x.data(), n, 5, y0.data(), n);
      ops.axpy_block_f32(n, s0.data(), 5, 3, x.data(), n, 5, y1.data(), n);
      for (size_t i = 0; i < y0.size(); ++i)
        if (!(std::fabs(double(y0[i]) - y1[i]) <= 1e-5 * (std::fabs(double(y0[i])) + 50.0))) fail(tag + ": axpy_block_f32");
    }
    std::printf("ok vec_ops %s\n", isa_name(isa));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::Avx2, CpuIsa::Avx512, CpuIsa::Neon, CpuIsa::Dotprod, CpuIsa::I8mm})
    if (cpu::detail::isa_available(isa)) isas.push_back(isa);
  const std::string only = argc > 1 ? argv[1] : "";  // optional: one format name
  std::printf("cpu: best isa %s%s%s; checking:", isa_name(best_isa()), cpu_feature_note().empty() ? "" : ", ",
              cpu_feature_note().c_str());
  for (CpuIsa isa : isas) std::printf(" %s", isa_name(isa));
  std::printf("\n");
  std::mt19937 rng(12345);
  int n_formats = 0;
  std::vector<std::string> scalar_only;
  for (uint32_t id = 0; id < kGgmlTypeIdLimit; ++id) {
    const TypeTraits* tr = find_type_traits(id);
    if (tr == nullptr || !tr->computable() || cpu::find_kernels(GgmlType(id)) == nullptr) continue;
    if (!only.empty() && only != tr->name) continue;
    const cpu::CpuKernels& kern = *cpu::find_kernels(GgmlType(id));
    const bool vector = kern.avx2 || kern.avx512 || kern.neon || kern.dotprod || kern.i8mm;
    if (!vector) scalar_only.push_back(tr->name);
    if (tr->quantize_weighted == nullptr || tr->dequantize_ref == nullptr) {
      std::printf("skip %s: no reference quantizer\n", tr->name);
      continue;
    }
    std::vector<double> worst(2 * isas.size(), 0.0);  // per ISA: vs scalar, vs reference
    const int before = g_failures;
    check_format(GgmlType(id), *tr, isas, rng, &worst);
    for (size_t i = 0; i < isas.size(); ++i)
      std::printf("%s %-8s %-8s worst |y-scalar|/slack %.3f  |y-ref|/bound %.3f\n", g_failures == before ? "ok  " : "FAIL",
                  tr->name, isa_name(isas[i]), worst[2 * i], worst[2 * i + 1]);
    ++n_formats;
  }
  if (only.empty()) check_vec_ops(isas, rng);
  std::printf("formats without a vector kernel (scalar fallback):");
  for (auto& n : scalar_only) std::printf(" %s", n.c_str());
  std::printf("%s\n", scalar_only.empty() ? " none" : "");
  std::printf("%s: %d formats x %zu ISA levels, %d failures\n", g_failures ? "FAILED" : "PASSED", n_formats,
              isas.size(), g_failures);
  return g_failures ? 1 : 0;
}
