// Who runs a batch's round trip (services/dataplane/ucx_worker.h, PollUntil): while the client's
// caller and the server's compute thread poll the worker themselves, a round trip wakes neither
// progress thread (counted from the kernel: the voluntary context switches of every
// "ucx-progress" thread in /proc/self/task); a poller that got what it waited for and does not
// come back leaves the worker to its progress thread after the hand-off grace, so a request
// nobody polls for is still answered.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "services/common/poll_window.h"
#include "services/dataplane/ucx_worker.h"
#include "tests/common/thread_sleeps.h"
#include "tests/dataplane/ucx_test_util.h"

namespace moe::dataplane {
namespace {

using testing::Filled;
using testing::TokenHeader;

// Voluntary context switches (sleeps) of this process's UCX progress threads, summed.
int64_t ProgressThreadSleeps() { return moe::testing::ThreadSleeps("ucx-progress"); }

// A hand-off grace long enough that, on a loaded machine too, no progress thread looks at the
// worker while the round trips run (it looks once per 10 graces, 500 ms, while a thread polls).
constexpr std::chrono::milliseconds kGrace{50};

std::unique_ptr<UcxWorker> Worker(const std::string& tls, const std::string& name,
                                  std::chrono::microseconds spin = {}) {
  UcxOptions o;
  o.name = name;
  o.tls = tls;
  o.handoff_grace = kGrace;
  o.spin = spin;
  auto w = UcxWorker::Create(o);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : nullptr;
}

// An echo server whose compute thread polls the worker between requests, as an expert server's
// does: requests land on whichever thread progresses the worker and are queued; the compute
// thread answers each (payload + 1) while `polling` is on, and only sleeps otherwise.
class PollingEcho {
 public:
  PollingEcho(UcxWorker* w, uint64_t back_ep) : w_(w), back_ep_(back_ep) {
    w_->OnMessage([this](std::string_view header, size_t length) {
      UcxWorker::MessageSink sink;
      auto buf = w_->Buffer(length);
      if (!buf.ok()) return sink;
      sink.buffer = *buf;
      sink.done = [this, buf = *buf, h = std::string(header)](const absl::Status& s, size_t n) {
        if (!s.ok()) return;
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back({h, buf, n, std::chrono::steady_clock::now()});
        queued_.fetch_add(1);
      };
      return sink;
    });
    thread_ = std::thread([this] { Run(); });
  }
  ~PollingEcho() {
    stop_ = true;
    thread_.join();
  }
  std::atomic<bool> polling{true};
  // Each answer leaves this long after its request landed (a compute that takes time).
  std::chrono::microseconds delay{0};

 private:
  struct Request {
    std::string header;
    std::shared_ptr<UcxBuffer> buf;
    size_t n;
    std::chrono::steady_clock::time_point landed;
  };
  void Run() {
    while (!stop_) {
      if (polling) {
        w_->PollUntil(std::chrono::steady_clock::now() + std::chrono::milliseconds(20),
                      [this] { return queued_.load() > 0 || stop_; });
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      std::deque<Request> todo;
      {
        std::lock_guard<std::mutex> lock(mu_);
        todo.swap(queue_);
        queued_.store(0);
      }
      for (Request& r : todo) {
        const auto ready = r.landed + delay;
        while (std::chrono::steady_clock::now() < ready) {
        }
        for (size_t i = 0; i < r.n; ++i)
          r.buf->data()[i] = static_cast<uint8_t>(r.buf->data()[i] + 1);
        (void)w_->SendMessage(back_ep_, UcxWorker::Message::kReply, r.header, r.buf, r.n,
                              absl::Now() + absl::Seconds(10));
      }
    }
  }
  UcxWorker* w_;
  uint64_t back_ep_;
  std::mutex mu_;
  std::deque<Request> queue_;
  std::atomic<int> queued_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A client and a server worker of one lane (both with progress spin `spin`), an endpoint each
// way, and the server's polling echo.
struct EchoPair {
  std::unique_ptr<UcxWorker> client, server;
  uint64_t ep = 0;                    // client -> server
  std::unique_ptr<PollingEcho> echo;  // destroyed first: it uses the server
};
bool MakeEchoPair(const std::string& tls, std::chrono::microseconds spin, EchoPair* p) {
  p->client = Worker(tls, "client", spin);
  p->server = Worker(tls, "server", spin);
  if (p->client == nullptr || p->server == nullptr) return false;
  auto back = p->server->Connect(p->client->address(), nullptr);
  auto ep = p->client->Connect(p->server->address(), nullptr);
  if (!back.ok() || !ep.ok()) return false;
  p->ep = *ep;
  p->echo = std::make_unique<PollingEcho>(p->server.get(), *back);
  return true;
}

class UcxPolling : public ::testing::TestWithParam<std::string> {
 protected:
  // One request of n bytes and its reply, the client polling for up to `spin`; whether the
  // reply came back right.
  bool RoundTrip(UcxWorker& client, uint64_t ep, uint64_t token, size_t n,
                 std::chrono::microseconds spin) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    auto reply = client.Buffer(n);
    if (!reply.ok()) return false;
    auto got = client.ExpectMessage(token, *reply, deadline);
    auto sent = client.SendMessage(ep, UcxWorker::Message::kRequest, TokenHeader(token),
                                   Filled(client, n, static_cast<uint8_t>(token)), n, deadline);
    auto len = client.Await(*got, deadline, spin);
    if (!len.ok() || *len != n || !client.Await(*sent, deadline, spin).ok()) return false;
    for (size_t i = 0; i < n; ++i) {
      if ((*reply)->data()[i] != static_cast<uint8_t>(token + i * 7 + 1)) return false;
    }
    return true;
  }
};

TEST_P(UcxPolling, PolledRoundTripsWakeNoProgressThread) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  EchoPair p;
  ASSERT_TRUE(MakeEchoPair(GetParam(), {}, &p));
  UcxWorker& client = *p.client;
  PollingEcho& echo = *p.echo;
  // Warm: the endpoints' wire-up and the first sleeps are not what is counted.
  for (uint64_t i = 0; i < 20; ++i) {
    ASSERT_TRUE(RoundTrip(client, p.ep, i, 1024, std::chrono::milliseconds(50)));
  }
  // 300 round trips of 1 KiB (eager) and 64 KiB (rendezvous), the caller polling for up to 50
  // ms (a loaded machine may take a poller's core for a while: it still must not be handed off).
  const int64_t before = ProgressThreadSleeps();
  ASSERT_GE(before, 0);
  int ok = 0;
  for (uint64_t i = 0; i < 300; ++i) {
    ok +=
        RoundTrip(client, p.ep, 100 + i, i % 2 == 0 ? 1024 : 65536, std::chrono::milliseconds(50));
  }
  const int64_t sleeps = ProgressThreadSleeps() - before;
  EXPECT_EQ(ok, 300);
  // Woken per message, the two progress threads slept about 4 times per round trip (1,200
  // here); polled, only their periodic look (once per 10 graces) and the server's rare hand-off
  // (20 ms without a request) remain.
  EXPECT_LT(sleeps, 60) << "progress threads slept " << sleeps << " times in 300 round trips";
  std::printf("[polling] %s: progress threads slept %lld times in 300 polled round trips\n",
              GetParam().c_str(), static_cast<long long>(sleeps));
  // The server's compute thread stops polling after its last batch (it got what it waited for,
  // so it was not handed off): its progress thread takes the worker over after the grace and a
  // request nobody polls for is answered; so is one whose client does not poll either.
  echo.polling = false;
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_TRUE(RoundTrip(client, p.ep, 1000, 4096, std::chrono::milliseconds(50)));
  EXPECT_TRUE(RoundTrip(client, p.ep, 1001, 4096, std::chrono::microseconds(0)));
}

// Nobody polls (the server's compute thread sleeps, the client waits without polling): the
// progress threads move every transfer. Without a spin they sleep whenever a step of a round
// trip finds nothing to do (5-9 times per 256 KiB round trip here: its rendezvous fragments,
// the handshakes, the reply); with one longer than the gaps (UcxOptions::spin,
// --ucx_progress_spin_us) about twice per round trip (measured on 2 vCPUs, where the two
// spinning threads and the echo's share the cores).
TEST_P(UcxPolling, ProgressSpinKeepsTheProgressThreadsAwakeBetweenFragments) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto sleeps_in = [&](std::chrono::microseconds spin, int64_t* sleeps) {
    EchoPair p;
    ASSERT_TRUE(MakeEchoPair(GetParam(), spin, &p));
    UcxWorker& client = *p.client;
    PollingEcho& echo = *p.echo;
    echo.polling = false;
    constexpr size_t kBytes = size_t{256} << 10;
    for (uint64_t i = 0; i < 5; ++i) {
      ASSERT_TRUE(RoundTrip(client, p.ep, i, kBytes, std::chrono::microseconds(0)));
    }
    const int64_t before = ProgressThreadSleeps();
    ASSERT_GE(before, 0);
    int ok = 0;
    for (uint64_t i = 0; i < 40; ++i) {
      ok += RoundTrip(client, p.ep, 100 + i, kBytes, std::chrono::microseconds(0));
    }
    *sleeps = ProgressThreadSleeps() - before;
    EXPECT_EQ(ok, 40);
  };
  int64_t without = 0, with = 0;
  sleeps_in(std::chrono::microseconds(0), &without);
  sleeps_in(std::chrono::microseconds(kMaxProgressSpinUs), &with);
  std::printf(
      "[polling] %s: progress threads slept %lld times in 40 round trips of 256 KiB "
      "without a spin, %lld with a %d us one\n",
      GetParam().c_str(), static_cast<long long>(without), static_cast<long long>(with),
      kMaxProgressSpinUs);
  EXPECT_GE(without, 40);
  EXPECT_LT(with * 2, without);
}

// While a thread polls, the progress thread only looks whether one still does, once per 10
// graces (UcxWorkerImpl::SleepWhilePolled): each look is a wake-up on a core a poller may spin on.
// A 600 ms poll with a 2 ms grace woke it 21 times (its first sleep, armed, lasts up to 200 ms);
// with one look per grace 48 times in 300 ms.
TEST_P(UcxPolling, TheProgressThreadLooksRarelyWhileAThreadPolls) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  UcxOptions o;
  o.name = "looks";
  o.tls = GetParam();
  o.handoff_grace = std::chrono::milliseconds(2);
  auto w = UcxWorker::Create(o);
  ASSERT_TRUE(w.ok()) << w.status();
  const int64_t before = ProgressThreadSleeps();
  ASSERT_GE(before, 0);
  (*w)->PollUntil(std::chrono::steady_clock::now() + std::chrono::milliseconds(600),
                  [] { return false; });
  const int64_t looks = ProgressThreadSleeps() - before;
  std::printf("[polling] %s: the progress thread woke %lld times during a 600 ms poll\n",
              GetParam().c_str(), static_cast<long long>(looks));
  EXPECT_LE(looks, 60);
}

// Voluntary context switches (sleeps) of the calling thread.
int64_t ThisThreadSleeps() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_nvcsw;
}

// A caller whose replies take longer than the floor of its poll (services/common/poll_window.h):
// with a fixed window (the ceiling at the floor) it sleeps for nearly every reply; with the
// window learned from its round trips it polls through them (the waiting thread's own sleeps,
// counted by the kernel). Every other reply is awaited with no deadline (absl::InfiniteFuture):
// the poll is bounded by the window alone there.
TEST_P(UcxPolling, ALearnedWindowPollsThroughRepliesLongerThanTheFloor) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  EchoPair p;
  ASSERT_TRUE(MakeEchoPair(GetParam(), {}, &p));
  UcxWorker& client = *p.client;
  PollingEcho& echo = *p.echo;
  echo.delay = std::chrono::microseconds(500);
  constexpr int kRoundTrips = 100;
  auto sleeps_with = [&](PollWindow& window, uint64_t first_token, int64_t* sleeps) {
    auto once = [&](uint64_t token) {
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      auto reply = client.Buffer(1024);
      ASSERT_TRUE(reply.ok());
      auto got = client.ExpectMessage(token, *reply, deadline);
      auto sent =
          client.SendMessage(p.ep, UcxWorker::Message::kRequest, TokenHeader(token),
                             Filled(client, 1024, static_cast<uint8_t>(token)), 1024, deadline);
      const absl::Time await_by = token % 2 == 0 ? deadline : absl::InfiniteFuture();
      auto len = client.Await(*got, await_by, window, std::chrono::steady_clock::now());
      ASSERT_TRUE(len.ok() && *len == 1024) << len.status();
      ASSERT_TRUE(client.Await(*sent, deadline, std::chrono::microseconds(0)).ok());
      ASSERT_EQ((*reply)->data()[5], static_cast<uint8_t>(token + 5 * 7 + 1));
    };
    for (uint64_t i = 0; i < 20; ++i) once(first_token + i);  // warm, and learned
    const int64_t before = ThisThreadSleeps();
    for (uint64_t i = 0; i < kRoundTrips; ++i) once(first_token + 100 + i);
    *sleeps = ThisThreadSleeps() - before;
  };
  PollWindow fixed(std::chrono::microseconds(100), std::chrono::microseconds(100));
  // A ceiling far above the replies (as the other tests here poll for 50 ms): a loaded machine
  // may stretch a 500 us reply to milliseconds, and the window must still cover it.
  PollWindow learned(std::chrono::microseconds(100), std::chrono::milliseconds(50));
  int64_t fixed_sleeps = 0, learned_sleeps = 0;
  sleeps_with(fixed, 1000, &fixed_sleeps);
  sleeps_with(learned, 5000, &learned_sleeps);
  std::printf(
      "[polling] %s: a caller slept %lld times in %d round trips of 500 us with a fixed 100 us "
      "poll, %lld with the learned window (%lld us)\n",
      GetParam().c_str(), static_cast<long long>(fixed_sleeps), kRoundTrips,
      static_cast<long long>(learned_sleeps), static_cast<long long>(learned.Window().count()));
  // Alone the fixed window slept for every reply (100 of 100), and the learned one for none (100
  // with its window held at the floor: tried); a loaded machine may deschedule a poller (it
  // yields every 8 empty polls) past the reply's arrival, so the fixed window's count is not
  // asserted (43 of 100 in one ctest -j2 run).
  EXPECT_LE(learned_sleeps, kRoundTrips / 10);
  EXPECT_GT(learned.Window(), std::chrono::microseconds(500));
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxPolling, ::testing::Values("posix", "tcp"),
                         [](const auto& info) { return info.param; });

// The sizes of this process's mappings of UCX's posix shared memory (its FIFOs and receive
// descriptors), read from the kernel.
std::multiset<size_t> PosixShmMappings() {
  std::multiset<size_t> sizes;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("ucx_shm_posix") == std::string::npos) continue;
    const size_t dash = line.find('-'), space = line.find(' ');
    sizes.insert(std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16) -
                 std::stoull(line.substr(0, dash), nullptr, 16));
  }
  return sizes;
}

// The posix mappings a new worker adds (smallest first: its FIFO, then its descriptors).
// *shape: the shape the worker says it has (shared_memory_fifo), "" when it was not made.
std::vector<size_t> NewWorkerMappings(absl::Status* status, std::string* shape = nullptr) {
  const std::multiset<size_t> before = PosixShmMappings();
  UcxOptions o;
  o.tls = "posix";
  auto w = UcxWorker::Create(o);
  *status = w.status();
  if (shape != nullptr) *shape = w.ok() ? (*w)->shared_memory_fifo() : "";
  std::multiset<size_t> added = PosixShmMappings();
  for (size_t b : before) {
    if (auto it = added.find(b); it != added.end()) added.erase(it);
  }
  return std::vector<size_t>(added.begin(), added.end());
}

// A worker sizes UCX's shared-memory FIFO for large batches (128 elements of 32 KiB + 64, where
// UCX's own is 64 of 8 KiB + 64: docs/data-plane.md), as UCX really mapped it, and says the
// shape it got (what OpenDataPlane hands the attention node to compare with its own); a user's
// UCX_POSIX_* settings stand; a segment UCX 1.13 would lose fragments of is refused.
TEST(UcxSharedMemoryFifo, SizedForLargeBatchesUnlessTheUserSetsIt) {
  if (!UcxBuilt()) GTEST_SKIP() << "built without UCX";
  absl::Status s;
  std::string ours_shape, users_shape, sysv_shape;
  const std::vector<size_t> ours = NewWorkerMappings(&s, &ours_shape);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(ours_shape, "128x32832");
  // A user's setting for another shared-memory transport only: UCX's own FIFO for posix too
  // (this project's names reach all of them), and the worker says so.
  setenv("UCX_SYSV_FIFO_SIZE", "64", 1);
  const std::vector<size_t> sysv_only = NewWorkerMappings(&s, &sysv_shape);
  unsetenv("UCX_SYSV_FIFO_SIZE");
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(sysv_shape, "64x32832");
  setenv("UCX_POSIX_FIFO_SIZE", "64", 1);
  setenv("UCX_POSIX_SEG_SIZE", "8256", 1);
  const std::vector<size_t> users = NewWorkerMappings(&s, &users_shape);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(users_shape, "64x8256");
  for (const char* v : {"65600", "64k", "1m"}) {
    setenv("UCX_POSIX_SEG_SIZE", v, 1);
    const std::vector<size_t> none = NewWorkerMappings(&s);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << v << ": " << s;
    EXPECT_NE(s.message().find("16 bits"), std::string::npos) << s;
    EXPECT_TRUE(none.empty()) << v;
  }
  unsetenv("UCX_POSIX_FIFO_SIZE");
  unsetenv("UCX_POSIX_SEG_SIZE");
  std::string seen;
  for (size_t b : ours) seen += std::to_string(b) + " ";
  seen += "| user's: ";
  for (size_t b : users) seen += std::to_string(b) + " ";
  std::printf("[fifo] posix mappings of a new worker: %s\n", seen.c_str());
  ASSERT_GE(ours.size(), 2u) << seen;
  ASSERT_GE(users.size(), 2u) << seen;
  ASSERT_GE(sysv_only.size(), 2u) << seen;
  EXPECT_EQ(sysv_only.front(), users.front()) << seen;  // 64 elements, as the shape says
  // The FIFO: 128-byte elements, 64 more of them.
  EXPECT_EQ(ours.front() - users.front(), 64u * 128u) << seen;
  // The receive descriptors: segments four times as large, as many per chunk.
  EXPECT_GE(ours.back(), 3 * users.back()) << seen;
  EXPECT_GE(ours.back(), 128u * 32832u) << seen;
}

}  // namespace
}  // namespace moe::dataplane
