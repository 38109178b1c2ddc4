// Bounds-checked, memory-mapped GGUF reader. Every count, length, offset and type read from
// the file is validated before use; any violation throws tf::Error naming the problem.
//
// Memory: metadata arrays are not copied. Open validates each array once (lengths, nesting,
// bool bytes) and keeps only its element type, count and byte range; elements are decoded
// from the mapping on access. So the cost of metadata stays proportional to its bytes, not to
// its element count (a 97 MiB uint8 array costs a few dozen bytes, not 8 bytes per element).
//
// SIGBUS: the file is memory-mapped, and if another process truncates it while it is mapped,
// touching a page past the new end kills the process with SIGBUS. No handler is installed for
// that (it cannot be recovered from safely). Instead the file stays open and
// check_unchanged() fstat()s it — a cheap syscall — so a long-lived user (the engine, between
// requests) can refuse to go on once the file shrank or was rewritten in place. Replacing the
// file by rename is safe: the mapping keeps the old inode alive.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace tf {

enum class GgufValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

const char* gguf_type_name(GgufValueType t);
// Bytes of one element of a fixed-size type; 0 for STRING and ARRAY.
uint64_t gguf_fixed_size(GgufValueType t);

struct GgufValue {
  GgufValueType type = GgufValueType::UINT8;
  // Scalars: integers and bools in `i` (unsigned ones also in `u`, exact above INT64_MAX),
  // floats in `f`, strings in `s`.
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  std::string s;
  // Arrays: elements stay in the mapping, in the file bytes [begin, end); see
  // GgufFile::read_element / element_offsets. Fixed-size elements are `count` packed
  // little-endian values at base() + begin.
  GgufValueType elem_type = GgufValueType::UINT8;
  uint64_t count = 0;
  uint64_t begin = 0, end = 0;
  uint32_t depth = 0;  // nesting level of this array (0: a metadata value)
  size_t array_size() const { return type == GgufValueType::ARRAY ? size_t(count) : 0; }
};

struct GgufTensorInfo {
  std::string name;
  uint32_t type_id = 0;
  bool type_supported = false;       // traits known and kernels exist
  std::vector<int64_t> ne;           // ggml order: ne[0] is the contiguous (row) dimension
  uint64_t offset = 0;               // from the start of the file
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;     // into the mapping
  GgmlType type() const { return static_cast<GgmlType>(type_id); }
  int64_t n_elements() const;
};

class GgufFile {
 public:
  // Maps and validates the whole header; throws tf::Error on any problem. Anything but a
  // regular file (FIFO, socket, device, directory) is refused before it is read.
  static std::shared_ptr<GgufFile> open(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  // The path for messages: invalid UTF-8 bytes escaped, so messages always decode.
  const std::string& display_path() const { return shown_; }
  uint32_t version() const { return version_; }
  uint64_t file_size() const { return size_; }
  uint64_t data_offset() const { return data_offset_; }
  uint64_t alignment() const { return alignment_; }
  const uint8_t* base() const { return base_; }
  // Random-access hint for the whole mapping: no read-ahead and no fault-around, so a
  // process that reads only some tensor ranges (a TP rank) maps only the pages it touches.
  void advise_random() const;
  // Throws tf::Error (InvalidInput) when the file under the mapping shrank or was modified
  // since open (size or mtime differ): reading it further could SIGBUS or give other bytes
  // than were validated. One fstat(); meant to be called between requests.
  void check_unchanged() const;

  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
  const GgufValue* find(const std::string& key) const;
  // Typed getters. Without a default they throw tf::Error naming the key when it is missing;
  // all throw when the value has the wrong type.
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_float(const std::string& key) const;
  double get_float(const std::string& key, double def) const;
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& def) const;
  bool get_bool(const std::string& key, bool def) const;

  // Array elements. read_element decodes the element of `array` starting at file offset
  // `pos` and moves `pos` past it (scalars and strings filled in, a nested array described
  // like a top-level one). element_offsets gives the start of every element (one pass;
  // 8 bytes per element, never more than the elements' own bytes). Both re-check bounds,
  // so a file changed in place gives tf::Error, never a read outside the array.
  GgufValue read_element(const GgufValue& array, uint64_t& pos) const;
  std::vector<uint64_t> element_offsets(const GgufValue& array) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;

 private:
  GgufFile() = default;
  std::string path_, shown_;
  uint32_t version_ = 0;
  uint64_t size_ = 0, data_offset_ = 0, alignment_ = 32;
  const uint8_t* base_ = nullptr;
  int fd_ = -1;                      // kept open for check_unchanged()
  int64_t mtime_sec_ = 0, mtime_nsec_ = 0;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::vector<GgufTensorInfo> tensors_;
  // Name -> index; views into kv_ / tensors_, which never reallocate after open.
  std::unordered_map<std::string_view, size_t> key_index_, tensor_index_;
};

}  // namespace tf
