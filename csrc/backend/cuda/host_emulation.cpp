// format_decode.h run on the host (see host_emulation.h).
#include "backend/cuda/host_emulation.h"

#include <cmath>
#include <vector>

#include "backend/cuda/format_decode.h"
#include "backend/cuda/grouping.h"
#include "core/error.h"
#include "quant/tables/iq_tables.h"
#include "quant/traits.h"

namespace tf::cuda {

namespace {

using namespace tf::cudafmt;

Tables host_tables() {
  Tables t;
  t.iq2xxs = iq::kIq2xxsGrid;
  t.iq2xs = iq::kIq2xsGrid;
  t.iq2s = iq::kIq2sGrid;
  t.iq3xxs = iq::kIq3xxsGrid;
  t.iq3s = iq::kIq3sGrid;
  t.signs = iq::kSignsIq2xs;
  t.iq4nl = iq::kValuesIq4nl;
  t.mxfp4 = iq::kValuesMxfp4;
  return t;
}

template <uint32_t F>
void dequant_int8(const uint8_t* src, int64_t n, float* dst) {
  const Tables tb = host_tables();
  Chunk c;
  for (int64_t i = 0; i < n / 32; ++i) {
    decode_chunk<F>(src, i, tb, c);
    for (int l = 0; l < 32; ++l) dst[32 * i + l] = c.s[l >> 4] * float(c.q[l]) - c.m[l >> 4];
  }
}

template <uint32_t F>
void dequant_float(const uint8_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_value<F>(src, i);
}

// x (k values) as the kernels quantize it: int8 levels and a scale per 32.
void quantize_q8(const float* x, int64_t k, int8_t* q, float* d) {
  for (int64_t c = 0; c < k / 32; ++c) {
    float amax = 0.f;
    for (int l = 0; l < 32; ++l) amax = std::max(amax, std::fabs(x[32 * c + l]));
    d[c] = q8_scale(amax);
    for (int l = 0; l < 32; ++l) q[32 * c + l] = q8_level(x[32 * c + l], d[c]);
  }
}

template <uint32_t F>
void matmul_int8(const uint8_t* w, int64_t rows, int64_t k, const float* x, int64_t T, float* y) {
  const Tables tb = host_tables();
  const size_t rb = size_t(k / block_values(F)) * size_t(block_bytes(F));
  std::vector<int8_t> xq(static_cast<size_t>(k));
  std::vector<float> xd(static_cast<size_t>(k / 32));
  Chunk c;
  for (int64_t t = 0; t < T; ++t) {
    quantize_q8(x + t * k, k, xq.data(), xd.data());
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t ci = 0; ci < k / 32; ++ci) {
        decode_chunk<F>(w + size_t(r) * rb, ci, tb, c);
        int sumi[2] = {0, 0}, sx[2] = {0, 0};
        for (int l = 0; l < 32; ++l) {
          sumi[l >> 4] += int(c.q[l]) * int(xq[size_t(32 * ci + l)]);
          sx[l >> 4] += int(xq[size_t(32 * ci + l)]);
        }
        acc += xd[size_t(ci)] * (c.s[0] * float(sumi[0]) + c.s[1] * float(sumi[1]) -
                                 (c.m[0] * float(sx[0]) + c.m[1] * float(sx[1])));
      }
      y[t * rows + r] = acc;
    }
  }
}

template <uint32_t F>
void matmul_float(const uint8_t* w, int64_t rows, int64_t k, const float* x, int64_t T, float* y) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i)
        acc += float_value<F>(w + size_t(r) * size_t(k) * size_t(block_bytes(F)), i) * x[t * k + i];
      y[t * rows + r] = acc;
    }
}

void check_shape(uint32_t type_id, int64_t n) {
  TF_CHECK(has_kernel(type_id), "the CUDA backend has no kernel for type ",
           type_name(type_id) ? type_name(type_id) : std::to_string(type_id).c_str(), " (it has: ",
           kernel_type_names(), ")");
  TF_CHECK(n >= 0 && n % block_values(type_id) == 0 && n % (is_float_format(type_id) ? 1 : 32) == 0,
           "a row must hold whole blocks");
}

}  // namespace

bool has_kernel(uint32_t t) {
#define TF_X(F) if (t == F) return true;
  TF_CUDA_INT8_FORMATS(TF_X)
  TF_CUDA_FLOAT_FORMATS(TF_X)
#undef TF_X
  return false;
}

std::string kernel_type_names() {
  std::string s;
#define TF_X(F) s += (s.empty() ? "" : ", ") + std::string(#F);
  TF_CUDA_INT8_FORMATS(TF_X)
  TF_CUDA_FLOAT_FORMATS(TF_X)
#undef TF_X
  return s;
}

void emulate_dequantize(uint32_t type_id, const uint8_t* src, int64_t n, float* dst) {
  check_shape(type_id, n);
  switch (type_id) {
#define TF_X(F) case F: return dequant_int8<F>(src, n, dst);
    TF_CUDA_INT8_FORMATS(TF_X)
#undef TF_X
#define TF_X(F) case F: return dequant_float<F>(src, n, dst);
    TF_CUDA_FLOAT_FORMATS(TF_X)
#undef TF_X
  }
}

void emulate_matmul(uint32_t type_id, const uint8_t* w, int64_t rows, int64_t k, const float* x, int64_t T,
                    float* y) {
  check_shape(type_id, k);
  switch (type_id) {
#define TF_X(F) case F: return matmul_int8<F>(w, rows, k, x, T, y);
    TF_CUDA_INT8_FORMATS(TF_X)
#undef TF_X
#define TF_X(F) case F: return matmul_float<F>(w, rows, k, x, T, y);
    TF_CUDA_FLOAT_FORMATS(TF_X)
#undef TF_X
  }
}

float emulate_dot(uint32_t type_id, const uint8_t* wrow, int64_t k, const float* x) {
  float y = 0.f;
  emulate_matmul(type_id, wrow, 1, k, x, 1, &y);
  return y;
}

void emulate_matmul_stack(uint32_t type_id, const uint8_t* w, size_t mat_stride, size_t row_stride, int64_t rows,
                          int64_t k, const float* x, int64_t ldx, const Grouping& g, float* y, int64_t ldy) {
  const GroupPlan p = plan_groups(g, ldx, 8);
  std::vector<int64_t> yoff;
  output_offsets(p, ldy, yoff);
  for (const MmItem& it : p.items)
    for (int32_t r = it.row0; r < it.row0 + it.n; ++r)
      for (int64_t wr = 0; wr < rows; ++wr)
        y[yoff[size_t(r)] + wr] =
            emulate_dot(type_id, w + size_t(it.mat) * mat_stride + size_t(wr) * row_stride, k, x + p.src_off[size_t(r)]);
}

}  // namespace tf::cuda
