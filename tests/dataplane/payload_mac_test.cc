// The payload integrity check: AES-256-GMAC against the GCM specification's known answer, and
// what a wrong key, nonce, direction or byte does to it; a large payload hashed in pieces on
// threads and joined in GF(2^128) against OpenSSL's one pass.
#include "services/dataplane/payload_mac.h"

#include <gtest/gtest.h>
#include <openssl/evp.h>

#include <atomic>
#include <chrono>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "services/common/thread_pool.h"
#include "services/dataplane/gf128.h"
#include "tests/dataplane/gmac_oracle.h"

namespace moe::dataplane {
namespace {

std::string Hex(const std::string& b) {
  static const char* k = "0123456789abcdef";
  std::string out;
  for (unsigned char c : b) {
    out.push_back(k[c >> 4]);
    out.push_back(k[c & 15]);
  }
  return out;
}

// "The Galois/Counter Mode of Operation (GCM)", McGrew and Viega, test case 13: AES-256, a zero
// key, a zero 96-bit IV, no plaintext, no additional data. Our nonce is (direction, 0, 0, 0,
// sequence big-endian): direction 0 is not a Direction, so the zero IV needs a cast.
TEST(PayloadMac, MatchesTheGcmSpecificationsKnownAnswer) {
  auto mac = PayloadMac::Create(std::string(kMacKeyBytes, '\0'));
  ASSERT_TRUE(mac.ok()) << mac.status();
  EXPECT_EQ(Hex(mac->Compute(static_cast<Direction>(0), 0, nullptr, 0)),
            "530f8afbc74536b9a963b4f1c4cb738b");
}

TEST(PayloadMac, AnyChangeToKeyNonceDirectionOrBytesFailsTheCheck) {
  const std::string key = RandomBytes(kMacKeyBytes);
  auto mac = PayloadMac::Create(key);
  ASSERT_TRUE(mac.ok());
  std::vector<uint8_t> data(100000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 13);
  const std::string tag = mac->Compute(Direction::kToExpert, 7, data.data(), data.size());
  ASSERT_EQ(tag.size(), kMacBytes);
  EXPECT_TRUE(mac->Verify(Direction::kToExpert, 7, data.data(), data.size(), tag));
  EXPECT_FALSE(mac->Verify(Direction::kToExpert, 8, data.data(), data.size(), tag));
  EXPECT_FALSE(mac->Verify(Direction::kToAttention, 7, data.data(), data.size(), tag));
  EXPECT_FALSE(mac->Verify(Direction::kToExpert, 7, data.data(), data.size() - 1, tag));
  EXPECT_FALSE(mac->Verify(Direction::kToExpert, 7, data.data(), data.size(), tag.substr(1)));
  data[54321] ^= 1;
  EXPECT_FALSE(mac->Verify(Direction::kToExpert, 7, data.data(), data.size(), tag));
  data[54321] ^= 1;
  auto other = PayloadMac::Create(RandomBytes(kMacKeyBytes));
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(other->Verify(Direction::kToExpert, 7, data.data(), data.size(), tag));
  EXPECT_FALSE(PayloadMac::Create("short").ok());
}

TEST(Gf128, CarrylessMultiplyIsTheSpecificationsBitByBitOne) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 20000; ++i) {
    const Gf128 x{rng(), rng()}, y{rng(), rng()};
    ASSERT_EQ(Mul(x, y), MulReference(x, y)) << i;
  }
  const Gf128 x{rng(), rng()};
  EXPECT_EQ(MulReference(x, Gf128::One()), x);
  EXPECT_EQ(MulReference(Gf128::One(), x), x);
  // x^127 * x = x^128 = x^7 + x^2 + x + 1: bits 0, 1, 2 and 7 of the first byte (0xE1).
  EXPECT_EQ(MulReference(Gf128{0, 1}, Gf128{uint64_t{1} << 62, 0}),
            (Gf128{uint64_t{0xE1} << 56, 0}));
  EXPECT_EQ(Pow(x, 0), Gf128::One());
  EXPECT_EQ(Pow(x, 5), Mul(Mul(Mul(Mul(x, x), x), x), x));
  uint8_t block[16];
  x.Store(block);
  EXPECT_EQ(Gf128::Load(block), x);
}

// The wide GHASH of every width this CPU has (whole steps, a last step of 2..62 or 4..60 blocks,
// then single blocks) against one block at a time with the bit-by-bit multiply, from a random
// state, at every count to 2 steps and 3 blocks. A width the CPU lacks is said, not run.
TEST(Gf128, WideGhashIsOneBlockAtATime) {
  std::mt19937_64 rng(3);
  const GhashKey key(Gf128{rng(), rng()});
  std::vector<uint8_t> data(16 * (2 * kGhashStepBlocks + 3));
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  int widths_run = 0;
  for (GhashWidth width : {GhashWidth::k512, GhashWidth::k256, GhashWidth::kOne}) {
    if (!GhashWidthAvailable(width)) {
      std::printf("this CPU lacks %s: not run\n", GhashWidthName(width));
      continue;
    }
    ++widths_run;
    for (size_t blocks = 0; blocks <= 2 * kGhashStepBlocks + 3; ++blocks) {
      const Gf128 y0{rng(), rng()};
      Gf128 want = y0;
      for (size_t i = 0; i < blocks; ++i) {
        want = MulReference(want ^ Gf128::Load(data.data() + 16 * i), key.powers[0]);
      }
      ASSERT_EQ(GhashBlocks(key, y0, data.data(), blocks, width), want)
          << GhashWidthName(width) << ", " << blocks << " blocks";
    }
  }
  EXPECT_GE(widths_run, 1);
  EXPECT_TRUE(GhashWidthAvailable(WidestGhash()));
}

// Pieces of every kind of size (one block, not a block, a prefix that ends inside or exactly at
// a block, a last piece of 1 byte, of exactly a piece), on the calling thread and on 3 threads:
// always OpenSSL's one-pass tag.
TEST(PayloadMac, PiecesJoinToTheOnePassTag) {
  const std::string key = RandomBytes(kMacKeyBytes);
  auto mac = PayloadMac::Create(key);
  ASSERT_TRUE(mac.ok());
  ThreadPool pool(3);
  std::mt19937_64 rng(5);
  std::vector<uint8_t> data(1 << 16);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  int cases = 0;
  for (size_t piece : {size_t{16}, size_t{48}, size_t{1024}, size_t{4096}}) {
    for (size_t prefix_len : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}}) {
      if (prefix_len >= piece) continue;
      const std::string prefix(reinterpret_cast<const char*>(data.data()) + 7, prefix_len);
      for (size_t n : {size_t{0}, size_t{1}, piece - prefix_len, piece - prefix_len + 1, 3 * piece,
                       5 * piece - prefix_len, 7 * piece + 9, size_t{40000}}) {
        const uint64_t seq = rng();
        const std::string want =
            OnePass(key, Direction::kToAttention, seq, prefix, data.data() + 3, n);
        EXPECT_EQ(mac->ComputeInPieces(Direction::kToAttention, seq, data.data() + 3, n, prefix,
                                       piece, nullptr),
                  want)
            << "piece " << piece << " prefix " << prefix_len << " n " << n;
        EXPECT_EQ(mac->ComputeInPieces(Direction::kToAttention, seq, data.data() + 3, n, prefix,
                                       piece, &pool),
                  want)
            << "piece " << piece << " prefix " << prefix_len << " n " << n;
        ++cases;
      }
    }
  }
  EXPECT_GE(cases, 100);
}

// Without a pool the pieces are hashed in order on the caller's thread, and `between` runs once
// between each two of them (a shard progresses its transport there): the tag is the one pass's.
TEST(PayloadMac, BetweenRunsBetweenPiecesAndLeavesTheTag) {
  const std::string key = RandomBytes(kMacKeyBytes);
  auto mac = PayloadMac::Create(key);
  ASSERT_TRUE(mac.ok());
  std::vector<uint8_t> data(300001);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 29 + 3);
  const std::string prefix(40, 'p');
  for (size_t n : {size_t{0}, size_t{1000}, kMacPieceBytes - 40, kMacPieceBytes, data.size()}) {
    int calls = 0;
    const std::string tag = mac->ComputeInPieces(Direction::kToAttention, 9, data.data(), n, prefix,
                                                 kMacPieceBytes, nullptr, [&] { ++calls; });
    EXPECT_EQ(tag, OnePass(key, Direction::kToAttention, 9, prefix, data.data(), n)) << n;
    const size_t pieces = (prefix.size() + n + kMacPieceBytes - 1) / kMacPieceBytes;
    EXPECT_EQ(calls, pieces > 1 ? static_cast<int>(pieces) - 1 : 0) << n;
  }
}

// A payload large enough for the process's MAC pool on either GHASH (8 MiB: a K3 shard's reply
// at about 150 tokens) with a frame as prefix. Every piece and the prefix are covered: one bit
// anywhere fails.
TEST(PayloadMac, ALargePayloadHashedOnThreadsIsCheckedInEveryPiece) {
  const std::string key = RandomBytes(kMacKeyBytes);
  auto mac = PayloadMac::Create(key);
  ASSERT_TRUE(mac.ok());
  std::vector<uint8_t> data(std::max(kParallelMacBytes, kParallelWideMacBytes) + 5);
  std::mt19937_64 rng(9);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  std::string prefix = "frame of 40 bytes, as MacPrefix makes...";
  const std::string tag =
      mac->Compute(Direction::kToAttention, 77, data.data(), data.size(), prefix);
  EXPECT_EQ(tag, OnePass(key, Direction::kToAttention, 77, prefix, data.data(), data.size()));
  EXPECT_TRUE(mac->Verify(Direction::kToAttention, 77, data.data(), data.size(), tag, prefix));
  for (size_t at = 0; at < data.size(); at += kMacPieceBytes - 1) {
    data[at] ^= 0x10;
    EXPECT_FALSE(mac->Verify(Direction::kToAttention, 77, data.data(), data.size(), tag, prefix))
        << "a flipped bit at byte " << at;
    data[at] ^= 0x10;
  }
  data.back() ^= 1;
  EXPECT_FALSE(mac->Verify(Direction::kToAttention, 77, data.data(), data.size(), tag, prefix));
  data.back() ^= 1;
  prefix[39] ^= 1;
  EXPECT_FALSE(mac->Verify(Direction::kToAttention, 77, data.data(), data.size(), tag, prefix));
  prefix[39] ^= 1;
  EXPECT_FALSE(
      mac->Verify(Direction::kToAttention, 77, data.data(), data.size() - 16, tag, prefix));
  EXPECT_TRUE(mac->Verify(Direction::kToAttention, 77, data.data(), data.size(), tag, prefix));
}

// A pool busy with another payload is not waited for: the caller hashes in one pass, and the
// tag is the same.
TEST(PayloadMac, ABusyPoolIsNotWaitedFor) {
  const std::string key = RandomBytes(kMacKeyBytes);
  auto mac = PayloadMac::Create(key);
  ASSERT_TRUE(mac.ok());
  ThreadPool pool(2);
  std::atomic<bool> holding{false}, release{false};
  std::thread other([&] {
    pool.ParallelFor(2, [&](int64_t) {
      holding = true;
      while (!release) std::this_thread::yield();
    });
  });
  const auto t0 = std::chrono::steady_clock::now();
  while (!holding && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    std::this_thread::yield();
  }
  ASSERT_TRUE(holding);
  int ran = 0;
  EXPECT_FALSE(pool.TryParallelFor(4, [&](int64_t) { ++ran; }));
  EXPECT_EQ(ran, 0);
  std::vector<uint8_t> data(300000, 7);
  EXPECT_EQ(
      mac->ComputeInPieces(Direction::kToExpert, 3, data.data(), data.size(), {}, 4096, &pool),
      OnePass(key, Direction::kToExpert, 3, "", data.data(), data.size()));
  release = true;
  other.join();
  std::atomic<int> after{0};
  EXPECT_TRUE(pool.TryParallelFor(4, [&](int64_t) { ++after; }));
  EXPECT_EQ(after, 4);
}

TEST(PayloadMac, RandomTagsDoNotRepeat) {
  std::set<uint64_t> seen;
  for (int i = 0; i < 10000; ++i) seen.insert(RandomU64());
  EXPECT_EQ(seen.size(), 10000u);
  EXPECT_NE(RandomBytes(16), RandomBytes(16));
  EXPECT_TRUE(ConstantTimeEqual("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEqual("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEqual("abc", "ab"));
}

}  // namespace
}  // namespace moe::dataplane
