// Memory a backend hands out: where it lives (host, device, or unified memory that host and
// device both address) and who frees it. Move-only, so it is freed exactly once.
#pragma once
#include <cstddef>
#include <utility>

namespace tf {

enum class BufferKind { Host, Device, Unified };

class Buffer {
 public:
  using FreeFn = void (*)(void* p, size_t bytes);
  Buffer() = default;
  Buffer(void* p, size_t bytes, BufferKind kind, FreeFn free_fn) : p_(p), n_(bytes), kind_(kind), free_(free_fn) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
    }
    return *this;
  }
  ~Buffer() { reset(); }

  void* data() const { return p_; }
  size_t size() const { return n_; }
  BufferKind kind() const { return kind_; }
  explicit operator bool() const { return p_ != nullptr; }
  void reset() {
    if (p_ && free_) free_(p_, n_);
    p_ = nullptr;
    n_ = 0;
  }

 private:
  void swap(Buffer& o) {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(kind_, o.kind_);
    std::swap(free_, o.free_);
  }
  void* p_ = nullptr;
  size_t n_ = 0;
  BufferKind kind_ = BufferKind::Host;
  FreeFn free_ = nullptr;
};

}  // namespace tf
