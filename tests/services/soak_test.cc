// A soak: a local cluster under steady Forward traffic for MOE_SOAK_SECONDS (120 in the test
// command; scripts/soak.sh runs 1800), the RSS, threads and open descriptors of every process
// sampled every 5 s. After a warm-up (a fifth of the run, at least 20 s) they must stay flat:
// RSS within 48 MiB of the warm-up's, threads within 2, descriptors within 8. Every answer is
// checked bit for bit. The table it prints is docs/survive.md's soak figures.
#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::Traffic;

struct Sample {
  int64_t rss = 0, threads = 0, fds = 0;
};

Sample Read(pid_t pid) {
  Sample s;
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") status >> s.rss, s.rss *= 1024;
    if (key == "Threads:") status >> s.threads;
  }
  if (DIR* d = ::opendir(("/proc/" + std::to_string(pid) + "/fd").c_str())) {
    while (const dirent* e = ::readdir(d)) s.fds += e->d_name[0] != '.';
    ::closedir(d);
  }
  return s;
}

class ClusterSoak : public testing::ClusterTest {};

TEST_F(ClusterSoak, ResourcesStayFlatUnderSteadyTraffic) {
  const char* env = std::getenv("MOE_SOAK_SECONDS");
  const int seconds = env != nullptr ? std::max(30, std::atoi(env)) : 120;
  const int warmup = std::max(20, seconds / 5);
  UsePreset("tiny", {{0, 8}, {8, 16}});
  options().router_args = {"--window_tokens=4096"};  // windows roll over many times
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  const std::vector<Bf16> x = Hidden(16, 61);
  const std::vector<Bf16> want = Want(x, 16);
  Traffic a, b;
  a.Start(cluster(), layer(), x, 16, hidden(), want);
  b.Start(cluster(), layer(), x, 16, hidden(), want);
  std::map<std::string, Sample> base, last, peak;
  const auto start = std::chrono::steady_clock::now();
  for (int t = 0; t <= seconds; t += 5) {
    std::this_thread::sleep_until(start + std::chrono::seconds(t));
    for (const auto& [name, pid] : cluster().Processes()) {
      const Sample s = Read(pid);
      if (t <= warmup) base[name] = s;  // the last sample of the warm-up
      last[name] = s;
      Sample& p = peak[name];
      p.rss = std::max(p.rss, s.rss);
      p.threads = std::max(p.threads, s.threads);
      p.fds = std::max(p.fds, s.fds);
    }
  }
  a.Stop();
  b.Stop();
  std::printf("[soak %d s, warm-up %d s] %lld answers, %lld failed, %lld wrong\n", seconds, warmup,
              static_cast<long long>(a.ok + b.ok), static_cast<long long>(a.failed + b.failed),
              static_cast<long long>(a.wrong + b.wrong));
  std::printf("[soak] %-14s %22s %18s %14s\n", "process", "RSS MiB (warm -> end)", "threads",
              "open fds");
  for (const auto& [name, s] : last) {
    const Sample& w = base[name];
    std::printf("[soak] %-14s %10.1f -> %-10.1f %7lld -> %-7lld %6lld -> %-6lld\n", name.c_str(),
                w.rss / 1048576.0, s.rss / 1048576.0, static_cast<long long>(w.threads),
                static_cast<long long>(s.threads), static_cast<long long>(w.fds),
                static_cast<long long>(s.fds));
    EXPECT_LE(s.rss - w.rss, int64_t{48} << 20) << name;
    EXPECT_LE(s.threads - w.threads, 2) << name;
    EXPECT_LE(s.fds - w.fds, 8) << name;
  }
  EXPECT_GT(a.ok + b.ok, seconds);  // traffic flowed the whole time
  EXPECT_EQ(a.failed + b.failed, 0) << (a.errors.empty() ? "" : a.errors[0]);
  EXPECT_EQ(a.wrong + b.wrong, 0);
}

}  // namespace
}  // namespace moe
