// The attention core without processes (attention_core.h): a core on a synthetic checkpoint
// whose shards' experts are in this process (LocalExpertChannel), fed placements and biases
// as router-svc's watches would feed them. Its Forward against the in-process layer (bit for
// bit), the routing view it keeps (readiness, bias versions, stale or wrong ones ignored), the
// statistics it reports (loads and tokens counted), and its refusals, each with its code.
#include "attention-svc/attention_core.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "services/checkpoint/synthetic.h"
#include "services/common/thread_pool.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/transport/tensor_codec.h"

namespace moe::attention_svc {
namespace {

using tensor::Bf16;

constexpr int64_t kSplit = 6;  // shard-0 hosts experts [0, 6), shard-1 [6, E)

class CoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = *PresetConfig("tiny");
    layer_ = cfg_.first_moe_layer;
    so_.seed = 7;
    so_.router_skew = 1.0;
    lo_ = checkpoint::SyntheticExperts(cfg_, layer_, 0, kSplit, so_);
    hi_ = checkpoint::SyntheticExperts(cfg_, layer_, kSplit, cfg_.num_experts, so_);
    AttentionServerOptions o;
    o.preset = "tiny";
    o.seed = so_.seed;
    o.router_skew = so_.router_skew;
    o.data_plane.name = "grpc";  // no data plane half: every shard here is local
    o.workers = 2;
    o.max_tokens = 64;
    o.budget_check_every = 0;
    o.canary_interval_ms = canary_interval_ms_;
    o.audit_share = audit_share_;
    auto core = AttentionCore::Load(o);
    ASSERT_TRUE(core.ok()) << core.status();
    core_ = std::move(*core);
    // A shard serving other weights under its own name (a lying member): another seed.
    checkpoint::SyntheticOptions other = so_;
    other.seed = so_.seed + 1;
    hi_lie_ = checkpoint::SyntheticExperts(cfg_, layer_, kSplit, cfg_.num_experts, other);
    LocalExperts local;
    local.weights = [this](const ShardRef& s) -> const numerics::MoeLayerWeights* {
      if (s.shard == "shard-0") return &lo_;
      if (s.shard == "shard-1") return lying_.load() ? &hi_lie_ : &hi_;
      if (s.shard == "shard-1r") return &hi_;        // an honest replica of shard-1
      if (s.shard == "shard-liar") return &hi_lie_;  // a lying one (a valid identity)
      return nullptr;
    };
    local.kernels = &numerics::cpu::ChosenKernels(cfg_.latent, cfg_.intermediate);
    local.pool = &pool_;
    ASSERT_TRUE(core_->Start(/*metrics=*/nullptr, local).ok());
  }

  // shard-1_at: its endpoint's suffix (a restarted shard-1 is somewhere else).
  v1::Placement TwoShards(bool healthy = true, const std::string& shard1_at = "") const {
    v1::Placement p;
    p.set_version(1);
    for (auto [name, lo, hi] : {std::tuple<const char*, int64_t, int64_t>{"shard-0", 0, kSplit},
                                {"shard-1", kSplit, cfg_.num_experts}}) {
      v1::ShardInfo* s = p.add_shards();
      s->set_shard(name);
      s->set_endpoint(std::string("local:") + name +
                      (std::string(name) == "shard-1" ? shard1_at : ""));
      s->set_healthy(healthy);
      v1::ExpertRange* r = s->add_ranges();
      r->set_layer(static_cast<int32_t>(layer_));
      r->set_expert_lo(static_cast<int32_t>(lo));
      r->set_expert_hi(static_cast<int32_t>(hi));
    }
    return p;
  }

  v1::ForwardRequest Request(int64_t tokens, uint64_t seed) const {
    v1::ForwardRequest req;
    req.set_layer(static_cast<int32_t>(layer_));
    req.set_request_id(seed);
    x_ = checkpoint::SyntheticHiddenStates(cfg_, tokens, seed);
    transport::EncodeBf16Into(x_, tokens, cfg_.hidden, req.mutable_hidden_states());
    req.mutable_options()->set_return_routing(true);
    return req;
  }

  // The whole layer in this process, experts included, under `bias` (null: the checkpoint's).
  numerics::LayerOutput InProcess(int64_t tokens, const float* bias = nullptr) const {
    auto layer =
        numerics::cpu::CpuMoeLayer::Create(cfg_, checkpoint::SyntheticLayer(cfg_, layer_, so_), {});
    EXPECT_TRUE(layer.ok()) << layer.status();
    auto y = (*layer)->Forward(x_, tokens, cfg_.hidden, bias);
    EXPECT_TRUE(y.ok()) << y.status();
    return *std::move(y);
  }

  // Serve on the core's workers, as a front does.
  absl::Status Serve(const v1::ForwardRequest& req, v1::ForwardResponse* resp) {
    std::promise<absl::Status> done;
    const bool queued = core_->Submit([&] {
      done.set_value(core_->Serve(req, absl::Now() + absl::Seconds(30), resp, "Forward"));
    });
    if (!queued) return absl::ResourceExhaustedError("queue full");
    return done.get_future().get();
  }

  int64_t canary_interval_ms_ = 0;  // the readiness canary: off but in its own tests
  int64_t audit_share_ = 64;        // twin audits: the default
  ModelConfig cfg_;
  int64_t layer_ = 0;
  checkpoint::SyntheticOptions so_;
  numerics::MoeLayerWeights lo_, hi_, hi_lie_;
  std::atomic<bool> lying_{false};  // shard-1 answers with hi_lie_
  ThreadPool pool_{2};
  std::unique_ptr<AttentionCore> core_;
  mutable std::vector<Bf16> x_;
};

TEST_F(CoreTest, AForwardEqualsTheInProcessLayerBitForBit) {
  EXPECT_FALSE(core_->LayerReady(static_cast<int32_t>(layer_)));
  EXPECT_TRUE(core_->ApplyPlacement(TwoShards()));
  EXPECT_TRUE(core_->LayerReady(static_cast<int32_t>(layer_)));
  for (int64_t tokens : {1, 13, 64}) {
    SCOPED_TRACE(tokens);
    v1::ForwardResponse resp;
    ASSERT_TRUE(Serve(Request(tokens, 100 + tokens), &resp).ok());
    const numerics::LayerOutput want = InProcess(tokens);
    ASSERT_EQ(resp.output().data().size(), want.out.size() * sizeof(Bf16));
    EXPECT_EQ(std::memcmp(resp.output().data().data(), want.out.data(), want.out.size() * 2), 0);
    ASSERT_EQ(resp.routing().expert_ids_size(), tokens * cfg_.top_k);
    for (int64_t i = 0; i < tokens * cfg_.top_k; ++i) {
      ASSERT_EQ(resp.routing().expert_ids(static_cast<int>(i)), want.routing.expert_ids[i]);
    }
    EXPECT_EQ(resp.bias_version(), 0u);
    EXPECT_EQ(resp.expert_budget(), cfg_.top_k);
    EXPECT_EQ(resp.routed_pairs(), tokens * cfg_.top_k);
    EXPECT_GT(resp.dispatch_bytes_sent(), 0);
  }
}

TEST_F(CoreTest, ABiasFromTheRouterIsServedAndAWrongOneIgnored) {
  core_->ApplyPlacement(TwoShards());
  std::vector<float> bias(static_cast<size_t>(cfg_.num_experts));
  for (size_t e = 0; e < bias.size(); ++e) bias[e] = 0.05f * static_cast<float>(e % 5);
  v1::LayerBias b;
  b.set_layer(static_cast<int32_t>(layer_));
  b.set_version(3);
  *b.mutable_bias() = {bias.begin(), bias.end()};
  core_->ApplyBias(b);
  v1::LayerBias wrong = b;  // another width: ignored, version 3 stays
  wrong.set_version(4);
  wrong.add_bias(1.0f);
  core_->ApplyBias(wrong);
  v1::LayerBias other = b;  // a layer not hosted here: ignored
  other.set_layer(static_cast<int32_t>(layer_) + 1);
  other.set_version(5);
  core_->ApplyBias(other);
  v1::ForwardResponse resp;
  ASSERT_TRUE(Serve(Request(9, 5), &resp).ok());
  EXPECT_EQ(resp.bias_version(), 3u);
  const numerics::LayerOutput want = InProcess(9, bias.data());
  EXPECT_EQ(std::memcmp(resp.output().data().data(), want.out.data(), want.out.size() * 2), 0);
}

TEST_F(CoreTest, ItsReportsCountEveryTokenAndSelectionOncePerBiasVersion) {
  core_->ApplyPlacement(TwoShards());
  v1::ForwardResponse resp;
  ASSERT_TRUE(Serve(Request(10, 1), &resp).ok());
  ASSERT_TRUE(Serve(Request(7, 2), &resp).ok());
  std::vector<v1::ReportStatsRequest> reports = core_->TakeReports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].node(), "attention-0");
  EXPECT_EQ(reports[0].tokens(), 17);
  EXPECT_EQ(reports[0].bias_version(), 0u);
  const int64_t loads =
      std::accumulate(reports[0].loads().begin(), reports[0].loads().end(), int64_t{0});
  EXPECT_EQ(loads, 17 * cfg_.top_k);
  EXPECT_FALSE(reports[0].qb_histogram().empty());
  EXPECT_TRUE(core_->TakeReports().empty());  // taken once
  // A new bias version closes the window: two reports, the old version's first.
  ASSERT_TRUE(Serve(Request(4, 3), &resp).ok());
  v1::LayerBias b;
  b.set_layer(static_cast<int32_t>(layer_));
  b.set_version(1);
  b.mutable_bias()->Resize(static_cast<int>(cfg_.num_experts), 0.0f);
  core_->ApplyBias(b);
  ASSERT_TRUE(Serve(Request(5, 4), &resp).ok());
  reports = core_->TakeReports();
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports[0].bias_version(), 0u);
  EXPECT_EQ(reports[0].tokens(), 4);
  EXPECT_EQ(reports[1].bias_version(), 1u);
  EXPECT_EQ(reports[1].tokens(), 5);
}

TEST_F(CoreTest, RefusalsCarryTheirCodes) {
  v1::ForwardResponse resp;
  // No placement yet.
  EXPECT_EQ(Serve(Request(2, 1), &resp).code(), absl::StatusCode::kUnavailable);
  core_->ApplyPlacement(TwoShards(/*healthy=*/false));
  EXPECT_FALSE(core_->LayerReady(static_cast<int32_t>(layer_)));
  core_->ApplyPlacement(TwoShards());
  v1::ForwardRequest req = Request(2, 1);
  req.set_layer(static_cast<int32_t>(layer_) + 1);
  EXPECT_EQ(Serve(req, &resp).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Serve(Request(65, 1), &resp).code(), absl::StatusCode::kResourceExhausted);
  req = Request(2, 1);
  req.mutable_hidden_states()->set_shape(1, cfg_.hidden + 1);
  EXPECT_EQ(Serve(req, &resp).code(), absl::StatusCode::kInvalidArgument);
  req = Request(2, 1);
  req.mutable_options()->set_expert_budget(static_cast<int32_t>(cfg_.top_k) + 1);
  EXPECT_EQ(Serve(req, &resp).code(), absl::StatusCode::kInvalidArgument);
  // A cap below k with no solved thresholds is refused, never served at k in silence.
  req = Request(2, 1);
  req.mutable_options()->set_expert_budget(2);
  EXPECT_EQ(Serve(req, &resp).code(), absl::StatusCode::kFailedPrecondition);
  // And the core still serves.
  EXPECT_TRUE(Serve(Request(2, 1), &resp).ok());
}

TEST_F(CoreTest, ModelInfoSaysWhatItServesAndWhere) {
  v1::ModelInfo info;
  core_->FillModelInfo(&info);
  EXPECT_FALSE(info.ready());
  EXPECT_EQ(info.hidden(), cfg_.hidden);
  ASSERT_EQ(info.layers_size(), 1);
  EXPECT_EQ(info.layers(0), layer_);
  core_->ApplyPlacement(TwoShards());
  info.Clear();
  core_->FillModelInfo(&info);
  EXPECT_TRUE(info.ready());
  ASSERT_EQ(info.shards_size(), 2);
  EXPECT_EQ(info.shards(1).expert_lo(), kSplit);
}

TEST_F(CoreTest, StopRunsWhatIsQueuedAndRefusesMore) {
  core_->ApplyPlacement(TwoShards());
  std::atomic<int> ok{0};
  std::vector<v1::ForwardRequest> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(Request(3, 10 + i));
  std::vector<v1::ForwardResponse> resps(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_TRUE(core_->Submit([&, i] {
      ok += core_->Serve(reqs[i], absl::Now() + absl::Seconds(30), &resps[i], "Forward").ok();
    }));
  }
  core_->Stop();
  EXPECT_EQ(ok.load(), 6);
  EXPECT_FALSE(core_->Submit([] {}));
}

// The readiness canary on (every 50 ms): ready only once a canary through the whole path
// matched the layer's in-process reference; a shard that starts serving other weights under its
// own name makes the node not ready within a few canaries, and ready again once it answers
// right (readiness_canary.h).
class CanaryCoreTest : public CoreTest {
 protected:
  CanaryCoreTest() { canary_interval_ms_ = 50; }

  // Until core_->Ready() == want (bounded: 10 s).
  bool AwaitReady(bool want) {
    for (int i = 0; i < 400; ++i) {
      if (core_->Ready() == want) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    return core_->Ready() == want;
  }
};

TEST_F(CanaryCoreTest, ReadyOnlyWhileTheCanaryAnswersRight) {
  std::vector<bool> told;
  std::mutex told_mu;
  core_->OnReadinessChange([&](bool ready) {
    std::lock_guard<std::mutex> lock(told_mu);
    told.push_back(ready);
  });
  EXPECT_FALSE(core_->Ready());  // no placement
  ASSERT_TRUE(core_->ApplyPlacement(TwoShards()));
  ASSERT_TRUE(AwaitReady(true)) << "the first canary never matched";
  v1::ModelInfo info;
  core_->FillModelInfo(&info);
  EXPECT_TRUE(info.ready());

  // shard-1 restarted serving other weights under its own name (a new endpoint: a new channel).
  lying_ = true;
  ASSERT_TRUE(core_->ApplyPlacement(TwoShards(true, "-restarted")));
  ASSERT_TRUE(AwaitReady(false)) << "a lying shard was not caught";
  EXPECT_TRUE(core_->LayerReady(static_cast<int32_t>(layer_)));  // placed, but not answering right
  EXPECT_FALSE(core_->CanaryReady());
  core_->FillModelInfo(&info);
  EXPECT_FALSE(info.ready());
  // Requests are still served (readiness steers new traffic away; it does not refuse it).
  v1::ForwardResponse resp;
  EXPECT_TRUE(Serve(Request(3, 1), &resp).ok());

  lying_ = false;  // and again, with the right weights
  ASSERT_TRUE(core_->ApplyPlacement(TwoShards(true, "-fixed")));
  ASSERT_TRUE(AwaitReady(true)) << "the node did not come back";
  core_->OnReadinessChange(nullptr);
  std::lock_guard<std::mutex> lock(told_mu);
  EXPECT_EQ(told, (std::vector<bool>{true, false, true}));
}

// Twin audits on every message (share 1) with shard-1's range on three replicas, one of them
// serving other weights under its own name: the liar is caught at its first audited reply, the
// sink hears of it once, and no answer is wrong (an audited message is answered with the reply
// within the reference's bound); afterwards the liar gets nothing and the two honest replicas
// agree bit for bit.
class AuditCoreTest : public CoreTest {
 protected:
  AuditCoreTest() { audit_share_ = 1; }
};

TEST_F(AuditCoreTest, ALyingReplicaIsCaughtAndNoAnswerIsWrong) {
  std::mutex mu;
  std::vector<ShardQuarantine> caught;
  core_->OnQuarantine([&](const ShardQuarantine& q) {
    std::lock_guard<std::mutex> lock(mu);
    caught.push_back(q);
  });
  v1::Placement p = TwoShards();
  for (const char* name : {"shard-1r", "shard-liar"}) {
    v1::ShardInfo* s = p.add_shards();
    *s = p.shards(1);
    s->set_shard(name);
    s->set_endpoint(std::string("local:") + name);
  }
  ASSERT_TRUE(core_->ApplyPlacement(p));
  for (int i = 0; i < 8; ++i) {
    SCOPED_TRACE(i);
    v1::ForwardResponse resp;
    ASSERT_TRUE(Serve(Request(13, 300 + i), &resp).ok());
    const numerics::LayerOutput want = InProcess(13);
    ASSERT_EQ(resp.output().data().size(), want.out.size() * sizeof(Bf16));
    EXPECT_EQ(std::memcmp(resp.output().data().data(), want.out.data(), want.out.size() * 2), 0);
  }
  const TwinAuditor::Counts c = core_->AuditCounts();
  EXPECT_EQ(c.quarantined, std::vector<std::string>{"shard-liar"});
  EXPECT_GE(c.outcomes.count(TwinOutcome::kCaught) ? c.outcomes.at(TwinOutcome::kCaught) : 0, 1);
  EXPECT_GE(c.outcomes.count(TwinOutcome::kAgree) ? c.outcomes.at(TwinOutcome::kAgree) : 0, 1);
  EXPECT_EQ(c.outcomes.count(TwinOutcome::kUnresolved), 0u);
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(caught.size(), 1u);
  EXPECT_EQ(caught[0].shard.shard, "shard-liar");
  EXPECT_EQ(caught[0].layer, layer_);
  EXPECT_NE(caught[0].evidence.find("shard-liar"), std::string::npos) << caught[0].evidence;
}

// The canary adds nothing to the load statistics router-svc balances with.
TEST_F(CanaryCoreTest, CanariesAreNotCountedInTheReports) {
  ASSERT_TRUE(core_->ApplyPlacement(TwoShards()));
  ASSERT_TRUE(AwaitReady(true));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a few more canaries
  EXPECT_TRUE(core_->TakeReports().empty());
  v1::ForwardResponse resp;
  ASSERT_TRUE(Serve(Request(5, 2), &resp).ok());
  const std::vector<v1::ReportStatsRequest> reports = core_->TakeReports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].tokens(), 5);
}

}  // namespace
}  // namespace moe::attention_svc
