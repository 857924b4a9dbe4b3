// What the multi-process tests in tests/services/ share: one synthetic checkpoint per preset,
// the in-process oracle layer, a client of a local cluster, the test cluster's options, bit
// equality, and the flags of the data planes.
#ifndef MOE_TESTS_SERVICES_CLUSTER_FIXTURES_H_
#define MOE_TESTS_SERVICES_CLUSTER_FIXTURES_H_

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/common/temp_dir.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/tools/local_cluster.h"

namespace moe::testing {

using tensor::Bf16;
using tools::LocalCluster;
using tools::LocalClusterOptions;

// A fresh directory under the test process's own ($TMPDIR: tests/common/test_main.cc), removed
// with it; "" when it could not be made.
inline std::string MakeTempDir(const std::string& tag) {
  absl::StatusOr<std::string> dir = moe::MakeTempDir("moe_" + tag);
  EXPECT_TRUE(dir.ok()) << dir.status();
  return dir.ok() ? *dir : std::string();
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

// stdout of a shell command (bounded by `timeout`); add 2>&1 to see its errors too.
inline std::string RunShell(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(("timeout 10 " + cmd).c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

inline std::unique_ptr<client::MoeClient> ClientFor(const LocalCluster& c,
                                                    const std::string& token = "") {
  client::ClientOptions o = c.client_options();
  o.admin_token = token;
  o.timeout = absl::Seconds(30);
  auto client = client::MoeClient::Create(o);
  EXPECT_TRUE(client.ok());
  return std::move(*client);
}

// The attention nodes' member token LocalCluster made (work_dir/attention_token): what
// Dispatch and OpenDataPlane need. (work_dir/cluster_token is the router's secret.)
inline std::string AttentionToken(const LocalCluster& c) {
  std::ifstream f(c.work_dir() + "/attention_token");
  std::string token;
  f >> token;
  return token;
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

// Partial sums change the order of the fp32 latent sum (per shard, then across shards). r is
// rounded to bf16 after the sum, so it differs only where the fp32 sum lies next to a bf16
// rounding boundary; such a token's norm and up-projection then move a few outputs. Measured
// (mid, shards [0,40) [40,128)): 0 differing outputs up to T = 64; at T = 256 5 of 262144, the
// worst 2.2e-3 of the row's largest |output|. The bounds keep a margin of 3.5x and more.
inline constexpr double kPartialSumMaxDifferingFraction = 0.01;  // outputs not bit-identical
inline constexpr double kPartialSumMaxErrorOfRowScale = 0x1p-7;  // |diff| / max_i |out[t, i]|

// A partial-sum answer `got` against the per-pair (in-process) `want`, both [tokens, width]:
// the fraction of outputs that differ and the worst |difference| over its row's largest
// |want|, each checked against the bounds above. Returns them for the log.
inline std::pair<double, double> ExpectWithinPartialSumBounds(const std::vector<Bf16>& got,
                                                              const std::vector<Bf16>& want,
                                                              int64_t tokens, int64_t width) {
  int64_t differing = 0;
  double worst = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    double scale = 0;
    for (int64_t i = 0; i < width; ++i) {
      scale = std::max(scale, std::fabs(double{want[t * width + i].ToFloat()}));
    }
    for (int64_t i = 0; i < width; ++i) {
      const double a = got[t * width + i].ToFloat();
      const double b = want[t * width + i].ToFloat();
      differing += a != b;
      worst = std::max(worst, std::fabs(a - b) / scale);
    }
  }
  const double fraction = static_cast<double>(differing) / static_cast<double>(got.size());
  EXPECT_LE(fraction, kPartialSumMaxDifferingFraction);
  EXPECT_LE(worst, kPartialSumMaxErrorOfRowScale);
  return {fraction, worst};
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

// Fresh certificates in dir/pki (tests/common/make_test_pki.sh, openssl): the cluster CA, two
// member certificates from it, and a certificate from another CA. Empty on failure.
inline std::string MakeTestPki(const std::string& dir) {
  const std::string pki = dir + "/pki";
  const std::string cmd =
      std::string("bash ") + MOE_SOURCE_DIR + "/tests/common/make_test_pki.sh " + pki;
  return std::system(cmd.c_str()) == 0 ? pki : std::string();
}
// TLS options for a member certificate `name` of the PKI (mutual TLS unless told).
inline transport::TlsOptions MemberTls(const std::string& pki, const std::string& name = "member",
                                       const std::string& ca = "ca") {
  transport::TlsOptions t;
  t.cert_file = pki + "/" + name + ".pem";
  t.key_file = pki + "/" + name + ".key";
  t.ca_file = pki + "/" + ca + ".pem";
  t.refresh_seconds = 1;
  return t;
}

// Forward traffic on its own thread, every answer checked against the in-process layer: ok,
// failed (an error status), wrong (other bits), hung (answered past its deadline + 1 s).
struct Traffic {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> ok{0}, failed{0}, wrong{0}, hung{0};
  std::vector<std::string> errors;  // the first few
  std::thread thread;
  // With record set before Start: every request's start and latency, answered right or not
  // (read after Stop).
  struct Sample {
    std::chrono::steady_clock::time_point start;
    double ms;
    bool ok;
    bool wrong;  // answered, with other bytes than want
  };
  bool record = false;
  std::vector<Sample> samples;

  void Start(const LocalCluster& c, int32_t layer, const std::vector<Bf16>& x, int64_t tokens,
             int64_t hidden, const std::vector<Bf16>& want,
             absl::Duration timeout = absl::Seconds(10)) {
    thread = std::thread([this, &c, layer, x, tokens, hidden, want, timeout] {
      auto client = ClientFor(c);
      client::ForwardOptions o;
      o.timeout = timeout;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(600);
      while (!stop.load() && std::chrono::steady_clock::now() < until) {
        const absl::Time start = absl::Now();
        const auto started = std::chrono::steady_clock::now();
        auto r = client->Forward(layer, x, tokens, hidden, o);
        if (absl::Now() - start > timeout + absl::Seconds(1)) ++hung;
        const bool right = r.ok() && SameBits(r->out, want);
        if (record) {
          samples.push_back(
              {started,
               std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started)
                   .count(),
               right, r.ok() && !right});
        }
        if (!r.ok()) {
          if (errors.size() < 5) errors.push_back(r.status().ToString());
          ++failed;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));  // no hot loop on errors
        } else if (!right) {
          ++wrong;
        } else {
          ++ok;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
  }
  void Stop() {
    stop = true;
    if (thread.joinable()) thread.join();
  }
};

}  // namespace moe::testing

#endif  // MOE_TESTS_SERVICES_CLUSTER_FIXTURES_H_
