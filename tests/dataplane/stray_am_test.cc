// No active message from a stranger stops a UCX worker (issue: the data plane, third
// generation). UCX 1.13.1 reads its AM handler table without a bounds check: an active message
// on id 65535, or on any id past about 17,000, crashed the process that received it (SIGSEGV in
// ucp_am_handler, on UCX's progress thread), before any code of ours ran, with no credential
// needed. Here a raw UCP peer (tests/dataplane/raw_ucp_peer.h, none of the project's code)
// sends every id 0..65535, with and without the reply flag, some with data, to the worker both
// services run (expert-svc's shard end and attention-svc's client end are this class); the
// worker must count every one as dropped and still carry a tagged message bit for bit after.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "services/dataplane/ucx_worker.h"
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
  moe::testing::RawUcpPeer peer(GetParam());
  ASSERT_TRUE(peer.Connect((*victim)->address()));

  constexpr int kIds = 65536;
  const std::string header(8, 'h'), data(70000, 'd');  // data past the eager size: rendezvous
  int sent = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (int reply = 0; reply < 2; ++reply) {
    for (int id = 0; id < kIds && std::chrono::steady_clock::now() < until; ++id) {
      const bool with_data = id % 4096 == 7;
      sent += peer.SendAm(static_cast<unsigned>(id), reply == 1, header, with_data ? data : "");
    }
  }
  ASSERT_EQ(sent, 2 * kIds) << "the victim stopped taking messages";
  // The hello id's two messages are hellos without a handler (this worker has none): dropped as
  // hellos; every other id's as strays.
  const int64_t want_stray = 2 * (kIds - 1);
  const auto wait_until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((*victim)->stray_messages_dropped() < want_stray &&
         std::chrono::steady_clock::now() < wait_until) {
    peer.Progress();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ((*victim)->stray_messages_dropped(), want_stray);
  EXPECT_EQ((*victim)->hellos_dropped(), 2);

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

TEST(UcxVersion, IsTheOneThisProjectTested) {
  // Debian 12's libucx0; another version may mis-dispatch differently (the services log a
  // warning at start when UcxVersionTested() is false).
  EXPECT_TRUE(UcxVersionTested()) << UcxVersion();
  EXPECT_EQ(UcxVersion().rfind("1.13.", 0), 0u) << UcxVersion();
}

}  // namespace
}  // namespace moe::dataplane
