// Runtime CPU feature detection, so one binary picks AVX-512, AVX2 or scalar kernels on x86-64
// and i8mm, dotprod, NEON or scalar kernels on aarch64.
#pragma once
#include <string>

namespace tf {

// x86 levels and aarch64 levels never coexist in one build; within each family a larger value
// is a superset of the smaller (i8mm CPUs all have dotprod, dotprod CPUs all have NEON).
enum class CpuIsa { Scalar = 0, Avx2 = 1, Avx512 = 2, Neon = 3, Dotprod = 4, I8mm = 5 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512vnni = false;
  // aarch64 (Linux: getauxval HWCAP/HWCAP2; macOS: hw.optional.arm.FEAT_* sysctls).
  bool asimd = false, asimddp = false, i8mm = false, sve2 = false;
  int sve_bits = 0;  // SVE vector length in bits when SVE is enabled (reported, not used yet)
};

const CpuFeatures& cpu_features();
// Best ISA the kernels may use; TENSORFOLD_ISA=scalar|avx2|avx512 (x86) or
// scalar|neon|dotprod|i8mm (aarch64) caps it (for tests).
CpuIsa best_isa();
const char* isa_name(CpuIsa isa);
// The ISA a name given by a user or TENSORFOLD_ISA means ("avx2", "dotprod", ...); false when unknown.
bool parse_isa(const char* name, CpuIsa* out);
// The extra CPU features worth reporting beside the ISA (e.g. "sve2/128"), or "".
std::string cpu_feature_note();

// CPUs this process may really use: the CPUs in its affinity mask, lowered to the cgroup
// CPU quota (cgroup v2 cpu.max, or v1 cfs_quota/cfs_period) rounded up; at least 1.
int usable_cpus();
// The cgroup CPU quota in CPUs (quota / period, rounded up), or 0 when unlimited/unknown.
// cgroup_fs is where the cgroup hierarchy is mounted (/sys/fs/cgroup) and proc_self_cgroup
// the text of /proc/self/cgroup; parameters so tests can feed a fake hierarchy.
int cgroup_cpu_limit(const std::string& cgroup_fs, const std::string& proc_self_cgroup);

}  // namespace tf
