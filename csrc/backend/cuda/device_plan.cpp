#include "backend/cuda/device_plan.h"

#include <algorithm>
#include <cstdio>

namespace tf::cuda {

namespace {
constexpr uint64_t MiB = 1ull << 20;

std::string gib(uint64_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GiB", double(b) / double(1ull << 30));
  return s;
}
}  // namespace

uint64_t DevicePlan::total() const {
  uint64_t t = 0;
  for (const DevicePlanLine& l : lines) t += l.bytes;
  return t;
}

std::string DevicePlan::table() const {
  std::string s = unified ? "CUDA memory plan (one shared pool):\n" : "CUDA memory plan (device memory):\n";
  for (const DevicePlanLine& l : lines) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "  %-34s %12s\n", l.what.c_str(), gib(l.bytes).c_str());
    s += buf;
  }
  char buf[200];
  std::snprintf(buf, sizeof buf, "  %-34s %12s  (limit %s: %s)%s", "total", gib(total()).c_str(), gib(limit).c_str(),
                limit_source.c_str(), fits() ? "" : "  OVER");
  return s + buf;
}

uint64_t context_bytes(const DeviceInfo& d) {
  // Module images for every kernel of this build, the runtime's heaps and the local-memory
  // reserve grow with the SM count; ~300 MiB on a 132-SM H100, measured figures of 250-500 MiB
  // are common: take 384 MiB plus 1 MiB per SM.
  return 384 * MiB + uint64_t(std::max(d.sm_count, 0)) * MiB;
}

uint64_t driver_reserve(const DeviceInfo& d) {
  // What the device already has in use when we plan (other processes, the display) plus 2%
  // slack for fragmentation: never plan into memory we are not given.
  const uint64_t used = d.total_bytes > d.free_bytes ? d.total_bytes - d.free_bytes : 0;
  return used + std::max<uint64_t>(d.total_bytes / 50, 256 * MiB);
}

DevicePlan plan_device(const DeviceInfo& d, const DeviceNeed& n) {
  DevicePlan p;
  p.unified = d.integrated;
  p.weights_in_place = d.integrated;
  p.lines.push_back({p.weights_in_place ? "weights (mapped file, in place)" : "weights (uploaded once)", n.weights});
  p.lines.push_back({"KV cache pool", n.kv});
  p.lines.push_back({"activation scratch", n.scratch});
  p.lines.push_back({"backend workspace", n.workspace});
  p.lines.push_back({"CUDA context", context_bytes(d)});
  if (p.unified) {
    // One pool shared with the OS: the engine's budget, else the device's total less 10% for the
    // OS (cudaMemGetInfo's free counts the page cache as used on these machines).
    if (n.budget > 0) {
      p.limit = n.budget;
      p.limit_source = "the memory budget";
    } else {
      p.limit = d.total_bytes - d.total_bytes / 10;
      p.limit_source = "90% of the shared memory";
    }
    if (d.total_bytes > 0 && p.limit > d.total_bytes) {
      p.limit = d.total_bytes;
      p.limit_source = "the shared memory";
    }
  } else {
    const uint64_t reserve = driver_reserve(d);
    p.limit = d.total_bytes > reserve ? d.total_bytes - reserve : 0;
    p.limit_source = d.name.empty() ? "device memory less in use and 2%" : d.name + " memory less in use and 2%";
  }
  return p;
}

}  // namespace tf::cuda
