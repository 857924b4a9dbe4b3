// The payload integrity check: AES-256-GMAC against the GCM specification's known answer, and
// what a wrong key, nonce, direction or byte does to it.
#include "services/dataplane/payload_mac.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

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
