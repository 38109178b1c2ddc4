#include "model/weights.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/interrupt.h"
#include "quant/traits.h"

namespace tf {

namespace {
constexpr size_t kReadWindow = size_t(64) << 20;  // bytes per pread: large, yet a small transient

std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

// Drops the file's cached pages of [offset, offset + n), rounded out to whole pages: a partial
// page would otherwise stay. Pages someone has mapped (or dirty ones) are never dropped, so
// the rounding cannot hurt another user of the file; a neighbour's page merely is re-read.
void drop_page_cache(int fd, uint64_t offset, size_t n) {
  static const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = offset / page * page, end = (offset + n + page - 1) / page * page;
  ::posix_fadvise(fd, off_t(begin), off_t(end - begin), POSIX_FADV_DONTNEED);
}
}  // namespace

void WeightLoader::check_computable(const GgufTensorInfo& t) const {
  if (!t.type_supported) {  // a type TensorFold does not compute with: the table's message
    try {
      type_traits(t.type());
    } catch (const Error& e) {
      fail(ErrorKind::Unsupported, file_->display_path(), ": tensor ", t.name, ": ", e.what());
    }
  }
  // Formats a backend lacks are refused by name at load, never computed some other way.
  if (be_ && !be_->supports(t.type()))
    fail(ErrorKind::Unsupported, file_->display_path(), ": tensor ", t.name, " has type ",
         type_name(t.type_id) ? type_name(t.type_id) : "?", ", which the ", be_->name(),
         " backend cannot compute with (it supports: ", be_->supported_types(), ")");
}

WeightLoader::WeightLoader(std::shared_ptr<GgufFile> file, const TpShard& tp, const Backend* be)
    : file_(std::move(file)), tp_(tp), be_(be) {}

void (*WeightLoader::dequantizer(const std::string& name) const)(const void*, float*, int64_t) {
  const GgufTensorInfo* t = file_->find_tensor(name);
  TF_CHECK(t != nullptr, file_->display_path(), ": tensor ", name, " is missing");
  const TypeTraits* tr = find_type_traits(t->type_id);
  if (!tr || !tr->dequantize_ref)
    fail(ErrorKind::Unsupported, file_->display_path(), ": tensor ", t->name, " has type ", tr ? tr->name : "?",
         " which TensorFold cannot read (no dequantization for it)");
  return tr->dequantize_ref;
}

Weight WeightLoader::weight(const std::string& name, int64_t k, int64_t rows, bool required, bool compute) {
  const GgufTensorInfo* t = file_->find_tensor(name);
  if (!t) {
    if (required) fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " is missing");
    return Weight{};
  }
  if (t->ne.size() != 2 || t->ne[0] != k || t->ne[1] != rows)
    fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " has shape ", shape_str(t->ne),
         ", expected [", k, ", ", rows, "]");
  if (compute)
    check_computable(*t);
  else
    dequantizer(name);
  Weight w;
  w.type = t->type();
  w.k = k;
  w.rows = rows;
  w.data = t->data;
  w.row_stride = row_bytes(w.type, k);
  bytes_ += t->nbytes;
  return w;
}

WeightStack WeightLoader::stack(const std::string& name, int64_t k, int64_t rows, int64_t n) {
  const GgufTensorInfo* t = file_->find_tensor(name);
  if (!t) fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " is missing");
  if (t->ne.size() != 3 || t->ne[0] != k || t->ne[1] != rows || t->ne[2] != n)
    fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " has shape ", shape_str(t->ne),
         ", expected [", k, ", ", rows, ", ", n, "]");
  check_computable(*t);
  WeightStack s;
  s.first.type = t->type();
  s.first.k = k;
  s.first.rows = rows;
  s.first.data = t->data;
  s.first.row_stride = row_bytes(s.first.type, k);
  s.n = n;
  s.stride = s.first.row_stride * size_t(rows);
  bytes_ += t->nbytes;
  return s;
}

const float* WeightLoader::vector(const std::string& name, int64_t n, bool required) {
  return floats(name, {n}, required);
}

namespace {
// The tensor's shape is `shape` (trailing unit dimensions allowed, as ggml treats them alike).
bool has_shape(const GgufTensorInfo& t, const std::vector<int64_t>& shape) {
  if (t.ne.size() < shape.size()) return false;
  for (size_t i = 0; i < t.ne.size(); ++i)
    if (t.ne[i] != (i < shape.size() ? shape[i] : 1)) return false;
  return true;
}
}  // namespace

const int32_t* WeightLoader::ints(const std::string& name, const std::vector<int64_t>& shape, bool required) {
  const GgufTensorInfo* t = file_->find_tensor(name);
  if (!t) {
    if (required) fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " is missing");
    return nullptr;
  }
  if (t->type_id != 26 || !has_shape(*t, shape))
    fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " is ", shape_str(t->ne), " of type ",
         t->type_id, ", expected I32 ", shape_str(shape));
  bytes_ += t->nbytes;
  size_t n = 1;
  for (int64_t d : shape) n *= size_t(d);
  owned_ints_.emplace_back(n);
  read_at(t->data, owned_ints_.back().data(), n * sizeof(int32_t), false);  // a private copy (aligned)
  return owned_ints_.back().data();
}

const float* WeightLoader::floats(const std::string& name, const std::vector<int64_t>& shape, bool required) {
  const GgufTensorInfo* t = file_->find_tensor(name);
  if (!t) {
    if (required) fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " is missing");
    return nullptr;
  }
  if (!has_shape(*t, shape))
    fail(ErrorKind::InvalidInput, file_->display_path(), ": tensor ", name, " has shape ", shape_str(t->ne),
         ", expected ", shape_str(shape));
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  bytes_ += t->nbytes;
  const bool aligned = reinterpret_cast<uintptr_t>(t->data) % alignof(float) == 0;
  if (t->type() == GgmlType::F32 && tp_.size == 1 && aligned) return reinterpret_cast<const float*>(t->data);
  float* out = owned_floats(size_t(n));
  if (t->type() == GgmlType::F32) {
    // A private copy: under TP so the mapping's pages (and their neighbours) stay untouched;
    // otherwise because general.alignment 1 or 2 may leave the floats misaligned.
    if (tp_.size > 1)
      read_at(t->data, out, size_t(n) * sizeof(float), false);
    else
      std::memcpy(out, t->data, size_t(n) * sizeof(float));
    return out;
  }
  // Small vectors in other formats are converted once at load.
  const auto dequant = dequantizer(name);
  if (tp_.size > 1) {
    std::vector<uint8_t> raw(size_t(t->nbytes));
    read_at(t->data, raw.data(), raw.size(), false);
    dequant(raw.data(), out, n);
  } else {
    dequant(t->data, out, n);
  }
  return out;
}

float* WeightLoader::owned_floats(size_t n) {
  owned_floats_.emplace_back(n);
  return owned_floats_.back().data();
}

std::vector<std::pair<const void*, size_t>> WeightLoader::owned_ranges() const {
  std::vector<std::pair<const void*, size_t>> out;
  for (const auto& v : owned_floats_)
    if (!v.empty()) out.emplace_back(v.data(), v.size() * sizeof(float));
  for (const auto& v : owned_ints_)
    if (!v.empty()) out.emplace_back(v.data(), v.size() * sizeof(int32_t));
  for (size_t i = 0; i < owned_.size(); ++i)
    if (owned_sizes_[i] > 0) out.emplace_back(owned_[i].get(), owned_sizes_[i]);
  return out;
}

uint8_t* WeightLoader::owned_bytes(size_t n) {
  owned_sizes_.push_back(n);
  owned_.emplace_back(new uint8_t[std::max<size_t>(n, 1)]);
  return owned_.back().get();
}

void WeightLoader::read_at(const uint8_t* src, void* dst, size_t n, bool drop_cache) const {
  // Read from the file rather than the mapping, so the mapping's pages stay untouched; the
  // part (of a split model) that holds the bytes is found from their address.
  const auto [part, start] = file_->locate(src, n);
  uint64_t offset = start;
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    check_interrupt();  // TP loads read gigabytes: Ctrl-C must not wait for all of them
    if (tp_.abandon && tp_.abandon->load()) fail(ErrorKind::Runtime, "loading abandoned: the TP peer is gone");
    const ssize_t r = ::pread(part->fd, p, std::min(n, kReadWindow), off_t(offset));
    if (r <= 0) fail(ErrorKind::Runtime, part->shown, ": read failed while loading a TP slice");
    // The private copy is what stays resident; the file's pages go as soon as they are copied.
    if (drop_cache) drop_page_cache(part->fd, offset, size_t(r));
    p += r;
    offset += uint64_t(r);
    n -= size_t(r);
  }
}

void WeightLoader::read_cols(const uint8_t* src, int64_t rows, size_t row_stride, size_t skip, size_t n,
                             uint8_t* dst) const {
  // Whole rows in windows of about kReadWindow, one pread each (a pread per row part would be
  // millions of small reads, and dropping a part's pages would miss the pages it shares with
  // the other rank's part), then this rank's part of every row is copied out.
  const int64_t window = std::max<int64_t>(1, int64_t(kReadWindow / row_stride));
  std::unique_ptr<uint8_t[]> buf(new uint8_t[size_t(std::min(window, rows)) * row_stride]);
  for (int64_t r0 = 0; r0 < rows; r0 += window) {
    const int64_t cnt = std::min(window, rows - r0);
    read_at(src + size_t(r0) * row_stride, buf.get(), size_t(cnt) * row_stride);
    for (int64_t r = 0; r < cnt; ++r)
      std::memcpy(dst + size_t(r0 + r) * n, buf.get() + size_t(r) * row_stride + skip, n);
  }
}

Weight WeightLoader::keep(const Weight& w) { return slice_rows(w, 0, w.rows); }

Weight WeightLoader::slice_rows(const Weight& w, int64_t r0, int64_t r1) {
  Weight s = w;
  s.rows = r1 - r0;
  count(s);
  if (tp_.plan_only || s.rows <= 0) return s;  // sizes only
  const size_t n = w.row_stride * size_t(s.rows);
  uint8_t* dst = owned_bytes(n);
  read_at(w.data + size_t(r0) * w.row_stride, dst, n);
  s.data = dst;
  return s;
}

Weight WeightLoader::slice_cols(const Weight& w, int64_t c0, int64_t c1) {
  Weight s = w;
  s.k = c1 - c0;
  s.row_stride = row_bytes(w.type, s.k);
  count(s);
  if (tp_.plan_only) return s;
  uint8_t* dst = owned_bytes(s.row_stride * size_t(w.rows));
  read_cols(w.data, w.rows, w.row_stride, row_bytes(w.type, c0), s.row_stride, dst);
  s.data = dst;
  return s;
}

WeightStack WeightLoader::slice_rows(const WeightStack& w, int64_t r0, int64_t r1) {
  WeightStack s = w;
  s.first.rows = r1 - r0;
  const size_t per = w.first.row_stride * size_t(s.first.rows);
  s.stride = per;
  bytes_ += uint64_t(per) * uint64_t(w.n);
  if (tp_.plan_only) return s;
  uint8_t* dst = owned_bytes(per * size_t(w.n));
  for (int64_t e = 0; e < w.n; ++e)
    read_at(w.first.data + size_t(e) * w.stride + size_t(r0) * w.first.row_stride, dst + size_t(e) * per, per);
  s.first.data = dst;
  return s;
}

WeightStack WeightLoader::slice_cols(const WeightStack& w, int64_t c0, int64_t c1) {
  WeightStack s = w;
  s.first.k = c1 - c0;
  s.first.row_stride = row_bytes(w.first.type, s.first.k);
  s.stride = s.first.row_stride * size_t(w.first.rows);
  bytes_ += uint64_t(s.stride) * uint64_t(w.n);
  if (tp_.plan_only) return s;
  const size_t skip = row_bytes(w.first.type, c0);
  uint8_t* dst = owned_bytes(s.stride * size_t(w.n));
  const size_t packed = w.first.row_stride * size_t(w.first.rows);
  if (w.stride == packed) {  // the matrices' rows follow each other: one run of rows
    read_cols(w.first.data, w.first.rows * w.n, w.first.row_stride, skip, s.first.row_stride, dst);
  } else {
    for (int64_t e = 0; e < w.n; ++e)
      read_cols(w.first.data + size_t(e) * w.stride, w.first.rows, w.first.row_stride, skip, s.first.row_stride,
                dst + size_t(e) * s.stride);
  }
  s.first.data = dst;
  return s;
}

WeightStack WeightLoader::slice_stack(const WeightStack& w, int64_t e0, int64_t e1) {
  WeightStack s = w;
  s.n = e1 - e0;
  // The matrices packed (a view may have gaps between them: MLA's W_vb inside attn_kv_b).
  const size_t per = w.first.row_stride * size_t(w.first.rows);
  s.stride = per;
  bytes_ += uint64_t(per) * uint64_t(s.n);
  if (tp_.plan_only) return s;
  uint8_t* dst = owned_bytes(per * size_t(s.n));
  if (per == w.stride) {
    read_at(w.first.data + size_t(e0) * w.stride, dst, per * size_t(s.n));
  } else {
    for (int64_t e = e0; e < e1; ++e) read_at(w.first.data + size_t(e) * w.stride, dst + size_t(e - e0) * per, per);
  }
  s.first.data = dst;
  return s;  // matrix e of the model is local matrix e - e0
}

Weight WeightLoader::kview(const Weight& w, int64_t c0, int64_t c1) {
  Weight v = w;
  v.data = w.data + row_bytes(w.type, c0);
  v.k = c1 - c0;
  v.k0 = w.k0 + c0;
  return v;  // row_stride unchanged: a column range of every row
}

WeightStack WeightLoader::kview(const WeightStack& w, int64_t c0, int64_t c1) {
  WeightStack v = w;
  v.first = kview(w.first, c0, c1);
  return v;
}

int64_t WeightLoader::block_size(const Weight& w) {
  return w.rows > 0 ? find_type_traits(uint32_t(w.type))->block_size : 1;
}

int64_t WeightLoader::split_point(int64_t n, int64_t al) {
  int64_t best = -1;
  for (int64_t c = al; c < n; c += al)
    if (best < 0 || std::llabs(2 * c - n) < std::llabs(2 * best - n)) best = c;
  return best;
}

}  // namespace tf
