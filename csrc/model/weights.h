// Reading a model's weights for its blocks: views into the mmapped GGUF checked against the
// shapes the blocks expect, small vectors converted to float once, and under tensor parallel
// (TP=2) this rank's slices read with pread into private buffers (the file's cached pages
// dropped after), so a rank keeps only its half resident.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "comm/group.h"
#include "gguf/gguf_reader.h"

namespace tf {

struct TpShard {
  int rank = 0;                  // engine rank: 0 schedules and samples
  int size = 1;
  comm::Group* group = nullptr;  // required when size > 1
  int group_rank(int engine_rank) const { return group ? (engine_rank + group_rank_offset) % size : 0; }
  int group_rank_offset = 0;     // engine rank -> group rank mapping (the listener is group rank 0)
  // TP=1 only: split the reduction sums at TP=2's boundaries, so results are bit-identical
  // to a TP=2 run of the same model (costs ~5-10% decode speed: two half-width passes).
  bool tp_compatible = false;
  // Only plan: this rank's geometry and bytes are computed (weight bytes, scratch) but no
  // slice is read or allocated and no group is needed; such a model cannot run forward.
  bool plan_only = false;
  // Set (by another thread) when the load is pointless, the peer being gone: reading the
  // slices stops at the next window instead of finishing a load nobody will use.
  const std::atomic<bool>* abandon = nullptr;
};

class WeightLoader {
 public:
  // `be` decides which types can be computed with (nullptr: only sizes are wanted).
  WeightLoader(std::shared_ptr<GgufFile> file, const TpShard& tp, const Backend* be);

  const GgufFile& file() const { return *file_; }
  const TpShard& tp() const { return tp_; }
  bool has(const std::string& name) const { return file_->find_tensor(name) != nullptr; }

  // A [k, rows] matrix (compute = false: only read row by row through its reference dequantization).
  Weight weight(const std::string& name, int64_t k, int64_t rows, bool required = true, bool compute = true);
  // A [k, rows, n] stack of matrices.
  WeightStack stack(const std::string& name, int64_t k, int64_t rows, int64_t n);
  // An [n] vector as floats (converted once when stored otherwise).
  const float* vector(const std::string& name, int64_t n, bool required = true);
  // A small tensor of this shape (ggml order) as floats, or as int32 (type I32: tables).
  const float* floats(const std::string& name, const std::vector<int64_t>& shape, bool required = true);
  const int32_t* ints(const std::string& name, const std::vector<int64_t>& shape, bool required = true);
  // The reference dequantization of a tensor's type (throws naming the tensor when there is none).
  void (*dequantizer(const std::string& name) const)(const void*, float*, int64_t);
  float* owned_floats(size_t n);  // private float storage living as long as the loader
  // The host memory the loader owns (converted vectors, TP slices), for the backend to adopt.
  std::vector<std::pair<const void*, size_t>> owned_ranges() const;

  // TP slices (sizes only when plan_only); each counts toward bytes().
  Weight slice_rows(const Weight& w, int64_t r0, int64_t r1);
  Weight slice_cols(const Weight& w, int64_t c0, int64_t c1);
  WeightStack slice_rows(const WeightStack& w, int64_t r0, int64_t r1);
  WeightStack slice_cols(const WeightStack& w, int64_t c0, int64_t c1);
  WeightStack slice_stack(const WeightStack& w, int64_t e0, int64_t e1);  // matrices [e0, e1), packed
  Weight keep(const Weight& w);  // a whole weight this rank keeps (replicated): read privately at TP=2
  // A column range [c0, c1) of every row, as a view.
  static Weight kview(const Weight& w, int64_t c0, int64_t c1);
  static WeightStack kview(const WeightStack& w, int64_t c0, int64_t c1);
  // Where a reduction of width n splits into two parts both on block boundaries of every weight
  // it cuts (al: the lcm of their block sizes), closest to the middle; -1 when none exists.
  static int64_t split_point(int64_t n, int64_t al);
  static int64_t block_size(const Weight& w);

  // pread of the n mapped bytes at src from the file part they belong to.
  void read_at(const uint8_t* src, void* dst, size_t n, bool drop_cache = true) const;

  // Bytes of weights this rank holds: everything loaded at TP=1; at TP=2 counted afresh as the
  // blocks keep or slice their weights (reset_bytes first).
  uint64_t bytes() const { return bytes_; }
  void reset_bytes() { bytes_ = 0; }
  void count(const Weight& w) { bytes_ += uint64_t(w.row_stride) * uint64_t(w.rows); }

 private:
  void check_computable(const GgufTensorInfo& t) const;
  void read_cols(const uint8_t* src, int64_t rows, size_t row_stride, size_t skip, size_t n, uint8_t* dst) const;
  uint8_t* owned_bytes(size_t n);

  std::shared_ptr<GgufFile> file_;
  TpShard tp_;
  const Backend* be_;
  uint64_t bytes_ = 0;
  std::vector<std::vector<float>> owned_floats_;
  std::vector<std::vector<int32_t>> owned_ints_;
  std::vector<std::unique_ptr<uint8_t[]>> owned_;
  std::vector<size_t> owned_sizes_;
};

}  // namespace tf
