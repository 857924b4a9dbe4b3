// Bad input to attention-svc and to expert-svc directly, on one local cluster: the right code, a
// message that says what is wrong, and the servers keep serving (the good answer after each
// kind of refusal is checked against the in-process layer or kernels, bit for bit). Each step
// is one method of the fixture; the test runs them in order on the same cluster and the same
// Dispatch stream, which no refusal may break.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/payload_mac.h"
#include "services/dataplane/ucx_worker.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/tools/local_cluster.h"
#include "services/transport/expert_stream.h"
#include "services/transport/grpc_server.h"
#include "services/transport/health_check.h"
#include "services/transport/tensor_codec.h"
#include "tests/common/metrics_text.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::SameBits;

class ClusterBadInput : public testing::ClusterTest {
 protected:
  void SetUp() override {
    UsePreset("tiny", {{0, 7}, {7, 16}});
    options().attention_args = {"--max_message_bytes=4194304", "--max_tokens=1024"};
    ASSERT_NO_FATAL_FAILURE(StartCluster());
    h_ = cfg().hidden;
    d_ = cfg().latent;
    x_ = checkpoint::SyntheticHiddenStates(cfg(), 8, 3);
    ModelConfig latent = cfg();
    latent.hidden = d_;
    z_ = checkpoint::SyntheticHiddenStates(latent, 3, 9);
    // Straight to shard-0 (experts [0, 7)) on one Dispatch stream, as a member (the token).
    stream_ = std::make_unique<transport::ExpertStream>(
        "shard-0", cluster().shard_endpoint(0), 64 << 20, moe::testing::AttentionToken(cluster()));
    deadline_ = absl::Now() + absl::Seconds(10);
  }

  void ExpectError(absl::StatusOr<client::ForwardResult> r, absl::StatusCode code,
                   const std::string& needle) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(needle), absl::string_view::npos) << r.status();
  }

  v1::DispatchRequest Batch(int32_t l, std::vector<std::pair<int32_t, int32_t>> groups,
                            const std::vector<Bf16>& rows) const {
    v1::DispatchRequest r;
    r.set_layer(l);
    int64_t n = 0;
    for (auto [e, c] : groups) {
      auto* g = r.add_groups();
      g->set_expert_id(e);
      g->set_token_count(c);
      n += c;
    }
    transport::EncodeBf16Into(rows, n, d_, r.mutable_activations());
    return r;
  }

  void ExpectDispatchError(v1::DispatchRequest r, absl::StatusCode code,
                           const std::string& needle) {
    auto reply = stream_->Call(std::move(r), deadline_);
    ASSERT_FALSE(reply.ok());
    EXPECT_EQ(reply.status().code(), code) << reply.status();
    EXPECT_NE(reply.status().message().find(needle), absl::string_view::npos) << reply.status();
    EXPECT_NE(reply.status().message().find("shard-0"), absl::string_view::npos);
  }

  // What the in-process kernels compute for rows z_ routed one expert each.
  std::vector<Bf16> Kernels(std::vector<int32_t> experts) {
    numerics::Routing routing;
    routing.tokens = static_cast<int64_t>(experts.size());
    routing.top_k = 1;
    routing.expert_ids = std::move(experts);
    routing.weights.assign(routing.expert_ids.size(), 1.0f);
    return numerics::cpu::RunExperts(numerics::cpu::ChosenKernels(cfg().latent, cfg().intermediate),
                                     &pool_, cfg(), oracle().weights(), routing, z_.data());
  }

  // A Dispatch whose activations travel out of band (their bytes cleared here).
  v1::DispatchRequest OutOfBand(uint64_t client, uint64_t tag, int64_t bytes, int64_t timeout_ms,
                                std::string mac = std::string(16, 'm'),
                                uint64_t sequence = 1) const {
    v1::DispatchRequest r = Batch(layer(), {{1, 3}}, z_);
    r.mutable_activations()->clear_data();
    r.set_timeout_ms(timeout_ms);
    v1::OutOfBand* o = r.mutable_out_of_band();
    o->set_client_id(client);
    o->set_tag(tag);
    o->set_activation_bytes(bytes);
    o->set_reply_tag(tag + 1000);
    o->set_reply_capacity_bytes(3 * d_ * 2);
    o->set_sequence(sequence);
    o->set_activation_mac(mac);
    return r;
  }

  void TearDown() override {  // the streams before the cluster they talk to
    stream_.reset();
    stub_.reset();
    worker_.reset();
    ClusterTest::TearDown();
  }

  void CheckHealthAndReflection();
  void CheckForwardRefusals();
  void CheckDispatchRefusals();
  void CheckPartialSums();
  void OpenOwnDataPlane();
  void CheckOutOfBandHeaders();
  void CheckReopenReplacesTheClient();

  int64_t h_ = 0, d_ = 0;
  std::vector<Bf16> x_, z_;
  std::unique_ptr<transport::ExpertStream> stream_;
  absl::Time deadline_;
  ThreadPool pool_{1};
  // The data plane of our own (OpenOwnDataPlane), as attention-svc opens one.
  std::unique_ptr<dataplane::UcxWorker> worker_;
  std::unique_ptr<v1::ExpertService::Stub> stub_;
  v1::OpenDataPlaneRequest open_;
  v1::OpenDataPlaneReply opened_;
  uint64_t ep_ = 0;
};

// Every server: the standard health service says SERVING, reflection lists its service.
void ClusterBadInput::CheckHealthAndReflection() {
  const std::vector<std::pair<std::string, std::string>> servers = {
      {cluster().router_endpoint(), "moe.v1.RouterService"},
      {cluster().attention_endpoint(), "moe.v1.AttentionService"},
      {cluster().shard_endpoint(0), "moe.v1.ExpertService"},
      {cluster().shard_endpoint(1), "moe.v1.ExpertService"}};
  for (const auto& [endpoint, service] : servers) {
    auto serving = transport::CheckHealth(endpoint, absl::Seconds(5));
    ASSERT_TRUE(serving.ok()) << endpoint << ": " << serving.status();
    EXPECT_TRUE(*serving) << endpoint;
    auto alive = transport::CheckHealth(endpoint, absl::Seconds(5), transport::kLivenessService);
    ASSERT_TRUE(alive.ok()) << endpoint << ": " << alive.status();
    EXPECT_TRUE(*alive) << endpoint;
    auto unknown = transport::CheckHealth(endpoint, absl::Seconds(5), "no.such.service");
    EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << endpoint;
    auto names = transport::ListServices(endpoint, absl::Seconds(5));
    ASSERT_TRUE(names.ok()) << endpoint << ": " << names.status();
    EXPECT_NE(std::find(names->begin(), names->end(), service), names->end()) << endpoint;
    EXPECT_NE(std::find(names->begin(), names->end(), "grpc.health.v1.Health"), names->end());
  }
}

void ClusterBadInput::CheckForwardRefusals() {
  // Wrong width: 8 x 128 values sent as [16, 64].
  ExpectError(user().Forward(layer(), x_, 16, h_ / 2), absl::StatusCode::kInvalidArgument,
              "width 64 but this layer needs 128");
  ExpectError(user().Forward(layer(), {}, 0, h_), absl::StatusCode::kInvalidArgument, "T = 0");
  ExpectError(user().Forward(layer() + 5, x_, 8, h_), absl::StatusCode::kNotFound,
              absl::StrCat("layer ", layer() + 5, " is not hosted"));
  std::vector<Bf16> nan_x = x_;
  nan_x[3 * h_ + 5] = Bf16::FromFloat(std::nanf(""));
  ExpectError(user().Forward(layer(), nan_x, 8, h_), absl::StatusCode::kInvalidArgument, "token 3");
  // Over max_tokens, and over the gRPC message limit (20000 x 128 bf16 = 5.1 MB > 4 MiB).
  const std::vector<Bf16> many = checkpoint::SyntheticHiddenStates(cfg(), 2000, 4);
  ExpectError(user().Forward(layer(), many, 2000, h_), absl::StatusCode::kResourceExhausted,
              "at most 1024");
  const std::vector<Bf16> huge(static_cast<size_t>(20000 * h_), Bf16::FromFloat(0.5f));
  auto too_big = user().Forward(layer(), huge, 20000, h_);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();
  // Still serving, with the right numbers.
  auto good = user().Forward(layer(), x_, 8, h_);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE(SameBits(good->out, oracle().Forward(x_, 8, h_)->out));
}

void ClusterBadInput::CheckDispatchRefusals() {
  {  // without the cluster token the stream is refused before any batch is read
    transport::ExpertStream stranger("shard-0", cluster().shard_endpoint(0), 64 << 20);
    auto refused = stranger.Call(Batch(layer(), {{1, 3}}, z_), deadline_);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("code 16: Dispatch to shard shard-0 needs the "
                                              "cluster token"),
              absl::string_view::npos)
        << refused.status();
  }
  ExpectDispatchError(Batch(layer() + 3, {{1, 3}}, z_), absl::StatusCode::kNotFound,
                      "is not hosted here");
  ExpectDispatchError(Batch(layer(), {{9, 3}}, z_), absl::StatusCode::kNotFound,
                      "expert 9 of layer 1 is not hosted here");
  ExpectDispatchError(Batch(layer(), {{99, 3}}, z_), absl::StatusCode::kInvalidArgument,
                      "outside [0, 16)");
  ExpectDispatchError(Batch(layer(), {{2, 1}, {1, 2}}, z_), absl::StatusCode::kInvalidArgument,
                      "strictly ascending");
  ExpectDispatchError(Batch(layer(), {{1, 4}}, z_), absl::StatusCode::kInvalidArgument,
                      "needs " + std::to_string(4 * d_ * 2));
  std::vector<Bf16> z_nan = z_;
  z_nan[d_ + 2] = Bf16::FromFloat(std::numeric_limits<float>::infinity());
  ExpectDispatchError(Batch(layer(), {{1, 3}}, z_nan), absl::StatusCode::kInvalidArgument,
                      "row 1 (expert 1) column 2 is not finite");
  // The same stream then computes a good batch exactly like the in-process expert kernels.
  auto reply = stream_->Call(Batch(layer(), {{1, 2}, {6, 1}}, z_), deadline_);
  ASSERT_TRUE(reply.ok()) << reply.status();
  auto out = transport::DecodeBf16Matrix(reply->outputs(), "outputs", d_, false);
  ASSERT_TRUE(out.ok());
  EXPECT_TRUE(SameBits(out->values, Kernels({1, 1, 6})));
}

// Partial sums: rows (token 0, expert 1), (token 2, expert 1), (token 0, expert 6) with
// weights; one fp32 row per distinct token (0 and 2), experts summed in ascending id.
void ClusterBadInput::CheckPartialSums() {
  const std::vector<Bf16> want = Kernels({1, 1, 6});
  v1::DispatchRequest partial = Batch(layer(), {{1, 2}, {6, 1}}, z_);
  partial.set_reply_mode(v1::REPLY_MODE_PARTIAL_SUM);
  partial.set_num_tokens(3);
  for (int32_t t : {0, 2, 0}) partial.add_token_index(t);
  for (float w : {0.25f, 0.5f, 0.75f}) partial.add_weights(w);
  auto sums = stream_->Call(partial, deadline_);
  ASSERT_TRUE(sums.ok()) << sums.status();
  auto got = transport::DecodeF32Matrix(sums->outputs(), "outputs", 2, d_);
  ASSERT_TRUE(got.ok()) << got.status();
  for (int64_t c = 0; c < d_; ++c) {
    const float t0 =
        (0.0f + want[0 * d_ + c].ToFloat() * 0.25f) + want[2 * d_ + c].ToFloat() * 0.75f;
    const float t2 = 0.0f + want[1 * d_ + c].ToFloat() * 0.5f;
    ASSERT_EQ((*got)[c], t0) << "column " << c;
    ASSERT_EQ((*got)[d_ + c], t2) << "column " << c;
  }
  // A tiny batch that claims 2^30 tokens costs what its rows cost (same sums, no 8 GB table).
  v1::DispatchRequest claims = partial;
  claims.set_num_tokens(1 << 30);
  const absl::Time t0 = absl::Now();
  auto claimed = stream_->Call(claims, deadline_);
  ASSERT_TRUE(claimed.ok()) << claimed.status();
  EXPECT_EQ(claimed->outputs().data(), sums->outputs().data());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  // One that claims 2^26 rows is refused before anything that size is allocated.
  ExpectDispatchError(Batch(layer(), {{1, 1 << 26}}, z_), absl::StatusCode::kResourceExhausted,
                      "exceed this server's limit");
  partial.set_token_index(1, 7);  // outside num_tokens
  ExpectDispatchError(partial, absl::StatusCode::kInvalidArgument, "token_index 7");
}

// A data plane of our own, opened over gRPC as attention-svc opens one: only members may open
// it or learn the worker's address; a hello with a wrong secret binds nothing, the right one
// is acknowledged with the shard's view of the lanes.
void ClusterBadInput::OpenOwnDataPlane() {
  dataplane::UcxOptions uo;
  uo.tls = "tcp";
  auto worker = dataplane::UcxWorker::Create(uo);
  ASSERT_TRUE(worker.ok()) << worker.status();
  worker_ = std::move(*worker);
  stub_ = v1::ExpertService::NewStub(transport::MakeChannel(cluster().shard_endpoint(0)));
  open_.set_node("cluster-test");
  {
    grpc::ClientContext stranger;
    stranger.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    const grpc::Status refused = stub_->OpenDataPlane(&stranger, open_, &opened_);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_NE(refused.error_message().find("needs the cluster token"), std::string::npos);
    grpc::ClientContext info_ctx;
    info_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ExpertServerInfo info;
    ASSERT_TRUE(stub_->GetInfo(&info_ctx, v1::GetExpertInfoRequest(), &info).ok());
    EXPECT_EQ(info.data_plane(), "ucx");
    EXPECT_TRUE(info.ucx_address().empty()) << "a stranger was handed the UCX address";
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ctx.AddMetadata(transport::kClusterTokenMetadata, moe::testing::AttentionToken(cluster()));
  ASSERT_TRUE(stub_->OpenDataPlane(&ctx, open_, &opened_).ok());
  const uint64_t me = opened_.client_id();
  ASSERT_GE(me, 1u);
  ASSERT_EQ(opened_.hello_secret().size(), dataplane::kHelloSecretBytes);
  ASSERT_EQ(opened_.mac_key().size(), dataplane::kMacKeyBytes);
  // Before its hello, the client has no way back: refused by name.
  ExpectDispatchError(OutOfBand(me, 2, 3 * d_ * 2, 1000), absl::StatusCode::kFailedPrecondition,
                      "has not sent its UCX hello");
  auto ep = worker_->Connect(opened_.worker_address(), nullptr);
  ASSERT_TRUE(ep.ok()) << ep.status();
  ep_ = *ep;
  auto ack_buffer = worker_->Buffer(256);
  ASSERT_TRUE(ack_buffer.ok());
  (void)worker_->SendHello(ep_, dataplane::EncodeHello({me, std::string(16, 'x')}),
                           absl::Now() + absl::Seconds(5));
  auto ack = worker_->RecvAny(opened_.ack_tag(), *ack_buffer, absl::Now() + absl::Seconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(ack->done()) << "a hello with a wrong secret was acknowledged";
  ExpectDispatchError(OutOfBand(me, 3, 3 * d_ * 2, 1000), absl::StatusCode::kFailedPrecondition,
                      "has not sent its UCX hello");
  (void)worker_->SendHello(ep_, dataplane::EncodeHello({me, opened_.hello_secret()}),
                           absl::Now() + absl::Seconds(5));
  auto acked = ack->Wait(absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(acked.ok()) << acked.status();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*ack_buffer)->data()), *acked), "tcp");
}

// Out-of-band headers that lie (docs/data-plane.md): each gets its own code and the stream goes
// on; the right bytes under the connection's MAC give the kernels' bits, a reconnect replaces
// the client, and the shard counts what it refused.
void ClusterBadInput::CheckOutOfBandHeaders() {
  const uint64_t me = opened_.client_id();
  const int64_t bytes = 3 * d_ * 2;
  ExpectDispatchError(OutOfBand(me, 4, 0, 1000), absl::StatusCode::kInvalidArgument,
                      "out-of-band sizes");
  ExpectDispatchError(OutOfBand(me, 5, int64_t{1} << 40, 1000), absl::StatusCode::kInvalidArgument,
                      "out-of-band sizes");
  ExpectDispatchError(OutOfBand(me, 6, bytes, 1000, "short"), absl::StatusCode::kInvalidArgument,
                      "activation_mac of 5 bytes");
  // A payload that never comes: DEADLINE_EXCEEDED at the header's budget, not a hang.
  const absl::Time t_wait = absl::Now();
  ExpectDispatchError(OutOfBand(me, 7, bytes, 300), absl::StatusCode::kDeadlineExceeded,
                      "did not complete by its deadline");
  EXPECT_LT(absl::Now() - t_wait, absl::Seconds(3));
  auto payload = worker_->Buffer(bytes);
  ASSERT_TRUE(payload.ok());
  std::memcpy((*payload)->data(), z_.data(), bytes);
  // A payload shorter than the header says: refused, nothing computed from it.
  auto sent = worker_->Send(ep_, 8, *payload, 100, absl::Now() + absl::Seconds(5));
  ExpectDispatchError(OutOfBand(me, 8, bytes, 2000), absl::StatusCode::kInvalidArgument,
                      "a chunk of 100 bytes where");
  (void)sent->Wait(absl::Now() + absl::Seconds(5));
  // The right bytes under a wrong MAC (what an injected payload looks like): DATA_LOSS, never
  // computed; the same bytes with the MAC of the connection's key: the kernels' bits.
  auto mac = dataplane::PayloadMac::Create(opened_.mac_key());
  ASSERT_TRUE(mac.ok());
  const std::string mac9 =
      mac->Compute(dataplane::Direction::kToExpert, 9, (*payload)->data(), bytes);
  sent = worker_->Send(ep_, 9, *payload, bytes, absl::Now() + absl::Seconds(5));
  ExpectDispatchError(OutOfBand(me, 9, bytes, 2000, mac9, /*sequence=*/10),
                      absl::StatusCode::kDataLoss, "failed its integrity check");
  (void)sent->Wait(absl::Now() + absl::Seconds(5));
  auto reply_buffer = worker_->Buffer(bytes);
  ASSERT_TRUE(reply_buffer.ok());
  auto got_reply = worker_->Recv(1011, *reply_buffer, bytes, absl::Now() + absl::Seconds(5));
  sent = worker_->Send(ep_, 11, *payload, bytes, absl::Now() + absl::Seconds(5));
  const std::string mac11 =
      mac->Compute(dataplane::Direction::kToExpert, 11, (*payload)->data(), bytes);
  auto ok_reply = stream_->Call(OutOfBand(me, 11, bytes, 2000, mac11, /*sequence=*/11), deadline_);
  ASSERT_TRUE(ok_reply.ok()) << ok_reply.status();
  ASSERT_TRUE(ok_reply->out_of_band());
  ASSERT_TRUE(got_reply->Wait(absl::Now() + absl::Seconds(5)).ok());
  EXPECT_TRUE(mac->Verify(dataplane::Direction::kToAttention, 11, (*reply_buffer)->data(), bytes,
                          ok_reply->output_mac()));
  EXPECT_FALSE(mac->Verify(dataplane::Direction::kToAttention, 12, (*reply_buffer)->data(), bytes,
                           ok_reply->output_mac()));
  EXPECT_EQ(std::memcmp((*reply_buffer)->data(), Kernels({1, 1, 1}).data(), bytes), 0);
}

// Opening the data plane again from the same node (a reconnect) replaces the old client; what
// the shard counted: one rejected hello, one payload that failed its check.
void ClusterBadInput::CheckReopenReplacesTheClient() {
  const uint64_t me = opened_.client_id();
  const int64_t bytes = 3 * d_ * 2;
  grpc::ClientContext again_ctx;
  again_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  again_ctx.AddMetadata(transport::kClusterTokenMetadata, moe::testing::AttentionToken(cluster()));
  v1::OpenDataPlaneReply again;
  ASSERT_TRUE(stub_->OpenDataPlane(&again_ctx, open_, &again).ok());
  EXPECT_NE(again.client_id(), me);
  ExpectDispatchError(OutOfBand(me, 12, bytes, 1000), absl::StatusCode::kFailedPrecondition,
                      absl::StrCat("unknown data-plane client ", me));
  for (const char* event : {"event=\"hello_rejected\"", "event=\"integrity_failed\""}) {
    EXPECT_EQ(moe::testing::ScrapeSum(cluster().shard_metrics(0),
                                      "moe_expert_data_plane_events_total", {event}),
              1)
        << event;
  }
}

TEST_F(ClusterBadInput, ClearErrorsAndTheServersKeepServing) {
  CheckHealthAndReflection();
  CheckForwardRefusals();
  CheckDispatchRefusals();
  CheckPartialSums();
  if (dataplane::UcxBuilt()) {
    ExpectDispatchError(OutOfBand(999, 1, 3 * d_ * 2, 1000), absl::StatusCode::kFailedPrecondition,
                        "unknown data-plane client 999");
    OpenOwnDataPlane();
    if (!HasFatalFailure()) CheckOutOfBandHeaders();
    if (!HasFatalFailure()) CheckReopenReplacesTheClient();
  }
  EXPECT_EQ(stream_->streams_opened(), 1);  // errors never broke the stream
}

}  // namespace
}  // namespace moe
