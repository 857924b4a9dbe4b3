// expert-svc as a library in this process: a synthetic expert range made from a seed (no
// checkpoint) answers Dispatch exactly like the CPU expert kernels on the same weights.
#include "expert-svc/expert_server.h"

#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>

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

TEST(ExpertServer, SyntheticRangeFromASeedServesTheSameExperts) {
  ExpertServerOptions o;
  o.preset = "tiny";
  o.seed = 5;
  o.router_skew = 1.0;
  o.expert_lo = 3;
  o.expert_hi = 9;
  o.shard = "shard-x";
  o.threads = 1;
  auto server = ExpertServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string endpoint = "127.0.0.1:" + std::to_string((*server)->port());

  auto stub = v1::ExpertService::NewStub(transport::MakeChannel(endpoint));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ExpertServerInfo info;
  ASSERT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
  EXPECT_EQ(info.shard(), "shard-x");
  EXPECT_EQ(info.expert_lo(), 3);
  EXPECT_EQ(info.expert_hi(), 9);
  ASSERT_EQ(info.layers_size(), 1);
  EXPECT_EQ(info.layers(0), 1);

  const ModelConfig cfg = *PresetConfig("tiny");
  checkpoint::SyntheticOptions so;
  so.seed = 5;
  so.router_skew = 1.0;
  const numerics::MoeLayerWeights full = checkpoint::SyntheticLayer(cfg, 1, so);
  ModelConfig zcfg = cfg;
  zcfg.hidden = cfg.latent;
  const std::vector<Bf16> z = checkpoint::SyntheticHiddenStates(zcfg, 4, 2);  // 4 distinct rows
  // Pairs: expert 3 <- rows 0, 2; expert 8 <- rows 1, 2, 3 (row_source form).
  v1::DispatchRequest req;
  req.set_layer(1);
  for (auto [e, n] : std::vector<std::pair<int, int>>{{3, 2}, {8, 3}}) {
    auto* g = req.add_groups();
    g->set_expert_id(e);
    g->set_token_count(n);
  }
  for (int r : {0, 2, 1, 2, 3}) req.add_row_source(r);
  transport::EncodeBf16Into(z, 4, cfg.latent, req.mutable_activations());
  auto stream_owner = std::make_unique<transport::ExpertStream>("shard-x", endpoint, 64 << 20);
  transport::ExpertStream& stream = *stream_owner;
  auto reply = stream.Call(req, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->shard(), "shard-x");
  auto out = transport::DecodeBf16Matrix(reply->outputs(), "outputs", cfg.latent, false);
  ASSERT_TRUE(out.ok());
  ASSERT_EQ(out->rows, 5);

  numerics::Routing routing;
  routing.tokens = 5;
  routing.top_k = 1;
  routing.expert_ids = {3, 3, 8, 8, 8};
  routing.weights.assign(5, 1.0f);
  std::vector<Bf16> rows;
  for (int r : {0, 2, 1, 2, 3})
    rows.insert(rows.end(), z.begin() + r * cfg.latent, z.begin() + (r + 1) * cfg.latent);
  ThreadPool pool(1);
  const std::vector<Bf16> want =
      numerics::cpu::RunExperts(numerics::cpu::ChosenKernels(cfg.latent, cfg.intermediate), &pool,
                                cfg, full, routing, rows.data());
  ASSERT_EQ(want.size(), out->values.size());
  EXPECT_EQ(std::memcmp(want.data(), out->values.data(), want.size() * 2), 0);

  // A bad row_source is refused on the same stream.
  req.set_row_source(4, 9);
  auto bad = stream.Call(req, absl::Now() + absl::Seconds(10));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("row_source[4] = 9 outside [0, 4)"),
            absl::string_view::npos)
      << bad.status();
  stream_owner.reset();  // closes the stream, so shutdown needs no grace period
  (*server)->Shutdown();
}

// The limits are measured again while the shard is idle (here after 200 ms without a batch, at
// most every 300 ms), each a counted probe whose best is kept.
TEST(ExpertServer, MeasuresItsLimitsAgainWhileIdle) {
  const std::string port_file = ::testing::TempDir() + "/expert_idle_metrics_port";
  std::remove(port_file.c_str());
  ExpertServerOptions o;
  o.preset = "tiny";
  o.expert_lo = 0;
  o.expert_hi = 16;
  o.shard = "shard-i";
  o.threads = 2;
  o.metrics_port = 0;
  o.metrics_port_file = port_file;
  o.limits_idle_ms = 200;
  o.limits_every_ms = 300;
  auto server = ExpertServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  int metrics_port = 0;
  std::ifstream(port_file) >> metrics_port;
  ASSERT_GT(metrics_port, 0);
  double probes = 0, bw = 0;
  for (int i = 0; i < 100 && probes < 3; ++i) {  // bounded: 10 s
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const std::string page = moe::testing::HttpBodyOf(moe::testing::HttpExchange(
        metrics_port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
    probes = Sample(page, "moe_expert_machine_limit_probes_total", {"shard=\"shard-i\""});
    bw = Sample(page, "moe_expert_machine_read_bandwidth_bytes_per_second", {"shard=\"shard-i\""});
  }
  EXPECT_GE(probes, 3) << "measured at start, then twice again while idle";
  EXPECT_GT(bw, 1e9);
  (*server)->Shutdown();
}

TEST(ExpertServer, ExportsAchievedFractionsOfItsMeasuredLimitsAndItsProductionChecks) {
  const std::string port_file = ::testing::TempDir() + "/expert_metrics_port";
  std::remove(port_file.c_str());
  ExpertServerOptions o;
  o.preset = "mid";
  o.seed = 4;
  o.expert_lo = 0;
  o.expert_hi = 32;
  o.shard = "shard-m";
  o.threads = 2;
  o.metrics_port = 0;
  o.metrics_port_file = port_file;
  o.verify_fraction = 1.0;  // every batch
  auto server = ExpertServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  int metrics_port = 0;
  std::ifstream(port_file) >> metrics_port;
  ASSERT_GT(metrics_port, 0);

  // Before any batch there is nothing to divide: the fractions are absent, not NaN.
  const std::string before = moe::testing::HttpBodyOf(moe::testing::HttpExchange(
      metrics_port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  EXPECT_EQ(before.find("moe_expert_weight_bandwidth_fraction{"), std::string::npos) << before;
  EXPECT_EQ(before.find("moe_expert_fma_peak_fraction{"), std::string::npos) << before;
  EXPECT_EQ(before.find("NaN"), std::string::npos) << before;
  EXPECT_EQ(Sample(before, "moe_expert_machine_limit_probes_total", {"shard=\"shard-m\""}), 1);

  const ModelConfig cfg = *PresetConfig("mid");
  ModelConfig zcfg = cfg;
  zcfg.hidden = cfg.latent;
  auto stream = std::make_unique<transport::ExpertStream>(
      "shard-m", "127.0.0.1:" + std::to_string((*server)->port()), 64 << 20);
  // Three batches: experts {2, 5, 30} x 4 rows each; 12 rows, 3 distinct experts per batch.
  for (int b = 0; b < 3; ++b) {
    const std::vector<Bf16> z = checkpoint::SyntheticHiddenStates(zcfg, 12, 20 + b);
    v1::DispatchRequest req;
    req.set_layer(1);
    for (int e : {2, 5, 30}) {
      auto* g = req.add_groups();
      g->set_expert_id(e);
      g->set_token_count(4);
    }
    transport::EncodeBf16Into(z, 12, cfg.latent, req.mutable_activations());
    ASSERT_TRUE(stream->Call(req, absl::Now() + absl::Seconds(10)).ok());
  }
  const std::vector<std::string> shard = {"shard=\"shard-m\""};
  // The checks run in the background.
  const std::string page = PageWithMatches(metrics_port, 3);
  EXPECT_EQ(Sample(page, "moe_expert_verified_batches_total", {"result=\"match\""}), 3) << page;
  EXPECT_EQ(Sample(page, "moe_expert_verified_batches_total", {"result=\"mismatch\""}), 0);
  EXPECT_EQ(Sample(page, "moe_expert_verified_batches_total", {"result=\"error\""}), 0);
  // Work done, counted independently: 3 batches x 3 experts streamed, 36 rows of FFN.
  const double bytes = 3.0 * 3 * cfg.ExpertBytes();
  const double flops = 36.0 * 6 * cfg.latent * cfg.intermediate;
  EXPECT_EQ(Sample(page, "moe_expert_weight_read_bytes_total", shard), bytes);
  EXPECT_EQ(Sample(page, "moe_expert_flops_total", shard), flops);
  // The limits were measured (any machine reads over 1 GB/s and multiplies-adds over 1 GFLOP/s).
  const double bw = Sample(page, "moe_expert_machine_read_bandwidth_bytes_per_second", shard);
  const std::string isa = std::string("isa=\"") +
                          numerics::cpu::ChosenKernels(cfg.latent, cfg.intermediate).name + "\"";
  const double peak = Sample(page, "moe_expert_machine_fma_peak_flops_per_second", {isa});
  EXPECT_GT(bw, 1e9) << page;
  EXPECT_GT(peak, 1e9) << page;
  // The fractions are the window's work over its compute time over the limits.
  const double busy = Sample(page, "moe_expert_busy_seconds_total", shard);
  ASSERT_GT(busy, 0);
  EXPECT_NEAR(Sample(page, "moe_expert_weight_bandwidth_fraction", shard), bytes / busy / bw,
              1e-6 * bytes / busy / bw);
  EXPECT_NEAR(Sample(page, "moe_expert_fma_peak_fraction", shard), flops / busy / peak,
              1e-6 * flops / busy / peak);
  stream.reset();  // closes the stream, so shutdown needs no grace period
  (*server)->Shutdown();
}

// W4A8 on the wire: MXFP8 activations (codes, then scales) with row_source give the CPU kernels'
// W4A8 on the same rows; BF16 activations in W4A8 are quantized by the server to the same
// result; the production check verifies W4A8 batches against the reference's W4A8; bad MXFP8
// (mode, NaN code, NaN scale, byte count) is INVALID_ARGUMENT naming what is wrong.
// In checkpoint mode the production check reads its reference weights through a mapping of the
// checkpoint of its own: batches computed from the server's mapping match it.
TEST(ExpertServer, ChecksBatchesAgainstTheCheckpointItServes) {
  const ModelConfig cfg = *PresetConfig("tiny");
  std::string dir = ::testing::TempDir() + "/moe_verify_ckpt_XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  checkpoint::SyntheticOptions so;
  so.seed = 8;
  ASSERT_TRUE(checkpoint::WriteSyntheticCheckpoint(cfg, dir, so).ok());
  const std::string port_file = dir + "/metrics_port";
  ExpertServerOptions o;
  o.checkpoint = dir;
  o.shard = "shard-c";
  o.threads = 1;
  o.measure_limits = false;
  o.metrics_port = 0;
  o.metrics_port_file = port_file;
  o.verify_fraction = 1.0;
  auto server = ExpertServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  int metrics_port = 0;
  std::ifstream(port_file) >> metrics_port;
  ModelConfig zcfg = cfg;
  zcfg.hidden = cfg.latent;
  auto stream = std::make_unique<transport::ExpertStream>(
      "shard-c", "127.0.0.1:" + std::to_string((*server)->port()), 64 << 20);
  for (int b = 0; b < 2; ++b) {
    const std::vector<Bf16> z = checkpoint::SyntheticHiddenStates(zcfg, 6, 30 + b);
    v1::DispatchRequest req;
    req.set_layer(1);
    for (int e : {1, 9, 15}) {
      auto* g = req.add_groups();
      g->set_expert_id(e);
      g->set_token_count(2);
    }
    transport::EncodeBf16Into(z, 6, cfg.latent, req.mutable_activations());
    ASSERT_TRUE(stream->Call(req, absl::Now() + absl::Seconds(10)).ok());
  }
  // The checks run in the background.
  const std::string page = PageWithMatches(metrics_port, 2);
  EXPECT_EQ(Sample(page, "moe_expert_verified_batches_total", {"result=\"match\""}), 2) << page;
  EXPECT_EQ(Sample(page, "moe_expert_verified_batches_total", {"result=\"mismatch\""}), 0);
  EXPECT_EQ(Sample(page, "moe_expert_verified_batches_total", {"result=\"error\""}), 0);
  stream.reset();
  (*server)->Shutdown();
}

// GetInfo of a server on this host (empty when the call fails, which the caller's checks see).
v1::ExpertServerInfo InfoOf(const ExpertServer& server) {
  auto stub = v1::ExpertService::NewStub(
      transport::MakeChannel("127.0.0.1:" + std::to_string(server.port())));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ExpertServerInfo info;
  EXPECT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
  return info;
}

// The range comes from the placement table by ordinal (services/placement), as in a
// StatefulSet pod: ordinal 3 of 3 ranges x 2 replicas serves [5, 11).
TEST(ExpertServer, RangeFromThePlacementTableByOrdinal) {
  const std::string path = ::testing::TempDir() + "/ranges.json";
  std::ofstream(path)
      << R"({"num_experts": 16, "replicas_per_range": 2, "ranges": [[0, 5], [5, 11], [11, 16]]})";
  ExpertServerOptions o;
  o.preset = "tiny";
  o.ranges_file = path;
  o.ordinal = 3;
  o.threads = 1;
  o.measure_limits = false;
  auto server = ExpertServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const v1::ExpertServerInfo info = InfoOf(**server);
  EXPECT_EQ(info.expert_lo(), 5);
  EXPECT_EQ(info.expert_hi(), 11);
  (*server)->Shutdown();
  o.ordinal = 6;  // 6 pods: 0..5
  auto refused = ExpertServer::Start(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("ordinal 6 outside [0, 6)"), absl::string_view::npos)
      << refused.status();
}

// Without a usable GPU (this CI): "cuda" refuses to start with the reason, "auto" falls back to
// the CPU kernels, an unknown name is refused. With a GPU, "auto" picks CUDA (tests/gpu checks
// the kernels themselves).
TEST(ExpertServer, BackendRegistryFallsBackToTheCpu) {
  ExpertServerOptions o;
  o.preset = "tiny";
  o.threads = 1;
  const bool gpu = numerics::cuda::CudaDeviceStatus().ok();
  o.backend = Backend::kAuto;
  auto server = ExpertServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const v1::ExpertServerInfo info = InfoOf(**server);
  EXPECT_EQ(info.backend().rfind(gpu ? "cuda/" : "cpu/", 0), 0u) << info.backend();
  (*server)->Shutdown();
  if (!gpu) {
    o.backend = Backend::kCuda;
    auto refused = ExpertServer::Start(o);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(refused.status().message().find("backend cuda"), absl::string_view::npos)
        << refused.status();
    std::printf("[backend cuda without a GPU] %s\n", refused.status().ToString().c_str());
  }
  // An unknown name is refused where it is parsed (the flag; ctest flags.expert-svc_bad_backend).
  auto unknown = ParseBackend("tpu");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("not one of auto, cpu, cuda"), absl::string_view::npos);
  EXPECT_EQ(*ParseBackend("cuda"), Backend::kCuda);
}

TEST(ExpertServer, RefusesARangeOutsideTheModel) {
  ExpertServerOptions o;
  o.preset = "tiny";
  o.expert_lo = 10;
  o.expert_hi = 40;
  auto server = ExpertServer::Start(o);
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("[10, 40)"), absl::string_view::npos);
}

}  // namespace
}  // namespace moe::expert_svc
