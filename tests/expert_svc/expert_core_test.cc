// The expert core through its in-process endpoint (batch_endpoint.h "local"): no gRPC server,
// no process. A batch in its local endpoint is answered like the CPU expert kernels on the same
// synthetic weights, bad batches with their codes, an out-of-band header refused by name where
// there is no UCX, and a stopped core answers UNAVAILABLE.
#include "expert-svc/expert_core.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <vector>

#include "expert-svc/batch_endpoint.h"
#include "services/checkpoint/synthetic.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/kernels.h"
#include "services/transport/tensor_codec.h"

namespace moe::expert_svc {
namespace {

using tensor::Bf16;

// Answers collected from the local endpoint.
struct Answers {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<v1::DispatchReply> all;
  v1::DispatchReply Next(size_t i) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(10), [&] { return all.size() > i; });
    return all.size() > i ? all[i] : v1::DispatchReply();
  }
};

TEST(ExpertCore, AnswersThroughTheLocalEndpointLikeTheKernels) {
  ExpertServerOptions o;
  o.preset = "tiny";
  o.seed = 5;
  o.expert_lo = 3;
  o.expert_hi = 9;
  o.shard = "shard-core";
  o.threads = 1;
  o.measure_limits = false;
  o.verify_fraction = 0;
  auto core = ExpertCore::Load(o);
  ASSERT_TRUE(core.ok()) << core.status();
  (*core)->Start(nullptr);
  Answers answers;
  EndpointContext ctx;
  ctx.shard = o.shard;
  ctx.local_reply = [&](v1::DispatchReply r) {
    std::lock_guard<std::mutex> lock(answers.mu);
    answers.all.push_back(std::move(r));
    answers.cv.notify_all();
  };
  auto submit = [&](v1::DispatchRequest req) {
    MakeBatchEndpoint(req, ctx)->Receive(
        std::move(req),
        [&](v1::DispatchRequest& r, std::string_view bytes, std::unique_ptr<BatchReply> reply) {
          EXPECT_STREQ(reply->transport(), "local");
          (*core)->Admit(r, bytes, std::move(reply));
        });
  };

  const ModelConfig& cfg = (*core)->config();
  const int64_t d = cfg.latent;
  ModelConfig zcfg = cfg;
  zcfg.hidden = d;
  const std::vector<Bf16> z = checkpoint::SyntheticHiddenStates(zcfg, 3, 2);
  v1::DispatchRequest req;
  req.set_batch_id(7);
  req.set_layer(1);
  for (auto [e, n] : std::vector<std::pair<int, int>>{{4, 2}, {8, 1}}) {
    v1::ExpertGroup* g = req.add_groups();
    g->set_expert_id(e);
    g->set_token_count(n);
  }
  transport::EncodeBf16Into(z, 3, d, req.mutable_activations());
  submit(req);
  const v1::DispatchReply ok = answers.Next(0);
  ASSERT_EQ(ok.code(), 0) << ok.message();
  EXPECT_EQ(ok.batch_id(), 7u);
  EXPECT_EQ(ok.shard(), "shard-core");
  auto out = transport::DecodeBf16Matrix(ok.outputs(), "outputs", d, false);
  ASSERT_TRUE(out.ok()) << out.status();
  numerics::Routing routing;
  routing.tokens = 3;
  routing.top_k = 1;
  routing.expert_ids = {4, 4, 8};
  routing.weights = {1, 1, 1};
  ThreadPool pool(1);
  checkpoint::SyntheticOptions so;
  so.seed = 5;
  const numerics::MoeLayerWeights w = checkpoint::SyntheticExperts(cfg, 1, 3, 9, so);
  const std::vector<Bf16> want = numerics::cpu::RunExperts(
      numerics::cpu::ChosenKernels(cfg.latent, cfg.intermediate), &pool, cfg, w, routing, z.data());
  ASSERT_EQ(out->values.size(), want.size());
  EXPECT_EQ(std::memcmp(out->values.data(), want.data(), want.size() * sizeof(Bf16)), 0);

  // Bad batches: their codes, named; an out-of-band header where there is no UCX.
  v1::DispatchRequest foreign = req;
  foreign.set_batch_id(8);
  foreign.mutable_groups(0)->set_expert_id(1);  // not hosted here
  submit(foreign);
  const v1::DispatchReply not_here = answers.Next(1);
  EXPECT_EQ(not_here.code(), static_cast<int>(absl::StatusCode::kNotFound)) << not_here.message();
  v1::DispatchRequest oob = req;
  oob.set_batch_id(9);
  oob.mutable_out_of_band()->set_client_id(1);
  submit(oob);
  const v1::DispatchReply refused = answers.Next(2);
  EXPECT_EQ(refused.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_NE(refused.message().find("has no out-of-band data plane"), std::string::npos)
      << refused.message();

  // Stopped: new batches are refused UNAVAILABLE, named.
  (*core)->Stop();
  v1::DispatchRequest late = req;
  late.set_batch_id(10);
  submit(late);
  const v1::DispatchReply stopped = answers.Next(3);
  EXPECT_EQ(stopped.code(), static_cast<int>(absl::StatusCode::kUnavailable));
  EXPECT_NE(stopped.message().find("shard-core"), std::string::npos);
}

}  // namespace
}  // namespace moe::expert_svc
