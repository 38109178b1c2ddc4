// Stand-in for ibverbs_transport.cpp when libibverbs was not found at build time.
#include "comm/ibverbs_transport.h"
#include "core/error.h"

namespace tf::comm {
namespace {
[[noreturn]] void not_built() {
  fail(ErrorKind::Unsupported,
       "ibverbs transport not built: TensorFold was built without ibverbs (install "
       "libibverbs-dev and rebuild)");
}
}  // namespace

bool built_with_ibverbs() { return false; }

std::vector<IbvDeviceInfo> ibverbs_devices() { return {}; }

void ibverbs_preflight(const GroupOptions&) { not_built(); }

std::unique_ptr<Transport> ibverbs_transport(const GroupOptions&, int, Bootstrap&, Deadline) {
  not_built();
}

}  // namespace tf::comm
