// The one fixture of the multi-process tests, as Envoy's BaseIntegrationTest is theirs: a test
// says which checkpoint and which cluster it needs, starts it, and then reads as what it does.
// The fixture holds the in-process oracle layer on the same checkpoint, the cluster, a user and
// an admin client, and the lookups every cluster test makes (hidden states, the oracle's answer,
// a Forward checked against it, a metric of a process).
//
//   class ClusterFoo : public moe::testing::ClusterTest {};
//   TEST_F(ClusterFoo, Bar) {
//     UsePreset("tiny", {{0, 8}, {8, 16}});
//     options().attention_args = UcxArgs("tcp");
//     ASSERT_NO_FATAL_FAILURE(StartCluster());
//     ExpectOracleAnswer(16, /*seed=*/3);
//   }
#ifndef MOE_TESTS_SERVICES_CLUSTER_TEST_BASE_H_
#define MOE_TESTS_SERVICES_CLUSTER_TEST_BASE_H_

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/tools/load_generator.h"
#include "services/tools/local_cluster.h"
#include "tests/common/metrics_text.h"
#include "tests/services/cluster_fixtures.h"

namespace moe::testing {

class ClusterTest : public ::testing::Test {
 public:  // what helpers of a test (traffic threads, canaries) read too
  // The checkpoint of `preset` (written once per binary), the oracle layer on it, and the
  // cluster's options over it (TestCluster: one thread per process; empty ranges: two equal).
  void UsePreset(const std::string& preset, std::vector<std::pair<int64_t, int64_t>> ranges = {}) {
    checkpoint_ = CheckpointFor(preset);
    oracle_ = InProcessLayer(checkpoint_, &cfg_);
    options_ = TestCluster(checkpoint_, std::move(ranges));
  }
  LocalClusterOptions& options() { return options_; }

  // Starts the cluster of options(); a failure to start fails the test with its status.
  void StartCluster() {
    ASSERT_NE(oracle_, nullptr) << "UsePreset first";
    auto c = LocalCluster::Start(options_);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = std::move(*c);
  }

  LocalCluster& cluster() { return *cluster_; }
  const ModelConfig& cfg() const { return cfg_; }
  int32_t layer() const { return static_cast<int32_t>(cfg_.first_moe_layer); }
  int64_t hidden() const { return cfg_.hidden; }
  numerics::cpu::CpuMoeLayer& oracle() { return *oracle_; }
  const std::string& checkpoint_dir() const { return checkpoint_; }

  // A client without credentials, and one with options().admin_token (each made on first use).
  client::MoeClient& user() {
    if (user_ == nullptr) user_ = ClientFor(*cluster_);
    return *user_;
  }
  client::MoeClient& admin() {
    if (admin_ == nullptr) admin_ = ClientFor(*cluster_, options_.admin_token);
    return *admin_;
  }

  std::vector<Bf16> Hidden(int64_t tokens, uint64_t seed) const {
    return checkpoint::SyntheticHiddenStates(cfg_, tokens, seed);
  }
  // The oracle's output for x (bias of the checkpoint, or `bias` when given).
  std::vector<Bf16> Want(const std::vector<Bf16>& x, int64_t tokens, const float* bias = nullptr) {
    auto r = oracle_->Forward(x, tokens, cfg_.hidden, bias);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->out : std::vector<Bf16>();
  }

  absl::StatusOr<client::ForwardResult> Forward(const std::vector<Bf16>& x, int64_t tokens,
                                                const client::ForwardOptions& o = {}) {
    return user().Forward(layer(), x, tokens, cfg_.hidden, o);
  }
  // A Forward of `tokens` fresh hidden states through the cluster, bit for bit the oracle's.
  void ExpectOracleAnswer(int64_t tokens, uint64_t seed, const client::ForwardOptions& o = {}) {
    const std::vector<Bf16> x = Hidden(tokens, seed);
    auto got = Forward(x, tokens, o);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(SameBits(got->out, Want(x, tokens))) << "T=" << tokens << " seed " << seed;
  }

  // Closed-loop load on the hosted layer: `concurrency` clients sending `tokens`-token batches
  // until `duration` or `max_requests` (tools/load_generator.h; the rest of its options as they
  // default).
  tools::LoadOptions Load(int concurrency, int64_t tokens, absl::Duration duration,
                          int64_t max_requests) const {
    tools::LoadOptions lo;
    lo.layer = layer();
    lo.hidden = hidden();
    lo.concurrency = concurrency;
    lo.tokens = tokens;
    lo.duration = duration;
    lo.max_requests = max_requests;
    return lo;
  }

  // Until x is answered again (a shard restarted, a router back; bounded: `tries` x 100 ms, each
  // Forward within 5 s), then bit for bit `want`.
  void ExpectServedAgain(const std::vector<Bf16>& x, int64_t tokens, const std::vector<Bf16>& want,
                         int tries = 100) {
    client::ForwardOptions fo;
    fo.timeout = absl::Seconds(5);
    absl::StatusOr<client::ForwardResult> r = absl::UnavailableError("not tried");
    for (int i = 0; i < tries && !r.ok(); ++i) {
      r = Forward(x, tokens, fo);
      if (!r.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(SameBits(r->out, want));
  }

  // Forward `probe` until the cluster answers under bias version `version` (the WatchBias push
  // reaching the attention node); false after `tries` tries 50 ms apart.
  bool AwaitBiasVersion(uint64_t version, int tries = 100) {
    const std::vector<Bf16> probe = Hidden(4, 1);
    for (int i = 0; i < tries; ++i) {
      auto r = Forward(probe, 4);
      if (r.ok() && r->bias_version == version) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  // The sum of a metric's samples carrying every label in `labels` (tests/common/metrics_text).
  double AttentionMetric(const std::string& name, const std::vector<std::string>& labels = {}) {
    return ScrapeSum(cluster_->attention_metrics(), name, labels);
  }
  double RouterMetric(const std::string& name, const std::vector<std::string>& labels = {}) {
    return ScrapeSum(cluster_->router_metrics(), name, labels);
  }
  double ShardMetric(int shard, const std::string& name,
                     const std::vector<std::string>& labels = {}) {
    return ScrapeSum(cluster_->shard_metrics(shard), name, labels);
  }

 protected:
  void TearDown() override {
    user_.reset();
    admin_.reset();
    if (cluster_ == nullptr) return;
    cluster_->Stop();
    // A work dir the cluster made (tokens, the local CA's key, logs) is gone with it.
    if (options_.work_dir.empty()) {
      EXPECT_FALSE(std::filesystem::exists(cluster_->work_dir()));
    }
  }

 private:
  std::string checkpoint_;
  ModelConfig cfg_;
  std::unique_ptr<numerics::cpu::CpuMoeLayer> oracle_;
  LocalClusterOptions options_;
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<client::MoeClient> user_, admin_;
};

// The same for value-parameterized tests.
template <class Param>
class ClusterTestWithParam : public ClusterTest, public ::testing::WithParamInterface<Param> {};

}  // namespace moe::testing

#endif  // MOE_TESTS_SERVICES_CLUSTER_TEST_BASE_H_
