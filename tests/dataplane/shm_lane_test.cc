// The shm lane's rings and descriptors (services/dataplane/shm_lane.h): records of every size
// cross a wrapping ring bit-exact between two threads that sleep and wake through the doorbell;
// every impossible position or record a peer could write is DATA_LOSS, never a read out of
// bounds; a region not sealed, of the wrong size or not a memfd is refused before it is mapped;
// a datagram with more descriptors than asked for is refused and closes them all.
#include "services/dataplane/shm_lane.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>

namespace moe::dataplane {
namespace {

using C = absl::StatusCode;
constexpr uint64_t kRing = kShmMinRing;

int OpenFds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n;
}

void Put(uint8_t* base, size_t offset, uint64_t v) { std::memcpy(base + offset, &v, sizeof v); }

TEST(ShmRing, RecordsOfEverySizeCrossAWrappingRingBitExactWithSleepsAndWakes) {
  auto region = ShmRegion::Create(kRing);
  ASSERT_TRUE(region.ok()) << region.status();
  auto bell = NewEventFd();
  ASSERT_TRUE(bell.ok());
  ShmRing producer = region->Ring(ShmDirection::kToShard, bell->get());
  ShmRing consumer = region->Ring(ShmDirection::kToShard, -1);
  constexpr int kRecords = 3000;
  std::atomic<int> sleeps{0};
  std::atomic<int> wrong{0};
  std::thread reader([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (int i = 0; i < kRecords && std::chrono::steady_clock::now() < until;) {
      auto r = consumer.Peek();
      ASSERT_TRUE(r.ok()) << r.status();
      if (!r->has_value()) {
        consumer.SetSleeping(true);
        if (!consumer.MaybeReady()) {
          ++sleeps;
          WaitReadable(bell->get(), -1, std::chrono::steady_clock::now() + std::chrono::seconds(5));
          Drain(bell->get());
        }
        consumer.SetSleeping(false);
        continue;
      }
      const ShmRecord& rec = **r;
      // Record i: token i, header of i % 300 bytes of (i & 0xff), payload of bytes (i * 7919 %
      // 500,000).
      bool ok = rec.token == static_cast<uint64_t>(i) &&
                rec.sequence == static_cast<uint64_t>(i) + 1 &&
                rec.header_bytes == static_cast<uint32_t>(i % 300) &&
                rec.payload_bytes == static_cast<uint64_t>(i) * 7919 % 500000 &&
                reinterpret_cast<uintptr_t>(rec.payload) % 64 == 0;
      for (uint32_t b = 0; ok && b < rec.header_bytes; ++b) ok = rec.header[b] == (i & 0xff);
      for (uint64_t b = 0; ok && b < rec.payload_bytes; b += 4093) {
        ok = rec.payload[b] == static_cast<uint8_t>(b * 31 + i);
      }
      if (ok && rec.payload_bytes > 0) {
        ok = rec.payload[rec.payload_bytes - 1] ==
             static_cast<uint8_t>((rec.payload_bytes - 1) * 31 + i);
      }
      wrong += !ok;
      consumer.Release(rec);
      ++i;
    }
  });
  uint64_t total = 0;
  for (int i = 0; i < kRecords; ++i) {
    const size_t hb = i % 300;
    const uint64_t pb = static_cast<uint64_t>(i) * 7919 % 500000;
    absl::StatusOr<ShmRing::Slot> s;
    for (int tries = 0; tries < 200000; ++tries) {
      s = producer.Reserve(hb, pb);
      if (s.ok() || s.status().code() != C::kResourceExhausted) break;
      if (i % 2 == 0) std::this_thread::yield();  // half the time the reader catches up asleep
    }
    ASSERT_TRUE(s.ok()) << s.status();
    std::memset(s->header, i & 0xff, hb);
    for (uint64_t b = 0; b < pb; ++b) s->payload[b] = static_cast<uint8_t>(b * 31 + i);
    producer.Publish(*s, {static_cast<uint64_t>(i), static_cast<uint64_t>(i) + 1});
    total += ShmRing::RecordBytes(hb, pb);
    if (i % 97 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  reader.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(total, 20 * kRing) << "the ring wrapped many times";
  EXPECT_GT(sleeps.load(), 0) << "the reader slept and was woken";
}

TEST(ShmRing, TheWriterRefusesWhatCannotFitAndAReaderPositionItNeverGave) {
  auto region = ShmRegion::Create(kRing);
  ASSERT_TRUE(region.ok());
  ShmRing producer = region->Ring(ShmDirection::kToShard, -1);
  EXPECT_EQ(producer.Reserve(0, kRing / 2).status().code(), C::kOutOfRange);
  EXPECT_EQ(producer.Reserve(2 << 20, 0).status().code(), C::kOutOfRange);
  // Fill it: two records of just under half the ring, then nothing fits.
  const uint64_t half = kRing / 2 - kShmRecordHeadBytes;
  for (int i = 0; i < 2; ++i) {
    auto s = producer.Reserve(0, half);
    ASSERT_TRUE(s.ok()) << s.status();
    producer.Publish(*s, {1, 1});
  }
  EXPECT_EQ(producer.Reserve(0, 0).status().code(), C::kResourceExhausted);
  // A reader that claims to have read past what was written, or a misaligned position.
  for (uint64_t tail : {kRing + 64, uint64_t{1} << 40, uint64_t{64 * 3 + 1}, ~uint64_t{0}}) {
    Put(region->base(), kShmToShardTail, tail);
    EXPECT_EQ(producer.Reserve(0, 0).status().code(), C::kDataLoss) << tail;
  }
}

// Every head and record a writer that breaks the protocol can leave is DATA_LOSS.
TEST(ShmRing, TheReaderRefusesEveryImpossibleRecord) {
  struct Case {
    const char* name;
    uint64_t head, record_bytes;
    uint32_t kind, header_bytes;
    uint64_t payload_bytes;
  };
  const Case cases[] = {
      {"head past the ring", kRing + 64, 128, 1, 0, 64},
      {"head misaligned", 100, 128, 1, 0, 64},
      {"head far away", uint64_t{1} << 62, 128, 1, 0, 64},
      {"record of 0 bytes", 128, 0, 1, 0, 0},
      {"record misaligned", 128, 100, 1, 0, 0},
      {"record past the head", 128, 192, 1, 0, 128},
      {"record of 2^63", 128, uint64_t{1} << 63, 1, 0, 64},
      {"unknown kind", 128, 128, 7, 0, 64},
      {"sizes that do not add up", 128, 128, 1, 0, 4096},
      {"a header of 4 GiB", 128, 128, 1, 0xffffffffu, 0},
      {"a payload of 2^64-1", 128, 128, 1, 0, ~uint64_t{0}},
  };
  for (const Case& c : cases) {
    auto region = ShmRegion::Create(kRing);
    ASSERT_TRUE(region.ok());
    ShmRing consumer = region->Ring(ShmDirection::kToShard, -1);
    uint8_t* data = region->base() + kShmControlBytes;
    Put(data, 0, c.record_bytes);
    std::memcpy(data + 8, &c.kind, 4);
    std::memcpy(data + 12, &c.header_bytes, 4);
    Put(data, 16, c.payload_bytes);
    Put(data, c.record_bytes % kRing, c.record_bytes);  // a second filler, where one follows
    std::memcpy(data + c.record_bytes % kRing + 8, &c.kind, 4);
    Put(region->base(), kShmToShardHead, c.head);
    EXPECT_EQ(consumer.Peek().status().code(), C::kDataLoss) << c.name;
  }
  // A record whose end passes the ring's end (a writer must pad instead).
  auto region = ShmRegion::Create(kRing);
  ASSERT_TRUE(region.ok());
  ShmRing consumer = region->Ring(ShmDirection::kToShard, -1);
  ShmRing producer = region->Ring(ShmDirection::kToShard, -1);
  auto s = producer.Reserve(0, kRing / 2 - 128);
  ASSERT_TRUE(s.ok());
  producer.Publish(*s, {1, 1});
  auto r = consumer.Peek();
  ASSERT_TRUE(r.ok() && r->has_value());
  consumer.Release(**r);
  const uint64_t at = kRing / 2 - 64;  // where the next record starts: 64 bytes before the middle
  uint8_t* data = region->base() + kShmControlBytes;
  Put(data, at % kRing + 0, kRing);  // ... and says it runs a whole ring
  const uint32_t kind = 1;
  std::memcpy(data + at + 8, &kind, 4);
  Put(data, at + 16, kRing - kShmRecordHeadBytes);  // sizes that add up: only its end is wrong
  Put(region->base(), kShmToShardHead, at + kRing);
  EXPECT_EQ(consumer.Peek().status().code(), C::kDataLoss);
}

uint64_t Get(const uint8_t* base, size_t offset) {
  uint64_t v;
  std::memcpy(&v, base + offset, sizeof v);
  return v;
}

// A shard fills reply slots in the order its batches finish and a node holds replies while it
// reads them: slots appear in ring order once those before them are done (a slot given up
// becomes a filler, a header shorter than its room leaves a filler before it), and the reader
// frees the ring up to the oldest record it still holds.
TEST(ShmRing, SlotsFilledOutOfOrderAppearInOrderAndHeldRecordsFreeInOrder) {
  auto region = ShmRegion::Create(kRing);
  ASSERT_TRUE(region.ok());
  ShmRing producer = region->Ring(ShmDirection::kToNode, -1);
  ShmRing consumer = region->Ring(ShmDirection::kToNode, -1);
  auto a = producer.Reserve(100, 1000), b = producer.Reserve(16384, 5000),
       c = producer.Reserve(10, 64), d = producer.Reserve(0, 200);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
  auto fill = [](const ShmRing::Slot& s, uint8_t v, size_t header) {
    std::memset(ShmRing::HeaderAt(s, header), v, header);
    std::memset(s.payload, v + 1, s.payload_bytes);
  };
  fill(*c, 30, 10);
  producer.Publish(*c, {3, 3});
  ASSERT_TRUE(consumer.Peek().ok());
  EXPECT_FALSE(consumer.Peek()->has_value()) << "C waits for A and B";
  fill(*b, 20, 37);
  producer.Publish(*b, {2, 2}, 37);
  EXPECT_FALSE(consumer.Peek()->has_value()) << "B waits for A";
  producer.Abandon(*a);
  auto rb = consumer.Peek();
  ASSERT_TRUE(rb.ok() && rb->has_value()) << rb.status();
  EXPECT_EQ((*rb)->token, 2u);
  ASSERT_EQ((*rb)->header_bytes, 37u);
  EXPECT_EQ((*rb)->header[0], 20);
  EXPECT_EQ((*rb)->header[36], 20);
  ASSERT_EQ((*rb)->payload_bytes, 5000u);
  EXPECT_EQ((*rb)->payload, b->payload);
  EXPECT_EQ((*rb)->payload[4999], 21);
  auto rc = consumer.Peek();
  ASSERT_TRUE(rc.ok() && rc->has_value());
  EXPECT_EQ((*rc)->token, 3u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*rc)->header), 10), std::string(10, 30));
  EXPECT_FALSE(consumer.Peek()->has_value()) << "D is not published";
  fill(*d, 40, 0);
  producer.Publish(*d, {4, 4});
  auto rd = consumer.Peek();
  ASSERT_TRUE(rd.ok() && rd->has_value());
  EXPECT_EQ((*rd)->token, 4u);
  // The reader holds B, C and D; freeing C and D first frees nothing but the fillers before B
  // (A's, and the room B's 37-byte header left of its 16,384).
  const uint64_t b_start = b->start + 16384 - 64;
  EXPECT_EQ(Get(region->base(), kShmToNodeTail), b_start);
  consumer.Release(**rc);
  consumer.Release(**rd);
  EXPECT_EQ(Get(region->base(), kShmToNodeTail), b_start);
  EXPECT_EQ(consumer.held(), d->end() - b_start);
  consumer.Release(**rb);
  EXPECT_EQ(Get(region->base(), kShmToNodeTail), d->end());
  EXPECT_EQ(consumer.held(), 0u);
  // Held records keep their room: with half the ring held, a record of half the ring waits.
  auto big = producer.Reserve(0, kRing / 2 - 128);
  ASSERT_TRUE(big.ok());
  producer.Publish(*big, {5, 5});
  auto rbig = consumer.Peek();
  ASSERT_TRUE(rbig.ok() && rbig->has_value());
  EXPECT_EQ(producer.Reserve(0, kRing / 2 - 128).status().code(), C::kResourceExhausted);
  consumer.Release(**rbig);
  EXPECT_TRUE(producer.Reserve(0, kRing / 2 - 128).ok());
}

// A sleeping consumer is woken when a record becomes visible, also when it becomes so because an
// earlier slot was given up (not only when the record itself is published).
TEST(ShmRing, GivingUpASlotWakesASleepingReaderOfTheOnesAfterIt) {
  auto region = ShmRegion::Create(kRing);
  ASSERT_TRUE(region.ok());
  auto bell = NewEventFd();
  ASSERT_TRUE(bell.ok());
  ShmRing producer = region->Ring(ShmDirection::kToNode, bell->get());
  ShmRing consumer = region->Ring(ShmDirection::kToNode, -1);
  consumer.SetSleeping(true);
  auto rung = [&] {
    uint64_t n = 0;
    return ::read(bell->get(), &n, sizeof n) == sizeof n && n > 0;
  };
  auto a = producer.Reserve(0, 64), b = producer.Reserve(0, 64);
  ASSERT_TRUE(a.ok() && b.ok());
  producer.Publish(*b, {2, 2});
  EXPECT_FALSE(rung()) << "B is not visible while A is open";
  producer.Abandon(*a);
  EXPECT_TRUE(rung()) << "giving A up made B visible: the sleeping reader is woken";
  auto r = consumer.Peek();
  ASSERT_TRUE(r.ok() && r->has_value());
  EXPECT_EQ((*r)->token, 2u);
}

// kShmReuseFrom: a writer that finds its ring empty past the first MiB starts at the ring's start
// again, so a steady stream of batches keeps to the same pages; with a record held it goes on.
TEST(ShmRing, AnEmptyRingPastItsFirstMebibyteIsWrittenFromItsStartAgain) {
  constexpr uint64_t kBig = kShmMinRing * 8;
  auto region = ShmRegion::Create(kBig);
  ASSERT_TRUE(region.ok());
  ShmRing producer = region->Ring(ShmDirection::kToShard, -1);
  ShmRing consumer = region->Ring(ShmDirection::kToShard, -1);
  uint8_t* first = nullptr;
  uint8_t* furthest = nullptr;
  for (int i = 0; i < 200; ++i) {  // 200 x 40 KiB: 8 MiB through, the ring's size
    auto s = producer.Reserve(100, 40 << 10);
    ASSERT_TRUE(s.ok()) << s.status();
    if (first == nullptr) first = s->payload;
    furthest = std::max(furthest, s->payload);
    std::memset(s->payload, i, s->payload_bytes);
    producer.Publish(*s, {static_cast<uint64_t>(i), 1});
    auto r = consumer.Peek();
    ASSERT_TRUE(r.ok() && r->has_value()) << i;
    EXPECT_EQ((*r)->token, static_cast<uint64_t>(i));
    EXPECT_EQ((*r)->payload[(40 << 10) - 1], static_cast<uint8_t>(i));
    consumer.Release(**r);
  }
  EXPECT_LT(furthest - first, static_cast<ptrdiff_t>(kShmReuseFrom + (64 << 10)))
      << "the records stayed in the first MiB and one record";
  // A record the reader holds keeps the writer going forward (nothing behind it is free).
  auto held_slot = producer.Reserve(0, 40 << 10);
  ASSERT_TRUE(held_slot.ok());
  producer.Publish(*held_slot, {1000, 1});
  auto held = consumer.Peek();
  ASSERT_TRUE(held.ok() && held->has_value());
  uint8_t* last = held_slot->payload;
  for (int i = 0; i < 40; ++i) {
    auto s = producer.Reserve(0, 40 << 10);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_GT(s->payload, last) << i;
    last = s->payload;
    producer.Publish(*s, {static_cast<uint64_t>(2000 + i), 1});
    auto r = consumer.Peek();
    ASSERT_TRUE(r.ok() && r->has_value());
    consumer.Release(**r);
  }
  EXPECT_GT(last - first, static_cast<ptrdiff_t>(kShmReuseFrom)) << "past the first MiB";
  consumer.Release(**held);
}

TEST(ShmRegion, OnlyASealedMemfdOfTheRightSizeIsMapped) {
  auto memfd = [](int seals, off_t size) {
    OwnedFd fd(::memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    EXPECT_EQ(::ftruncate(fd.get(), size), 0);
    if (seals != 0) {
      EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, seals), 0);
    }
    return fd;
  };
  const off_t right = kShmControlBytes + 2 * kRing;
  auto unsealed = ShmRegion::Map(memfd(0, right), kRing);
  EXPECT_EQ(unsealed.status().code(), C::kInvalidArgument);
  EXPECT_NE(unsealed.status().message().find("not sealed"), std::string::npos);
  EXPECT_EQ(ShmRegion::Map(memfd(F_SEAL_GROW, right), kRing).status().code(), C::kInvalidArgument);
  auto small = ShmRegion::Map(memfd(F_SEAL_SHRINK | F_SEAL_GROW, right - 4096), kRing);
  EXPECT_EQ(small.status().code(), C::kInvalidArgument);
  EXPECT_NE(small.status().message().find("bytes"), std::string::npos);
  EXPECT_EQ(ShmRegion::Map(memfd(F_SEAL_SHRINK | F_SEAL_GROW, right), kRing * 3).status().code(),
            C::kInvalidArgument);
  EXPECT_EQ(ShmRegion::Map(memfd(F_SEAL_SHRINK | F_SEAL_GROW, right), 12345).status().code(),
            C::kInvalidArgument);
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  ::close(p[1]);
  EXPECT_EQ(ShmRegion::Map(OwnedFd(p[0]), kRing).status().code(), C::kInvalidArgument);
  // A file that is not a memfd (the temporary directory's) has no seals to add.
  std::string path = ::testing::TempDir() + "/shm_region_XXXXXX";
  OwnedFd file(::mkstemp(path.data()));
  ::unlink(path.c_str());
  ASSERT_EQ(::ftruncate(file.get(), right), 0);
  EXPECT_EQ(ShmRegion::Map(std::move(file), kRing).status().code(), C::kInvalidArgument);
  // What the node makes is what the shard maps, and they see each other's writes.
  auto made = ShmRegion::Create(kRing);
  ASSERT_TRUE(made.ok());
  auto mapped = ShmRegion::Map(OwnedFd(::fcntl(made->fd(), F_DUPFD_CLOEXEC, 0)), kRing);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  made->base()[kShmControlBytes + 5] = 42;
  EXPECT_EQ(mapped->base()[kShmControlBytes + 5], 42);
  EXPECT_NE(::ftruncate(made->fd(), 4096), 0) << "the seal holds against the node too";
}

TEST(ShmDescriptors, ADatagramWithTooManyDescriptorsIsRefusedAndClosesThemAll) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  OwnedFd a(sv[0]), b(sv[1]);
  auto e1 = NewEventFd(), e2 = NewEventFd();
  ASSERT_TRUE(e1.ok() && e2.ok());
  EXPECT_TRUE(IsEventFd(e1->get()));
  EXPECT_FALSE(IsEventFd(a.get()));
  const int before = OpenFds();
  ASSERT_TRUE(SendWithFds(a.get(), "hello", {e1->get(), e2->get(), e1->get(), e2->get()}).ok());
  auto got = ReceiveWithFds(b.get(), 64, 3);
  EXPECT_EQ(got.status().code(), C::kInvalidArgument);
  EXPECT_EQ(OpenFds(), before) << "every descriptor that arrived was closed";
  ASSERT_TRUE(SendWithFds(a.get(), std::string(100, 'x'), {}).ok());
  EXPECT_EQ(ReceiveWithFds(b.get(), 64, 3).status().code(), C::kInvalidArgument);
  EXPECT_EQ(ReceiveWithFds(b.get(), 64, 3).status().code(), C::kUnavailable) << "nothing left";
  ASSERT_TRUE(SendWithFds(a.get(), "ok", {e1->get()}).ok());
  auto one = ReceiveWithFds(b.get(), 64, 3);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->bytes, "ok");
  ASSERT_EQ(one->fds.size(), 1u);
  EXPECT_TRUE(IsEventFd(one->fds[0].get()));
  a = OwnedFd();
  EXPECT_EQ(ReceiveWithFds(b.get(), 64, 3).status().code(), C::kAborted);
}

TEST(ShmDescriptors, AnAbstractListenerTakesConnectionsAndNamesTheirUser) {
  auto l = ListenAbstract("moe-shm-test");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->address.substr(0, 14), "@moe-shm-test-");
  auto c = ConnectAbstract(l->address);
  ASSERT_TRUE(c.ok()) << c.status();
  OwnedFd s(::accept4(l->fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(s.valid());
  auto uid = PeerUid(s.get());
  ASSERT_TRUE(uid.ok());
  EXPECT_EQ(*uid, ::geteuid());
  EXPECT_EQ(ConnectAbstract("@moe-shm-test-nobody").status().code(), C::kUnavailable);
  EXPECT_EQ(ConnectAbstract("moe-shm-test").status().code(), C::kInvalidArgument);
  EXPECT_EQ(ConnectAbstract("@" + std::string(200, 'x')).status().code(), C::kInvalidArgument);
}

}  // namespace
}  // namespace moe::dataplane
