// Bounds-checked, memory-mapped GGUF reader. Every count, length, offset and type read from
// the file is validated before use; any violation throws tf::Error naming the problem.
//
// Memory: metadata arrays are not copied. Open validates each array once (lengths, nesting,
// bool bytes) and keeps only its element type, count and byte range; elements are decoded
// from the mapping on access. So the cost of metadata stays proportional to its bytes, not to
// its element count (a 97 MiB uint8 array costs a few dozen bytes, not 8 bytes per element).
//
// SIGBUS: the file is memory-mapped, and if another process truncates it while it is mapped,
// touching a page past the new end raises SIGBUS. Each mapping is registered with the SIGBUS
// guard (gguf/mapping_guard.h), which makes such reads return zeros and marks the file lost
// (mapping_lost()), so the engine can fail the step with an error instead of the process
// dying. The file also stays open and check_unchanged() fstat()s it — a cheap syscall — so a
// long-lived user (the engine, before each step) refuses to go on once the file shrank or was
// rewritten in place. Replacing the file by rename is safe: the mapping keeps the old inode.
//
// Split models (llama.cpp's gguf-split): NAME-00001-of-0000N.gguf ... NAME-0000N-of-0000N.gguf,
// each a complete GGUF carrying split.no (0-based), split.count and split.tensors.count; the
// first part holds the model's metadata, every part its own tensors. open() on any part's path
// finds the siblings by that naming pattern, validates each part as a file of its own and the
// set as a whole (count, numbering, no duplicate tensor, the announced total), and presents one
// model: part 1's metadata, all parts' tensors, each tensor's data in its own part's mapping.
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
  uint32_t part = 0;                 // split models: the part holding the data (0: first)
  uint32_t type_id = 0;
  bool type_supported = false;       // traits known and kernels exist
  std::vector<int64_t> ne;           // ggml order: ne[0] is the contiguous (row) dimension
  uint64_t offset = 0;               // from the start of its part's file
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;     // into its part's mapping
  GgmlType type() const { return static_cast<GgmlType>(type_id); }
  int64_t n_elements() const;
};

// One file of a (possibly split) model: mapped read-only, kept open for check_unchanged().
struct GgufPart {
  std::string path, shown;           // shown: printable form for messages
  const uint8_t* base = nullptr;     // the whole file, mapped
  uint64_t size = 0, data_offset = 0;
  uint64_t n_tensors = 0;            // tensors whose data this part holds
  int fd = -1;
  int64_t mtime_sec = 0, mtime_nsec = 0;
  int guard_slot = -1;               // its SIGBUS guard slot (gguf/mapping_guard.h)
};

class GgufFile {
 public:
  // Maps and validates the whole header; throws tf::Error on any problem. Anything but a
  // regular file (FIFO, socket, device, directory) is refused before it is read. A part of a
  // split model opens the whole model (see the header comment).
  static std::shared_ptr<GgufFile> open(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  // The (first part's) path; metadata and header offsets below refer to that file.
  const std::string& path() const { return parts_[0].path; }
  // The path for messages: invalid UTF-8 bytes escaped, so messages always decode.
  const std::string& display_path() const { return parts_[0].shown; }
  uint32_t version() const { return version_; }
  // Bytes of all parts together.
  uint64_t file_size() const { return total_size_; }
  uint64_t data_offset() const { return parts_[0].data_offset; }
  uint64_t alignment() const { return alignment_; }
  const uint8_t* base() const { return parts_[0].base; }
  // Every file of the model, in split order (one entry for an unsplit file).
  const std::vector<GgufPart>& parts() const { return parts_; }
  // The part whose mapping holds the bytes [p, p + n), and p's offset in that file (for
  // reading them with pread); throws when they are not inside one mapping.
  std::pair<const GgufPart*, uint64_t> locate(const uint8_t* p, uint64_t n) const;

  // Random-access hint for every mapping and file descriptor: no read-ahead and no
  // fault-around, so a process that reads only some tensor ranges (a TP rank) caches only
  // the pages it reads.
  void advise_random() const;
  // Faults every page of every part in (reads one byte a page), so the mapping is resident.
  void prefault() const;
  // Throws tf::Error (InvalidInput) when a file under the mappings shrank or was modified
  // since open (size or mtime differ): reading it further could SIGBUS or give other bytes
  // than were validated. One fstat() per part; meant to be called between requests.
  void check_unchanged() const;
  // Whether a read of a mapping faulted because its file shrank (see gguf/mapping_guard.h):
  // the bytes read since are zeros, so nothing computed from them may be used. No syscall:
  // cheap enough to ask after every forward pass.
  bool mapping_lost() const;

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
  // One file, parsed and validated on its own (split.* keys not followed).
  static std::shared_ptr<GgufFile> open_one(const std::string& path);
  // Opens the other parts of the split model `f` belongs to and returns the whole model.
  static std::shared_ptr<GgufFile> open_split(std::shared_ptr<GgufFile> f);
  uint32_t version_ = 0;
  uint64_t alignment_ = 32, total_size_ = 0;
  std::vector<GgufPart> parts_;      // owns every mapping and descriptor
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::vector<GgufTensorInfo> tensors_;
  // Name -> index; views into kv_ / tensors_, which never reallocate after open.
  std::unordered_map<std::string_view, size_t> key_index_, tensor_index_;
};

}  // namespace tf
