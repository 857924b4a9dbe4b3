// The UCX worker on its own, per transport: two workers of this process talk over the transports
// UCX_TLS can pick here (posix and sysv shared memory, TCP on loopback): the lane UCX selected,
// tagged messages, buffer reuse, batch messages, strange messages, each checked by what comes
// out (bytes, codes, counts). Deadlines, failed peers and reuse: ucx_worker_peers_test.cc.
#include "services/dataplane/ucx_worker.h"

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
#include "tests/dataplane/ucx_test_util.h"

namespace moe::dataplane {
namespace {

using testing::Filled;
using testing::MakeWorker;
using testing::TokenHeader;

// UCX_TLS and the lane kind UCX must then really select (read from UCX): shared memory only
// without peer error handling (UCX 1.13), so "posix,tcp" puts the rendezvous lanes on TCP and
// the worker falls back to an all-TCP endpoint with peer error handling.
struct Lane {
  std::string tls, kind;
};
class UcxTransports : public ::testing::TestWithParam<Lane> {};

TEST_P(UcxTransports, TheLaneIsTheOneUcxSelected) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto a = MakeWorker(GetParam().tls, "a");
  auto b = MakeWorker(GetParam().tls, "b");
  ASSERT_NE(b, nullptr);
  auto ep = a->Connect(b->address(), nullptr);
  ASSERT_TRUE(ep.ok()) << ep.status();
  auto lanes = a->Lanes(*ep);
  ASSERT_TRUE(lanes.ok()) << lanes.status();
  EXPECT_EQ(lanes->kind, GetParam().kind) << lanes->Describe();
  // The other side sees the same lanes on the endpoint UCX made for our hello.
  std::atomic<uint64_t> hello_ep{0};
  std::string seen_lanes, seen_hello;
  std::mutex mu;
  b->OnHello([&](std::string_view hello, uint64_t from, const UcxLanes& l) {
    std::lock_guard<std::mutex> lock(mu);
    seen_hello = std::string(hello);
    seen_lanes = l.kind;
    hello_ep.store(from);
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  ASSERT_TRUE(a->SendHello(*ep, "hello there", deadline)->Wait(deadline).ok());
  for (int i = 0; i < 200 && hello_ep.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_NE(hello_ep.load(), 0u);
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(seen_hello, "hello there");
    EXPECT_EQ(seen_lanes, GetParam().kind);
  }
  // And can answer on it, chunked: 3 MiB + 5 in 1 MiB chunks.
  auto in = a->Buffer((3 << 20) + 5);
  ASSERT_TRUE(in.ok());
  auto r = a->Recv(77, *in, (3 << 20) + 5, deadline, nullptr, 1 << 20);
  auto out = Filled(*b, (3 << 20) + 5, 4);
  ASSERT_TRUE(b->Send(hello_ep.load(), 77, out, (3 << 20) + 5, deadline, nullptr, 1 << 20)
                  ->Wait(deadline)
                  .ok());
  auto n = r->Wait(deadline);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, size_t{(3 << 20) + 5});
  EXPECT_EQ(std::memcmp(out->data(), (*in)->data(), (3 << 20) + 5), 0);
}

TEST_P(UcxTransports, TaggedMessagesArriveWholeAndMatchTheirTags) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto a = MakeWorker(GetParam().tls, "a");
  auto b = MakeWorker(GetParam().tls, "b");
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
    auto recv = b->Recv(100 + j, *buf, sizes[j], deadline);
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
  auto a = MakeWorker(GetParam().tls, "a");
  auto b = MakeWorker(GetParam().tls, "b");
  ASSERT_NE(b, nullptr);
  auto ep = a->Connect(b->address(), nullptr);
  ASSERT_TRUE(ep.ok());
  for (int i = 0; i < 50; ++i) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    auto out = Filled(*a, 200000, static_cast<uint8_t>(i));
    auto in = b->Buffer(200000);
    ASSERT_TRUE(in.ok());
    auto r = b->Recv(i, *in, 200000, deadline);
    auto s = a->Send(*ep, i, out, 200000, deadline);
    ASSERT_TRUE(r->Wait(deadline).ok());
    ASSERT_TRUE(s->Wait(deadline).ok());
    EXPECT_EQ(std::memcmp(out->data(), (*in)->data(), 200000), 0);
  }
  // One buffer per side in use at a time: the pool hands the same ones back.
  EXPECT_LE(a->buffers_registered(), 2);
  EXPECT_LE(b->buffers_registered(), 2);
}

// A batch as one active message each way: the request lands where the server's handler says, the
// reply in the buffer the client expected it in (by token), each with its header; eager and
// rendezvous sizes; the client waits by polling the worker itself (Await), and the round trip
// comes back bit-exact.
TEST_P(UcxTransports, ABatchIsOneMessageEachWayAndItsReplyFindsItsToken) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto client = MakeWorker(GetParam().tls, "client");
  auto server = MakeWorker(GetParam().tls, "server");
  ASSERT_NE(client, nullptr);
  ASSERT_NE(server, nullptr);
  // The server echoes each request's payload plus one to the client's endpoint, with the
  // request's header (whose first 8 bytes are the token) as the reply's header.
  auto back = server->Connect(client->address(), nullptr);
  ASSERT_TRUE(back.ok()) << back.status();
  std::atomic<int> requests{0};
  UcxWorker* srv = server.get();
  const uint64_t back_ep = *back;
  server->OnMessage([&, srv, back_ep](std::string_view header, size_t length) {
    UcxWorker::MessageSink sink;
    auto buf = srv->Buffer(length);
    if (!buf.ok()) return sink;
    sink.buffer = *buf;
    sink.done = [srv, back_ep, &requests, buf = *buf, h = std::string(header)](
                    const absl::Status& s, size_t n) {
      if (!s.ok()) return;
      requests.fetch_add(1);
      for (size_t i = 0; i < n; ++i) buf->data()[i] = static_cast<uint8_t>(buf->data()[i] + 1);
      (void)srv->SendMessage(back_ep, UcxWorker::Message::kReply, h, buf, n,
                             absl::Now() + absl::Seconds(10));
    };
    return sink;
  });
  auto ep = client->Connect(server->address(), nullptr);
  ASSERT_TRUE(ep.ok()) << ep.status();
  const std::vector<size_t> sizes = {0, 1, 7168, 200000, (3 << 20) + 5};
  for (size_t k = 0; k < sizes.size(); ++k) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    const size_t n = sizes[k];
    auto reply_buf = client->Buffer(std::max<size_t>(n, 1));
    ASSERT_TRUE(reply_buf.ok());
    const uint64_t token = 0x1234567890abcdefULL + k;
    const std::string header = TokenHeader(token) + std::string(8, 'x');
    auto got = client->ExpectMessage(token, *reply_buf, deadline);
    auto sent = client->SendMessage(
        *ep, UcxWorker::Message::kRequest, header,
        Filled(*client, std::max<size_t>(n, 1), static_cast<uint8_t>(k)), n, deadline);
    auto len = client->Await(*got, deadline, std::chrono::microseconds(200));
    ASSERT_TRUE(len.ok()) << "size " << n << ": " << len.status();
    EXPECT_EQ(*len, n);
    EXPECT_EQ(got->header(), header);
    size_t wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      wrong += (*reply_buf)->data()[i] != static_cast<uint8_t>(k + i * 7 + 1);
    }
    EXPECT_EQ(wrong, 0u) << "size " << n;
    EXPECT_TRUE(client->Await(*sent, deadline, std::chrono::microseconds(0)).ok());
  }
  EXPECT_EQ(requests.load(), static_cast<int>(sizes.size()));
  EXPECT_EQ(client->messages_dropped(), 0);
  EXPECT_EQ(server->messages_dropped(), 0);
}

// What the batch ids refuse: a reply whose token nobody expects (or that came after its
// deadline) is dropped and counted; one longer than the expected buffer fails that transfer
// INTERNAL without an overrun; a request without a handler is dropped; a header over the limit
// never leaves.
TEST_P(UcxTransports, StrangeBatchMessagesAreDroppedOrFailTheirOwnTransferOnly) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto a = MakeWorker(GetParam().tls, "a");
  auto b = MakeWorker(GetParam().tls, "b");
  ASSERT_NE(b, nullptr);
  auto ep = a->Connect(b->address(), nullptr);
  ASSERT_TRUE(ep.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto payload = Filled(*a, 200000, 3);
  // Unknown token, and a request to a worker without a handler.
  EXPECT_TRUE(
      a->SendMessage(*ep, UcxWorker::Message::kReply, TokenHeader(77), payload, 100, deadline)
          ->Wait(deadline)
          .ok());
  EXPECT_TRUE(
      a->SendMessage(*ep, UcxWorker::Message::kRequest, TokenHeader(78), payload, 100000, deadline)
          ->Wait(deadline)
          .ok());
  // Longer than the buffer it was expected in (eager and rendezvous); the guard past the
  // buffer's capacity stays untouched.
  for (size_t n : {size_t{5000}, size_t{150000}}) {
    auto small = b->Buffer(4096);
    ASSERT_TRUE(small.ok());
    std::memset((*small)->data(), 0xee, (*small)->capacity());
    auto got = b->ExpectMessage(1000 + n, *small, deadline);
    (void)a->SendMessage(*ep, UcxWorker::Message::kReply, TokenHeader(1000 + n), payload, n,
                         deadline);
    auto r = got->Wait(deadline);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  }
  // A reply expected until a deadline that passed: DEADLINE_EXCEEDED, and the late one dropped.
  auto late_buf = b->Buffer(4096);
  auto late = b->ExpectMessage(5, *late_buf, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(late->Wait(deadline).status().code(), absl::StatusCode::kDeadlineExceeded);
  (void)a->SendMessage(*ep, UcxWorker::Message::kReply, TokenHeader(5), payload, 10, deadline)
      ->Wait(deadline);
  auto big = a->SendMessage(*ep, UcxWorker::Message::kRequest, std::string(257, 'h'), payload, 1,
                            deadline);
  EXPECT_EQ(big->Wait(deadline).status().code(), absl::StatusCode::kInvalidArgument);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (b->messages_dropped() < 3 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(b->messages_dropped(), 3);  // unknown token, no handler, late
  // Bytes at an offset past the buffer's end, or running past it: refused before UCX sees them.
  const size_t cap = payload->capacity();
  for (auto [offset, bytes] : {std::pair<size_t, size_t>{cap + 1, 0}, {cap - 10, 11}, {1, cap}}) {
    auto outside = a->SendMessage(*ep, UcxWorker::Message::kReply, TokenHeader(11), payload, bytes,
                                  deadline, nullptr, offset);
    EXPECT_EQ(outside->Wait(deadline).status().code(), absl::StatusCode::kInvalidArgument)
        << offset << " + " << bytes;
  }
  // The worker still delivers an honest reply, from the start of a buffer and from an offset.
  for (size_t offset : {size_t{0}, size_t{12345}}) {
    auto ok_buf = b->Buffer(4096);
    auto ok = b->ExpectMessage(9 + offset, *ok_buf, deadline);
    (void)a->SendMessage(*ep, UcxWorker::Message::kReply, TokenHeader(9 + offset), payload, 4000,
                         deadline, nullptr, offset);
    auto n = b->Await(*ok, deadline, std::chrono::microseconds(100));
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(*n, 4000u);
    EXPECT_EQ(std::memcmp((*ok_buf)->data(), payload->data() + offset, 4000), 0) << offset;
  }
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxTransports,
                         ::testing::Values(Lane{"posix", "shm"}, Lane{"sysv", "shm"},
                                           Lane{"posix,tcp", "tcp"}, Lane{"tcp", "tcp"}),
                         [](const auto& info) {
                           std::string name = info.param.tls;
                           for (char& c : name) c = c == ',' ? '_' : c;
                           return name;
                         });

}  // namespace
}  // namespace moe::dataplane
