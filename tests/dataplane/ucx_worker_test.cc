// The UCX worker on its own: two workers of this process talk over the transports UCX_TLS can
// pick here (posix and sysv shared memory, TCP on loopback); deadlines, truncation, a failed peer
// and buffer reuse, each checked by what comes out (bytes, codes, counts).
#include "services/dataplane/ucx_worker.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace moe::dataplane {
namespace {

std::unique_ptr<UcxWorker> MakeWorker(const std::string& tls, const std::string& name) {
  UcxOptions o;
  o.name = name;
  o.tls = tls;
  auto w = UcxWorker::Create(o);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : nullptr;
}

std::shared_ptr<UcxBuffer> Filled(UcxWorker& w, size_t bytes, uint8_t seed) {
  auto b = w.Buffer(bytes);
  EXPECT_TRUE(b.ok()) << b.status();
  for (size_t i = 0; i < bytes; ++i) (*b)->data()[i] = static_cast<uint8_t>(seed + i * 7);
  return *b;
}

class UcxTransports : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxTransports, TaggedMessagesArriveWholeAndMatchTheirTags) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto a = MakeWorker(GetParam(), "a");
  auto b = MakeWorker(GetParam(), "b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto ep = a->Connect(b->address(), nullptr);
  ASSERT_TRUE(ep.ok()) << ep.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  // Small (eager) and large (rendezvous) messages; received in the reverse order of sending.
  const std::vector<size_t> sizes = {1, 7168, 1 << 20, (3 << 20) + 5};
  std::vector<std::shared_ptr<UcxTransfer>> sends;
  for (size_t i = 0; i < sizes.size(); ++i) {
    sends.push_back(
        a->Send(*ep, 100 + i, Filled(*a, sizes[i], static_cast<uint8_t>(i)), sizes[i], deadline));
  }
  for (size_t j = sizes.size(); j-- > 0;) {
    auto buf = b->Buffer(sizes[j]);
    ASSERT_TRUE(buf.ok());
    auto recv = b->Recv(100 + j, *buf, deadline);
    auto n = recv->Wait(deadline);
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(*n, sizes[j]);
    size_t wrong = 0;
    for (size_t i = 0; i < sizes[j]; ++i) {
      wrong += (*buf)->data()[i] != static_cast<uint8_t>(j + i * 7);
    }
    EXPECT_EQ(wrong, 0u) << "message " << j;
  }
  for (auto& s : sends) EXPECT_TRUE(s->Wait(deadline).ok());
  EXPECT_EQ(a->transfers_in_flight(), 0);
  EXPECT_EQ(b->transfers_in_flight(), 0);
}

TEST_P(UcxTransports, BuffersAreRegisteredOnceAndReused) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto a = MakeWorker(GetParam(), "a");
  auto b = MakeWorker(GetParam(), "b");
  ASSERT_NE(b, nullptr);
  auto ep = a->Connect(b->address(), nullptr);
  ASSERT_TRUE(ep.ok());
  for (int i = 0; i < 50; ++i) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    auto out = Filled(*a, 200000, static_cast<uint8_t>(i));
    auto in = b->Buffer(200000);
    ASSERT_TRUE(in.ok());
    auto r = b->Recv(i, *in, deadline);
    auto s = a->Send(*ep, i, out, 200000, deadline);
    ASSERT_TRUE(r->Wait(deadline).ok());
    ASSERT_TRUE(s->Wait(deadline).ok());
    EXPECT_EQ(std::memcmp(out->data(), (*in)->data(), 200000), 0);
  }
  // One buffer per side in use at a time: the pool hands the same ones back.
  EXPECT_LE(a->buffers_registered(), 2);
  EXPECT_LE(b->buffers_registered(), 2);
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxTransports, ::testing::Values("posix,tcp", "sysv,tcp", "tcp"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) c = c == ',' ? '_' : c;
                           return name;
                         });

TEST(UcxWorker, AReceiveNobodySendsEndsAtItsDeadline) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto a = MakeWorker("tcp", "a");
  ASSERT_NE(a, nullptr);
  auto buf = a->Buffer(4096);
  ASSERT_TRUE(buf.ok());
  const absl::Time t0 = absl::Now();
  auto r = a->Recv(42, *buf, t0 + absl::Milliseconds(150));
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
  auto r = b->Recv(9, *small, deadline);
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
  auto r = b->Recv(1, *in, deadline);
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
  auto r = (*b)->Recv(5, *in, deadline);
  auto out = Filled(**a, 1 << 20, 9);
  ASSERT_TRUE((*a)->Send(*ep, 5, out, 1 << 20, deadline)->Wait(deadline).ok());
  ASSERT_TRUE(r->Wait(deadline).ok());
  EXPECT_EQ(std::memcmp(out->data(), (*in)->data(), 1 << 20), 0);
}

}  // namespace
}  // namespace moe::dataplane
