// The CPUs a process may use: its affinity mask capped by its cgroup's CPU quota, read from a
// made-up cgroup tree (v2 and v1, the quota on the process's cgroup or on one above it, none),
// and on this machine against what the kernel says.
#include "services/common/cpus.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace moe {
namespace {

class CgroupTree : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = std::filesystem::path(::testing::TempDir()) /
            ("cgroup-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
  }
  void Write(const std::string& rel, const std::string& text) {
    const auto p = root_ / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  std::filesystem::path root_;
};

TEST_F(CgroupTree, V2QuotaOfTheProcessOrAnyParentTheTightestWins) {
  Write("cpu.max", "max 100000\n");
  Write("kubepods/pod1/cpu.max", "250000 100000\n");  // 2.5 CPUs on the pod
  Write("kubepods/pod1/box/cpu.max", "max 100000\n");
  EXPECT_DOUBLE_EQ(*CgroupCpuQuota(root_, "0::/kubepods/pod1/box\n"), 2.5);
  Write("kubepods/pod1/box/cpu.max", "50000 100000\n");  // the container's own is tighter
  EXPECT_DOUBLE_EQ(*CgroupCpuQuota(root_, "0::/kubepods/pod1/box\n"), 0.5);
  // No quota anywhere, or no cpu.max at all.
  EXPECT_FALSE(CgroupCpuQuota(root_, "0::/\n").has_value());
  EXPECT_FALSE(CgroupCpuQuota(root_, "0::/elsewhere\n").has_value());
  EXPECT_FALSE(CgroupCpuQuota(root_, "").has_value());
}

TEST_F(CgroupTree, V1QuotaOverPeriodOnTheCpuController) {
  Write("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "300000\n");
  Write("cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  Write("cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  Write("cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  const char* self = "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n1:name=systemd:/x\n";
  EXPECT_DOUBLE_EQ(*CgroupCpuQuota(root_, self), 3.0);
  EXPECT_FALSE(CgroupCpuQuota(root_, "11:cpu,cpuacct:/\n").has_value());  // -1: none
}

TEST(Cpus, ThisProcessMayUseItsAffinityCappedByItsQuota) {
  const CpuBudget b = ReadCpuBudget();
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_EQ(b.affinity, CPU_COUNT(&set));
  EXPECT_GE(b.cpus, 1);
  EXPECT_LE(b.cpus, b.affinity);
  if (b.quota) {
    EXPECT_LE(b.cpus, static_cast<int>(*b.quota) + 1);
  }
  EXPECT_EQ(UsableCpus(), b.cpus);
  EXPECT_NE(b.Describe().find("affinity"), std::string::npos);
}

}  // namespace
}  // namespace moe
