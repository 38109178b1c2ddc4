#include "core/cpu_features.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#endif
#if defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace tf {

namespace {
CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  unsigned long long xcr0 = 0;
  if (osxsave) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (unsigned long long)hi << 32 | lo;
  }
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  const bool os_avx512 = (xcr0 & 0xe6) == 0xe6;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = os_avx && (b & (1u << 5));
    f.avx512f = os_avx512 && (b & (1u << 16));
    f.avx512dq = os_avx512 && (b & (1u << 17));
    f.avx512bw = os_avx512 && (b & (1u << 30));
    f.avx512vl = os_avx512 && (b & (1u << 31));
    f.avx512vnni = os_avx512 && (c & (1u << 11));
  }
  f.fma = f.fma && os_avx;
  f.f16c = f.f16c && os_avx;
#elif defined(__aarch64__) && defined(__linux__)
  // Bit numbers from the kernel's uapi asm/hwcap.h (spelled out: older headers lack some).
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  f.asimd = hw & (1ul << 1);
  f.asimddp = f.asimd && (hw & (1ul << 20));
  f.i8mm = f.asimddp && (hw2 & (1ul << 13));
  f.sve2 = (hw & (1ul << 22)) && (hw2 & (1ul << 1));
  if (hw & (1ul << 22)) {
    const int vl = prctl(51 /* PR_SVE_GET_VL */);
    if (vl > 0) f.sve_bits = (vl & 0xffff) * 8;
  }
#elif defined(__aarch64__) && defined(__APPLE__)
  auto has = [](const char* name) {
    int v = 0;
    size_t n = sizeof(v);
    return sysctlbyname(name, &v, &n, nullptr, 0) == 0 && v != 0;
  };
  f.asimd = true;  // every Apple Silicon core
  f.asimddp = has("hw.optional.arm.FEAT_DotProd");
  f.i8mm = f.asimddp && has("hw.optional.arm.FEAT_I8MM");
#endif
  return f;
}
}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

CpuIsa best_isa() {
  static const CpuIsa isa = [] {
    const CpuFeatures& f = cpu_features();
    CpuIsa best = CpuIsa::Scalar;
#if defined(TF_HAVE_X86_KERNELS)
    if (f.avx2 && f.fma && f.f16c) best = CpuIsa::Avx2;
    if (best == CpuIsa::Avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni)
      best = CpuIsa::Avx512;
#elif defined(TF_HAVE_ARM_KERNELS)
    if (f.asimd) best = CpuIsa::Neon;
    if (f.asimddp) best = CpuIsa::Dotprod;
    if (f.i8mm) best = CpuIsa::I8mm;
#else
    (void)f;
#endif
    CpuIsa want;
    if (const char* cap = std::getenv("TENSORFOLD_ISA"); cap && parse_isa(cap, &want)) {
      // A cap only lowers within this build's family (an x86 name means scalar on arm64).
      const bool same_family = (want >= CpuIsa::Neon) == (best >= CpuIsa::Neon);
      if (!same_family) want = CpuIsa::Scalar;
      if (int(want) < int(best)) best = want;
    }
    return best;
  }();
  return isa;
}

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx512: return "avx512";
    case CpuIsa::Avx2: return "avx2";
    case CpuIsa::Neon: return "neon";
    case CpuIsa::Dotprod: return "dotprod";
    case CpuIsa::I8mm: return "i8mm";
    default: return "scalar";
  }
}

bool parse_isa(const char* name, CpuIsa* out) {
  for (CpuIsa isa : {CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512, CpuIsa::Neon, CpuIsa::Dotprod, CpuIsa::I8mm})
    if (!std::strcmp(name, isa_name(isa))) {
      *out = isa;
      return true;
    }
  return false;
}

std::string cpu_feature_note() {
  const CpuFeatures& f = cpu_features();
  if (f.sve2 && f.sve_bits > 0) return "sve2/" + std::to_string(f.sve_bits);
  return {};
}

namespace {
std::string read_text(const std::string& path) {
  std::ifstream f(path);
  if (!f) return {};
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// CPUs allowed by one quota file's text: "max 100000" / "50000 100000" (v2) or, for v1, the
// quota and period files' numbers. 0 = unlimited or unreadable.
int quota_cpus(long long quota, long long period) {
  if (quota <= 0 || period <= 0) return 0;
  return int((quota + period - 1) / period);
}

int min_limit(int a, int b) { return a == 0 ? b : (b == 0 ? a : std::min(a, b)); }
}  // namespace

int cgroup_cpu_limit(const std::string& fs, const std::string& proc_self_cgroup) {
  int limit = 0;
  std::istringstream lines(proc_self_cgroup);
  std::string line;
  while (std::getline(lines, line)) {
    // hierarchy-id:controllers:path
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    const bool v2 = line.compare(0, a, "0") == 0 && controllers.empty();
    bool v1_cpu = false;
    std::string name;
    for (std::istringstream cs(controllers); std::getline(cs, name, ',');) v1_cpu |= name == "cpu";
    if (!v2 && !v1_cpu) continue;
    // A quota may sit on any ancestor: walk from the leaf up to the root.
    for (;;) {
      if (v2) {
        std::istringstream q(read_text(fs + path + (path.empty() || path.back() != '/' ? "/" : "") + "cpu.max"));
        std::string quota;
        long long period = 0;
        if (q >> quota >> period && quota != "max") limit = min_limit(limit, quota_cpus(std::atoll(quota.c_str()), period));
      } else {
        for (const char* dir : {"/cpu,cpuacct", "/cpu"}) {
          const std::string base = fs + dir + path + (path.empty() || path.back() != '/' ? "/" : "");
          const std::string q = read_text(base + "cpu.cfs_quota_us"), p = read_text(base + "cpu.cfs_period_us");
          if (!q.empty() && !p.empty()) {
            limit = min_limit(limit, quota_cpus(std::atoll(q.c_str()), std::atoll(p.c_str())));
            break;
          }
        }
      }
      if (path.empty() || path == "/") break;
      const size_t slash = path.find_last_of('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  }
  return limit;
}

int usable_cpus() {
  static const int n = [] {
    int cpus = int(std::max(1u, std::thread::hardware_concurrency()));
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = std::max(1, CPU_COUNT(&set));
    const int quota = cgroup_cpu_limit("/sys/fs/cgroup", read_text("/proc/self/cgroup"));
    if (quota > 0) cpus = std::min(cpus, quota);
#endif
    return cpus;
  }();
  return n;
}

}  // namespace tf
