// No active message from a stranger stops a UCX worker (issue: the data plane, third
// generation). UCX 1.13.1 reads its AM handler table without a bounds check: an active message
// on id 65535, or on any id past about 17,000, crashed the process that received it (SIGSEGV in
// ucp_am_handler, on UCX's progress thread), before any code of ours ran, with no credential
// needed. Here a raw UCP peer (tests/dataplane/raw_ucp_peer.h, none of the project's code)
// sends every id 0..65535, with and without the reply flag, some with data, to the worker both
// services run (expert-svc's shard end and attention-svc's client end are this class); the
// worker must count every one as dropped and still carry a tagged message bit for bit after.
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <set>
#include <string>
#include <thread>

#include "services/dataplane/net_interface.h"
#include "services/dataplane/ucx_worker.h"
#include "tests/common/listening_sockets.h"
#include "tests/dataplane/raw_ucp_peer.h"

namespace moe::dataplane {
namespace {

class StrayActiveMessages : public ::testing::TestWithParam<std::string> {};

TEST_P(StrayActiveMessages, EveryIdWithAndWithoutReplyIsDroppedAndCounted) {
  UcxOptions o;
  o.tls = GetParam();
  o.name = "victim";
  auto victim = UcxWorker::Create(o);
  ASSERT_TRUE(victim.ok()) << victim.status();
  // A peer on shared memory reaches the victim only with the victim's FIFO shape (UCX writes into
  // a peer's FIFO with its own): a hostile one that wants its bytes read uses it too.
  const std::string fifo = (*victim)->shared_memory_fifo();
  const size_t x = fifo.find('x');
  ASSERT_NE(x, std::string::npos) << fifo;
  setenv("UCX_POSIX_FIFO_SIZE", fifo.substr(0, x).c_str(), 1);
  setenv("UCX_POSIX_SEG_SIZE", fifo.substr(x + 1).c_str(), 1);
  moe::testing::RawUcpPeer peer(GetParam());
  unsetenv("UCX_POSIX_FIFO_SIZE");
  unsetenv("UCX_POSIX_SEG_SIZE");
  ASSERT_TRUE(peer.Connect((*victim)->address()));

  constexpr int kIds = 65536;
  const std::string header(8, 'h'), data(70000, 'd');  // data past the eager size: rendezvous
  const int sent = peer.SendEveryId(header, data, 4096, 7, std::chrono::seconds(120));
  ASSERT_EQ(sent, 2 * kIds) << "the victim stopped taking messages";
  // The hello id's two messages are hellos without a handler (this worker has none): dropped as
  // hellos; the batch ids' four are messages nobody expects (no request handler, no reply
  // token): dropped as messages; every other id's as strays.
  const int64_t want_stray = 2 * (kIds - 3);
  const auto wait_until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((*victim)->stray_messages_dropped() < want_stray &&
         std::chrono::steady_clock::now() < wait_until) {
    peer.Progress();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ((*victim)->stray_messages_dropped(), want_stray);
  EXPECT_EQ((*victim)->hellos_dropped(), 2);
  EXPECT_EQ((*victim)->messages_dropped(), 4);

  // The worker still carries a tagged message from an honest peer, bit for bit.
  auto honest = UcxWorker::Create(o);
  ASSERT_TRUE(honest.ok()) << honest.status();
  auto ep = (*honest)->Connect((*victim)->address(), nullptr);
  ASSERT_TRUE(ep.ok()) << ep.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  constexpr size_t kBytes = 100000;
  auto out = (*honest)->Buffer(kBytes);
  auto in = (*victim)->Buffer(kBytes);
  ASSERT_TRUE(out.ok() && in.ok());
  for (size_t i = 0; i < kBytes; ++i) (*out)->data()[i] = static_cast<uint8_t>(i * 13 + 5);
  auto recv = (*victim)->Recv(42, *in, kBytes, deadline);
  auto send = (*honest)->Send(*ep, 42, *out, kBytes, deadline);
  auto n = recv->Wait(deadline);
  ASSERT_TRUE(n.ok()) << n.status();
  ASSERT_EQ(*n, kBytes);
  EXPECT_EQ(0, std::memcmp((*in)->data(), (*out)->data(), kBytes));
  EXPECT_TRUE(send->Wait(deadline).ok());
}

INSTANTIATE_TEST_SUITE_P(Tls, StrayActiveMessages, ::testing::Values("tcp", "posix"),
                         [](const auto& info) { return info.param; });

// UCX's TCP transport listens on every interface unless told otherwise; a worker given the
// service's address listens only on the interface that holds it (read from the kernel).
TEST(UcxBinding, TcpListensOnlyOnTheInterfaceOfTheServicesAddress) {
  const auto before = moe::testing::ListeningSockets(getpid());
  UcxOptions o;
  o.tls = "tcp";
  o.bind_host = "127.0.0.1";
  auto bound = UcxWorker::Create(o);
  ASSERT_TRUE(bound.ok()) << bound.status();
  const auto after = moe::testing::ListeningSockets(getpid());
  ASSERT_GT(after.size(), before.size()) << "UCX's TCP transport opened no listening socket";
  for (const auto& s : after) EXPECT_TRUE(s.loopback) << s.address << " is not loopback";
  bound->reset();

  // Without the address UCX listens on every interface: where this machine has one besides
  // loopback, a socket on it shows that the check above can fail.
  bool other_interface = false;
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
      other_interface |= i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET &&
                         (i->ifa_flags & IFF_LOOPBACK) == 0 && (i->ifa_flags & IFF_UP) != 0;
    }
    freeifaddrs(ifs);
  }
  if (!other_interface) GTEST_SKIP() << "no interface but loopback: the unbound case shows nothing";
  o.bind_host = "";
  auto unbound = UcxWorker::Create(o);
  ASSERT_TRUE(unbound.ok()) << unbound.status();
  int elsewhere = 0;
  for (const auto& s : moe::testing::ListeningSockets(getpid())) elsewhere += !s.loopback;
  EXPECT_GT(elsewhere, 0) << "UCX's default no longer listens beyond loopback here";
}

// The chart fixes the ports UCX's TCP transport listens on (UCX_TCP_PORT_RANGE, dataPlane.tcpPorts)
// so that its NetworkPolicies can name them: read from the kernel, the worker's new listening
// sockets are all inside the range.
TEST(UcxBinding, TcpListensInThePortRangeItIsGiven) {
  auto ports = [] {
    std::set<int> out;
    for (const auto& s : moe::testing::ListeningSockets(getpid())) {
      out.insert(std::stoi(s.address.substr(s.address.rfind(':') + 1)));
    }
    return out;
  };
  const std::set<int> before = ports();
  ASSERT_EQ(setenv("UCX_TCP_PORT_RANGE", "23450-23469", 1), 0);
  UcxOptions o;
  o.tls = "tcp";
  o.bind_host = "127.0.0.1";
  auto w = UcxWorker::Create(o);
  unsetenv("UCX_TCP_PORT_RANGE");
  ASSERT_TRUE(w.ok()) << w.status();
  int opened = 0;
  for (int port : ports()) {
    if (before.count(port) != 0) continue;
    ++opened;
    EXPECT_GE(port, 23450);
    EXPECT_LE(port, 23469);
  }
  EXPECT_GT(opened, 0) << "UCX's TCP transport opened no listening socket";
}

TEST(UcxBinding, TheInterfaceOfAnAddress) {
  EXPECT_EQ(*InterfaceOf("127.0.0.1"), "lo");
  EXPECT_EQ(*InterfaceOf("127.0.0.2"), "lo");  // inside lo's 127.0.0.0/8
  EXPECT_EQ(*InterfaceOf("localhost"), "lo");
  for (const char* wildcard : {"", "0.0.0.0", "::", "[::]"}) {
    EXPECT_EQ(*InterfaceOf(wildcard), "") << wildcard;
  }
  // TEST-NET-3 (RFC 5737): held by no interface; nothing is sent, the name is only compared.
  const auto none = InterfaceOf("203.0.113.7");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("not an address of any interface"), std::string::npos);
  UcxOptions o;
  o.tls = "tcp";
  o.bind_host = "203.0.113.7";
  EXPECT_EQ(UcxWorker::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(UcxVersion, IsTheOneThisProjectTested) {
  // Debian 12's libucx0; another version may mis-dispatch differently (the services log a
  // warning at start when CheckUcxVersion() is not OK).
  EXPECT_TRUE(CheckUcxVersion().ok()) << CheckUcxVersion();
  EXPECT_EQ(UcxVersion().rfind("1.13.", 0), 0u) << UcxVersion();
}

}  // namespace
}  // namespace moe::dataplane
