// TLS and mutual TLS on a real cluster (docs/security.md), with certificates made by openssl at
// test time (tests/common/make_test_pki.sh): members with certificates from the cluster CA get
// bit-exact answers; plaintext, certificate-less and wrong-CA peers are refused at the
// handshake and change nothing; a rotated certificate is served without a restart; bad TLS
// files are clear errors before anything listens.
#include <grpcpp/grpcpp.h>
#include <stdio.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe/v1/expert.grpc.pb.h"
#include "moe/v1/router.grpc.pb.h"
#include "services/transport/channel.h"
#include "services/transport/security.h"
#include "tests/services/cluster_fixtures.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::CheckpointFor;
using testing::InProcessLayer;
using testing::MakeTempDir;
using testing::MakeTestPki;
using testing::MemberTls;
using testing::RunShell;
using testing::SameBits;
using testing::TestCluster;
using tools::LocalCluster;
using tools::LocalClusterOptions;

// The subject of the certificate a TLS server presents, as openssl prints it ("CN = ...").
std::string PresentedSubject(const std::string& endpoint, const transport::TlsOptions& me) {
  const std::string subject =
      RunShell(absl::StrCat("openssl s_client -connect ", endpoint, " -alpn h2 -cert ",
                            me.cert_file, " -key ", me.key_file, " -CAfile ", me.ca_file,
                            " </dev/null 2>/dev/null | openssl x509 -noout -subject 2>/dev/null"));
  return std::string(absl::StripAsciiWhitespace(absl::StripPrefix(subject, "subject=")));
}

void CopyFileAtomically(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  const std::string tmp = to + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out << in.rdbuf();
  }
  ::chmod(tmp.c_str(), 0600);
  ASSERT_EQ(std::rename(tmp.c_str(), to.c_str()), 0);
}

struct Fixture {
  ModelConfig cfg;
  std::unique_ptr<numerics::cpu::CpuMoeLayer> local;
  std::string pki;
  std::unique_ptr<LocalCluster> cluster;
  int32_t layer = 0;
  std::vector<Bf16> x;
  std::vector<Bf16> want;
};

// A tiny cluster on mutual TLS with the given member certificate files.
void StartMtlsCluster(Fixture* f, const transport::TlsOptions& tls) {
  const std::string& dir = CheckpointFor("tiny");
  f->local = InProcessLayer(dir, &f->cfg);
  LocalClusterOptions o = TestCluster(dir, {{0, 7}, {7, 16}});
  o.tls = tls;
  auto cluster = LocalCluster::Start(o);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  f->cluster = std::move(*cluster);
  f->layer = static_cast<int32_t>(f->cfg.first_moe_layer);
  f->x = checkpoint::SyntheticHiddenStates(f->cfg, 3, 11);
  auto want = f->local->Forward(f->x, 3, f->cfg.hidden);
  ASSERT_TRUE(want.ok());
  f->want = want->out;
}

// A Forward with these client TLS options (none: plaintext), 5 s deadline.
absl::StatusOr<client::ForwardResult> ForwardWith(const Fixture& f,
                                                  const transport::TlsOptions& tls) {
  client::ClientOptions o = f.cluster->client_options();
  o.tls = tls;
  o.timeout = absl::Seconds(5);
  auto c = client::MoeClient::Create(o);
  if (!c.ok()) return c.status();
  return (*c)->Forward(f.layer, f.x, 3, f.cfg.hidden);
}

TEST(ClusterTls, RefusesPlaintextCertificateLessAndWrongCaPeers) {
  Fixture f;
  f.pki = MakeTestPki(MakeTempDir("tls"));
  ASSERT_FALSE(f.pki.empty());
  // Each process with its own identity (tests/common/make_test_pki.sh).
  ASSERT_NO_FATAL_FAILURE(StartMtlsCluster(&f, MemberTls(f.pki, "{name}")));
  auto ok = ForwardWith(f, MemberTls(f.pki));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(SameBits(ok->out, f.want));

  transport::TlsOptions ca_only;  // server verified, no certificate of our own
  ca_only.ca_file = f.pki + "/ca.pem";
  transport::TlsOptions wrong_trust = MemberTls(f.pki, "member", "other-ca");
  const struct {
    const char* name;
    transport::TlsOptions tls;
  } refused[] = {
      {"plaintext", transport::TlsOptions{}},
      {"no client certificate", ca_only},
      {"a certificate from another CA", MemberTls(f.pki, "rogue", "ca")},
      {"a client that does not trust the cluster CA", wrong_trust},
  };
  for (const auto& r : refused) {
    SCOPED_TRACE(r.name);
    const absl::Time start = absl::Now();
    auto got = ForwardWith(f, r.tls);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(6)) << "a refused handshake must not hang";
  }

  // A rogue expert server with a certificate from another CA cannot even reach the router.
  auto rogue_creds = transport::MakeChannelCredentials(MemberTls(f.pki, "rogue", "ca"));
  ASSERT_TRUE(rogue_creds.ok());
  auto router = v1::RouterService::NewStub(transport::MakeChannel(
      f.cluster->router_endpoint(), transport::kDefaultMaxMessageBytes, *rogue_creds));
  v1::RegisterExpertServerRequest reg;
  reg.set_shard("a-rogue");
  reg.set_endpoint("127.0.0.1:1");
  auto* range = reg.add_ranges();
  range->set_layer(f.layer);
  range->set_expert_lo(0);
  range->set_expert_hi(static_cast<int32_t>(f.cfg.num_experts));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::RegisterExpertServerResponse resp;
  EXPECT_EQ(router->RegisterExpertServer(&ctx, reg, &resp).error_code(),
            grpc::StatusCode::UNAVAILABLE);

  // The exec probe of a TLS deployment (kubelet's gRPC probe speaks plaintext only).
  const transport::TlsOptions m = MemberTls(f.pki);
  const std::string probe = absl::StrCat(
      MOE_BIN_DIR,
      "/moe-cli health --service=moe.liveness --endpoint=", f.cluster->attention_endpoint());
  EXPECT_THAT(
      RunShell(absl::StrCat(probe, " --tls_ca_file=", m.ca_file, " --tls_cert_file=", m.cert_file,
                            " --tls_key_file=", m.key_file, " 2>&1; echo rc=$?")),
      ::testing::HasSubstr("SERVING\nrc=0"));
  EXPECT_THAT(RunShell(probe + " 2>&1; echo rc=$?"), ::testing::HasSubstr("rc=1"));

  // Everything still serves members, with the same bits (the placement did not change).
  auto again = ForwardWith(f, MemberTls(f.pki));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(SameBits(again->out, f.want));
}

// A rotated certificate is served without a restart; a broken rotation (a key that does not
// match its certificate) keeps the last good pair serving, and a good pair after it is taken.
TEST(ClusterTls, RotatedCertificateIsServedWithoutARestart) {
  Fixture f;
  f.pki = MakeTestPki(MakeTempDir("tls_rotate"));
  ASSERT_FALSE(f.pki.empty());
  // Each process reads its own "live" files that the test rotates (as cert-manager rewrites
  // a pod's Secret): the same identity, a new certificate (CN moe-member -> moe-member-2).
  const char* kProcesses[] = {"router-svc", "attention-svc", "shard-0", "shard-1", "client"};
  for (const char* p : kProcesses) {
    CopyFileAtomically(f.pki + "/" + p + ".pem", f.pki + "/live-" + p + ".pem");
    CopyFileAtomically(f.pki + "/" + p + ".key", f.pki + "/live-" + p + ".key");
  }
  ASSERT_NO_FATAL_FAILURE(StartMtlsCluster(&f, MemberTls(f.pki, "live-{name}")));
  const transport::TlsOptions me = MemberTls(f.pki);
  const std::string attention = f.cluster->attention_endpoint();
  EXPECT_EQ(PresentedSubject(attention, me), "CN = moe-member");

  for (const char* p : kProcesses) {
    CopyFileAtomically(f.pki + "/" + p + "-2.key", f.pki + "/live-" + p + ".key");
    CopyFileAtomically(f.pki + "/" + p + "-2.pem", f.pki + "/live-" + p + ".pem");
  }
  std::string subject;
  for (int i = 0; i < 60 && subject != "CN = moe-member-2"; ++i) {  // refresh: 1 s
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    subject = PresentedSubject(attention, me);
  }
  EXPECT_EQ(subject, "CN = moe-member-2");
  // Each process takes its pair on its own refresh (a pair read half copied, the new key with
  // the old certificate, is refused and taken whole a refresh later).
  subject.clear();
  for (int i = 0; i < 60 && subject != "CN = moe-member-2"; ++i) {
    subject = PresentedSubject(f.cluster->router_endpoint(), me);
    if (subject != "CN = moe-member-2") std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  EXPECT_EQ(subject, "CN = moe-member-2");
  // The rotated members still reach each other (attention -> shards over new connections).
  auto got = ForwardWith(f, me);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(SameBits(got->out, f.want));

  // A broken rotation (each process's first certificate with its second key: they do not
  // match) is refused: the last good pair keeps serving new handshakes for 3 refreshes...
  for (const char* p : kProcesses) {
    CopyFileAtomically(f.pki + "/" + p + ".pem", f.pki + "/live-" + p + ".pem");
  }
  for (int i = 0; i < 12; ++i) {  // 3 s
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    ASSERT_EQ(PresentedSubject(attention, me), "CN = moe-member-2") << "after " << i;
  }
  EXPECT_EQ(PresentedSubject(f.cluster->router_endpoint(), me), "CN = moe-member-2");
  auto during = ForwardWith(f, me);
  ASSERT_TRUE(during.ok()) << during.status();
  EXPECT_TRUE(SameBits(during->out, f.want));
  // ... and a good pair after it is taken as usual.
  for (const char* p : kProcesses) {
    CopyFileAtomically(f.pki + "/" + p + ".key", f.pki + "/live-" + p + ".key");
  }
  subject.clear();
  for (int i = 0; i < 60 && subject != "CN = moe-member"; ++i) {  // refresh: 1 s
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    subject = PresentedSubject(attention, me);
  }
  EXPECT_EQ(subject, "CN = moe-member");
  auto after = ForwardWith(f, me);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(SameBits(after->out, f.want));
}

// The member tokens are hex SHA-256 of "<secret>:expert:<shard>" for an expert and
// "<secret>:attention" for the attention tier (values from coreutils' sha256sum; the chart
// derives them the same way with sprig's sha256sum: tests/deploy).
TEST(TlsOptions, MemberTokens) {
  EXPECT_EQ(transport::ExpertMemberToken("s3cret", "shard-0"),
            "8afeec0324ccde44f89a9700a720f6b82b23ca54aefb2760abca5a8633effe50");
  EXPECT_EQ(transport::ExpertMemberToken("s3cret", "shard-1"),
            "633f2dbfcf8537e251c5dd33970d7e64e87ae0f1534e16971e2e540356b5999b");
  const std::string attention = transport::MemberRoleToken("s3cret", "attention");
  EXPECT_EQ(attention, "f9067681e55b50b014e3fa02e84390d0150afd641595af1821930e4799325721");
  EXPECT_EQ(transport::MemberTokenDigest(attention),
            "b162ea2818122c2861e6120dfecd8cb83a713a92d88c97d7b3f90d9ca5f023fd");
}

TEST(TlsOptions, IncompleteOrUnsafeFilesAreClearErrors) {
  const std::string pki = MakeTestPki(MakeTempDir("tls_files"));
  ASSERT_FALSE(pki.empty());
  transport::TlsOptions t = MemberTls(pki);
  EXPECT_TRUE(transport::ValidateTlsOptions(t, /*server=*/true).ok());

  transport::TlsOptions no_key = t;
  no_key.key_file.clear();
  EXPECT_EQ(transport::ValidateTlsOptions(no_key, true).code(), absl::StatusCode::kInvalidArgument);
  transport::TlsOptions no_ca = t;
  no_ca.ca_file.clear();
  EXPECT_THAT(std::string(transport::ValidateTlsOptions(no_ca, true).message()),
              ::testing::HasSubstr("without a CA file"));
  transport::TlsOptions client_only;
  client_only.ca_file = t.ca_file;
  EXPECT_TRUE(transport::ValidateTlsOptions(client_only, /*server=*/false).ok());
  EXPECT_THAT(std::string(transport::ValidateTlsOptions(client_only, true).message()),
              ::testing::HasSubstr("needs a certificate"));
  transport::TlsOptions missing = t;
  missing.ca_file = pki + "/nope.pem";
  EXPECT_EQ(transport::ValidateTlsOptions(missing, true).code(), absl::StatusCode::kNotFound);
  transport::TlsOptions not_pem = t;
  not_pem.cert_file = pki + "/ca.srl";
  EXPECT_THAT(std::string(transport::ValidateTlsOptions(not_pem, true).message()),
              ::testing::HasSubstr("holds no PEM"));
  transport::TlsOptions mismatched = t;
  mismatched.key_file = pki + "/member2.key";
  EXPECT_THAT(std::string(transport::ValidateTlsOptions(mismatched, true).message()),
              ::testing::HasSubstr("the key does not match the certificate"));
  ASSERT_EQ(::chmod(t.key_file.c_str(), 0644), 0);
  EXPECT_EQ(transport::ValidateTlsOptions(t, true).code(), absl::StatusCode::kPermissionDenied);

  // The service refuses to start on it, saying why (before anything listens).
  const std::string out = RunShell(absl::StrCat(
      MOE_BIN_DIR, "/expert-svc --preset=tiny --port=0 --tls_cert_file=", t.cert_file,
      " --tls_key_file=", t.key_file, " --tls_ca_file=", t.ca_file, " 2>&1; echo rc=$?"));
  EXPECT_THAT(out, ::testing::HasSubstr("is readable by others"));
  EXPECT_THAT(out, ::testing::HasSubstr("rc=1"));
}

// A member acts only as itself: with mutual TLS the router takes a registration or heartbeat
// only from the certificate naming that shard (spiffe://moe/expert/<shard>), ranges only from
// the deployment's table, statistics only from attention identities, and a shard takes
// Dispatch only from attention identities. The cluster token alone is not enough.
TEST(ClusterTls, AMemberCertificateActsOnlyAsItself) {
  Fixture f;
  f.pki = MakeTestPki(MakeTempDir("tls_identity"));
  ASSERT_FALSE(f.pki.empty());
  ASSERT_NO_FATAL_FAILURE(StartMtlsCluster(&f, MemberTls(f.pki, "{name}")));
  // Every call below carries the member token of the shard it names: only the certificate is
  // wrong.
  std::ifstream tf(f.cluster->work_dir() + "/cluster_token");
  std::string secret;
  tf >> secret;
  const std::string attention_token = moe::testing::AttentionToken(*f.cluster);
  auto call_as = [&](const std::string& cert) {
    auto creds = transport::MakeChannelCredentials(MemberTls(f.pki, cert));
    EXPECT_TRUE(creds.ok());
    return transport::MakeChannel(f.cluster->router_endpoint(), transport::kDefaultMaxMessageBytes,
                                  *creds);
  };
  auto reg = [&](const std::string& cert, const std::string& shard, int lo, int hi) {
    auto router = v1::RouterService::NewStub(call_as(cert));
    v1::RegisterExpertServerRequest r;
    r.set_shard(shard);
    r.set_endpoint("127.0.0.1:1");
    auto* range = r.add_ranges();
    range->set_layer(f.layer);
    range->set_expert_lo(lo);
    range->set_expert_hi(hi);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    // A TLS handshake slower than the channel's connect timeout (MakeChannel's 100 ms minimum
    // reconnect backoff, which gRPC also takes as the minimum connect timeout) on a loaded
    // machine is a transient failure: wait for the channel within the deadline instead of
    // failing the call UNAVAILABLE, so what is asserted is the server's answer.
    ctx.set_wait_for_ready(true);
    ctx.AddMetadata(transport::kClusterTokenMetadata, transport::ExpertMemberToken(secret, shard));
    v1::RegisterExpertServerResponse resp;
    return router->RegisterExpertServer(&ctx, r, &resp);
  };
  const int E = static_cast<int>(f.cfg.num_experts);
  struct Case {
    const char* what;
    std::string cert, shard;
    int lo, hi;
    const char* message;
  };
  for (const Case& c : {
           // shard-1's certificate (the "impostor") registering under shard-0's name.
           Case{"another shard's name", "impostor", "shard-0", 0, 7,
                "needs the certificate of spiffe://moe/expert/shard-0; the caller's names "
                "spiffe://moe/expert/shard-1"},
           Case{"a name outside the table", "impostor", "a-evil", 0, E, "needs the certificate"},
           // Its own name, a range beyond its own (shard-1 serves [7, 16)).
           Case{"a superset of its range", "shard-1", "shard-1", 0, E,
                "may serve experts [7, 16) (the deployment's ranges file), not the range [0, 16)"},
           Case{"no member identity (a user's certificate)", "member", "shard-0", 0, 7,
                "needs a member certificate naming one SPIFFE ID"},
           Case{"an attention identity", "attention-svc", "shard-0", 0, 7,
                "needs the certificate of spiffe://moe/expert/shard-0"},
       }) {
    SCOPED_TRACE(c.what);
    const grpc::Status s = reg(c.cert, c.shard, c.lo, c.hi);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr(c.message));
  }
  // shard-0's own certificate and token from a second process while shard-0 lives: its lease
  // is never displaced (the same shard restarted registers once the old lease has died).
  for (int i = 0; i < 4; ++i) {
    const grpc::Status s = reg("shard-0", "shard-0", 0, 7);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("under a live lease"));
  }
  // (The shards' own registrations, each under its certificate's name, made the placement the
  // Forward below uses.)

  // A shard's certificate cannot dispatch to another shard (only attention identities can).
  auto shard0 =
      transport::MakeChannel(f.cluster->shard_endpoint(0), transport::kDefaultMaxMessageBytes,
                             *transport::MakeChannelCredentials(MemberTls(f.pki, "shard-1")));
  auto expert = v1::ExpertService::NewStub(shard0);
  grpc::ClientContext dctx;
  dctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  dctx.set_wait_for_ready(true);  // as above: a slow handshake is retried, not the answer
  dctx.AddMetadata(transport::kClusterTokenMetadata, attention_token);
  auto stream = expert->Dispatch(&dctx);
  stream->WritesDone();
  v1::DispatchReply reply;
  while (stream->Read(&reply)) {
  }
  const grpc::Status ds = stream->Finish();
  EXPECT_EQ(ds.error_code(), grpc::StatusCode::PERMISSION_DENIED) << ds.error_message();
  EXPECT_THAT(ds.error_message(), ::testing::HasSubstr("needs the certificate of "
                                                       "spiffe://moe/attention/<name>"));

  // The cluster still serves bit-exact answers: the placement is the members' own.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto got = ForwardWith(f, MemberTls(f.pki));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(SameBits(got->out, f.want));
}

}  // namespace
}  // namespace moe
