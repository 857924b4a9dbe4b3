// What the hostile-peer cluster tests share: a shard's UCX address as a member reads it, a
// canary that sends one request again and again through the whole cluster while an attack runs
// and counts its answers against the in-process layer's, and the fixture of an attacked cluster.
//
//   class ClusterFoo : public AttackedClusterTest {};
//   TEST_F(ClusterFoo, Bar) {
//     ASSERT_NO_FATAL_FAILURE(StartAttackedCluster("tcp", 78));
//     auto canary = StartCanary();
//     ... attack ...
//     ExpectCleanCanary(*canary, 3);
//     ExpectEveryProcessUpAndServing();
//   }
#ifndef MOE_TESTS_SERVICES_HOSTILE_FIXTURES_H_
#define MOE_TESTS_SERVICES_HOSTILE_FIXTURES_H_

#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "moe/v1/expert.grpc.pb.h"
#include "services/transport/channel.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/cluster_test_base.h"

namespace moe::testing {

// Shard i's UCX worker address, read with the members' token (what a stranger is not given);
// empty when the shard offers none.
inline std::string ShardUcxAddress(const LocalCluster& c, int shard) {
  auto stub = v1::ExpertService::NewStub(transport::MakeChannel(c.shard_endpoint(shard)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ctx.AddMetadata(transport::kClusterTokenMetadata, AttentionToken(c));
  v1::ExpertServerInfo info;
  EXPECT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
  return info.ucx_address();
}

// The same Forward on its own thread until Stop (or max_requests), each answer counted as
// bit-exact with `want`, wrong, or failed.
class Canary {
 public:
  Canary(const LocalCluster& c, int32_t layer, std::vector<Bf16> x, int64_t tokens, int64_t hidden,
         std::vector<Bf16> want, int max_requests = 5000)
      : thread_([this, &c, layer, x = std::move(x), tokens, hidden, want = std::move(want),
                 max_requests] {
          auto client = ClientFor(c);
          client::ForwardOptions fo;
          fo.timeout = absl::Seconds(5);
          for (int i = 0; i < max_requests && !stop_.load(); ++i) {
            auto r = client->Forward(layer, x, tokens, hidden, fo);
            if (!r.ok()) {
              failed_.fetch_add(1);
            } else {
              (SameBits(r->out, want) ? ok_ : wrong_).fetch_add(1);
            }
          }
        }) {}
  ~Canary() { Stop(); }

  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  int ok() const { return ok_.load(); }
  int wrong() const { return wrong_.load(); }
  int failed() const { return failed_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> ok_{0}, wrong_{0}, failed_{0};
  std::thread thread_;
};

// A tiny two-shard cluster on a UCX lane, with one request and the in-process layer's answer
// to it: what an attack is run against, and what is checked after it.
class AttackedClusterTest : public ClusterTest {
 protected:
  static constexpr int64_t kTokens = 16;

  void StartAttackedCluster(const std::string& ucx_tls, uint64_t seed) {
    UsePreset("tiny", {{0, 8}, {8, 16}});
    options().expert_args = UcxArgs(ucx_tls);
    options().attention_args = UcxArgs(ucx_tls);
    ASSERT_NO_FATAL_FAILURE(StartCluster());
    x_ = Hidden(kTokens, seed);
    want_ = Want(x_, kTokens);
  }
  std::unique_ptr<Canary> StartCanary(int max_requests = 5000) {
    return std::make_unique<Canary>(cluster(), layer(), x_, kTokens, hidden(), want_, max_requests);
  }
  // Stops the canary: at least `min_ok` answers, every one bit-exact, none failed.
  void ExpectCleanCanary(Canary& canary, int min_ok) {
    canary.Stop();
    EXPECT_GT(canary.ok(), min_ok);
    EXPECT_EQ(canary.wrong(), 0) << "an attack changed an answer";
    EXPECT_EQ(canary.failed(), 0);
  }
  // Every process is still there, and the cluster still answers bit-exact.
  void ExpectEveryProcessUpAndServing() {
    for (const auto& [name, pid] : cluster().Processes()) {
      EXPECT_EQ(::kill(pid, 0), 0) << name << " died";
    }
    auto after = Forward(x_, kTokens);
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_TRUE(SameBits(after->out, want_));
  }

  std::vector<Bf16> x_, want_;
};

}  // namespace moe::testing

#endif  // MOE_TESTS_SERVICES_HOSTILE_FIXTURES_H_
