// The tensor files moe-cli reads and writes, and moe-cli end to end against a local cluster:
// forward from a .npy file equal to the in-process layer, stats and a dry-run rebalance.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "services/checkpoint/synthetic.h"
#include "services/tools/local_cluster.h"
#include "services/tools/tensor_file.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::MakeTempDir;
using testing::SameBits;

// Runs a command line, returns its exit status and stdout.
int RunCommand(const std::string& cmd, std::string* out) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
  return ::pclose(p);
}

TEST(TensorFile, NpyRoundTripAndErrors) {
  const std::string dir = MakeTempDir("npy");
  const std::vector<float> v = {1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 7.0f};
  ASSERT_TRUE(tools::WriteNpyF32(dir + "/a.npy", v, 2, 3).ok());
  auto m = tools::ReadMatrix(dir + "/a.npy", "");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->rows, 2);
  EXPECT_EQ(m->cols, 3);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(m->values[i].bits, Bf16::FromFloat(v[i]).bits);
  EXPECT_FALSE(tools::ParseNpy("not numpy at all", "x").ok());
  std::string bad_dtype = "\x93NUMPY\x01";
  bad_dtype += '\0';
  std::string header = "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 1), }";
  bad_dtype += static_cast<char>(header.size());
  bad_dtype += '\0';
  bad_dtype += header + std::string(8, '\0');
  auto r = tools::ParseNpy(bad_dtype, "x");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("<f8"), absl::string_view::npos) << r.status();
}

// The CLI end to end: forward from a .npy file, output to .npy, equal to the in-process layer;
// stats and a dry-run rebalance print their figures.
class MoeCli : public testing::ClusterTest {};

TEST_F(MoeCli, ForwardFromNpyMatchesTheInProcessLayer) {
  UsePreset("tiny");
  options().attention_args = {"--report_interval_ms=100"};
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  const ModelConfig& cfg = this->cfg();
  const int64_t tokens = 6;
  const std::vector<Bf16> x = Hidden(tokens, 21);
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = x[i].ToFloat();
  const std::string work = MakeTempDir("cli");
  ASSERT_TRUE(tools::WriteNpyF32(work + "/x.npy", xf, tokens, cfg.hidden).ok());
  const std::string cli = std::string(MOE_BIN_DIR) + "/moe-cli";
  std::string out;
  ASSERT_EQ(RunCommand(absl::StrCat(cli, " forward --attention ", cluster().attention_endpoint(),
                                    " --layer 1 --input ", work, "/x.npy --output ", work,
                                    "/y.npy --routing"),
                       &out),
            0)
      << out;
  EXPECT_NE(out.find("output [6, 128]"), std::string::npos) << out;
  auto y = tools::ReadMatrix(work + "/y.npy", "");
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_TRUE(SameBits(y->values, Want(x, tokens)));

  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // one statistics report
  out.clear();
  ASSERT_EQ(
      RunCommand(absl::StrCat(cli, " stats --router ", cluster().router_endpoint(), " --layer 1"),
                 &out),
      0)
      << out;
  EXPECT_NE(out.find("window 6 tokens"), std::string::npos) << out;
  out.clear();
  ASSERT_EQ(RunCommand(absl::StrCat(cli, " rebalance --dry_run --router ",
                                    cluster().router_endpoint(), " --layer 1"),
                       &out),
            0)
      << out;
  EXPECT_NE(out.find("dry run"), std::string::npos) << out;
  out.clear();
  EXPECT_NE(RunCommand(absl::StrCat(cli, " forward --attention ", cluster().attention_endpoint(),
                                    " --layer 1 --input ", work, "/missing.npy"),
                       &out),
            0);
  EXPECT_NE(out.find("cannot open"), std::string::npos) << out;
}

}  // namespace
}  // namespace moe
