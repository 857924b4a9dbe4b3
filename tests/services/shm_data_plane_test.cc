// The shm data plane (expert-svc/dataplane/shm, attention-svc/dataplane/shm) through the real
// expert server: batches of every size bit for bit like the in-band lane, many in flight from
// many threads over wrapping rings, batches larger than half a ring in band; and what a hostile
// peer can do: a hello from a stranger (wrong secret), a member's hello with a region or
// doorbells that are not what they say, and a member that breaks its rings after a good hello.
// Each loses only its own connection (counted); the server stays up and a canary channel stays
// bit-exact throughout.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/batch_message.h"
#include "attention-svc/dataplane/registry.h"
#include "attention-svc/dataplane/shm/shm_client_half.h"
#include "attention-svc/expert_channel_grpc.h"
#include "expert-svc/expert_server.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/shm_lane.h"
#include "services/transport/channel.h"
#include "tests/common/backend_shard.h"
#include "tests/common/echo_shard.h"
#include "tests/common/metrics_text.h"

namespace moe {
namespace {

using C = absl::StatusCode;
using dataplane::OwnedFd;

using ShmShard = testing::BackendShard;
ShmShard StartShmShard(const ModelConfig& cfg) { return testing::StartBackendShard(cfg, "shm"); }
attention_svc::ChannelOptions ChannelTo(const ShmShard& s, bool fallback) {
  return testing::BackendChannel(s, "attention-shm", fallback);
}
using testing::WrongEchoRows;

double Events(const ShmShard& s, const std::string& event) {
  return testing::ScrapeSum(s.metrics, "moe_expert_data_plane_events_total",
                            {"event=\"" + event + "\""});
}

// The shard's GetInfo (empty when it does not answer).
v1::ExpertServerInfo Info(const ShmShard& shard) {
  auto stub = v1::ExpertService::NewStub(transport::MakeChannel(shard.endpoint));
  grpc::ClientContext ctx;
  v1::ExpertServerInfo info;
  EXPECT_TRUE(stub->GetInfo(&ctx, v1::GetExpertInfoRequest(), &info).ok());
  return info;
}

TEST(ShmDataPlane, CarriesBatchesThroughTheRealServerBitExact) {
  const ModelConfig cfg = *PresetConfig("mid");
  ShmShard shard = StartShmShard(cfg);
  const v1::ExpertServerInfo info = Info(shard);
  EXPECT_EQ(info.data_plane(), "shm");
  EXPECT_EQ(info.ucx_address().substr(0, 9), "@moe-shm-");
  auto half = attention_svc::StartClientHalf("shm", {});
  ASSERT_TRUE(half.ok()) << half.status();
  std::vector<std::string> events;
  std::string lanes;
  attention_svc::ChannelOptions co = ChannelTo(shard, /*fallback=*/false);
  co.on_event = [&](const std::string&, const std::string& e) { events.push_back(e); };
  co.on_lanes = [&](const std::string&, const dataplane::Lanes& l, const std::string& theirs) {
    lanes = l.kind + "/" + theirs;
  };
  std::shared_ptr<attention_svc::ExpertChannel> shm = (*half)->MakeChannel(co);
  ASSERT_NO_FATAL_FAILURE(
      testing::ExpectServedBitExactOn(*shm, cfg, shard.endpoint, "shm", {1, 16, 200, 1}));
  EXPECT_EQ(events, std::vector<std::string>{"connected"});
  EXPECT_EQ(lanes, "shm/shm");
  // A batch whose reply does not fit half a ring goes in band, counted, bit-exact, also on a
  // channel that may not fall back for a shard without the lane (a long prefill must not fail).
  const int64_t big_t = attention_svc::kShmClientRing / 2 / (cfg.top_k * cfg.latent * 2) + 1;
  const testing::EchoBatch big = testing::MakeEchoBatch(cfg, big_t);
  auto call = shm->Send(big.header, big.message);
  auto r = call->Wait(absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_STREQ(call->transport(), "grpc");
  EXPECT_EQ(WrongEchoRows(big, *r, cfg.latent), 0u);
  EXPECT_EQ(events, (std::vector<std::string>{"connected", "fallback"}));
  // The next batch that fits is on shm again.
  const testing::EchoBatch small = testing::MakeEchoBatch(cfg, 4);
  auto again = shm->Send(small.header, small.message);
  ASSERT_TRUE(again->Wait(absl::Now() + absl::Seconds(30)).ok());
  EXPECT_STREQ(again->transport(), "shm");
}

// Four threads with batches of mixed sizes in flight on one channel: the rings wrap many times,
// the waiters hand the reading of the reply ring to each other, every reply is its batch's.
TEST(ShmDataPlane, ManyBatchesInFlightFromManyThreadsEachGetTheirOwnReply) {
  const ModelConfig cfg = *PresetConfig("mid");
  ShmShard shard = StartShmShard(cfg);
  auto half = attention_svc::StartClientHalf("shm", {});
  ASSERT_TRUE(half.ok());
  std::shared_ptr<attention_svc::ExpertChannel> shm = (*half)->MakeChannel(ChannelTo(shard, false));
  std::vector<testing::EchoBatch> batches;
  for (int64_t t : {1, 3, 16, 64, 300}) batches.push_back(testing::MakeEchoBatch(cfg, t));
  std::atomic<int> wrong{0}, failed{0};
  std::atomic<uint64_t> bytes{0};
  std::vector<std::thread> threads;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&, th] {
      for (int i = 0; i < 80 && std::chrono::steady_clock::now() < until; ++i) {
        const testing::EchoBatch& b = batches[(th + i) % batches.size()];
        auto call = shm->Send(b.header, b.message);
        auto r = call->Wait(absl::Now() + absl::Seconds(30));
        if (!r.ok()) {
          ++failed;
          ADD_FAILURE() << r.status();
          continue;
        }
        wrong += WrongEchoRows(b, *r, cfg.latent) != 0;
        bytes += b.reply_bytes;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(bytes.load(), 2 * attention_svc::kShmClientRing) << "the reply ring wrapped";
}

// A peer of the shard's Unix socket, by hand: OpenDataPlane over gRPC (a member), then a hello
// with whatever descriptors the case hands over.
struct RawPeer {
  v1::OpenDataPlaneReply opened;
  dataplane::ShmRegion region;
  OwnedFd socket, shard_bell, node_bell;
  dataplane::ShmRing requests, replies;
};

v1::OpenDataPlaneReply Open(const std::string& endpoint, const std::string& node) {
  auto stub = v1::ExpertService::NewStub(transport::MakeChannel(endpoint));
  grpc::ClientContext ctx;
  v1::OpenDataPlaneRequest req;
  req.set_node(node);
  v1::OpenDataPlaneReply reply;
  EXPECT_TRUE(stub->OpenDataPlane(&ctx, req, &reply).ok());
  return reply;
}

std::string Hello(const v1::OpenDataPlaneReply& o, const std::string& secret, uint64_t ring) {
  std::string h = dataplane::EncodeHello({o.client_id(), secret});
  h.append(reinterpret_cast<const char*>(&ring), sizeof ring);
  return h;
}

// Whether the shard acknowledged within two seconds (false: it closed the socket or said
// nothing).
bool Acked(int socket) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (std::chrono::steady_clock::now() < until) {
    auto d = dataplane::ReceiveWithFds(socket, 64, 0);
    if (d.ok()) return d->bytes.substr(0, 4) == "MOEA";
    if (!absl::IsUnavailable(d.status())) return false;
    dataplane::WaitReadable(socket, -1,
                            std::chrono::steady_clock::now() + std::chrono::milliseconds(50));
  }
  return false;
}

// Whether the shard closed the socket within three seconds.
bool ClosedByShard(int socket) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (std::chrono::steady_clock::now() < until) {
    char b;
    const ssize_t n = ::recv(socket, &b, 1, MSG_DONTWAIT);
    if (n == 0) return true;
    dataplane::WaitReadable(socket, -1,
                            std::chrono::steady_clock::now() + std::chrono::milliseconds(50));
  }
  return false;
}

RawPeer GoodPeer(const std::string& endpoint, const std::string& address, const std::string& node) {
  RawPeer p;
  p.opened = Open(endpoint, node);
  p.region = *dataplane::ShmRegion::Create(dataplane::kShmMinRing);
  p.shard_bell = *dataplane::NewEventFd();
  p.node_bell = *dataplane::NewEventFd();
  p.requests = p.region.Ring(dataplane::ShmDirection::kToShard, p.shard_bell.get());
  p.replies = p.region.Ring(dataplane::ShmDirection::kToNode, -1);
  p.socket = *dataplane::ConnectAbstract(address);
  EXPECT_TRUE(dataplane::SendWithFds(
                  p.socket.get(), Hello(p.opened, p.opened.hello_secret(), dataplane::kShmMinRing),
                  {p.region.fd(), p.shard_bell.get(), p.node_bell.get()})
                  .ok());
  EXPECT_TRUE(Acked(p.socket.get()));
  return p;
}

// A batch record as a node writes it, for client `id`.
void PutBatch(RawPeer& p, const testing::EchoBatch& b, uint64_t sequence) {
  const std::string h =
      attention_svc::BatchMessageHeader(b.header, b.message, p.opened.client_id(), sequence,
                                        b.message.activation_bytes(), b.reply_bytes)
          .SerializeAsString();
  auto s = p.requests.Reserve(h.size(), b.message.activation_bytes());
  ASSERT_TRUE(s.ok()) << s.status();
  std::memcpy(s->header, h.data(), h.size());
  b.message.z.CopyTo(s->payload);
  p.requests.Publish(*s, {sequence, sequence});
}

// A canary channel that sends batches until stopped, counting wrong and failed answers.
struct Canary {
  std::atomic<bool> stop{false};
  std::atomic<int> good{0}, bad{0};
  std::thread thread;
  Canary(std::shared_ptr<attention_svc::ExpertChannel> ch, const testing::EchoBatch& b, int64_t d) {
    thread = std::thread([this, ch, &b, d] {
      for (int i = 0; i < 100000 && !stop.load(); ++i) {
        auto r = ch->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30));
        if (r.ok() && WrongEchoRows(b, *r, d) == 0) {
          ++good;
        } else {
          ++bad;
        }
      }
    });
  }
  void Stop() {
    stop.store(true);
    thread.join();
  }
};

// A shm shard under attack: a canary channel sending batches throughout, and the shard's address
// (as GetInfo gives it to members; /proc/net/unix shows it to anyone on the host).
struct AttackedShard {
  const ModelConfig cfg = *PresetConfig("mid");
  ShmShard shard = StartShmShard(cfg);
  std::unique_ptr<attention_svc::ClientHalf> half = *attention_svc::StartClientHalf("shm", {});
  const testing::EchoBatch b = testing::MakeEchoBatch(cfg, 8);
  const std::string address = Info(shard).ucx_address();
  Canary canary{half->MakeChannel(ChannelTo(shard, false)), b, cfg.latent};

  // Stops the canary: it was answered, every answer bit-exact.
  void ExpectCanaryExact() {
    canary.Stop();
    EXPECT_GT(canary.good.load(), 0);
    EXPECT_EQ(canary.bad.load(), 0);
  }
};

TEST(ShmDataPlane, HellosFromStrangersAndBadDescriptorsFromMembersAreRefused) {
  AttackedShard a;
  ShmShard& shard = a.shard;
  const std::string& address = a.address;
  ASSERT_FALSE(address.empty());
  const uint64_t ring = dataplane::kShmMinRing;
  auto good_region = [&] { return *dataplane::ShmRegion::Create(ring); };
  struct Case {
    std::string name;
    std::function<void(const v1::OpenDataPlaneReply&, int socket)> send;
  };
  std::vector<Case> cases;
  cases.push_back({"a wrong secret", [&](const v1::OpenDataPlaneReply& o, int s) {
                     auto r = good_region();
                     auto e1 = *dataplane::NewEventFd(), e2 = *dataplane::NewEventFd();
                     (void)dataplane::SendWithFds(s, Hello(o, std::string(16, 's'), ring),
                                                  {r.fd(), e1.get(), e2.get()});
                   }});
  cases.push_back({"an unsealed memfd", [&](const v1::OpenDataPlaneReply& o, int s) {
                     OwnedFd m(::memfd_create("x", MFD_CLOEXEC));
                     EXPECT_EQ(::ftruncate(m.get(), dataplane::kShmControlBytes + 2 * ring), 0);
                     auto e1 = *dataplane::NewEventFd(), e2 = *dataplane::NewEventFd();
                     (void)dataplane::SendWithFds(s, Hello(o, o.hello_secret(), ring),
                                                  {m.get(), e1.get(), e2.get()});
                   }});
  cases.push_back({"a region of another size", [&](const v1::OpenDataPlaneReply& o, int s) {
                     auto r = good_region();
                     auto e1 = *dataplane::NewEventFd(), e2 = *dataplane::NewEventFd();
                     (void)dataplane::SendWithFds(s, Hello(o, o.hello_secret(), ring * 2),
                                                  {r.fd(), e1.get(), e2.get()});
                   }});
  cases.push_back({"rings of 1 TiB", [&](const v1::OpenDataPlaneReply& o, int s) {
                     auto r = good_region();
                     auto e1 = *dataplane::NewEventFd(), e2 = *dataplane::NewEventFd();
                     (void)dataplane::SendWithFds(s, Hello(o, o.hello_secret(), uint64_t{1} << 40),
                                                  {r.fd(), e1.get(), e2.get()});
                   }});
  cases.push_back({"a pipe for a doorbell", [&](const v1::OpenDataPlaneReply& o, int s) {
                     auto r = good_region();
                     int p[2];
                     ASSERT_EQ(::pipe(p), 0);
                     OwnedFd p0(p[0]), p1(p[1]);
                     auto e2 = *dataplane::NewEventFd();
                     (void)dataplane::SendWithFds(s, Hello(o, o.hello_secret(), ring),
                                                  {r.fd(), p1.get(), e2.get()});
                   }});
  cases.push_back({"the region for a doorbell", [&](const v1::OpenDataPlaneReply& o, int s) {
                     auto r = good_region();
                     auto e1 = *dataplane::NewEventFd();
                     (void)dataplane::SendWithFds(s, Hello(o, o.hello_secret(), ring),
                                                  {r.fd(), e1.get(), r.fd()});
                   }});
  cases.push_back({"five descriptors", [&](const v1::OpenDataPlaneReply& o, int s) {
                     auto r = good_region();
                     auto e1 = *dataplane::NewEventFd(), e2 = *dataplane::NewEventFd();
                     (void)dataplane::SendWithFds(s, Hello(o, o.hello_secret(), ring),
                                                  {r.fd(), e1.get(), e2.get(), e1.get(), e2.get()});
                   }});
  cases.push_back({"no descriptors", [&](const v1::OpenDataPlaneReply& o, int s) {
                     (void)dataplane::SendWithFds(s, Hello(o, o.hello_secret(), ring), {});
                   }});
  cases.push_back({"a long message", [&](const v1::OpenDataPlaneReply& o, int s) {
                     (void)dataplane::SendWithFds(s, std::string(4096, 'h'), {});
                   }});
  cases.push_back({"garbage then close", [&](const v1::OpenDataPlaneReply& o, int s) {
                     (void)dataplane::SendWithFds(s, std::string(37, '\xff'), {});
                   }});
  for (const Case& c : cases) {
    const double before = Events(shard, "hello_rejected");
    const v1::OpenDataPlaneReply o =
        Open(shard.endpoint, "hostile-" + std::to_string(&c - cases.data()));
    auto socket = dataplane::ConnectAbstract(address);
    ASSERT_TRUE(socket.ok()) << socket.status();
    c.send(o, socket->get());
    EXPECT_FALSE(Acked(socket->get())) << c.name;
    EXPECT_TRUE(ClosedByShard(socket->get())) << c.name;
    EXPECT_EQ(Events(shard, "hello_rejected"), before + 1) << c.name;
  }
  {  // Connected and silent: closed after the hello's two seconds, counted.
    const double before = Events(shard, "hello_rejected");
    auto silent = dataplane::ConnectAbstract(address);
    ASSERT_TRUE(silent.ok());
    EXPECT_TRUE(ClosedByShard(silent->get()));
    EXPECT_EQ(Events(shard, "hello_rejected"), before + 1);
  }
  a.ExpectCanaryExact();
}

TEST(ShmDataPlane, AMemberThatBreaksItsRingsLosesOnlyItsConnection) {
  AttackedShard a;
  ShmShard& shard = a.shard;
  const testing::EchoBatch& b = a.b;
  const std::string& address = a.address;
  ASSERT_FALSE(address.empty());
  {  // The raw peer itself works: a batch it writes is answered in its reply ring.
    RawPeer p = GoodPeer(shard.endpoint, address, "raw-good");
    PutBatch(p, b, 1);
    absl::StatusOr<std::optional<dataplane::ShmRecord>> r;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    do {
      r = p.replies.Peek();
    } while (r.ok() && !r->has_value() && std::chrono::steady_clock::now() < until);
    ASSERT_TRUE(r.ok() && r->has_value());
    EXPECT_EQ((*r)->token, 1u);
    EXPECT_EQ((*r)->payload_bytes, b.reply_bytes);
  }
  uint8_t* base = nullptr;
  auto put = [&](size_t off, uint64_t v) { std::memcpy(base + off, &v, sizeof v); };
  struct Case {
    const char* name;
    const char* event;
    std::function<void(RawPeer&)> act;
  };
  const Case cases[] = {
      {"a head past the ring", "message_rejected",
       [&](RawPeer& p) { put(dataplane::kShmToShardHead, uint64_t{1} << 40); }},
      {"a record of 1 GiB", "message_rejected",
       [&](RawPeer& p) {
         put(dataplane::kShmControlBytes, uint64_t{1} << 30);
         put(dataplane::kShmToShardHead, 128);
       }},
      {"a reply ring read ahead of the shard", "reply_failed",
       [&](RawPeer& p) {
         put(dataplane::kShmToNodeTail, uint64_t{1} << 40);
         PutBatch(p, b, 1);
       }},
      {"the same batch twice", "replayed",
       [&](RawPeer& p) {
         PutBatch(p, b, 5);
         PutBatch(p, b, 5);
       }},
  };
  for (const Case& c : cases) {
    const double before = Events(shard, c.event);
    RawPeer p = GoodPeer(shard.endpoint, address, std::string("raw-") + c.name);
    base = p.region.base();
    c.act(p);
    dataplane::Ring(p.shard_bell.get());
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (Events(shard, c.event) < before + 1 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(Events(shard, c.event), before + 1) << c.name;
    if (std::string(c.event) != "replayed") {
      EXPECT_TRUE(ClosedByShard(p.socket.get())) << c.name;
    }
  }
  {  // A header that is no protobuf: refused by the core, nothing else happens.
    RawPeer p = GoodPeer(shard.endpoint, address, "raw-garbage");
    auto s = p.requests.Reserve(100, 64);
    ASSERT_TRUE(s.ok());
    std::memset(s->header, 0xff, 100);
    p.requests.Publish(*s, {1, 1});
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  a.ExpectCanaryExact();
  EXPECT_EQ(Info(shard).data_plane(), "shm") << "the shard is up";
}

// The node's side of a ring a shard broke: this process is the node, so the test maps the
// channel's own memfd (found in /proc/self/fd) and writes an impossible position into the ring
// back (with the shard held off it) before a batch waits. The batch fails naming the shard (counted
// "integrity_failed"), nothing crashes, and the next batch opens a new region, bit-exact.
TEST(ShmDataPlane, ANodeWhoseReplyRingBreaksFailsThatBatchAndOpensAgain) {
  const ModelConfig cfg = *PresetConfig("mid");
  ShmShard shard = StartShmShard(cfg);
  auto half = attention_svc::StartClientHalf("shm", {});
  ASSERT_TRUE(half.ok());
  std::vector<std::string> events;
  std::mutex events_mu;
  attention_svc::ChannelOptions co = ChannelTo(shard, false);
  co.on_event = [&](const std::string&, const std::string& e) {
    std::lock_guard<std::mutex> lock(events_mu);
    events.push_back(e);
  };
  std::shared_ptr<attention_svc::ExpertChannel> shm = (*half)->MakeChannel(co);
  const testing::EchoBatch b = testing::MakeEchoBatch(cfg, 16);
  ASSERT_TRUE(shm->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30)).ok());
  // The channel's region: the one memfd of that name this process holds.
  void* mapped = nullptr;
  size_t bytes = 0;
  for (int fd = 0; fd < 4096 && mapped == nullptr; ++fd) {
    char link[128] = {};
    const std::string path = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t n = ::readlink(path.c_str(), link, sizeof link - 1);
    if (n <= 0 || std::string(link).find("memfd:moe-shm-data-plane") == std::string::npos) continue;
    bytes = dataplane::kShmControlBytes + 2 * attention_svc::kShmClientRing;
    mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mapped == MAP_FAILED) mapped = nullptr;
  }
  ASSERT_NE(mapped, nullptr) << "the channel's memfd";
  // The shard is told its reply ring is full (a reader position a ring behind what it
  // published: it waits, then drops its reply, and never writes the ring's position again), and
  // the position the node reads is impossible.
  auto* control = static_cast<uint8_t*>(mapped);
  uint64_t published = 0;
  std::memcpy(&published, control + dataplane::kShmToNodeHead, 8);
  const uint64_t behind = published - attention_svc::kShmClientRing + 64;
  std::memcpy(control + dataplane::kShmToNodeTail, &behind, 8);
  const uint64_t impossible = uint64_t{1} << 40;
  std::memcpy(control + dataplane::kShmToNodeHead, &impossible, 8);
  auto broken = shm->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30));
  ::munmap(mapped, bytes);
  EXPECT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("echo-0"), std::string::npos) << broken.status();
  for (int i = 0; i < 3; ++i) {
    auto r = shm->Send(b.header, b.message)->Wait(absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(WrongEchoRows(b, *r, cfg.latent), 0u);
  }
  std::lock_guard<std::mutex> lock(events_mu);
  EXPECT_EQ(events, (std::vector<std::string>{"connected", "integrity_failed", "connected"}));
}

}  // namespace
}  // namespace moe
