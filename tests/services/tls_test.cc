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
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using tensor::Bf16;
using testing::MakeTempDir;
using testing::MakeTestPki;
using testing::MemberTls;
using testing::RunShell;
using testing::SameBits;

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

// A tiny cluster on mutual TLS with the given member certificate files, one request and its
// oracle answer, and the steps the TLS tests share.
class ClusterTls : public testing::ClusterTest {
 protected:
  void MakePki(const std::string& tag) {
    pki_ = MakeTestPki(MakeTempDir(tag));
    ASSERT_FALSE(pki_.empty());
  }
  void StartMtlsCluster(const transport::TlsOptions& tls) {
    UsePreset("tiny", {{0, 7}, {7, 16}});
    options().tls = tls;
    ASSERT_NO_FATAL_FAILURE(StartCluster());
    x_ = Hidden(3, 11);
    want_ = Want(x_, 3);
  }

  // A Forward with these client TLS options (none: plaintext), 5 s deadline.
  absl::StatusOr<client::ForwardResult> ForwardWith(const transport::TlsOptions& tls) {
    client::ClientOptions o = cluster().client_options();
    o.tls = tls;
    o.timeout = absl::Seconds(5);
    auto c = client::MoeClient::Create(o);
    if (!c.ok()) return c.status();
    return (*c)->Forward(layer(), x_, 3, hidden());
  }
  void ExpectMembersServedBitExact() {
    auto got = ForwardWith(MemberTls(pki_));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(SameBits(got->out, want_));
  }

  // A RegisterExpertServer of `shard` for experts [lo, hi) over a channel with certificate
  // `cert` of the PKI, carrying `token`.
  grpc::Status RegisterAs(const std::string& cert, const std::string& shard, int lo, int hi,
                          const std::string& token = "") {
    auto creds = transport::MakeChannelCredentials(MemberTls(pki_, cert));
    EXPECT_TRUE(creds.ok());
    auto router = v1::RouterService::NewStub(transport::MakeChannel(
        cluster().router_endpoint(), transport::kDefaultMaxMessageBytes, *creds));
    v1::RegisterExpertServerRequest r;
    r.set_shard(shard);
    r.set_endpoint("127.0.0.1:1");
    auto* range = r.add_ranges();
    range->set_layer(layer());
    range->set_expert_lo(lo);
    range->set_expert_hi(hi);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    // A TLS handshake slower than the channel's connect timeout (MakeChannel's 100 ms minimum
    // reconnect backoff, which gRPC also takes as the minimum connect timeout) on a loaded
    // machine is a transient failure: wait for the channel within the deadline instead of
    // failing the call UNAVAILABLE, so what is asserted is the server's answer. (A peer the
    // server refuses at the handshake still fails UNAVAILABLE at the deadline.)
    if (cert != "rogue") ctx.set_wait_for_ready(true);
    if (!token.empty()) ctx.AddMetadata(transport::kClusterTokenMetadata, token);
    v1::RegisterExpertServerResponse resp;
    return router->RegisterExpertServer(&ctx, r, &resp);
  }

  // The exec probe of a TLS deployment (kubelet's gRPC probe speaks plaintext only): SERVING
  // with a member certificate, refused without.
  void ExpectExecProbeNeedsACertificate() {
    const transport::TlsOptions m = MemberTls(pki_);
    const std::string probe = absl::StrCat(
        MOE_BIN_DIR,
        "/moe-cli health --service=moe.liveness --endpoint=", cluster().attention_endpoint());
    EXPECT_THAT(
        RunShell(absl::StrCat(probe, " --tls_ca_file=", m.ca_file, " --tls_cert_file=", m.cert_file,
                              " --tls_key_file=", m.key_file, " 2>&1; echo rc=$?")),
        ::testing::HasSubstr("SERVING\nrc=0"));
    EXPECT_THAT(RunShell(probe + " 2>&1; echo rc=$?"), ::testing::HasSubstr("rc=1"));
  }

  // Until `endpoint` presents a certificate of `subject` (bounded: 60 x 250 ms, the refresh is
  // 1 s); returns the last subject seen.
  std::string AwaitSubject(const std::string& endpoint, const std::string& subject) {
    std::string seen;
    for (int i = 0; i < 60; ++i) {
      seen = PresentedSubject(endpoint, MemberTls(pki_));
      if (seen == subject) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
    return seen;
  }
  // Each process's live certificate (or key) replaced by its `suffix` one.
  void RotateLive(const char* ext, const std::string& suffix) {
    for (const char* p : kProcesses) {
      CopyFileAtomically(pki_ + "/" + p + suffix + ext, pki_ + "/live-" + p + ext);
    }
  }

  static constexpr const char* kProcesses[] = {"router-svc", "attention-svc", "shard-0", "shard-1",
                                               "client"};
  std::string pki_;
  std::vector<Bf16> x_, want_;
};

TEST_F(ClusterTls, RefusesPlaintextCertificateLessAndWrongCaPeers) {
  ASSERT_NO_FATAL_FAILURE(MakePki("tls"));
  // Each process with its own identity (tests/common/make_test_pki.sh).
  ASSERT_NO_FATAL_FAILURE(StartMtlsCluster(MemberTls(pki_, "{name}")));
  ASSERT_NO_FATAL_FAILURE(ExpectMembersServedBitExact());
  transport::TlsOptions ca_only;  // server verified, no certificate of our own
  ca_only.ca_file = pki_ + "/ca.pem";
  const struct {
    const char* name;
    transport::TlsOptions tls;
  } refused[] = {
      {"plaintext", transport::TlsOptions{}},
      {"no client certificate", ca_only},
      {"a certificate from another CA", MemberTls(pki_, "rogue", "ca")},
      {"a client that does not trust the cluster CA", MemberTls(pki_, "member", "other-ca")},
  };
  for (const auto& r : refused) {
    SCOPED_TRACE(r.name);
    const absl::Time start = absl::Now();
    auto got = ForwardWith(r.tls);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(6)) << "a refused handshake must not hang";
  }
  // A rogue expert server with a certificate from another CA cannot even reach the router.
  EXPECT_EQ(RegisterAs("rogue", "a-rogue", 0, static_cast<int>(cfg().num_experts)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  ExpectExecProbeNeedsACertificate();
  // Everything still serves members, with the same bits (the placement did not change).
  ExpectMembersServedBitExact();
}

// A rotated certificate is served without a restart; a broken rotation (a key that does not
// match its certificate) keeps the last good pair serving, and a good pair after it is taken.
TEST_F(ClusterTls, RotatedCertificateIsServedWithoutARestart) {
  ASSERT_NO_FATAL_FAILURE(MakePki("tls_rotate"));
  // Each process reads its own "live" files that the test rotates (as cert-manager rewrites
  // a pod's Secret): the same identity, a new certificate (CN moe-member -> moe-member-2).
  RotateLive(".pem", "");
  RotateLive(".key", "");
  ASSERT_NO_FATAL_FAILURE(StartMtlsCluster(MemberTls(pki_, "live-{name}")));
  const std::string attention = cluster().attention_endpoint();
  EXPECT_EQ(PresentedSubject(attention, MemberTls(pki_)), "CN = moe-member");
  RotateLive(".key", "-2");
  RotateLive(".pem", "-2");
  EXPECT_EQ(AwaitSubject(attention, "CN = moe-member-2"), "CN = moe-member-2");
  // Each process takes its pair on its own refresh (a pair read half copied, the new key with
  // the old certificate, is refused and taken whole a refresh later).
  EXPECT_EQ(AwaitSubject(cluster().router_endpoint(), "CN = moe-member-2"), "CN = moe-member-2");
  // The rotated members still reach each other (attention -> shards over new connections).
  ASSERT_NO_FATAL_FAILURE(ExpectMembersServedBitExact());

  // A broken rotation (each process's first certificate with its second key: they do not
  // match) is refused: the last good pair keeps serving new handshakes for 3 refreshes...
  RotateLive(".pem", "");
  for (int i = 0; i < 12; ++i) {  // 3 s
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    ASSERT_EQ(PresentedSubject(attention, MemberTls(pki_)), "CN = moe-member-2") << "after " << i;
  }
  EXPECT_EQ(PresentedSubject(cluster().router_endpoint(), MemberTls(pki_)), "CN = moe-member-2");
  ASSERT_NO_FATAL_FAILURE(ExpectMembersServedBitExact());
  // ... and a good pair after it is taken as usual.
  RotateLive(".key", "");
  EXPECT_EQ(AwaitSubject(attention, "CN = moe-member"), "CN = moe-member");
  ExpectMembersServedBitExact();
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
// What a shard's certificate gets when it dispatches to another shard.
grpc::Status DispatchAs(const std::string& pki, const std::string& endpoint,
                        const std::string& cert, const std::string& token) {
  auto channel = transport::MakeChannel(endpoint, transport::kDefaultMaxMessageBytes,
                                        *transport::MakeChannelCredentials(MemberTls(pki, cert)));
  auto expert = v1::ExpertService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ctx.set_wait_for_ready(true);  // as in RegisterAs: a slow handshake is retried, not the answer
  ctx.AddMetadata(transport::kClusterTokenMetadata, token);
  auto stream = expert->Dispatch(&ctx);
  stream->WritesDone();
  v1::DispatchReply reply;
  while (stream->Read(&reply)) {
  }
  return stream->Finish();
}

TEST_F(ClusterTls, AMemberCertificateActsOnlyAsItself) {
  ASSERT_NO_FATAL_FAILURE(MakePki("tls_identity"));
  ASSERT_NO_FATAL_FAILURE(StartMtlsCluster(MemberTls(pki_, "{name}")));
  // Every call below carries the member token of the shard it names: only the certificate is
  // wrong.
  std::ifstream tf(cluster().work_dir() + "/cluster_token");
  std::string secret;
  tf >> secret;
  const int E = static_cast<int>(cfg().num_experts);
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
    const grpc::Status s =
        RegisterAs(c.cert, c.shard, c.lo, c.hi, transport::ExpertMemberToken(secret, c.shard));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr(c.message));
  }
  // shard-0's own certificate and token from a second process while shard-0 lives: its lease
  // is never displaced (the same shard restarted registers once the old lease has died).
  for (int i = 0; i < 4; ++i) {
    const grpc::Status s =
        RegisterAs("shard-0", "shard-0", 0, 7, transport::ExpertMemberToken(secret, "shard-0"));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("under a live lease"));
  }
  // A shard's certificate cannot dispatch to another shard (only attention identities can).
  const grpc::Status ds = DispatchAs(pki_, cluster().shard_endpoint(0), "shard-1",
                                     moe::testing::AttentionToken(cluster()));
  EXPECT_EQ(ds.error_code(), grpc::StatusCode::PERMISSION_DENIED) << ds.error_message();
  EXPECT_THAT(ds.error_message(), ::testing::HasSubstr("needs the certificate of "
                                                       "spiffe://moe/attention/<name>"));
  // The cluster still serves bit-exact answers: the placement is the members' own (the shards'
  // registrations, each under its certificate's name).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ExpectMembersServedBitExact();
}

}  // namespace
}  // namespace moe
