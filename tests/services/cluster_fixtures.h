// What the multi-process tests in tests/services/ share: one synthetic checkpoint per preset,
// the in-process oracle layer, a client of a local cluster, the test cluster's options, bit
// equality, and the flags of the data planes.
#ifndef MOE_TESTS_SERVICES_CLUSTER_FIXTURES_H_
#define MOE_TESTS_SERVICES_CLUSTER_FIXTURES_H_

#include <stdlib.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/tools/local_cluster.h"

namespace moe::testing {

using tensor::Bf16;
using tools::LocalCluster;
using tools::LocalClusterOptions;

inline std::string MakeTempDir(const std::string& tag) {
  std::string tmpl = ::testing::TempDir() + "/moe_" + tag + "_XXXXXX";
  char* dir = ::mkdtemp(tmpl.data());
  return dir != nullptr ? std::string(dir) : std::string();
}

// One synthetic checkpoint per preset for the whole test binary.
inline const std::string& CheckpointFor(const std::string& preset) {
  static std::map<std::string, std::string>* dirs = new std::map<std::string, std::string>();
  auto it = dirs->find(preset);
  if (it != dirs->end()) return it->second;
  const std::string dir = MakeTempDir("ckpt_" + preset);
  auto cfg = PresetConfig(preset);
  EXPECT_TRUE(cfg.ok());
  checkpoint::SyntheticOptions so;
  so.seed = 5;
  so.router_skew = 1.0;
  so.single_file = preset == "tiny";
  EXPECT_TRUE(checkpoint::WriteSyntheticCheckpoint(*cfg, dir, so).ok());
  return (*dirs)[preset] = dir;
}

inline std::unique_ptr<client::MoeClient> ClientFor(const LocalCluster& c,
                                                    const std::string& token = "") {
  client::ClientOptions o;
  o.attention = c.attention_endpoint();
  o.router = c.router_endpoint();
  o.admin_token = token;
  o.timeout = absl::Seconds(30);
  auto client = client::MoeClient::Create(o);
  EXPECT_TRUE(client.ok());
  return std::move(*client);
}

inline std::unique_ptr<numerics::cpu::CpuMoeLayer> InProcessLayer(const std::string& ckpt_dir,
                                                                  ModelConfig* cfg) {
  auto ckpt = checkpoint::Checkpoint::Open(ckpt_dir);
  EXPECT_TRUE(ckpt.ok());
  *cfg = *(*ckpt)->LoadConfig();
  auto w = checkpoint::LoadMoeLayer(**ckpt, *cfg, cfg->first_moe_layer, {});
  EXPECT_TRUE(w.ok()) << w.status();
  auto layer = numerics::cpu::CpuMoeLayer::Create(*cfg, std::move(*w), {});
  EXPECT_TRUE(layer.ok());
  return std::move(*layer);
}

// A cluster on `dir` with the given shard ranges (empty: two equal ones), one compute thread per
// process (the tests run next to each other on two cores).
inline LocalClusterOptions TestCluster(const std::string& dir,
                                       std::vector<std::pair<int64_t, int64_t>> ranges = {}) {
  LocalClusterOptions o;
  o.checkpoint = dir;
  o.shard_ranges = std::move(ranges);
  o.threads = 1;
  return o;
}

inline bool SameBits(const std::vector<Bf16>& a, const std::vector<Bf16>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(Bf16)) == 0;
}

// Both sides on UCX with the given transports (docs/data-plane.md): shared memory needs tcp
// next to it for UCX's peer-failure detection.
inline std::vector<std::string> UcxArgs(const std::string& tls) {
  return {"--data_plane=ucx", "--ucx_tls=" + tls};
}
inline std::vector<std::string> Concat(std::vector<std::string> a,
                                       const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
inline const std::vector<std::string> kGrpc = {"--data_plane=grpc"};

}  // namespace moe::testing

#endif  // MOE_TESTS_SERVICES_CLUSTER_FIXTURES_H_
