// The CPUs this process may use: the CPUs of its affinity mask, capped by its cgroup's CPU quota
// (cgroup v2 cpu.max, or v1 cpu.cfs_quota_us / cpu.cfs_period_us, on the process's cgroup and
// every cgroup above it), rounded up. A pod with a 4-CPU limit on a 64-core node gets 4, not
// std::thread::hardware_concurrency()'s 64: thread pools sized by the latter oversubscribe
// their quota and are throttled.
//
//   const int n = UsableCpus();           // at least 1
//   CpuBudget b = ReadCpuBudget();        // n, and where it came from (for the start log)
#ifndef MOE_SERVICES_COMMON_CPUS_H_
#define MOE_SERVICES_COMMON_CPUS_H_

#include <optional>
#include <string>
#include <string_view>

namespace moe {

struct CpuBudget {
  int cpus = 1;                  // what the process may use
  int affinity = 0;              // CPUs of its affinity mask
  std::optional<double> quota;   // CPUs of the tightest cgroup quota, if any
  std::string Describe() const;  // "2 (affinity 2, no cgroup quota)"
};

CpuBudget ReadCpuBudget();
inline int UsableCpus() { return ReadCpuBudget().cpus; }

// The tightest CPU quota (in CPUs) of the cgroup named in `proc_self_cgroup` (the text of
// /proc/self/cgroup) and of every cgroup above it, read under the cgroup file system mounted at
// `root` (/sys/fs/cgroup): v2 ("0::/path", cpu.max "max 100000" or "200000 100000") or v1 (the
// "cpu" controller's line, cpu.cfs_quota_us -1 or a quota over cpu.cfs_period_us). nullopt
// without a quota. Pure file reads: tested on a made-up tree.
std::optional<double> CgroupCpuQuota(const std::string& root, std::string_view proc_self_cgroup);

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_CPUS_H_
