#include "model/scratch.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace tf {

void* Scratch::take(const std::string& key, int64_t n, size_t elem, bool host) {
  TF_CHECK(n >= 0, "scratch: negative size for ", key);
  Slot& s = slots_[key];
  const double want = double(n) * double(elem);
  if (!bound_) {
    s.bytes = std::max(s.bytes, want);
    s.host = s.host || host;
    return nullptr;
  }
  TF_CHECK(want <= double(s.buf.size()), "scratch: ", key, " asked for more than was planned");
  return n > 0 ? s.buf.data() : nullptr;
}

double Scratch::bytes(Backend* be, int64_t max_rows) const {
  double b = 0;
  for (const auto& [key, s] : slots_) b += s.bytes;
  if (be) b += double(be->reserve_products(shapes_, max_rows, /*count_only=*/true));
  return b;
}

uint64_t Scratch::allocate(Backend& be, int64_t max_rows) {
  TF_CHECK(!bound_, "scratch: allocated twice");
  uint64_t total = 0;
  for (auto& [key, s] : slots_) {
    const size_t n = size_t(s.bytes);
    if (n == 0) continue;
    // Host-touched buffers as unified memory (host and device address it), activations as device memory.
    s.buf = be.alloc(n, s.host ? BufferKind::Unified : BufferKind::Device);
    TF_CHECK(bool(s.buf), "cannot allocate ", n, " bytes of activation scratch (", key, ")");
    be.zero(s.buf.data(), n);  // resident from the start (where the backend keeps it)
    total += n;
  }
  total += be.reserve_products(shapes_, max_rows, /*count_only=*/false);
  bound_ = true;
  return total;
}

}  // namespace tf
