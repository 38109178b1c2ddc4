// The CUDA backend's memory plan, decided on the host before anything is allocated on the
// device: plain C++ (no CUDA), so it is tested with made-up device descriptions anywhere.
//
// Discrete GPU: weights are uploaded once, the KV pool and activations live on the device, the
// backend's workspace (quantized activations, staging, tables) and the CUDA context take their
// share; all of it must fit the device's memory less a reserve for the driver. The host keeps
// only the mapped file (page cache, evictable).
// Integrated GPU (cudaDevAttrIntegrated, e.g. GB10): CPU and GPU share one pool; weights are used
// in place from the mapped file (registered, not copied), so everything - weights, KV, scratch,
// workspace, context - is counted once against the budget (the engine's, else the device's
// total; never cudaMemGetInfo's free, which counts the page cache as used there).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tf::cuda {

struct DeviceInfo {
  std::string name;
  int cc_major = 0, cc_minor = 0;
  uint64_t total_bytes = 0;  // cudaMemGetInfo total (integrated: the shared pool)
  uint64_t free_bytes = 0;   // cudaMemGetInfo free (not trusted on integrated devices)
  bool integrated = false;   // cudaDevAttrIntegrated
  bool pageable_access = false;  // cudaDevAttrPageableMemoryAccess
  int sm_count = 0;
  double bandwidth_gbs = 0;  // peak memory bandwidth (bus width x memory clock), 0 unknown
};

struct DeviceNeed {
  uint64_t weights = 0;    // bytes of weights computed with on the device
  uint64_t kv = 0;         // KV pool
  uint64_t scratch = 0;    // activation scratch of one step (the blocks' slots)
  uint64_t workspace = 0;  // the backend's own: quantized activations, gathered rows, staging
  uint64_t budget = 0;     // the engine's budget for this process (0: none given)
};

struct DevicePlanLine {
  std::string what;
  uint64_t bytes = 0;
};

struct DevicePlan {
  bool unified = false;           // one pool (integrated device)
  bool weights_in_place = false;  // registered from the mapped file instead of copied
  std::vector<DevicePlanLine> lines;
  uint64_t limit = 0;             // what they must fit in
  std::string limit_source;
  uint64_t total() const;
  bool fits() const { return total() <= limit; }
  std::string table() const;      // one line per entry, the total and the limit
};

// Bytes a CUDA context takes on a device of this compute capability (module images, the
// runtime's heaps, per-SM local memory reserve): an estimate on the safe side.
uint64_t context_bytes(const DeviceInfo& d);
// Device memory held back for the driver and other processes on a discrete device.
uint64_t driver_reserve(const DeviceInfo& d);
DevicePlan plan_device(const DeviceInfo& d, const DeviceNeed& n);

}  // namespace tf::cuda
