// A member acts only as itself, by default and without TLS (docs/security.md, "Members act only
// as themselves"): the local CA `moe-cli up` makes (transport::MakeLocalPki) issues each process
// its SPIFFE identity, and on a running cluster a rogue that holds another member's credential,
// or shard-0's own from a second process, never takes shard-0's place, while a canary's answers
// stay bit-exact (the finding: with one token per role, a rogue re-registering shard-0 made 24 of
// 28 canary answers wrong).
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/v1/router.grpc.pb.h"
#include "services/transport/channel.h"
#include "services/transport/local_pki.h"
#include "services/transport/security.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using testing::MakeTempDir;
using testing::RunShell;
using testing::Traffic;
using tools::LocalCluster;

std::string ReadWord(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  f >> s;
  return s;
}

// Checked by openssl itself, an independent reader of the files: each certificate verifies
// against the CA for TLS client and server use, names its SPIFFE ID and the loopback names,
// and its key is the owner's only. Names that could smuggle another SAN into OpenSSL's
// configuration text are refused.
TEST(LocalPki, IssuesEachProcessItsOwnSpiffeIdentity) {
  const std::string dir = MakeTempDir("local_pki") + "/pki";
  ASSERT_TRUE(
      transport::MakeLocalPki(dir, {{"shard-0", "expert"}, {"client", "client"}}, "moe").ok());
  for (const auto& [name, role] :
       {std::pair<std::string, std::string>{"shard-0", "expert"}, {"client", "client"}}) {
    SCOPED_TRACE(name);
    const std::string cert = dir + "/" + name + ".pem";
    EXPECT_THAT(RunShell(absl::StrCat("openssl verify -purpose sslserver -CAfile ", dir, "/ca.pem ",
                                      cert, " 2>&1")),
                ::testing::HasSubstr(": OK"));
    EXPECT_THAT(RunShell(absl::StrCat("openssl verify -purpose sslclient -CAfile ", dir, "/ca.pem ",
                                      cert, " 2>&1")),
                ::testing::HasSubstr(": OK"));
    const std::string san =
        RunShell("openssl x509 -noout -ext subjectAltName -in " + cert + " 2>&1");
    EXPECT_THAT(san, ::testing::HasSubstr(absl::StrCat("URI:spiffe://moe/", role, "/", name)));
    EXPECT_THAT(san, ::testing::HasSubstr("DNS:localhost"));
    EXPECT_THAT(san, ::testing::HasSubstr("IP Address:127.0.0.1"));
    struct stat st;
    ASSERT_EQ(::stat((dir + "/" + name + ".key").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    transport::TlsOptions t;
    t.ca_file = dir + "/ca.pem";
    t.cert_file = cert;
    t.key_file = dir + "/" + name + ".key";
    EXPECT_TRUE(transport::ValidateTlsOptions(t, /*server=*/true).ok());
  }
  // A certificate of another CA made the same way does not verify against this one.
  const std::string other = MakeTempDir("local_pki_other") + "/pki";
  ASSERT_TRUE(transport::MakeLocalPki(other, {{"shard-0", "expert"}}, "moe").ok());
  EXPECT_THAT(RunShell(absl::StrCat("openssl verify -CAfile ", dir, "/ca.pem ", other,
                                    "/shard-0.pem 2>&1")),
              ::testing::Not(::testing::HasSubstr(": OK")));
  for (const auto& [members, domain] :
       std::vector<std::pair<std::vector<transport::PkiMember>, std::string>>{
           {{{"a,URI:spiffe://moe/expert/shard-0", "expert"}}, "moe"},
           {{{"shard-0", "admin"}}, "moe"},
           {{{"shard-0", "expert"}}, "moe,URI:spiffe://x/expert/shard-1"},
           {{{"", "expert"}}, "moe"}}) {
    EXPECT_EQ(transport::MakeLocalPki(MakeTempDir("local_pki_bad"), members, domain).code(),
              absl::StatusCode::kInvalidArgument)
        << members[0].name << " " << domain;
  }
}

// What a registration under shard-0's name gets from router-svc, presenting `token` and, with
// TLS, the certificate of `cert_name` from the cluster's PKI.
grpc::Status RegisterAs(const LocalCluster& c, const std::string& token,
                        const std::string& cert_name, int32_t layer, int32_t lo, int32_t hi) {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!cert_name.empty()) {
    transport::TlsOptions t;
    t.ca_file = c.work_dir() + "/pki/ca.pem";
    t.cert_file = c.work_dir() + "/pki/" + cert_name + ".pem";
    t.key_file = c.work_dir() + "/pki/" + cert_name + ".key";
    creds = *transport::MakeChannelCredentials(t);
  }
  auto router = v1::RouterService::NewStub(
      transport::MakeChannel(c.router_endpoint(), transport::kDefaultMaxMessageBytes, creds));
  v1::RegisterExpertServerRequest r;
  r.set_shard("shard-0");
  r.set_endpoint("127.0.0.1:1");  // where a rogue would take shard-0's traffic
  v1::ExpertRange* range = r.add_ranges();
  range->set_layer(layer);
  range->set_expert_lo(lo);
  range->set_expert_hi(hi);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ctx.set_wait_for_ready(true);  // a slow TLS handshake on a loaded machine is not the answer
  ctx.AddMetadata(transport::kClusterTokenMetadata, token);
  v1::RegisterExpertServerResponse resp;
  return router->RegisterExpertServer(&ctx, r, &resp);
}

// true: moe-cli up's default (mTLS)
class ARogue : public testing::ClusterTestWithParam<bool> {};

TEST_P(ARogue, NeverDisplacesALiveShard) {
  const bool tls = GetParam();
  UsePreset("tiny", {{0, 7}, {7, 16}});
  options().local_pki = tls;
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  LocalCluster& c = cluster();
  ASSERT_EQ(c.client_options().tls.enabled(), tls);
  const std::vector<tensor::Bf16> x = Hidden(3, 11);
  Traffic canary;
  canary.Start(c, layer(), x, 3, hidden(), Want(x, 3));

  const std::string shard0 = ReadWord(c.work_dir() + "/shard-0.token");
  const std::string shard1 = ReadWord(c.work_dir() + "/shard-1.token");
  ASSERT_FALSE(shard0.empty());
  ASSERT_NE(shard0, shard1);
  struct Try {
    const char* what;
    std::string token, cert;
    grpc::StatusCode code;
    const char* message;
  };
  std::vector<Try> tries = {
      {"shard-1's credentials under shard-0's name", shard1, tls ? "shard-1" : "",
       grpc::StatusCode::PERMISSION_DENIED, "with the member token of shard shard-1"},
      {"shard-0's own credentials from a second process", shard0, tls ? "shard-0" : "",
       grpc::StatusCode::ALREADY_EXISTS, "under a live lease"},
  };
  if (tls) {  // shard-0's token stolen, shard-1's certificate: the certificate still binds
    tries.push_back({"shard-0's token with shard-1's certificate", shard0, "shard-1",
                     grpc::StatusCode::PERMISSION_DENIED,
                     "needs the certificate of spiffe://moe/expert/shard-0"});
  }
  for (const Try& t : tries) {
    SCOPED_TRACE(t.what);
    for (int i = 0; i < 8; ++i) {  // as often as the rogue of the finding re-registered
      const grpc::Status s = RegisterAs(c, t.token, t.cert, layer(), 0, 7);
      EXPECT_EQ(s.error_code(), t.code) << s.error_message();
      EXPECT_THAT(s.error_message(), ::testing::HasSubstr(t.message));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  // shard-0 is still the real one, and every answer meanwhile was right.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  canary.Stop();
  auto placement = user().GetPlacement();
  ASSERT_TRUE(placement.ok()) << placement.status();
  for (const v1::ShardInfo& s : placement->shards()) {
    EXPECT_NE(s.endpoint(), "127.0.0.1:1") << s.shard();
    if (s.shard() == "shard-0") {
      EXPECT_EQ(s.endpoint(), c.shard_endpoint(0));
    }
  }
  EXPECT_GE(canary.ok.load(), 10);
  EXPECT_EQ(canary.wrong.load(), 0);
  EXPECT_EQ(canary.failed.load(), 0) << (canary.errors.empty() ? "" : canary.errors[0]);
}

INSTANTIATE_TEST_SUITE_P(BothModes, ARogue, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "MutualTlsOnTheLocalCa" : "PlaintextMemberTokens";
                         });

}  // namespace
}  // namespace moe
