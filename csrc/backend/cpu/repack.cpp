// The R8 layouts' scalar side (repack.h): building and undoing super-blocks, and the reference
// product the vector kernels match bit for bit.
#include "backend/cpu/repack.h"

#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cpu/kernels_internal.h"
#include "core/cpu_features.h"
#include "core/error.h"
#include "quant/blocks.h"

namespace tf::cpu::r8 {

namespace {

using T_ = GgmlType;

// Q5_K's header (d, dmin, scales) is Q4_K's: read and written through block_q4_K below.
static_assert(offsetof(block_q4_K, scales) == offsetof(block_q5_K, scales) &&
              offsetof(block_q4_K, dmin) == offsetof(block_q5_K, dmin), "K-quant headers");

// Where a row's value i sits in a super-block: the byte and the bit its field starts at, per
// part (the low bits, and where the type has them, the high bits).
struct Field {
  size_t byte;
  int shift;
};

// 6-bit fields: low nibbles in 64 bytes, top 2 bits in the 32 after them.
void put6(uint8_t* area, int n, int v) {
  area[n % 64] = uint8_t(area[n % 64] | ((v & 0xF) << (4 * (n / 64))));
  area[64 + n % 32] = uint8_t(area[64 + n % 32] | (((v >> 4) & 3) << (2 * (n / 32))));
}
int get6(const uint8_t* area, int n) {
  return ((area[n % 64] >> (4 * (n / 64))) & 0xF) | (((area[64 + n % 32] >> (2 * (n / 32))) & 3) << 4);
}

// Q3_K's 16 six-bit scales (0..63, before the -32) from its 12 packed bytes, and back.
void q3k_scales_get(const uint8_t* s, int* s6) {
  for (int j = 0; j < 16; ++j) {
    const int lo = j < 8 ? (s[j] & 0xF) : (s[j - 8] >> 4);
    s6[j] = lo | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
  }
}
void q3k_scales_put(const int* s6, uint8_t* s) {
  std::memset(s, 0, 12);
  for (int j = 0; j < 16; ++j) {
    s[j % 8] = uint8_t(s[j % 8] | ((s6[j] & 0xF) << (j < 8 ? 0 : 4)));
    s[8 + j % 4] = uint8_t(s[8 + j % 4] | (((s6[j] >> 4) & 3) << (2 * (j / 4))));
  }
}
// Q4_K's eight 6-bit scales and mins (get_scale_min_k4's packing), and back.
void q4k_scales_get(const uint8_t* q, int* sc, int* mn) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}
void q4k_scales_put(const int* sc, const int* mn, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = uint8_t((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = uint8_t((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
    q[j + 8] = uint8_t((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
  }
}

// File-block value encoders: the inverse of k_values (kernels_scalar.cpp).
void put_values(T_ t, const uint8_t* q, void* blk) {
  switch (t) {
    case T_::Q2_K:
    case T_::Q3_K: {
      uint8_t* qs = t == T_::Q2_K ? static_cast<block_q2_K*>(blk)->qs : static_cast<block_q3_K*>(blk)->qs;
      std::memset(qs, 0, 64);
      if (t == T_::Q3_K) std::memset(static_cast<block_q3_K*>(blk)->hmask, 0, 32);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, i = e % 128, j = i / 32, l = i % 32;
        qs[32 * h + l] = uint8_t(qs[32 * h + l] | ((q[e] & 3) << (2 * j)));
        if (t == T_::Q3_K) {
          uint8_t& hm = static_cast<block_q3_K*>(blk)->hmask[l];
          hm = uint8_t(hm | (((q[e] >> 2) & 1) << (4 * h + j)));
        }
      }
      break;
    }
    case T_::Q4_K:
    case T_::Q5_K: {
      uint8_t* qs = t == T_::Q4_K ? static_cast<block_q4_K*>(blk)->qs : static_cast<block_q5_K*>(blk)->qs;
      std::memset(qs, 0, 128);
      if (t == T_::Q5_K) std::memset(static_cast<block_q5_K*>(blk)->qh, 0, 32);
      for (int e = 0; e < 256; ++e) {
        const int s = e / 32, l = e % 32;
        qs[32 * (s / 2) + l] = uint8_t(qs[32 * (s / 2) + l] | ((q[e] & 0xF) << ((s & 1) ? 4 : 0)));
        if (t == T_::Q5_K) {
          uint8_t& qh = static_cast<block_q5_K*>(blk)->qh[l];
          qh = uint8_t(qh | (((q[e] >> 4) & 1) << s));
        }
      }
      break;
    }
    case T_::Q6_K: {
      auto* b = static_cast<block_q6_K*>(blk);
      std::memset(b->ql, 0, sizeof b->ql);
      std::memset(b->qh, 0, sizeof b->qh);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, i = e % 128, tt = i / 32, l = i % 32;
        uint8_t& lb = b->ql[64 * h + l + 32 * (tt & 1)];
        lb = uint8_t(lb | ((q[e] & 0xF) << (tt < 2 ? 0 : 4)));
        b->qh[32 * h + l] = uint8_t(b->qh[32 * h + l] | (((q[e] >> 4) & 3) << (2 * tt)));
      }
      break;
    }
    default: fail(ErrorKind::Unsupported, "r8: no row-interleaved layout for type id ", int(t));
  }
}

// A row's value i in a super-block: its low field and, for Q3_K / Q6_K, its high field
// (hi.byte == 0 when there is none: no high field starts at byte 0).
void locate(T_ t, int r, int i, Field* lo, Field* hi, int* lo_bits) {
  *hi = {0, 0};
  switch (t) {
    case T_::Q2_K:
    case T_::Q3_K: {
      const int s = i / 16, w = i % 16, j = w / 4, k = w % 4;
      *lo = {size_t((t == T_::Q2_K ? 160 : 112) + 32 * s + 4 * r + k), 2 * j};
      *lo_bits = 2;
      if (t == T_::Q3_K) *hi = {size_t(624 + 32 * (s / 2) + 4 * r + k), j + 4 * (s & 1)};
      break;
    }
    case T_::Q4_K:
    case T_::Q5_K: {
      const int s = i / 32, w = i % 32, tt = w / 8, u = w % 8;
      *lo = {size_t(128 + 128 * s + 32 * tt + 4 * r + u % 4), 4 * (u / 4)};
      *lo_bits = 4;
      if (t == T_::Q5_K) *hi = {size_t(1152 + 32 * s + 4 * r + u % 4), 2 * tt + u / 4};
      break;
    }
    case T_::Q6_K: {
      const int s = i / 16, w = i % 16, tt = w / 8, u = w % 8, j = w / 4, k = w % 4;
      *lo = {size_t(144 + 96 * s + 32 * tt + 4 * r + u % 4), 4 * (u / 4)};
      *lo_bits = 4;
      *hi = {size_t(144 + 96 * s + 64 + 4 * r + k), 2 * j};
      break;
    }
    default: fail(ErrorKind::Unsupported, "r8: no row-interleaved layout for type id ", int(t));
  }
}

void sb_put_value(T_ t, uint8_t* sb, int r, int i, int v) {
  Field lo, hi;
  int bits;
  locate(t, r, i, &lo, &hi, &bits);
  sb[lo.byte] = uint8_t(sb[lo.byte] | ((v & ((1 << bits) - 1)) << lo.shift));
  if (hi.byte) sb[hi.byte] = uint8_t(sb[hi.byte] | ((v >> bits) << hi.shift));
}
int sb_get_value(T_ t, const uint8_t* sb, int r, int i) {
  Field lo, hi;
  int bits;
  locate(t, r, i, &lo, &hi, &bits);
  int v = (sb[lo.byte] >> lo.shift) & ((1 << bits) - 1);
  if (hi.byte) v |= ((sb[hi.byte] >> hi.shift) & (t == T_::Q6_K ? 3 : 1)) << bits;
  return v;
}

void put16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
uint16_t get16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

}  // namespace

bool supported(GgmlType t) {
  return t == T_::Q2_K || t == T_::Q3_K || t == T_::Q4_K || t == T_::Q5_K || t == T_::Q6_K;
}

bool enabled_for(CpuIsa isa) {
  const char* v = std::getenv("TENSORFOLD_REPACK");
  if (v && (std::strcmp(v, "off") == 0 || std::strcmp(v, "0") == 0)) return false;
  return isa == CpuIsa::Avx512 && detail::isa_available(CpuIsa::Avx512);
}

size_t block_bytes(GgmlType t) {
  switch (t) {
    case T_::Q2_K: return sizeof(block_q2_K);
    case T_::Q3_K: return sizeof(block_q3_K);
    case T_::Q4_K: return sizeof(block_q4_K);
    case T_::Q5_K: return sizeof(block_q5_K);
    case T_::Q6_K: return sizeof(block_q6_K);
    default: fail(ErrorKind::Unsupported, "r8: no row-interleaved layout for type id ", int(t));
  }
}

namespace {

// The value fields of a super-block from the eight rows' values, a byte at a time (the
// inverse of sb_get_value, without its per-value lookup: a load-time pass over every weight).
void put_value_fields(T_ t, const uint8_t (*q)[256], uint8_t* sb) {
  auto pack2 = [](const uint8_t* v) {  // v[0], v[4], v[8], v[12] -> bits 0, 2, 4, 6
    return uint8_t((v[0] & 3) | ((v[4] & 3) << 2) | ((v[8] & 3) << 4) | ((v[12] & 3) << 6));
  };
  switch (t) {
    case T_::Q2_K:
    case T_::Q3_K: {
      uint8_t* lo = sb + (t == T_::Q2_K ? 160 : 112);
      for (int s = 0; s < 16; ++s)
        for (int r = 0; r < kRows; ++r)
          for (int k = 0; k < 4; ++k) lo[32 * s + 4 * r + k] = pack2(q[r] + 16 * s + k);
      if (t == T_::Q3_K) {
        uint8_t* hb = sb + 624;
        for (int p = 0; p < 8; ++p)
          for (int r = 0; r < kRows; ++r)
            for (int k = 0; k < 4; ++k) {
              int v = 0;
              for (int par = 0; par < 2; ++par)
                for (int j = 0; j < 4; ++j) v |= ((q[r][16 * (2 * p + par) + 4 * j + k] >> 2) & 1) << (j + 4 * par);
              hb[32 * p + 4 * r + k] = uint8_t(v);
            }
      }
      break;
    }
    case T_::Q4_K:
    case T_::Q5_K: {
      uint8_t* v = sb + 128;
      for (int s = 0; s < 8; ++s)
        for (int tt = 0; tt < 4; ++tt)
          for (int r = 0; r < kRows; ++r)
            for (int k = 0; k < 4; ++k) {
              const uint8_t* x = q[r] + 32 * s + 8 * tt + k;
              v[128 * s + 32 * tt + 4 * r + k] = uint8_t((x[0] & 0xF) | ((x[4] & 0xF) << 4));
            }
      if (t == T_::Q5_K)  // bit 4 of v[32s + 8tt + 4n + k] at bit 2tt + n of byte 4r + k
        for (int s = 0; s < 8; ++s)
          for (int r = 0; r < kRows; ++r)
            for (int k = 0; k < 4; ++k) {
              int h = 0;
              for (int w = 0; w < 8; ++w) h |= ((q[r][32 * s + 4 * w + k] >> 4) & 1) << w;
              sb[1152 + 32 * s + 4 * r + k] = uint8_t(h);
            }
      break;
    }
    case T_::Q6_K: {
      for (int s = 0; s < 16; ++s) {
        uint8_t* p = sb + 144 + 96 * s;
        for (int r = 0; r < kRows; ++r)
          for (int k = 0; k < 4; ++k) {
            const uint8_t* x = q[r] + 16 * s + k;
            p[4 * r + k] = uint8_t((x[0] & 0xF) | ((x[4] & 0xF) << 4));
            p[32 + 4 * r + k] = uint8_t((x[8] & 0xF) | ((x[12] & 0xF) << 4));
            p[64 + 4 * r + k] = uint8_t(((x[0] >> 4) & 3) | (((x[4] >> 4) & 3) << 2) | (((x[8] >> 4) & 3) << 4) |
                                        (((x[12] >> 4) & 3) << 6));
          }
      }
      break;
    }
    default: fail(ErrorKind::Unsupported, "r8: no row-interleaved layout for type id ", int(t));
  }
}

}  // namespace

namespace {

uint64_t ld64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
void st64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

// k_values for the R8 types, eight values per 64-bit word (the load-time pass reads every
// weight once; k_values' value-at-a-time loop was most of its time).
void values_fast(T_ t, const uint8_t* blk, uint8_t* q) {
  constexpr uint64_t m1 = 0x0101010101010101ull, m2 = 0x0303030303030303ull, m4 = 0x0F0F0F0F0F0F0F0Full;
  switch (t) {
    case T_::Q2_K:
    case T_::Q3_K: {
      const uint8_t* qs = t == T_::Q2_K ? reinterpret_cast<const block_q2_K*>(blk)->qs
                                        : reinterpret_cast<const block_q3_K*>(blk)->qs;
      const uint8_t* hm = t == T_::Q3_K ? reinterpret_cast<const block_q3_K*>(blk)->hmask : nullptr;
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j)
          for (int l = 0; l < 32; l += 8) {
            uint64_t v = (ld64(qs + 32 * h + l) >> (2 * j)) & m2;
            if (hm) v |= ((ld64(hm + l) >> (4 * h + j)) & m1) << 2;
            st64(q + 128 * h + 32 * j + l, v);
          }
      break;
    }
    case T_::Q4_K: {
      const uint8_t* qs = reinterpret_cast<const block_q4_K*>(blk)->qs;
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; l += 8) {
          const uint64_t x = ld64(qs + 32 * c + l);
          st64(q + 64 * c + l, x & m4);
          st64(q + 64 * c + 32 + l, (x >> 4) & m4);
        }
      break;
    }
    case T_::Q6_K: {
      const auto* b = reinterpret_cast<const block_q6_K*>(blk);
      for (int h = 0; h < 2; ++h)
        for (int tt = 0; tt < 4; ++tt)
          for (int l = 0; l < 32; l += 8) {
            const uint64_t lb = ld64(b->ql + 64 * h + l + 32 * (tt & 1));
            const uint64_t lo = tt < 2 ? (lb & m4) : ((lb >> 4) & m4);
            const uint64_t hi = (ld64(b->qh + 32 * h + l) >> (2 * tt)) & m2;
            st64(q + 128 * h + 32 * tt + l, lo | (hi << 4));
          }
      break;
    }
    case T_::Q5_K: {
      const auto* b = reinterpret_cast<const block_q5_K*>(blk);
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; l += 8) {
          const uint64_t x = ld64(b->qs + 32 * c + l), h = ld64(b->qh + l);
          st64(q + 64 * c + l, (x & m4) | (((h >> (2 * c)) & m1) << 4));
          st64(q + 64 * c + 32 + l, ((x >> 4) & m4) | (((h >> (2 * c + 1)) & m1) << 4));
        }
      break;
    }
    default: detail::k_values(t, blk, q);
  }
}

}  // namespace

void pack_superblock(GgmlType t, const uint8_t* const rows[kRows], uint8_t* sb) {
  std::memset(sb, 0, kRows * block_bytes(t));
  uint8_t q[kRows][256];
  for (int r = 0; r < kRows; ++r) values_fast(t, rows[r], q[r]);
  put_value_fields(t, q, sb);
  for (int r = 0; r < kRows; ++r) {
    switch (t) {
      case T_::Q2_K: {
        const auto* b = reinterpret_cast<const block_q2_K*>(rows[r]);
        put16(sb + 2 * r, b->d);
        put16(sb + 16 + 2 * r, b->dmin);
        for (int s = 0; s < 16; ++s) sb[32 + 8 * s + r] = b->scales[s];
        break;
      }
      case T_::Q3_K: {
        const auto* b = reinterpret_cast<const block_q3_K*>(rows[r]);
        put16(sb + 2 * r, b->d);
        int s6[16];
        q3k_scales_get(b->scales, s6);
        for (int s = 0; s < 16; ++s) put6(sb + 16, 8 * s + r, s6[s]);
        break;
      }
      case T_::Q4_K:
      case T_::Q5_K: {
        // d, dmin and the 12 scale bytes sit at the same offsets in both blocks
        const auto* b = reinterpret_cast<const block_q4_K*>(rows[r]);
        put16(sb + 2 * r, b->d);
        put16(sb + 16 + 2 * r, b->dmin);
        int sc[8], mn[8];
        q4k_scales_get(b->scales, sc, mn);
        for (int s = 0; s < 8; ++s) {
          put6(sb + 32, 8 * s + r, sc[s]);
          put6(sb + 32, 64 + 8 * s + r, mn[s]);
        }
        break;
      }
      case T_::Q6_K: {
        const auto* b = reinterpret_cast<const block_q6_K*>(rows[r]);
        put16(sb + 2 * r, b->d);
        for (int s = 0; s < 16; ++s) sb[16 + 8 * s + r] = uint8_t(b->scales[s]);
        break;
      }
      default: fail(ErrorKind::Unsupported, "r8: no row-interleaved layout for type id ", int(t));
    }
  }
}

void unpack_superblock(GgmlType t, const uint8_t* sb, uint8_t* const rows[kRows]) {
  uint8_t q[256];
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < 256; ++i) q[i] = uint8_t(sb_get_value(t, sb, r, i));
    put_values(t, q, rows[r]);
    switch (t) {
      case T_::Q2_K: {
        auto* b = reinterpret_cast<block_q2_K*>(rows[r]);
        b->d = get16(sb + 2 * r);
        b->dmin = get16(sb + 16 + 2 * r);
        for (int s = 0; s < 16; ++s) b->scales[s] = sb[32 + 8 * s + r];
        break;
      }
      case T_::Q3_K: {
        auto* b = reinterpret_cast<block_q3_K*>(rows[r]);
        b->d = get16(sb + 2 * r);
        int s6[16];
        for (int s = 0; s < 16; ++s) s6[s] = get6(sb + 16, 8 * s + r);
        q3k_scales_put(s6, b->scales);
        break;
      }
      case T_::Q4_K:
      case T_::Q5_K: {
        auto* b = reinterpret_cast<block_q4_K*>(rows[r]);  // the same header as block_q5_K
        b->d = get16(sb + 2 * r);
        b->dmin = get16(sb + 16 + 2 * r);
        int sc[8], mn[8];
        for (int s = 0; s < 8; ++s) {
          sc[s] = get6(sb + 32, 8 * s + r);
          mn[s] = get6(sb + 32, 64 + 8 * s + r);
        }
        q4k_scales_put(sc, mn, b->scales);
        break;
      }
      case T_::Q6_K: {
        auto* b = reinterpret_cast<block_q6_K*>(rows[r]);
        b->d = get16(sb + 2 * r);
        for (int s = 0; s < 16; ++s) b->scales[s] = int8_t(sb[16 + 8 * s + r]);
        break;
      }
      default: fail(ErrorKind::Unsupported, "r8: no row-interleaved layout for type id ", int(t));
    }
  }
}

void pack_group(GgmlType t, const uint8_t* rows8, int64_t nb, uint8_t* out) {
  const size_t bb = block_bytes(t), row = size_t(nb) * bb;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rows[kRows];
    for (int r = 0; r < kRows; ++r) rows[r] = rows8 + r * row + size_t(b) * bb;
    pack_superblock(t, rows, out + size_t(b) * kRows * bb);
  }
}

void unpack_group(GgmlType t, const uint8_t* sb0, int64_t nbv, uint8_t* out, size_t out_stride) {
  const size_t bb = block_bytes(t);
  for (int64_t b = 0; b < nbv; ++b) {
    uint8_t* rows[kRows];
    for (int r = 0; r < kRows; ++r) rows[r] = out + r * out_stride + size_t(b) * bb;
    unpack_superblock(t, sb0 + size_t(b) * kRows * bb, rows);
  }
}

void gemv_ref(GgmlType t, int64_t nb, const uint8_t* sb0, const void* xq, size_t xs, int64_t ncols, float* y,
              int64_t ldy) {
  const size_t bb = block_bytes(t);
  // Q3_K's and Q6_K's offsets (4, 32) scale with the same d: taken off in integers.
  const bool fold = t == T_::Q3_K || t == T_::Q6_K;
  std::vector<uint8_t> blocks(kRows * bb);
  for (int64_t c = 0; c < ncols; ++c) {
    float acc[kRows] = {};
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* rows[kRows];
      for (int r = 0; r < kRows; ++r) rows[r] = blocks.data() + r * bb;
      unpack_superblock(t, sb0 + size_t(b) * kRows * bb, rows);
      const auto* a = reinterpret_cast<const detail::ActK*>(static_cast<const uint8_t*>(xq) + size_t(c) * xs) + b;
      for (int r = 0; r < kRows; ++r) {
        detail::KUnpacked u;
        uint8_t q[256];
        detail::k_scales(t, rows[r], &u);
        detail::k_values(t, rows[r], q);
        // The sums formed as the vector kernels form them.
        int32_t isum = 0, msum = 0;
        const int off = t == T_::Q3_K ? 4 : 32;
        for (int s = 0; s < 16; ++s) {
          int32_t dot = 0;
          for (int i = 16 * s; i < 16 * s + 16; ++i) dot += int32_t(q[i]) * int32_t(a->qs[i]);
          if (fold) isum += int32_t(u.sc[s]) * (dot - off * int32_t(a->bsums[s]));
          else {
            isum += int32_t(u.sc[s]) * dot;
            msum += int32_t(u.mn[s]) * int32_t(a->bsums[s]);
          }
        }
        float tt = float(isum) * u.d;
        if (!fold) tt = std::fma(float(msum), -u.dmin, tt);
        acc[r] = std::fma(tt, a->d, acc[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) y[c * ldy + r] = acc[r];
  }
}

GemvFn best_gemv() {
#if TF_HAVE_X86_KERNELS
  if (detail::isa_available(CpuIsa::Avx512)) return gemv_avx512;
  if (detail::isa_available(CpuIsa::Avx2)) return gemv_avx2;
#endif
  return gemv_ref;
}

const char* best_gemv_name() {
  const GemvFn f = best_gemv();
#if TF_HAVE_X86_KERNELS
  if (f == gemv_avx512) return "avx512";
  if (f == gemv_avx2) return "avx2";
#endif
  (void)f;
  return "scalar";
}

}  // namespace tf::cpu::r8
