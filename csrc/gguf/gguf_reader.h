// Bounds-checked, memory-mapped GGUF reader. Every count, length, offset and type read from
// the file is validated before use; any violation throws tf::Error naming the problem.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace tf {

enum class GgufValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

struct GgufValue {
  GgufValueType type = GgufValueType::UINT8;
  // Scalars: integers and bools in `i` (uint64 above INT64_MAX also in `u`), floats in `f`,
  // strings in `s`.
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  std::string s;
  // Arrays: elem_type says which one of these holds the elements.
  GgufValueType elem_type = GgufValueType::UINT8;
  std::vector<int64_t> ints;          // integer and bool elements
  std::vector<double> floats;         // float elements
  std::vector<std::string> strings;   // string elements
  std::vector<GgufValue> items;       // nested arrays
  size_t array_size() const;
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
  // Maps and validates the whole header; throws tf::Error on any problem.
  static std::shared_ptr<GgufFile> open(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t file_size() const { return size_; }
  uint64_t data_offset() const { return data_offset_; }
  uint64_t alignment() const { return alignment_; }
  const uint8_t* base() const { return base_; }
  // Random-access hint for the whole mapping: no read-ahead and no fault-around, so a
  // process that reads only some tensor ranges (a TP rank) maps only the pages it touches.
  void advise_random() const;

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

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;

 private:
  GgufFile() = default;
  std::string path_;
  uint32_t version_ = 0;
  uint64_t size_ = 0, data_offset_ = 0, alignment_ = 32;
  const uint8_t* base_ = nullptr;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::vector<GgufTensorInfo> tensors_;
};

}  // namespace tf
