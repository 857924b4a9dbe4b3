// FailoverChannel and the channel factory without processes: scripted channels stand in for the
// replicas of one range, and each case says what every replica answers and what the caller then
// gets, which replicas were sent the message, and how often a failover was reported.
#include "attention-svc/failover_channel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "attention-svc/dataplane/registry.h"
#include "attention-svc/dataplane/ucx/expert_channel_ucx.h"
#include "attention-svc/expert_channel_factory.h"
#include "attention-svc/expert_channel_grpc.h"
#include "attention-svc/expert_channel_local.h"
#include "services/checkpoint/synthetic.h"
#include "services/dataplane/ucx_worker.h"

namespace moe::attention_svc {
namespace {

// A replica whose calls answer from a script, one status per send (then OK), counting sends.
class ScriptedChannel final : public ExpertChannel {
 public:
  ScriptedChannel(std::string shard, std::deque<absl::StatusCode> script)
      : shard_(std::move(shard)), script_(std::move(script)) {}
  std::unique_ptr<ExpertCall> Send(const DispatchHeader& header, const DispatchMessage&) override {
    ++sends;
    last_timeout_ms = header.timeout_ms;
    absl::StatusCode code = absl::StatusCode::kOk;
    if (!script_.empty()) {
      code = script_.front();
      script_.pop_front();
    }
    return std::make_unique<Call>(code, shard_);
  }
  const std::string& shard() const override { return shard_; }
  const char* transport() const override { return "fake"; }
  int sends = 0;
  int64_t last_timeout_ms = 0;

 private:
  class Call final : public ExpertCall {
   public:
    Call(absl::StatusCode code, std::string shard) : code_(code), shard_(std::move(shard)) {}
    absl::StatusOr<ExpertReply> Wait(absl::Time) override {
      if (code_ != absl::StatusCode::kOk) {
        return absl::Status(code_, "expert shard " + shard_ + " scripted");
      }
      ExpertReply r;
      r.rows = 1;
      r.Own(std::vector<tensor::Bf16>(1));
      return r;
    }
    const char* transport() const override { return "fake"; }

   private:
    absl::StatusCode code_;
    std::string shard_;
  };
  std::string shard_;
  std::deque<absl::StatusCode> script_;
};

ShardRef Replica(const std::string& name, bool healthy = true) {
  return {name, "127.0.0.1:" + std::to_string(6000 + name.back()), 0, 8, healthy, 0};
}

struct Case {
  std::string name;
  std::vector<std::deque<absl::StatusCode>> scripts;  // per replica a, b
  absl::StatusCode want;
  std::vector<int> sends;  // per replica
  int failovers;
};

class FailoverChannelCases : public ::testing::TestWithParam<Case> {};

TEST_P(FailoverChannelCases, AnswersAsTheReplicasDo) {
  const Case& c = GetParam();
  const LayerRoute route = BuildRoute(1, 8, {Replica("a"), Replica("b")});
  std::map<std::string, std::shared_ptr<ScriptedChannel>> channels;
  channels["a"] = std::make_shared<ScriptedChannel>("a", c.scripts[0]);
  channels["b"] = std::make_shared<ScriptedChannel>("b", c.scripts[1]);
  ReplicaPicker picker(std::chrono::seconds(0));
  int failovers = 0, sent = 0;
  FailoverHooks hooks;
  hooks.channel_for = [&](const ShardRef& s) { return channels.at(s.shard); };
  hooks.on_sent = [&](const DispatchMessage&, const char*) { ++sent; };
  hooks.on_failover = [&](const ShardRef&, const ShardRef&, const absl::Status&) { ++failovers; };
  FailoverChannel replicas(route, &picker, hooks);
  DispatchMessage m;
  m.shard = 0;
  DispatchHeader h;
  h.timeout_ms = 100000;
  {
    auto call = replicas.Send(h, m);
    auto got = call->Wait(absl::Now() + absl::Seconds(5));
    EXPECT_EQ(got.status().code(), c.want) << got.status();
    EXPECT_STREQ(call->transport(), "fake");
  }
  EXPECT_EQ(channels["a"]->sends, c.sends[0]);
  EXPECT_EQ(channels["b"]->sends, c.sends[1]);
  EXPECT_EQ(failovers, c.failovers);
  EXPECT_EQ(sent, c.sends[0] + c.sends[1]);
  // Every call was counted and ended: nothing outstanding on either replica.
  EXPECT_EQ(picker.outstanding(route.shards[0]), 0);
  EXPECT_EQ(picker.outstanding(route.shards[1]), 0);
}

using C = absl::StatusCode;
INSTANTIATE_TEST_SUITE_P(
    Table, FailoverChannelCases,
    ::testing::Values(
        Case{"first_replica_answers", {{}, {}}, C::kOk, {1, 0}, 0},
        Case{"gone_replica_fails_over", {{C::kUnavailable}, {}}, C::kOk, {1, 1}, 1},
        // Both gone: the last tried gets it once more (a reopened transport), then the error.
        Case{"both_gone_once_more_then_error",
             {{C::kUnavailable}, {C::kUnavailable, C::kUnavailable}},
             C::kUnavailable,
             {1, 2},
             2},
        Case{"both_gone_the_retry_answers",
             {{C::kUnavailable}, {C::kUnavailable}},
             C::kOk,
             {1, 2},
             2},
        // Other errors are the answer: a bad batch is not sent again elsewhere.
        Case{"invalid_is_the_answer", {{C::kInvalidArgument}, {}}, C::kInvalidArgument, {1, 0}, 0},
        Case{"data_loss_is_the_answer", {{C::kDataLoss}, {}}, C::kDataLoss, {1, 0}, 0},
        Case{"deadline_is_the_answer",
             {{C::kDeadlineExceeded}, {}},
             C::kDeadlineExceeded,
             {1, 0},
             0}),
    [](const auto& info) { return info.param.name; });

// A replica whose calls answer `delay` after they were sent (a stall when long).
class DelayedChannel final : public ExpertChannel {
 public:
  DelayedChannel(std::string shard, absl::Duration delay)
      : shard_(std::move(shard)), delay_(delay) {}
  std::unique_ptr<ExpertCall> Send(const DispatchHeader&, const DispatchMessage&) override {
    ++sends;
    return std::make_unique<Call>(absl::Now() + delay_, shard_);
  }
  const std::string& shard() const override { return shard_; }
  const char* transport() const override { return "fake"; }
  int sends = 0;

 private:
  class Call final : public ExpertCall {
   public:
    Call(absl::Time ready, std::string shard) : ready_(ready), shard_(std::move(shard)) {}
    bool Answered(absl::Time until) override {
      absl::SleepFor(std::min(until, ready_) - absl::Now());
      return absl::Now() >= ready_;
    }
    absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
      if (!Answered(deadline)) {
        return absl::DeadlineExceededError("expert shard " + shard_ + " did not answer");
      }
      ExpertReply r;
      r.rows = 1;
      r.Own({tensor::Bf16::FromFloat(shard_ == "a" ? 1.0f : 2.0f)});
      return r;
    }
    const char* transport() const override { return "fake"; }

   private:
    const absl::Time ready_;
    const std::string shard_;
  };
  const std::string shard_;
  const absl::Duration delay_;
};

// Hedging: a replica silent past hedge_share of the time to the deadline gets a twin call on
// the other replica and the first answer wins; one that answers in time gets none; with
// hedge_share 0 a stall is the caller's DEADLINE_EXCEEDED.
TEST(FailoverChannel, ASilentReplicaIsHedgedAndTheFirstAnswerWins) {
  const LayerRoute route = BuildRoute(1, 8, {Replica("a"), Replica("b")});
  struct Case {
    const char* name;
    absl::Duration a_delay;
    double share;
    absl::StatusCode want;
    float value;  // which replica's answer
    int b_sends, hedges, twin_won;
  };
  for (const Case& c : {
           Case{"stalled_hedged", absl::Seconds(10), 0.5, absl::StatusCode::kOk, 2.0f, 1, 1, 1},
           Case{"prompt_no_hedge", absl::ZeroDuration(), 0.5, absl::StatusCode::kOk, 1.0f, 0, 0, 0},
           Case{"stalled_hedging_off", absl::Seconds(10), 0, absl::StatusCode::kDeadlineExceeded, 0,
                0, 0, 0},
       }) {
    SCOPED_TRACE(c.name);
    auto a = std::make_shared<DelayedChannel>("a", c.a_delay);
    auto b = std::make_shared<DelayedChannel>("b", absl::ZeroDuration());
    ReplicaPicker picker(std::chrono::seconds(0));
    int hedges = 0, twin_won = 0;
    FailoverHooks hooks;
    hooks.channel_for = [&](const ShardRef& s) -> std::shared_ptr<ExpertChannel> {
      return s.shard == "a" ? std::static_pointer_cast<ExpertChannel>(a) : b;
    };
    hooks.hedge_share = c.share;
    hooks.on_hedge = [&](const ShardRef& slow, const ShardRef& twin, bool won) {
      EXPECT_EQ(slow.shard, "a");
      EXPECT_EQ(twin.shard, "b");
      ++hedges;
      twin_won += won;
    };
    FailoverChannel replicas(route, &picker, hooks);
    DispatchMessage m;
    m.shard = 0;  // "a" is the first (least busy, lowest name) pick
    DispatchHeader h;
    const absl::Time start = absl::Now();
    {
      auto call = replicas.Send(h, m);
      auto got = call->Wait(start + absl::Milliseconds(400));
      ASSERT_EQ(got.status().code(), c.want) << got.status();
      if (got.ok()) {
        EXPECT_EQ(got->bf16[0].ToFloat(), c.value);
      }
    }
    if (c.hedges > 0) {
      EXPECT_LT(absl::Now() - start, absl::Milliseconds(380));
    }
    EXPECT_EQ(a->sends, 1);
    EXPECT_EQ(b->sends, c.b_sends);
    EXPECT_EQ(hedges, c.hedges);
    EXPECT_EQ(twin_won, c.twin_won);
    EXPECT_EQ(picker.outstanding(route.shards[0]), 0);
    EXPECT_EQ(picker.outstanding(route.shards[1]), 0);
  }
}

// Replicas "a" and "b" of one range, scripted; b healthy or not. Sends one message and waits
// until `deadline`.
struct TwoReplicas {
  std::shared_ptr<ScriptedChannel> a, b;
  absl::StatusOr<ExpertReply> SendAndWait(bool b_healthy, absl::Time deadline) {
    const LayerRoute route = BuildRoute(1, 8, {Replica("a"), Replica("b", b_healthy)});
    ReplicaPicker picker(std::chrono::seconds(0));
    FailoverHooks hooks;
    hooks.channel_for = [&](const ShardRef& s) {
      return s.shard == "a" ? std::shared_ptr<ExpertChannel>(a) : std::shared_ptr<ExpertChannel>(b);
    };
    FailoverChannel replicas(route, &picker, hooks);
    DispatchMessage m;
    m.shard = 0;
    return replicas.Send(DispatchHeader{}, m)->Wait(deadline);
  }
};

TEST(FailoverChannel, AnUnhealthyReplicaIsNeverChosenAndNoneLeftIsUnavailable) {
  TwoReplicas r{
      std::make_shared<ScriptedChannel>("a", std::deque<C>{C::kUnavailable, C::kUnavailable}),
      std::make_shared<ScriptedChannel>("b", std::deque<C>{})};
  auto got = r.SendAndWait(/*b_healthy=*/false, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(got.status().code(), C::kUnavailable);
  EXPECT_EQ(r.a->sends, 2);  // the only healthy replica, then once more
  EXPECT_EQ(r.b->sends, 0);
}

TEST(FailoverChannel, APassedDeadlineEndsTheFailover) {
  TwoReplicas r{std::make_shared<ScriptedChannel>("a", std::deque<C>{C::kUnavailable}),
                std::make_shared<ScriptedChannel>("b", std::deque<C>{})};
  auto got = r.SendAndWait(/*b_healthy=*/true, absl::Now() - absl::Seconds(1));
  EXPECT_EQ(got.status().code(), C::kUnavailable);
  EXPECT_EQ(r.a->sends, 1);
  EXPECT_EQ(r.b->sends, 0);
}

// The one factory: in process where the experts are here, the data plane's channel where this
// node has one (each registered backend), in-band gRPC otherwise (no connection is made by
// choosing).
TEST(MakeExpertChannel, ChoosesInProcessThenTheDataPlaneThenGrpc) {
  const ModelConfig cfg = *PresetConfig("tiny");
  const numerics::MoeLayerWeights w = checkpoint::SyntheticExperts(cfg, 1, 0, 8, {});
  ThreadPool pool(1);
  ExpertChannelConfig c;
  c.cfg = &cfg;
  c.kernels = &numerics::cpu::ScalarKernels();
  c.pool = &pool;
  c.local_weights = [&](const ShardRef& s) { return s.shard == "here" ? &w : nullptr; };
  const ShardRef here{"here", "127.0.0.1:1", 0, 8, true, 0};
  const ShardRef there{"there", "127.0.0.1:2", 8, 16, true, 0};
  EXPECT_NE(dynamic_cast<LocalExpertChannel*>(MakeExpertChannel(c, here).get()), nullptr);
  EXPECT_NE(dynamic_cast<GrpcExpertChannel*>(MakeExpertChannel(c, there).get()), nullptr);
  // Every registered backend's half makes the channel of a shard that is not here.
  for (const std::string& name : ClientBackendNames()) {
    if (name == "ucx" && !dataplane::UcxBuilt()) continue;
    auto half = StartClientHalf(name, {});
    ASSERT_TRUE(half.ok()) << name << ": " << half.status();
    c.data_planes = {half->get()};
    const std::shared_ptr<ExpertChannel> channel = MakeExpertChannel(c, there);
    if (name == "ucx") {
      EXPECT_NE(dynamic_cast<UcxExpertChannel*>(channel.get()), nullptr);
    }
    EXPECT_EQ(dynamic_cast<GrpcExpertChannel*>(channel.get()), nullptr) << name;
    EXPECT_EQ(dynamic_cast<LocalExpertChannel*>(channel.get()), nullptr) << name;
    EXPECT_NE(dynamic_cast<LocalExpertChannel*>(MakeExpertChannel(c, here).get()), nullptr);
  }
}

}  // namespace
}  // namespace moe::attention_svc
