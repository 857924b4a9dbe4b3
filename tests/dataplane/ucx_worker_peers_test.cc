// The UCX worker against peers that misbehave or go away: a receive nobody sends, a message
// longer than its buffer, a failed or destroyed peer, peers whose endpoints UCX reuses, the
// in-flight window, a dead shared-memory peer; UCX's own lane report parsed; the hello's wire
// form; RDMA verbs where a device exists. Each checked by what comes out (bytes, codes, counts).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/ucx_worker.h"
#include "tests/dataplane/ucx_test_util.h"

namespace moe::dataplane {
namespace {

using testing::Filled;
using testing::MakeWorker;

TEST(UcxWorker, AReceiveNobodySendsEndsAtItsDeadline) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto a = MakeWorker("tcp", "a");
  ASSERT_NE(a, nullptr);
  auto buf = a->Buffer(4096);
  ASSERT_TRUE(buf.ok());
  const absl::Time t0 = absl::Now();
  auto r = a->Recv(42, *buf, 4096, t0 + absl::Milliseconds(150));
  auto n = r->Wait(t0 + absl::Seconds(5));  // the transfer's own deadline comes first
  EXPECT_EQ(n.status().code(), absl::StatusCode::kDeadlineExceeded) << n.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(150));
  EXPECT_EQ(a->transfers_in_flight(), 0);
}

TEST(UcxWorker, AMessageLongerThanTheBufferIsAnErrorNotAnOverrun) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto a = MakeWorker("tcp", "a");
  auto b = MakeWorker("tcp", "b");
  ASSERT_NE(b, nullptr);
  auto ep = a->Connect(b->address(), nullptr);
  ASSERT_TRUE(ep.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto s = a->Send(*ep, 9, Filled(*a, 100000, 1), 100000, deadline);
  auto small = b->Buffer(4096);
  ASSERT_TRUE(small.ok());
  auto r = b->Recv(9, *small, 4096, deadline);
  auto n = r->Wait(deadline);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInternal) << n.status();
  (void)s->Wait(deadline);
}

TEST(UcxWorker, TransfersToAFailedPeerFailAndNeverHang) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto a = MakeWorker("tcp", "a");
  auto b = MakeWorker("tcp", "b");
  ASSERT_NE(b, nullptr);
  std::atomic<int> errors{0};
  auto ep = a->Connect(b->address(), [&](const absl::Status&) { errors.fetch_add(1); });
  ASSERT_TRUE(ep.ok());
  // The endpoint works first ...
  absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto in = b->Buffer(64);
  auto r = b->Recv(1, *in, 64, deadline);
  ASSERT_TRUE(a->Send(*ep, 1, Filled(*a, 64, 3), 64, deadline)->Wait(deadline).ok());
  ASSERT_TRUE(r->Wait(deadline).ok());
  b.reset();  // ... then the peer is gone
  deadline = absl::Now() + absl::Seconds(3);
  int failed = 0;
  for (int i = 0; i < 20; ++i) {
    auto s = a->Send(*ep, 2 + i, Filled(*a, 1 << 20, 5), 1 << 20, deadline);
    auto got = s->Wait(deadline + absl::Seconds(2));
    if (!got.ok()) {
      EXPECT_TRUE(got.status().code() == absl::StatusCode::kUnavailable ||
                  got.status().code() == absl::StatusCode::kDeadlineExceeded)
          << got.status();
      ++failed;
      break;
    }
  }
  EXPECT_EQ(failed, 1) << "a 1 MiB send to a destroyed peer must not succeed";
  EXPECT_LT(absl::Now(), deadline + absl::Seconds(3));
  // Sends that never matched a receive (rendezvous) are failed, not left holding buffers.
  for (int i = 0; i < 100 && a->transfers_in_flight() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(a->transfers_in_flight(), 0);
}

// Peers that say hello and go away one after another, as attention nodes that restart do. UCX
// releases the endpoint it made for a peer that is gone and may make the next peer's at the
// same address; every hello must still get an endpoint id of its own, answerable after the
// previous peer's id is let go (what the shard does when a node reconnects under its name).
// The CI run of 2026-12-04 lost a hello's acknowledgement to the id of a peer that was gone.
TEST(UcxWorker, EveryHelloGetsAnEndpointOfItsOwnWhenUcxReusesOne) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto b = MakeWorker("tcp", "shard");
  ASSERT_NE(b, nullptr);
  std::mutex mu;
  std::vector<std::pair<std::string, uint64_t>> hellos;  // (hello, endpoint id)
  b->OnHello([&](std::string_view hello, uint64_t from, const UcxLanes&) {
    std::lock_guard<std::mutex> lock(mu);
    hellos.emplace_back(std::string(hello), from);
  });
  const absl::Time end = absl::Now() + absl::Seconds(20);
  int rounds = 0, answered = 0;
  uint64_t previous = 0;
  std::vector<uint64_t> ids;
  // Bounded in count and time; stops early once UCX has reused an endpoint 3 times.
  for (; rounds < 60 && absl::Now() < end && b->reply_endpoints_reused() < 3; ++rounds) {
    auto a = MakeWorker("tcp", absl::StrCat("node-", rounds));
    ASSERT_NE(a, nullptr);
    auto ep = a->Connect(b->address(), nullptr);
    ASSERT_TRUE(ep.ok()) << ep.status();
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    auto in = a->Buffer(64);
    ASSERT_TRUE(in.ok());
    auto ack = a->RecvAny(1000 + rounds, *in, deadline);
    const std::string hello = absl::StrCat("peer ", rounds);
    ASSERT_TRUE(a->SendHello(*ep, hello, deadline)->Wait(deadline).ok());
    uint64_t from = 0;
    for (int i = 0; i < 500 && from == 0; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!hellos.empty() && hellos.back().first == hello) from = hellos.back().second;
      }
      if (from == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ASSERT_NE(from, 0u) << hello << " never arrived";
    ids.push_back(from);
    // The previous peer's endpoint is let go, then this peer is answered on its own.
    if (previous != 0) b->Disconnect(previous);
    previous = from;
    auto sent =
        b->Send(from, 1000 + rounds, Filled(*b, 64, static_cast<uint8_t>(rounds)), 64, deadline);
    auto got = ack->Wait(deadline);
    EXPECT_TRUE(got.ok()) << hello << ": " << got.status();
    if (got.ok()) {
      ++answered;
      EXPECT_EQ((*in)->data()[5], static_cast<uint8_t>(rounds + 5 * 7));
    }
    (void)sent->Wait(deadline);
    a.reset();  // the peer goes away; UCX may release the endpoint it made for it
  }
  EXPECT_EQ(answered, rounds);
  std::vector<uint64_t> sorted = ids;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::unique(sorted.begin(), sorted.end()), sorted.end()) << "an endpoint id was reused";
  std::printf("%d peers, UCX reused an endpoint %lld times\n", rounds,
              static_cast<long long>(b->reply_endpoints_reused()));
}

// Flow control: with a 1 MiB window, 8 MiB of 1 MiB chunks to one endpoint all arrive, in
// order of their tags, while no more than the window is ever started at once (the receiver
// posts late, so every chunk waits for it).
TEST(UcxWorker, AWindowBoundsTheBytesInFlightAndEveryChunkArrives) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  UcxOptions o;
  o.tls = "posix";
  o.chunk_bytes = 1 << 20;
  o.max_bytes_in_flight = 1 << 20;
  auto a = UcxWorker::Create(o);
  auto b = UcxWorker::Create(o);
  ASSERT_TRUE(a.ok() && b.ok());
  auto ep = (*a)->Connect((*b)->address(), nullptr);
  ASSERT_TRUE(ep.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::vector<std::shared_ptr<UcxBuffer>> outs;
  std::vector<std::shared_ptr<UcxTransfer>> sends;
  for (int i = 0; i < 2; ++i) {
    outs.push_back(Filled(**a, 4 << 20, static_cast<uint8_t>(i)));
    sends.push_back((*a)->Send(*ep, 1000 * (i + 1), outs.back(), 4 << 20, deadline));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(sends[1]->done()) << "the second payload went past the window";
  for (int i = 0; i < 2; ++i) {
    auto in = (*b)->Buffer(4 << 20);
    ASSERT_TRUE(in.ok());
    auto n = (*b)->Recv(1000 * (i + 1), *in, 4 << 20, deadline)->Wait(deadline);
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(std::memcmp(outs[i]->data(), (*in)->data(), 4 << 20), 0) << "payload " << i;
  }
  for (auto& s : sends) EXPECT_TRUE(s->Wait(deadline).ok());
}

// A shared-memory endpoint has no peer error handling in UCX 1.13: a send to a destroyed peer
// fails (UNAVAILABLE when UCX sees the segment gone, else DEADLINE_EXCEEDED at its deadline,
// abandoned with its buffer held until UCX lets go); it never hangs, never crashes.
TEST(UcxWorker, ASendToADeadSharedMemoryPeerEndsAtItsDeadline) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto a = MakeWorker("posix", "a");
  auto b = MakeWorker("posix", "b");
  ASSERT_NE(b, nullptr);
  auto ep = a->Connect(b->address(), nullptr);
  ASSERT_TRUE(ep.ok());
  b.reset();
  const absl::Time t0 = absl::Now();
  auto s = a->Send(*ep, 3, Filled(*a, 4 << 20, 1), 4 << 20, t0 + absl::Milliseconds(300));
  auto got = s->Wait(t0 + absl::Seconds(5));
  EXPECT_TRUE(got.status().code() == absl::StatusCode::kDeadlineExceeded ||
              got.status().code() == absl::StatusCode::kUnavailable)
      << got.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
  EXPECT_EQ(a->transfers_in_flight(), 0);
}

TEST(UcxLanes, ParsedFromUcxsOwnReport) {
  // Captured from ucp_ep_print_info of Debian's UCX 1.13.1 on this machine kind.
  const std::string shm_tcp =
      "# UCP endpoint\n#               peer: <no debug data>\n"
      "#                 lane[0]:  2:posix/memory.0 md[1]          -> md[1]/posix/sysdev[255] am "
      "am_bw#0\n"
      "#                 lane[1]:  0:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] "
      "rma_bw#0\n"
      "#                tag_send: 0..<egr/short>..93..<egr/bcopy>..8256..<rndv>..(inf)\n";
  const std::string sysv_cma =
      "#                 lane[0]:  2:sysv/memory.0 md[1]           -> md[1]/sysv/sysdev[255] am "
      "am_bw#0\n"
      "#                 lane[1]:  4:cma/memory.0 md[3]            -> md[3]/cma/sysdev[255] "
      "rma_bw#0\n";
  const std::string tcp =
      "#                 lane[0]:  0:tcp/lo.0 md[0]                -> md[0]/tcp/sysdev[255] am "
      "am_bw#0 keepalive wireup\n";
  const std::string verbs =
      "#                 lane[0]:  1:rc_mlx5/mlx5_0:1 md[1]        -> md[1]/ib am am_bw#0\n"
      "#                 lane[1]:  3:ud_verbs/mlx5_0:1 md[1]       -> md[1]/ib wireup\n";
  struct Case {
    std::string text, kind, describe;
  };
  for (const Case& c :
       {Case{shm_tcp, "mixed", "mixed (posix, tcp)"}, Case{sysv_cma, "shm", "shm (sysv, cma)"},
        Case{tcp, "tcp", "tcp"}, Case{verbs, "rdma", "rdma (rc_mlx5, ud_verbs)"},
        Case{"", "none", "none"}, Case{"lane[0]: x:posix/ lane[1]:  2:/x\n", "none", "none"}}) {
    const UcxLanes l = ParseUcxLanes(c.text);
    EXPECT_EQ(l.kind, c.kind) << c.text;
    EXPECT_EQ(l.Describe(), c.describe) << c.text;
  }
  EXPECT_STREQ(TransportClass("rcx"), "other");
  EXPECT_STREQ(TransportClass("dc_mlx5"), "rdma");
}

TEST(Hello, RoundTripsAndRefusesAnythingElse) {
  const std::string secret(kHelloSecretBytes, 's');
  const std::string h = EncodeHello({0x0102030405060708ull, secret});
  ASSERT_EQ(h.size(), kHelloBytes);
  auto back = ParseHello(h);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->client_id, 0x0102030405060708ull);
  EXPECT_EQ(back->secret, secret);
  EXPECT_FALSE(ParseHello(h.substr(1)).ok());
  EXPECT_FALSE(ParseHello(h + "x").ok());
  std::string bad = h;
  bad[4] = 2;  // version
  EXPECT_FALSE(ParseHello(bad).ok());
  bad = h;
  bad[0] = 'X';
  EXPECT_FALSE(ParseHello(bad).ok());
}

// RDMA verbs (rc, ud, dc) need an InfiniBand or RoCE device; where there is none, say so.
TEST(UcxWorker, RdmaVerbsWhereADeviceExists) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  UcxOptions o;
  o.tls = "rc,ud";
  auto a = UcxWorker::Create(o);
  if (!a.ok()) GTEST_SKIP() << "no RDMA verbs device on this machine: " << a.status();
  auto b = UcxWorker::Create(o);
  ASSERT_TRUE(b.ok()) << b.status();
  auto ep = (*a)->Connect((*b)->address(), nullptr);
  ASSERT_TRUE(ep.ok()) << ep.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto in = (*b)->Buffer(1 << 20);
  auto r = (*b)->Recv(5, *in, 1 << 20, deadline);
  auto out = Filled(**a, 1 << 20, 9);
  ASSERT_TRUE((*a)->Send(*ep, 5, out, 1 << 20, deadline)->Wait(deadline).ok());
  ASSERT_TRUE(r->Wait(deadline).ok());
  EXPECT_EQ(std::memcmp(out->data(), (*in)->data(), 1 << 20), 0);
}

}  // namespace
}  // namespace moe::dataplane
