#include "services/common/cpus.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace moe {
namespace {

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// "/a/b" -> {"/a/b", "/a", "/"}: the cgroup and every one above it.
std::vector<std::string> SelfAndParents(std::string path) {
  std::vector<std::string> out;
  if (path.empty() || path[0] != '/') path = "/" + path;
  for (;;) {
    out.push_back(path);
    if (path == "/") break;
    const size_t slash = path.rfind('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
  return out;
}

std::string Join(const std::string& root, const std::string& dir, const char* file) {
  return dir == "/" ? absl::StrCat(root, "/", file) : absl::StrCat(root, dir, "/", file);
}

}  // namespace

std::optional<double> CgroupCpuQuota(const std::string& root, std::string_view proc_self_cgroup) {
  std::optional<double> best;
  auto take = [&best](double cpus) {
    if (cpus > 0 && (!best || cpus < *best)) best = cpus;
  };
  for (absl::string_view line :
       absl::StrSplit(absl::string_view(proc_self_cgroup.data(), proc_self_cgroup.size()), '\n')) {
    // hierarchy-ID:controller-list:path
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    const std::string path(f[2]);
    if (f[0] == "0" && f[1].empty()) {  // v2
      for (const std::string& dir : SelfAndParents(path)) {
        const auto max = ReadFile(Join(root, dir, "cpu.max"));
        if (!max) continue;
        std::istringstream in(*max);
        std::string quota;
        double period = 0;
        if (in >> quota >> period && quota != "max" && period > 0) {
          take(std::atof(quota.c_str()) / period);
        }
      }
      continue;
    }
    bool cpu = false;
    for (absl::string_view c : absl::StrSplit(f[1], ',')) cpu |= c == "cpu";
    if (!cpu) continue;
    for (const char* mount : {"cpu", "cpu,cpuacct", "cpuacct,cpu"}) {
      const std::string base = absl::StrCat(root, "/", mount);
      for (const std::string& dir : SelfAndParents(path)) {
        const auto quota = ReadFile(Join(base, dir, "cpu.cfs_quota_us"));
        const auto period = ReadFile(Join(base, dir, "cpu.cfs_period_us"));
        if (!quota || !period) continue;
        const double q = std::atof(quota->c_str()), p = std::atof(period->c_str());
        if (q > 0 && p > 0) take(q / p);
      }
    }
  }
  return best;
}

CpuBudget ReadCpuBudget() {
  CpuBudget b;
  cpu_set_t set;
  CPU_ZERO(&set);
  b.affinity = sched_getaffinity(0, sizeof(set), &set) == 0
                   ? CPU_COUNT(&set)
                   : static_cast<int>(std::thread::hardware_concurrency());
  b.affinity = std::max(1, b.affinity);
  if (const auto self = ReadFile("/proc/self/cgroup")) {
    b.quota = CgroupCpuQuota("/sys/fs/cgroup", *self);
  }
  b.cpus = b.affinity;
  if (b.quota) b.cpus = std::min(b.cpus, std::max(1, static_cast<int>(std::ceil(*b.quota))));
  return b;
}

std::string CpuBudget::Describe() const {
  return absl::StrCat(cpus, " (affinity ", affinity, ", ",
                      quota ? absl::StrCat("cgroup quota ", *quota, " CPUs") : "no cgroup quota",
                      ")");
}

}  // namespace moe
