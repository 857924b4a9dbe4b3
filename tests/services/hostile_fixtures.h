// What the hostile-peer cluster tests share: a shard's UCX address as a member reads it, and a
// canary that sends one request again and again through the whole cluster while an attack runs
// and counts its answers against the in-process layer's.
//
//   Canary canary(**cluster, layer, x, tokens, cfg.hidden, want);
//   ... attack ...
//   canary.Stop();
//   EXPECT_EQ(canary.wrong(), 0);
#ifndef MOE_TESTS_SERVICES_HOSTILE_FIXTURES_H_
#define MOE_TESTS_SERVICES_HOSTILE_FIXTURES_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "moe/v1/expert.grpc.pb.h"
#include "services/transport/channel.h"
#include "tests/services/cluster_fixtures.h"

namespace moe::testing {

// A tiny two-shard cluster on a UCX lane, with one request and the in-process layer's answer
// to it: what an attack is run against.
struct AttackedCluster {
  ModelConfig cfg;
  std::unique_ptr<LocalCluster> cluster;
  int32_t layer = 0;
  static constexpr int64_t kTokens = 16;
  std::vector<Bf16> x, want;
};

inline AttackedCluster StartAttackedCluster(const std::string& ucx_tls, uint64_t seed) {
  AttackedCluster a;
  const std::string& dir = CheckpointFor("tiny");
  auto local = InProcessLayer(dir, &a.cfg);
  LocalClusterOptions o = TestCluster(dir, {{0, 8}, {8, 16}});
  o.expert_args = UcxArgs(ucx_tls);
  o.attention_args = UcxArgs(ucx_tls);
  auto cluster = LocalCluster::Start(o);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (cluster.ok()) a.cluster = std::move(*cluster);
  a.layer = static_cast<int32_t>(a.cfg.first_moe_layer);
  a.x = checkpoint::SyntheticHiddenStates(a.cfg, AttackedCluster::kTokens, seed);
  a.want = local->Forward(a.x, AttackedCluster::kTokens, a.cfg.hidden)->out;
  return a;
}

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

}  // namespace moe::testing

#endif  // MOE_TESTS_SERVICES_HOSTILE_FIXTURES_H_
