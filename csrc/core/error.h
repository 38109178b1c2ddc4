// Error type for everything the engine reports to callers. Bindings translate it into a
// Python exception (ValueError for bad input, RuntimeError otherwise).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace tf {

// Interrupted: Ctrl-C reached a long native call (see core/interrupt.h).
enum class ErrorKind { InvalidInput, Unsupported, OutOfMemory, Runtime, Interrupted };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... R>
void append(std::ostringstream& os, const T& v, const R&... rest) {
  os << v;
  append(os, rest...);
}
}  // namespace detail

template <typename... A>
[[noreturn]] void fail(ErrorKind kind, const A&... parts) {
  std::ostringstream os;
  detail::append(os, parts...);
  throw Error(kind, os.str());
}

}  // namespace tf

#define TF_CHECK(cond, ...)                                      \
  do {                                                           \
    if (!(cond)) ::tf::fail(::tf::ErrorKind::InvalidInput, __VA_ARGS__); \
  } while (0)
