// expert-svc in W4A8 (docs/w4a8.md): MXFP8 activations on the wire, BF16 rows quantized by the
// server, the production check on W4A8 batches, bad MXFP8 refused by name. A real server in this
// process, driven through its Dispatch stream.
#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

#include "expert-svc/expert_server.h"
#include "gtest/gtest.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/checkpoint/synthetic.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cuda/cuda_backend.h"
#include "services/transport/expert_stream.h"
#include "services/transport/grpc_server.h"
#include "services/transport/tensor_codec.h"
#include "tests/common/http_client.h"
#include "tests/expert_svc/metrics_page.h"

namespace moe::expert_svc {
namespace {

using tensor::Bf16;
using testing::PageWithMatches;
using testing::Sample;

// A W4A8 shard of mid experts [0, 32) with the production check on every batch, and its
// metrics port.
absl::StatusOr<std::unique_ptr<ExpertServer>> StartW4A8Shard(int* metrics_port) {
  const std::string port_file = ::testing::TempDir() + "/expert_w4a8_metrics_port";
  std::remove(port_file.c_str());
  ExpertServerOptions o;
  o.preset = "mid";
  o.seed = 4;
  o.expert_lo = 0;
  o.expert_hi = 32;
  o.shard = "shard-8";
  o.threads = 1;
  o.metrics_port = 0;
  o.metrics_port_file = port_file;
  o.verify_fraction = 1.0;
  o.measure_limits = false;
  o.backend = Backend::kCpu;
  auto server = ExpertServer::Start(o);
  if (server.ok()) std::ifstream(port_file) >> *metrics_port;
  return server;
}

// Three distinct MXFP8 rows to experts 4 (rows 0, 2) and 20 (rows 1, 2), with row_source; and
// what the CPU kernels give for them in W4A8.
struct W4A8Batch {
  std::vector<Bf16> z;
  v1::DispatchRequest req;
  std::vector<Bf16> want;
};
W4A8Batch MakeW4A8Batch(const ModelConfig& cfg) {
  W4A8Batch b;
  ModelConfig zcfg = cfg;
  zcfg.hidden = cfg.latent;
  const int64_t d = cfg.latent;
  b.z = checkpoint::SyntheticHiddenStates(zcfg, 3, 8);
  const tensor::Mxfp8Rows z8 = numerics::QuantizeMxfp8Rows(b.z.data(), 3, d);
  const std::vector<int32_t> source = {0, 2, 1, 2};
  b.req.set_layer(1);
  b.req.set_precision(v1::PRECISION_W4A8);
  for (auto [e, n] : std::vector<std::pair<int, int>>{{4, 2}, {20, 2}}) {
    auto* g = b.req.add_groups();
    g->set_expert_id(e);
    g->set_token_count(n);
  }
  for (int32_t r : source) b.req.add_row_source(r);
  transport::EncodeMxfp8Into(z8, b.req.mutable_activations());
  checkpoint::SyntheticOptions so;
  so.seed = 4;
  const numerics::MoeLayerWeights full = checkpoint::SyntheticLayer(cfg, 1, so);
  numerics::Routing routing;
  routing.tokens = 4;
  routing.top_k = 1;
  routing.expert_ids = {4, 4, 20, 20};
  routing.weights.assign(4, 1.0f);
  ThreadPool pool(1);
  const auto& kernels = numerics::cpu::ChosenKernels(cfg.latent, cfg.intermediate);
  b.want =
      numerics::cpu::RunExperts(kernels, &pool, cfg, full, routing, z8.Gather(source.data(), 4));
  return b;
}

void ExpectW4A8Reply(transport::ExpertStream& stream, const v1::DispatchRequest& r,
                     const std::vector<Bf16>& want, int64_t d) {
  auto reply = stream.Call(r, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->precision(), v1::PRECISION_W4A8);
  auto out = transport::DecodeBf16Matrix(reply->outputs(), "outputs", d, false);
  ASSERT_TRUE(out.ok());
  ASSERT_EQ(out->values.size(), want.size());
  EXPECT_EQ(std::memcmp(want.data(), out->values.data(), want.size() * 2), 0);
}

void ExpectRefused(transport::ExpertStream& stream, const v1::DispatchRequest& r,
                   const std::string& words) {
  auto reply = stream.Call(r, absl::Now() + absl::Seconds(10));
  ASSERT_FALSE(reply.ok());
  EXPECT_EQ(reply.status().code(), absl::StatusCode::kInvalidArgument) << reply.status();
  EXPECT_NE(reply.status().message().find(words), std::string::npos) << reply.status();
}

// W4A8 on the wire: MXFP8 activations (codes, then scales) with row_source give the CPU kernels'
// W4A8 on the same rows; BF16 activations in W4A8 are quantized by the server to the same
// result; the production check verifies W4A8 batches against the reference's W4A8; bad MXFP8
// (mode, NaN code, NaN scale, byte count) is INVALID_ARGUMENT naming what is wrong.
TEST(ExpertServer, ServesW4A8FromMxfp8OrBf16AndRefusesBadMxfp8) {
  int metrics_port = 0;
  auto server = StartW4A8Shard(&metrics_port);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string endpoint = "127.0.0.1:" + std::to_string((*server)->port());
  {
    auto stub = v1::ExpertService::NewStub(transport::MakeChannel(endpoint));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ExpertServerInfo info;
    ASSERT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
    ASSERT_EQ(info.precisions_size(), 2);
    EXPECT_EQ(info.precisions(0), v1::PRECISION_W4A16);  // the default first
    EXPECT_EQ(info.precisions(1), v1::PRECISION_W4A8);
  }
  const ModelConfig cfg = *PresetConfig("mid");
  const int64_t d = cfg.latent;
  const W4A8Batch b = MakeW4A8Batch(cfg);
  const v1::DispatchRequest& req = b.req;
  EXPECT_EQ(req.activations().data().size(), 3u * (d + d / 32));
  auto stream = std::make_unique<transport::ExpertStream>("shard-8", endpoint, 64 << 20);
  ExpectW4A8Reply(*stream, req, b.want, d);
  v1::DispatchRequest from_bf16 = req;  // W4A8 on BF16 rows: quantized by the server
  transport::EncodeBf16Into(b.z, 3, d, from_bf16.mutable_activations());
  ExpectW4A8Reply(*stream, from_bf16, b.want, d);

  v1::DispatchRequest wrong_mode = req;
  wrong_mode.set_precision(v1::PRECISION_W4A16);
  ExpectRefused(*stream, wrong_mode, "MXFP8 activations need precision W4A8");
  v1::DispatchRequest nan_code = req;
  (*nan_code.mutable_activations()->mutable_data())[d + 7] = 0x7F;  // row 1 column 7
  ExpectRefused(*stream, nan_code, "row 1 column 7 is not finite (NaN code)");
  v1::DispatchRequest nan_scale = req;
  (*nan_scale.mutable_activations()->mutable_data())[3 * d + 2 * (d / 32) + 1] = '\xff';
  ExpectRefused(*stream, nan_scale, "row 2 column 32 is not finite (NaN scale)");
  v1::DispatchRequest short_data = req;
  short_data.mutable_activations()->mutable_data()->pop_back();
  ExpectRefused(*stream, short_data, "bytes of data but MXFP8 [3, 512] needs 1584");

  // The production check took both W4A8 batches against the reference's W4A8.
  const std::string page = PageWithMatches(metrics_port, 2);
  EXPECT_EQ(Sample(page, "moe_expert_verified_batches_total", {"result=\"match\""}), 2) << page;
  EXPECT_EQ(Sample(page, "moe_expert_verified_batches_total", {"result=\"mismatch\""}), 0);
  stream.reset();
  (*server)->Shutdown();
}

}  // namespace
}  // namespace moe::expert_svc
