// Bounds-checked, memory-mapped GGUF reader (GGUF v2 / v3, little-endian).
//
// Layout (all little-endian):
//   magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
//   kv_count x { string key | u32 value_type | value }
//   tensor_count x { string name | u32 n_dims | n_dims x u64 ne | u32 type | u64 offset }
//   padding to `general.alignment` (default 32) | tensor data
// where string = u64 length + bytes, and an array value = u32 elem_type + u64 count + elements.
//
// Nothing read from the file is trusted: every length is checked against the bytes that remain
// before anything is allocated or dereferenced, and every error names the file, the problem and
// where it is (byte offset, key or tensor).
//
// Split models: open_one() parses and validates one file; open_split() finds, opens and
// validates the other parts and merges their tensor tables into the first part's object.
#include "gguf/gguf_reader.h"

#include "core/interrupt.h"
#include "gguf/mapping_guard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "core/error.h"
#include "quant/traits.h"

namespace tf {

namespace {

constexpr uint32_t kMaxArrayDepth = 8;       // nested arrays deeper than this are refused
constexpr uint64_t kDefaultAlignment = 32;
constexpr uint32_t kNumValueTypes = 13;
// Real models carry well under a thousand keys and tens of thousands of tensors; the caps keep
// the per-entry bookkeeping of a hostile header (one key costs ~200 bytes here, 14 on disk)
// bounded.
constexpr uint64_t kMaxKeys = 1u << 16;
constexpr uint64_t kMaxTensors = 1u << 20;

// Smallest encodings, used to bound counts by the bytes that remain in the file.
constexpr uint64_t kMinKvBytes = 8 + 1 + 4 + 1;               // key len, 1-byte key, type, u8 value
constexpr uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 8 + 4 + 8;  // name len, name, n_dims, ne, type, offset

const char* value_type_name(uint32_t t) {
  static const char* const names[kNumValueTypes] = {
      "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
      "bool",  "string", "array", "uint64", "int64", "float64"};
  return t < kNumValueTypes ? names[t] : "unknown";
}

uint64_t fixed_size(GgufValueType t) { return gguf_fixed_size(t); }

bool is_integer(GgufValueType t) {
  switch (t) {
    case GgufValueType::UINT8: case GgufValueType::INT8: case GgufValueType::UINT16:
    case GgufValueType::INT16: case GgufValueType::UINT32: case GgufValueType::INT32:
    case GgufValueType::UINT64: case GgufValueType::INT64: return true;
    default: return false;
  }
}

bool is_float(GgufValueType t) {
  return t == GgufValueType::FLOAT32 || t == GgufValueType::FLOAT64;
}

std::string describe_type(const GgufValue& v) {
  std::string s = value_type_name(static_cast<uint32_t>(v.type));
  if (v.type == GgufValueType::ARRAY) {
    s += "[";
    s += value_type_name(static_cast<uint32_t>(v.elem_type));
    s += "]";
  }
  return s;
}

// Printable, bounded rendering of a name read from the file, for error messages.
std::string quote(const std::string& s) {
  std::string out = "'";
  size_t n = 0;
  for (unsigned char c : s) {
    if (++n > 80) { out += "..."; break; }
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += static_cast<char>(c);
    } else {
      static const char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  out += "'";
  return out;
}

// Sequential little-endian reader over the mapping; all reads bounds-checked.
class Cursor {
 public:
  Cursor(const std::string& path, const uint8_t* base, uint64_t size)
      : path_(path), base_(base), size_(size) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }
  const uint8_t* here() const { return base_ + pos_; }
  void seek(uint64_t pos) { pos_ = pos <= size_ ? pos : size_; }
  // What is being parsed, e.g. "key #3 ('general.name')"; used in error messages.
  std::string where;

  void need(uint64_t n, const char* field) const {
    if (n > size_ - pos_) {
      uint64_t end_hi = pos_ + n;  // may wrap for absurd n; report what we can
      if (end_hi < pos_) {
        fail(ErrorKind::InvalidInput, path_, ": truncated: ", where, " ", field, " at byte ", pos_,
             " needs ", n, " bytes, past the end of the ", size_, "-byte file");
      }
      fail(ErrorKind::InvalidInput, path_, ": truncated: ", where, " ", field, " at byte ", pos_,
           " ends at byte ", end_hi, " past the end of the ", size_, "-byte file");
    }
  }

  template <typename T>
  T read(const char* field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));  // host is little-endian (x86-64 / arm64)
    pos_ += sizeof(T);
    return v;
  }
  uint8_t u8(const char* f) { return read<uint8_t>(f); }
  uint32_t u32(const char* f) { return read<uint32_t>(f); }
  uint64_t u64(const char* f) { return read<uint64_t>(f); }

  std::string str(const char* field) {
    uint64_t start = pos_;
    uint64_t len = u64(field);
    if (len > remaining()) {
      fail(ErrorKind::InvalidInput, path_, ": truncated: ", where, " ", field, " at byte ", start,
           " has length ", len, " but only ", remaining(), " bytes remain in the ", size_,
           "-byte file");
    }
    std::string s(reinterpret_cast<const char*>(base_ + pos_), static_cast<size_t>(len));
    pos_ += len;
    return s;
  }

  void skip(uint64_t n, const char* field) {
    need(n, field);
    pos_ += n;
  }

  // A string's bytes are only checked to be inside the file.
  void skip_str(const char* field) {
    uint64_t start = pos_;
    uint64_t len = u64(field);
    if (len > remaining()) {
      fail(ErrorKind::InvalidInput, path_, ": truncated: ", where, " ", field, " at byte ", start,
           " has length ", len, " but only ", remaining(), " bytes remain in the ", size_,
           "-byte file");
    }
    pos_ += len;
  }

  [[noreturn]] void error(uint64_t at, const std::string& what) const {
    fail(ErrorKind::InvalidInput, path_, ": ", what, " (", where, ", at byte ", at, ")");
  }

 private:
  const std::string& path_;
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

// Strict UTF-8 check (no overlong forms, surrogates or code points above U+10FFFF), the same
// rules as Python's decoder, so names always round-trip through Python str.
bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  while (i < n) {
    unsigned c = p[i];
    if (c < 0x80) { ++i; continue; }
    size_t len;
    uint32_t cp, min;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; min = 0x80; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; min = 0x800; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; min = 0x10000; }
    else return false;
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

uint32_t read_value_type(Cursor& c, const char* field) {
  uint64_t at = c.pos();
  uint32_t t = c.u32(field);
  if (t >= kNumValueTypes) c.error(at, std::string("unknown value type ") + std::to_string(t));
  return t;
}

// One scalar element of a fixed-size type, as (int64, uint64, double).
void read_scalar(Cursor& c, GgufValueType t, int64_t& i, uint64_t& u, double& f) {
  u = 0;
  switch (t) {
    case GgufValueType::UINT8: u = c.u8("uint8 value"); i = static_cast<int64_t>(u); break;
    case GgufValueType::INT8: i = c.read<int8_t>("int8 value"); break;
    case GgufValueType::UINT16: u = c.read<uint16_t>("uint16 value"); i = static_cast<int64_t>(u); break;
    case GgufValueType::INT16: i = c.read<int16_t>("int16 value"); break;
    case GgufValueType::UINT32: u = c.u32("uint32 value"); i = static_cast<int64_t>(u); break;
    case GgufValueType::INT32: i = c.read<int32_t>("int32 value"); break;
    case GgufValueType::UINT64: u = c.u64("uint64 value"); i = static_cast<int64_t>(u); break;
    case GgufValueType::INT64: i = c.read<int64_t>("int64 value"); break;
    case GgufValueType::FLOAT32: f = c.read<float>("float32 value"); break;
    case GgufValueType::FLOAT64: f = c.read<double>("float64 value"); break;
    case GgufValueType::BOOL: {
      uint64_t at = c.pos();
      uint8_t b = c.u8("bool value");
      if (b > 1) c.error(at, "bool value is " + std::to_string(b) + ", not 0 or 1");
      i = b;
      break;
    }
    default: c.error(c.pos(), "internal: not a scalar type");
  }
}

// Validates one array (element type, count, every element; nested arrays recursively) and
// records where its elements are, without copying any of them.
void read_array(Cursor& c, GgufValue& out, uint32_t depth) {
  uint64_t at = c.pos();
  if (depth >= kMaxArrayDepth) {
    c.error(at, "arrays nested deeper than " + std::to_string(kMaxArrayDepth) + " levels");
  }
  out.type = GgufValueType::ARRAY;
  out.depth = depth;
  auto et = static_cast<GgufValueType>(read_value_type(c, "array element type"));
  out.elem_type = et;
  uint64_t count_at = c.pos();
  uint64_t n = c.u64("array length");
  // Bound the count by the bytes left before walking anything.
  uint64_t min_elem = fixed_size(et);
  if (min_elem == 0) min_elem = et == GgufValueType::STRING ? 8 : 12;  // string len / nested header
  if (n > c.remaining() / min_elem) {
    c.error(count_at, "truncated or corrupt: array of " + std::to_string(n) + " " +
                          value_type_name(static_cast<uint32_t>(et)) + " elements needs at least " +
                          (n > std::numeric_limits<uint64_t>::max() / min_elem
                               ? std::string("2^64")
                               : std::to_string(n * min_elem)) +
                          " bytes but only " + std::to_string(c.remaining()) + " remain in the file");
  }
  out.count = n;
  out.begin = c.pos();
  if (et == GgufValueType::STRING) {
    for (uint64_t k = 0; k < n; ++k) c.skip_str("array string");
  } else if (et == GgufValueType::ARRAY) {
    GgufValue inner;
    for (uint64_t k = 0; k < n; ++k) read_array(c, inner, depth + 1);
  } else if (et == GgufValueType::BOOL) {
    const uint8_t* p = c.here();
    for (uint64_t k = 0; k < n; ++k) {
      if (p[k] > 1) {
        c.error(out.begin + k, "bool array element " + std::to_string(k) + " is " +
                                   std::to_string(p[k]) + ", not 0 or 1");
      }
    }
    c.skip(n, "bool elements");
  } else {
    c.skip(n * min_elem, "array elements");  // n * min_elem <= remaining(): no overflow
  }
  out.end = c.pos();
}

void read_value(Cursor& c, GgufValueType type, GgufValue& out) {
  out.type = type;
  if (type == GgufValueType::STRING) {
    out.s = c.str("string value");
  } else if (type == GgufValueType::ARRAY) {
    read_array(c, out, 0);
  } else {
    read_scalar(c, type, out.i, out.u, out.f);
  }
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }  // caller checks overflow

[[noreturn]] void not_gguf(const std::string& path, const uint8_t* p, uint64_t size) {
  auto starts = [&](const char* m, size_t n) { return size >= n && std::memcmp(p, m, n) == 0; };
  const char* what = nullptr;
  if (starts("tjgg", 4) || starts("fmgg", 4) || starts("lmgg", 4) || starts("algg", 4) ||
      starts("ggjt", 4) || starts("ggmf", 4) || starts("ggml", 4)) {
    what = "a legacy GGML/GGJT model file (pre-GGUF); convert it to GGUF first";
  } else if (starts("FUGG", 4)) {
    what = "byte-swapped GGUF magic (big-endian file?); only little-endian GGUF is supported";
  } else if (starts("PK\x03\x04", 4)) {
    what = "a ZIP archive (PyTorch checkpoint?), not GGUF";
  } else if (starts("\x89HDF", 4)) {
    what = "an HDF5 file, not GGUF";
  } else if (size >= 9 && p[8] == '{') {
    what = "a safetensors file, not GGUF (convert it with `tensorfold convert`)";
  } else if (size >= 2 && p[0] == 0x80 && p[1] <= 5) {
    what = "a Python pickle, not GGUF";
  } else if (starts("{", 1) || starts("<", 1) || starts("#", 1)) {
    what = "a text file, not GGUF";
  }
  std::string magic;
  for (uint64_t k = 0; k < 4 && k < size; ++k) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "%02x", p[k]);
    if (k) magic += ' ';
    magic += buf;
  }
  if (what) fail(ErrorKind::InvalidInput, path, ": not a GGUF file: looks like ", what,
                 " (magic bytes ", magic, " at byte 0)");
  fail(ErrorKind::InvalidInput, path, ": not a GGUF file: bad magic (bytes ", magic,
       " at byte 0, expected 'GGUF' = 47 47 55 46)");
}

}  // namespace

const char* gguf_type_name(GgufValueType t) { return value_type_name(static_cast<uint32_t>(t)); }

uint64_t gguf_fixed_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::UINT8: case GgufValueType::INT8: case GgufValueType::BOOL: return 1;
    case GgufValueType::UINT16: case GgufValueType::INT16: return 2;
    case GgufValueType::UINT32: case GgufValueType::INT32: case GgufValueType::FLOAT32: return 4;
    case GgufValueType::UINT64: case GgufValueType::INT64: case GgufValueType::FLOAT64: return 8;
    default: return 0;
  }
}

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // validated at open not to overflow
  return n;
}

GgufFile::~GgufFile() {
  for (GgufPart& part : parts_) {
    gguf_guard::unregister_mapping(part.guard_slot);
    if (part.base) munmap(const_cast<uint8_t*>(part.base), static_cast<size_t>(part.size));
    if (part.fd >= 0) ::close(part.fd);
  }
}

namespace {

const char* file_kind(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  return "not a regular file";
}

// Printable form of a path for messages: unchanged when it is valid UTF-8.
std::string display(const std::string& path) {
  if (valid_utf8(path)) return path;
  std::string q = quote(path);
  return q.substr(1, q.size() - 2);
}

}  // namespace

std::shared_ptr<GgufFile> GgufFile::open_one(const std::string& in_path) {
  std::shared_ptr<GgufFile> f(new GgufFile());
  f->parts_.emplace_back();
  GgufPart& part = f->parts_[0];
  part.path = in_path;
  part.shown = display(in_path);
  const std::string& path = part.shown;  // every message below uses the printable form

  // stat() before open(): opening a FIFO for reading blocks until a writer appears, and
  // opening a device can have side effects. O_NONBLOCK covers a path swapped in between.
  auto require_regular = [&](const struct stat& st) {
    if (S_ISDIR(st.st_mode)) fail(ErrorKind::InvalidInput, path, ": cannot open: Is a directory");
    if (!S_ISREG(st.st_mode))
      fail(ErrorKind::InvalidInput, path, ": not a regular file: it is ", file_kind(st.st_mode),
           "; give the path of a .gguf file");
  };
  struct stat st;
  if (::stat(in_path.c_str(), &st) != 0) {
    int e = errno;
    fail(ErrorKind::InvalidInput, path, ": cannot open: ", std::strerror(e));
  }
  require_regular(st);
  int fd = ::open(in_path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    int e = errno;
    fail(ErrorKind::InvalidInput, path, ": cannot open: ", std::strerror(e));
  }
  part.fd = fd;  // closed by the destructor from here on
  if (fstat(fd, &st) != 0) {
    int e = errno;
    fail(ErrorKind::InvalidInput, path, ": cannot stat: ", std::strerror(e));
  }
  require_regular(st);
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  part.mtime_sec = static_cast<int64_t>(st.st_mtim.tv_sec);
  part.mtime_nsec = static_cast<int64_t>(st.st_mtim.tv_nsec);
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) {
    fail(ErrorKind::InvalidInput, path, ": truncated: the file is empty (0 bytes), not a GGUF file");
  }
  if (size > static_cast<uint64_t>(std::numeric_limits<size_t>::max())) {
    fail(ErrorKind::InvalidInput, path, ": file too large to map");
  }
  void* m = mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
  if (m == MAP_FAILED) {
    int e = errno;
    fail(ErrorKind::InvalidInput, path, ": cannot mmap: ", std::strerror(e));
  }
  part.base = static_cast<const uint8_t*>(m);
  part.size = size;
  part.guard_slot = gguf_guard::register_mapping(m, static_cast<size_t>(size));
  f->total_size_ = size;
  const uint8_t* p = part.base;

  Cursor c(path, p, size);
  c.where = "header";
  if (std::memcmp(p, "GGUF", size < 4 ? static_cast<size_t>(size) : 4) != 0) {
    not_gguf(path, p, size);
  }
  c.u32("magic");
  uint64_t at = c.pos();
  uint32_t version = c.u32("version");
  if (version == 1) {
    c.error(at, "GGUF version 1 is not supported (only versions 2 and 3; re-convert the model)");
  }
  if (version != 2 && version != 3) {
    uint32_t swapped = __builtin_bswap32(version);
    if (swapped == 2 || swapped == 3) {
      c.error(at, "big-endian GGUF (version " + std::to_string(swapped) +
                      " byte-swapped) is not supported; only little-endian files are");
    }
    c.error(at, "unsupported GGUF version " + std::to_string(version) + " (supported: 2 and 3)");
  }
  f->version_ = version;

  uint64_t tc_at = c.pos();
  uint64_t tensor_count = c.u64("tensor_count");
  uint64_t kc_at = c.pos();
  uint64_t kv_count = c.u64("kv_count");
  if (kv_count > c.remaining() / kMinKvBytes) {
    c.error(kc_at, "truncated or corrupt: kv_count " + std::to_string(kv_count) +
                       " cannot fit in the " + std::to_string(c.remaining()) +
                       " bytes after the header of the " + std::to_string(size) + "-byte file");
  }
  if (tensor_count > (c.remaining() - kv_count * kMinKvBytes) / kMinTensorInfoBytes) {
    c.error(tc_at, "truncated or corrupt: tensor_count " + std::to_string(tensor_count) +
                       " cannot fit in the " + std::to_string(c.remaining()) +
                       " bytes after the header of the " + std::to_string(size) + "-byte file");
  }
  if (kv_count > kMaxKeys) {
    c.error(kc_at, "kv_count " + std::to_string(kv_count) + " is more than the " +
                       std::to_string(kMaxKeys) + " metadata keys this reader accepts");
  }
  if (tensor_count > kMaxTensors) {
    c.error(tc_at, "tensor_count " + std::to_string(tensor_count) + " is more than the " +
                       std::to_string(kMaxTensors) + " tensors this reader accepts");
  }

  // ---- key/value metadata ----
  // Exact reservations: the index holds views into these vectors, so they must not reallocate.
  f->kv_.reserve(static_cast<size_t>(kv_count));
  f->key_index_.reserve(static_cast<size_t>(kv_count));
  bool have_alignment = false;
  for (uint64_t k = 0; k < kv_count; ++k) {
    c.where = "key #" + std::to_string(k);
    uint64_t key_at = c.pos();
    std::string key = c.str("key");
    if (key.empty()) c.error(key_at, "empty metadata key");
    if (!valid_utf8(key)) c.error(key_at, "metadata key " + quote(key) + " is not valid UTF-8");
    c.where = "key #" + std::to_string(k) + " (" + quote(key) + ")";
    if (f->key_index_.count(key)) c.error(key_at, "duplicate metadata key " + quote(key));
    auto type = static_cast<GgufValueType>(read_value_type(c, "value type"));
    uint64_t val_at = c.pos();
    GgufValue v;
    read_value(c, type, v);
    if (key == "general.alignment") {
      if (type != GgufValueType::UINT32) {
        c.error(val_at, "general.alignment has type " + describe_type(v) + ", expected uint32");
      }
      if (v.u == 0 || (v.u & (v.u - 1)) != 0) {
        c.error(val_at, "general.alignment is " + std::to_string(v.u) +
                            ", expected a nonzero power of two");
      }
      f->alignment_ = v.u;
      have_alignment = true;
    }
    f->kv_.emplace_back(std::move(key), std::move(v));
    f->key_index_.emplace(std::string_view(f->kv_.back().first), f->kv_.size() - 1);
  }
  if (!have_alignment) f->alignment_ = kDefaultAlignment;
  const uint64_t align = f->alignment_;

  // ---- tensor infos ----
  f->tensors_.reserve(static_cast<size_t>(tensor_count));
  f->tensor_index_.reserve(static_cast<size_t>(tensor_count));
  std::vector<uint64_t> offset_pos;  // byte position of each tensor's offset field
  offset_pos.reserve(static_cast<size_t>(tensor_count));
  for (uint64_t t = 0; t < tensor_count; ++t) {
    c.where = "tensor info #" + std::to_string(t);
    uint64_t name_at = c.pos();
    GgufTensorInfo ti;
    ti.name = c.str("name");
    if (ti.name.empty()) c.error(name_at, "empty tensor name");
    if (!valid_utf8(ti.name)) {
      c.error(name_at, "tensor name " + quote(ti.name) + " is not valid UTF-8");
    }
    c.where = "tensor info #" + std::to_string(t) + " (" + quote(ti.name) + ")";
    if (f->tensor_index_.count(ti.name)) {
      c.error(name_at, "duplicate tensor name " + quote(ti.name));
    }
    uint64_t nd_at = c.pos();
    uint32_t n_dims = c.u32("n_dims");
    if (n_dims < 1 || n_dims > 4) {
      c.error(nd_at, "n_dims is " + std::to_string(n_dims) + ", expected 1..4");
    }
    ti.ne.resize(n_dims);
    int64_t nelem = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t d_at = c.pos();
      uint64_t ne = c.u64("dimension");
      if (ne == 0) c.error(d_at, "dimension " + std::to_string(d) + " is zero");
      if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        c.error(d_at, "dimension " + std::to_string(d) + " is " + std::to_string(ne) +
                          ", larger than INT64_MAX");
      }
      ti.ne[d] = static_cast<int64_t>(ne);
      if (__builtin_mul_overflow(nelem, ti.ne[d], &nelem)) {
        c.error(d_at, "element count overflows int64 (dimensions too large)");
      }
    }
    uint64_t type_at = c.pos();
    ti.type_id = c.u32("type");
    const TypeTraits* tr = find_type_traits(ti.type_id);
    if (!tr) c.error(type_at, "unknown tensor type id " + std::to_string(ti.type_id));
    ti.type_supported = tr->computable();
    if (tr->block_size <= 0 || ti.ne[0] % tr->block_size != 0) {
      c.error(nd_at, "ne[0] = " + std::to_string(ti.ne[0]) + " is not a multiple of the " +
                         tr->name + " block size " + std::to_string(tr->block_size));
    }
    uint64_t blocks = static_cast<uint64_t>(nelem) / static_cast<uint64_t>(tr->block_size);
    if (__builtin_mul_overflow(blocks, static_cast<uint64_t>(tr->type_size), &ti.nbytes)) {
      c.error(nd_at, "byte size overflows (dimensions too large)");
    }
    offset_pos.push_back(c.pos());
    ti.offset = c.u64("offset");  // relative to the data section for now
    f->tensors_.push_back(std::move(ti));
    f->tensor_index_.emplace(std::string_view(f->tensors_.back().name), f->tensors_.size() - 1);
  }

  // ---- data section ----
  uint64_t header_end = c.pos();
  if (header_end > std::numeric_limits<uint64_t>::max() - align) {
    c.error(header_end, "header end overflows when aligned");
  }
  uint64_t data_off = align_up(header_end, align);
  if (data_off > size) {
    if (!f->tensors_.empty()) {
      c.where = "data section";
      fail(ErrorKind::InvalidInput, path, ": truncated: the data section starts at byte ",
           data_off, " (header end ", header_end, " aligned to ", align,
           ") past the end of the ", size, "-byte file");
    }
    data_off = size;  // no tensors: tolerate a file that ends without the final padding
  }
  part.data_offset = data_off;
  part.n_tensors = f->tensors_.size();
  const uint64_t data_size = size - data_off;
  for (size_t t = 0; t < f->tensors_.size(); ++t) {
    GgufTensorInfo& ti = f->tensors_[t];
    c.where = "tensor info #" + std::to_string(t) + " (" + quote(ti.name) + ")";
    uint64_t rel = ti.offset;
    if (rel % align != 0) {
      c.error(offset_pos[t], "tensor data offset " + std::to_string(rel) +
                                 " is not a multiple of the alignment " + std::to_string(align));
    }
    if (rel > data_size || ti.nbytes > data_size - rel) {
      fail(ErrorKind::InvalidInput, path, ": truncated: ", c.where, " data [",
           data_off, " + ", rel, ", ", ti.nbytes, " bytes) ends past the end of the ", size,
           "-byte file (offset field at byte ", offset_pos[t], ")");
    }
    ti.offset = data_off + rel;
    ti.data = p + ti.offset;
  }
  return f;
}

namespace {

// llama.cpp's names for the parts of a split model (llama_split_path): PREFIX-%05d-of-%05d.gguf,
// numbered from 1.
std::string split_suffix(int64_t no, int64_t count) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05lld-of-%05lld.gguf", static_cast<long long>(no + 1),
                static_cast<long long>(count));
  return buf;
}

// A split.* key: gguf-split writes u16 / i32, any integer type is read; range-checked.
int64_t split_key(const GgufFile& f, const char* key, int64_t lo, int64_t hi) {
  const int64_t v = f.get_int(key);  // names the key when missing or not an integer
  if (v < lo || v > hi)
    fail(ErrorKind::InvalidInput, f.display_path(), ": metadata key '", key, "' is ", v,
         ", expected ", lo, "..", hi);
  return v;
}

}  // namespace

std::shared_ptr<GgufFile> GgufFile::open(const std::string& path) {
  std::shared_ptr<GgufFile> f = open_one(path);
  // Like llama.cpp, split.count 0 or 1 (or none) is an ordinary file.
  if (!f->find("split.count") || split_key(*f, "split.count", 0, 65535) <= 1) return f;
  return open_split(std::move(f));
}

std::shared_ptr<GgufFile> GgufFile::open_split(std::shared_ptr<GgufFile> f) {
  const std::string given = f->display_path();
  const int64_t count = split_key(*f, "split.count", 0, 65535);
  const int64_t no = split_key(*f, "split.no", 0, count - 1);
  // The siblings are found by name, as llama.cpp finds them.
  const std::string suffix = split_suffix(no, count);
  const std::string& raw = f->path();
  if (raw.size() <= suffix.size() || raw.compare(raw.size() - suffix.size(), suffix.size(), suffix) != 0)
    fail(ErrorKind::InvalidInput, given, ": this is part ", no + 1, " of a model split into ", count,
         " files (split.no ", no, ", split.count ", count, "), but its name does not end in '", suffix,
         "' as llama.cpp's gguf-split names the parts, so the other parts cannot be found; "
         "restore the original file names");
  const std::string prefix = raw.substr(0, raw.size() - suffix.size());

  std::vector<std::shared_ptr<GgufFile>> parts(static_cast<size_t>(count));
  parts[static_cast<size_t>(no)] = std::move(f);
  int64_t expected = -1;  // split.tensors.count, the same in every part
  uint64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    auto& part = parts[static_cast<size_t>(i)];
    if (!part) {
      const std::string path = prefix + split_suffix(i, count);
      struct stat st;
      if (::stat(path.c_str(), &st) != 0 && errno == ENOENT)
        fail(ErrorKind::InvalidInput, display(path), ": part ", i + 1, " of ", count,
             " of the split model is missing (no such file; opened from ", given, ")");
      part = open_one(path);
    }
    const std::string& shown = part->display_path();
    if (!part->find("split.count"))
      fail(ErrorKind::InvalidInput, shown, ": expected part ", i + 1, " of ", count, " of the split model ",
           given, ", but this file has no split.count: it is not a part of a split model");
    const int64_t c = split_key(*part, "split.count", 0, 65535);
    if (c != count)
      fail(ErrorKind::InvalidInput, shown, ": split.count is ", c, " but ", given, " says ", count,
           ": the file belongs to another split model");
    const int64_t n = split_key(*part, "split.no", 0, 65535);
    if (n != i)
      fail(ErrorKind::InvalidInput, shown, ": split.no is ", n, " but the file is named as part ", i + 1,
           " of ", count, " (split.no ", i, "): the parts are mixed up or renamed");
    if (i == 0 || part->find("split.tensors.count")) {
      const int64_t t = split_key(*part, "split.tensors.count", 0, std::numeric_limits<int32_t>::max());
      if (expected < 0) expected = t;
      if (t != expected)
        fail(ErrorKind::InvalidInput, shown, ": split.tensors.count is ", t, " but part 1 says ", expected,
             ": the file belongs to another split model");
    }
    total += part->tensors_.size();
  }
  if (total > kMaxTensors)
    fail(ErrorKind::InvalidInput, given, ": the ", count, " parts hold ", total, " tensors, more than the ",
         kMaxTensors, " tensors this reader accepts");

  // One model: part 1 (its metadata) with every part's tensors, each still pointing into its
  // own part's mapping; the mappings and descriptors move to part 1's object.
  std::shared_ptr<GgufFile> m = parts[0];
  std::vector<GgufTensorInfo> all;
  all.reserve(static_cast<size_t>(total));  // the index holds views into these names
  std::unordered_map<std::string_view, size_t> index;
  index.reserve(static_cast<size_t>(total));
  for (size_t i = 0; i < parts.size(); ++i) {
    for (GgufTensorInfo& t : parts[i]->tensors_) {
      t.part = static_cast<uint32_t>(i);
      all.push_back(std::move(t));
      auto [it, fresh] = index.emplace(std::string_view(all.back().name), all.size() - 1);
      if (!fresh) {
        const size_t j = all[it->second].part;
        fail(ErrorKind::InvalidInput, given, ": tensor ", quote(all.back().name), " is in part ", j + 1, " (",
             parts[j]->display_path(), ") and again in part ", i + 1, " (", parts[i]->display_path(),
             "): duplicate tensor names across the parts of a split model");
      }
    }
  }
  if (static_cast<int64_t>(total) != expected)
    fail(ErrorKind::InvalidInput, given, ": split.tensors.count says the model has ", expected,
         " tensors, but its ", count, " parts hold ", total);
  m->tensor_index_.clear();
  m->tensors_ = std::move(all);
  m->tensor_index_ = std::move(index);
  m->parts_.reserve(parts.size());
  for (size_t i = 1; i < parts.size(); ++i) {
    m->parts_.push_back(parts[i]->parts_[0]);
    parts[i]->parts_[0].base = nullptr;  // owned by m from here on
    parts[i]->parts_[0].fd = -1;
    m->total_size_ += m->parts_.back().size;
  }
  return m;
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = key_index_.find(std::string_view(key));
  return it == key_index_.end() ? nullptr : &kv_[it->second].second;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(std::string_view(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

GgufValue GgufFile::read_element(const GgufValue& array, uint64_t& pos) const {
  const GgufPart& part = parts_[0];  // metadata lives in the first part
  const std::string& shown = part.shown;
  if (array.type != GgufValueType::ARRAY || array.end > part.size || pos < array.begin ||
      pos >= array.end) {
    fail(ErrorKind::InvalidInput, shown, ": internal: element position ", pos,
         " is outside the array [", array.begin, ", ", array.end, ")");
  }
  // The bytes were validated at open; bounds are checked again against the array's own range
  // because a file rewritten in place can change what the mapping shows.
  Cursor c(shown, part.base, array.end);
  c.seek(pos);
  c.where = "array element";
  GgufValue v;
  try {
    switch (array.elem_type) {
      case GgufValueType::STRING: v.type = GgufValueType::STRING; v.s = c.str("string"); break;
      case GgufValueType::ARRAY: read_array(c, v, array.depth + 1); break;
      default: v.type = array.elem_type; read_scalar(c, array.elem_type, v.i, v.u, v.f); break;
    }
  } catch (const Error& e) {
    fail(ErrorKind::InvalidInput, shown, ": a metadata array no longer reads as it did when the "
         "file was opened (was the file modified?): ", e.what());
  }
  pos = c.pos();
  return v;
}

std::vector<uint64_t> GgufFile::element_offsets(const GgufValue& array) const {
  std::vector<uint64_t> out;
  if (array.type != GgufValueType::ARRAY) return out;
  out.reserve(static_cast<size_t>(array.count));
  const uint64_t fs = fixed_size(array.elem_type);
  uint64_t pos = array.begin;
  for (uint64_t k = 0; k < array.count; ++k) {
    out.push_back(pos);
    if (fs) {
      pos += fs;
    } else {
      read_element(array, pos);  // strings and nested arrays: walk to find the next start
    }
  }
  return out;
}

bool GgufFile::mapping_lost() const {
  for (const GgufPart& part : parts_)
    if (gguf_guard::mapping_lost(part.guard_slot)) return true;
  return false;
}

void GgufFile::check_unchanged() const {
  for (const GgufPart& part : parts_) {
    if (gguf_guard::mapping_lost(part.guard_slot))
      fail(ErrorKind::InvalidInput, part.shown, ": the file shrank while in use (a read past its new end "
           "was caught); reload the model");
    struct stat st;
    if (part.fd < 0 || fstat(part.fd, &st) != 0) {
      int e = errno;
      fail(ErrorKind::InvalidInput, part.shown, ": cannot stat the open model file: ", std::strerror(e));
    }
    const uint64_t now = static_cast<uint64_t>(st.st_size);
    if (now < part.size) {
      fail(ErrorKind::InvalidInput, part.shown, ": the file shrank from ", part.size, " to ", now,
           " bytes while it was in use; reading the missing part would crash (SIGBUS), reload "
           "the model");
    }
    if (now != part.size || static_cast<int64_t>(st.st_mtim.tv_sec) != part.mtime_sec ||
        static_cast<int64_t>(st.st_mtim.tv_nsec) != part.mtime_nsec) {
      fail(ErrorKind::InvalidInput, part.shown, ": the file was modified while it was in use (size "
           "or modification time changed); reload the model");
    }
  }
}

namespace {

[[noreturn]] void missing(const std::string& path, const std::string& key) {
  fail(ErrorKind::InvalidInput, path, ": metadata key '", key, "' is missing");
}

[[noreturn]] void wrong_type(const std::string& path, const std::string& key, const GgufValue& v,
                             const char* expected) {
  fail(ErrorKind::InvalidInput, path, ": metadata key '", key, "' has type ", describe_type(v),
       ", expected ", expected);
}

int64_t as_int(const std::string& path, const std::string& key, const GgufValue& v) {
  if (v.type == GgufValueType::BOOL) return v.i;
  if (!is_integer(v.type)) wrong_type(path, key, v, "an integer");
  if (v.type == GgufValueType::UINT64 &&
      v.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    fail(ErrorKind::InvalidInput, path, ": metadata key '", key, "' value ", v.u,
         " does not fit in int64");
  }
  return v.i;
}

double as_float(const std::string& path, const std::string& key, const GgufValue& v) {
  if (is_float(v.type)) return v.f;
  if (v.type == GgufValueType::UINT64) return static_cast<double>(v.u);
  if (is_integer(v.type)) return static_cast<double>(v.i);
  wrong_type(path, key, v, "a float");
}

}  // namespace

int64_t GgufFile::get_int(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) missing(display_path(), key);
  return as_int(display_path(), key, *v);
}

int64_t GgufFile::get_int(const std::string& key, int64_t def) const {
  const GgufValue* v = find(key);
  return v ? as_int(display_path(), key, *v) : def;
}

double GgufFile::get_float(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) missing(display_path(), key);
  return as_float(display_path(), key, *v);
}

double GgufFile::get_float(const std::string& key, double def) const {
  const GgufValue* v = find(key);
  return v ? as_float(display_path(), key, *v) : def;
}

std::string GgufFile::get_string(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) missing(display_path(), key);
  if (v->type != GgufValueType::STRING) wrong_type(display_path(), key, *v, "string");
  return v->s;
}

std::string GgufFile::get_string(const std::string& key, const std::string& def) const {
  const GgufValue* v = find(key);
  if (!v) return def;
  if (v->type != GgufValueType::STRING) wrong_type(display_path(), key, *v, "string");
  return v->s;
}

bool GgufFile::get_bool(const std::string& key, bool def) const {
  const GgufValue* v = find(key);
  if (!v) return def;
  if (v->type == GgufValueType::BOOL) return v->i != 0;
  if (is_integer(v->type)) return v->i != 0;
  wrong_type(display_path(), key, *v, "bool");
}

void GgufFile::advise_random() const {
  for (const GgufPart& part : parts_) {
    if (part.base && part.size > 0) madvise(const_cast<uint8_t*>(part.base), size_t(part.size), MADV_RANDOM);
    // No read-ahead for pread either: it would cache pages past each read (the other rank's
    // half of a row range) that nobody reads here, so nothing drops them again.
    if (part.fd >= 0) ::posix_fadvise(part.fd, 0, 0, POSIX_FADV_RANDOM);
  }
}

void GgufFile::prefault() const {
  for (const GgufPart& part : parts_) {
    if (!part.base || part.size == 0) continue;
    madvise(const_cast<uint8_t*>(part.base), size_t(part.size), MADV_WILLNEED);  // read ahead
    const long page = sysconf(_SC_PAGE_SIZE) > 0 ? sysconf(_SC_PAGE_SIZE) : 4096;
    volatile uint8_t sink = 0;
    for (uint64_t off = 0; off < part.size; off += uint64_t(page)) {
      if ((off & ((uint64_t(1) << 30) - 1)) == 0) check_interrupt();  // Ctrl-C between gigabytes
      sink = sink + part.base[off];
    }
    (void)sink;
  }
}

std::pair<const GgufPart*, uint64_t> GgufFile::locate(const uint8_t* p, uint64_t n) const {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  for (const GgufPart& part : parts_) {
    const auto b = reinterpret_cast<uintptr_t>(part.base);
    if (part.base && addr >= b && addr - b <= part.size && n <= part.size - (addr - b))
      return {&part, uint64_t(addr - b)};
  }
  fail(ErrorKind::Runtime, display_path(), ": internal: ", n, " bytes at ", static_cast<const void*>(p),
       " are not inside any mapped part of the model");
}

}  // namespace tf
