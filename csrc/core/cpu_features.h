// Runtime CPU feature detection, so one binary picks AVX-512, AVX2 or scalar kernels.
#pragma once
#include <string>

namespace tf {

enum class CpuIsa { Scalar = 0, Avx2 = 1, Avx512 = 2 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512vnni = false;
};

const CpuFeatures& cpu_features();
// Best ISA the kernels may use; TENSORFOLD_ISA=scalar|avx2|avx512 caps it (for tests).
CpuIsa best_isa();
const char* isa_name(CpuIsa isa);

// CPUs this process may really use: the CPUs in its affinity mask, lowered to the cgroup
// CPU quota (cgroup v2 cpu.max, or v1 cfs_quota/cfs_period) rounded up; at least 1.
int usable_cpus();
// The cgroup CPU quota in CPUs (quota / period, rounded up), or 0 when unlimited/unknown.
// cgroup_fs is where the cgroup hierarchy is mounted (/sys/fs/cgroup) and proc_self_cgroup
// the text of /proc/self/cgroup; parameters so tests can feed a fake hierarchy.
int cgroup_cpu_limit(const std::string& cgroup_fs, const std::string& proc_self_cgroup);

}  // namespace tf
