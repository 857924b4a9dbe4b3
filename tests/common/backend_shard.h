// An echo expert server on a data-plane backend of the registries ("fake", "shm"), with its
// metrics address, the channel options of a node to it, and the check of an echo reply: what
// the backends' tests share (tests/services/fake_data_plane_test.cc, shm_data_plane_test.cc).
//
//   testing::BackendShard shard = testing::StartBackendShard(cfg, "shm");
//   auto ch = half->MakeChannel(testing::BackendChannel(shard, "attention-shm", false));
//   EXPECT_EQ(testing::WrongEchoRows(batch, reply, cfg.latent), 0u);
//   ASSERT_NO_FATAL_FAILURE(testing::ExpectServedBitExactOn(*ch, cfg, shard.endpoint, "shm",
//                                                           {1, 16}));
#ifndef MOE_TESTS_COMMON_BACKEND_SHARD_H_
#define MOE_TESTS_COMMON_BACKEND_SHARD_H_

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/client_half.h"
#include "attention-svc/expert_channel_grpc.h"
#include "expert-svc/expert_server.h"
#include "tests/common/echo_shard.h"

namespace moe::testing {

struct BackendShard {
  std::unique_ptr<expert_svc::ExpertServer> server;
  std::string endpoint, metrics;  // gRPC and metrics host:port
};

inline BackendShard StartBackendShard(const ModelConfig& cfg, const std::string& backend) {
  expert_svc::ExpertServerOptions o = EchoServerOptions("mid", cfg.top_k, "");
  o.data_plane = dataplane::DataPlane{backend};
  o.metrics_port = 0;
  std::string dir = ::testing::TempDir() + "/" + backend + "_dp_XXXXXX";
  o.metrics_port_file = std::string(::mkdtemp(dir.data())) + "/metrics_port";
  auto server = expert_svc::ExpertServer::Start(o);
  EXPECT_TRUE(server.ok()) << server.status();
  BackendShard s;
  s.server = std::move(*server);
  s.endpoint = absl::StrCat("127.0.0.1:", s.server->port());
  int port = 0;
  std::ifstream(o.metrics_port_file) >> port;
  s.metrics = absl::StrCat("127.0.0.1:", port);
  return s;
}

inline attention_svc::ChannelOptions BackendChannel(const BackendShard& s, const std::string& node,
                                                    bool fallback) {
  attention_svc::ChannelOptions co;
  co.shard = "echo-0";
  co.endpoint = s.endpoint;
  co.node = node;
  co.max_message_bytes = 1 << 30;
  co.fallback_in_band = fallback;
  return co;
}

// Rows of an echo reply that are not their pair's activations (all of them, plus one, when the
// reply has the wrong size).
inline size_t WrongEchoRows(const EchoBatch& b, const attention_svc::ExpertReply& r, int64_t d) {
  const auto& z = b.message.z.bf16();
  if (r.bf16.size() != b.message.row_source.size() * d) return b.message.row_source.size() + 1;
  size_t wrong = 0;
  for (size_t i = 0; i < b.message.row_source.size(); ++i) {
    wrong += std::memcmp(&r.bf16[i * d], &z[b.message.row_source[i] * d], d * 2) != 0;
  }
  return wrong;
}

// Sends batches of `tokens` each on `ch` and checks every reply: it came on `lane`, each row is
// its pair's activations, and it equals the in-band lane's answer to the same batch from the
// shard at `endpoint` bit for bit. Wrap in ASSERT_NO_FATAL_FAILURE.
inline void ExpectServedBitExactOn(attention_svc::ExpertChannel& ch, const ModelConfig& cfg,
                                   const std::string& endpoint, const char* lane,
                                   std::initializer_list<int64_t> tokens) {
  attention_svc::GrpcExpertChannel inband("echo-0", endpoint, 1 << 30, "");
  for (int64_t t : tokens) {
    const EchoBatch b = MakeEchoBatch(cfg, t);
    auto call = ch.Send(b.header, b.message);
    auto reply = call->Wait(absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_STREQ(call->transport(), lane) << "T " << t;
    EXPECT_EQ(WrongEchoRows(b, *reply, cfg.latent), 0u) << "T " << t;
    auto in = inband.Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(in.ok()) << in.status();
    ASSERT_EQ(in->bf16.size(), reply->bf16.size());
    EXPECT_EQ(std::memcmp(in->bf16.data(), reply->bf16.data(), in->bf16.size() * 2), 0) << t;
  }
  EXPECT_STREQ(ch.transport(), lane);
}

}  // namespace moe::testing

#endif  // MOE_TESTS_COMMON_BACKEND_SHARD_H_
