// How often threads of this process slept, read from the kernel: the voluntary context switches
// of every thread whose name (/proc/self/task/*/comm) is `name`, summed. What tests of polling
// assert (a round trip that wakes no thread), whatever the code says it does.
//
//   const int64_t before = testing::ThreadSleeps("ucx-progress");  // -1: no /proc
//   ... round trips ...
//   EXPECT_LT(testing::ThreadSleeps("ucx-progress") - before, 60);
#ifndef MOE_TESTS_COMMON_THREAD_SLEEPS_H_
#define MOE_TESTS_COMMON_THREAD_SLEEPS_H_

#include <dirent.h>

#include <cstdint>
#include <fstream>
#include <string>

namespace moe::testing {

inline int64_t ThreadSleeps(const std::string& name) {
  int64_t total = 0;
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) return -1;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string dir = std::string("/proc/self/task/") + e->d_name;
    std::string comm;
    std::getline(std::ifstream(dir + "/comm"), comm);
    if (comm != name) continue;
    std::ifstream status(dir + "/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0) total += std::stoll(line.substr(24));
    }
  }
  ::closedir(d);
  return total;
}

}  // namespace moe::testing

#endif  // MOE_TESTS_COMMON_THREAD_SLEEPS_H_
