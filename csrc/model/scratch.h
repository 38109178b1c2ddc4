// Scratch from one source. Every block and the model ask for their buffers here, twice: a
// planning pass records the largest size asked under each key (blocks of one kind share their
// buffers: layers run one after another) and the products the backend will run; the binding
// pass hands out pointers into one allocation per key. The same pass gives the bytes the
// memory plan counts (in double, so a hostile geometry shows as a huge number, not a wrapped
// small one).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace tf {

class Scratch {
 public:
  // A planning pass (no backend memory is touched).
  Scratch() = default;

  // n floats (int32s) under `key`; nullptr while planning. `host`: the host reads or writes the
  // buffer directly between ops (per-step metadata, rotary angles, router logits and routing
  // results) - a device backend then keeps it where the host reaches it cheaply; the others are
  // activations only ops touch. Integer buffers are host-touched metadata.
  float* f32(const std::string& key, int64_t n, bool host = false) {
    return static_cast<float*>(take(key, n, 4, host));
  }
  int32_t* i32(const std::string& key, int64_t n) { return static_cast<int32_t*>(take(key, n, 4, true)); }
  int64_t* i64(const std::string& key, int64_t n) { return static_cast<int64_t*>(take(key, n, 8, true)); }
  void** ptrs(const std::string& key, int64_t n) { return static_cast<void**>(take(key, n, sizeof(void*), true)); }
  // A product the backend runs with up to `rows` input rows (grouped: gathered rows).
  void product(const Weight& w, int64_t rows) {
    if (w.rows <= 0) return;
    shapes_.push_back({w.type, w.k, rows, false});
    WeightStack one;
    one.first = w;
    one.n = 1;
    weights_.push_back(one);
  }
  // A product of a weight stack over up to `rows` list (or batch) rows.
  void product(const WeightStack& w, int64_t rows) {
    if (w.n <= 0 || w.first.rows <= 0) return;
    shapes_.push_back({w.first.type, w.first.k, rows, true});
    weights_.push_back(w);
  }
  // The weights of the products recorded (a matrix as a stack of one).
  const std::vector<WeightStack>& product_weights() const { return weights_; }

  bool binding() const { return bound_; }
  // Bytes of every buffer (and, with a backend, its product memory) as planned.
  double bytes(Backend* be, int64_t max_rows) const;
  // Allocates the planned buffers (zeroed: resident now) through the backend; the next pass
  // over the blocks binds them. Returns the bytes.
  uint64_t allocate(Backend& be, int64_t max_rows);

 private:
  void* take(const std::string& key, int64_t n, size_t elem, bool host);

  struct Slot {
    double bytes = 0;
    bool host = false;
    Buffer buf;
  };
  std::map<std::string, Slot> slots_;
  std::vector<ProductShape> shapes_;
  std::vector<WeightStack> weights_;
  bool bound_ = false;
};

}  // namespace tf
