// A reply's detached tag (services/dataplane/data_plane.h, kDetachTag): the frame flag round
// trips and unknown flags are refused; the tag message a shard builds carries the GMAC of the
// reply frame's prefix (flag included) and payload, checked here against OpenSSL's one pass;
// and the attention node's check accepts exactly that tag for exactly that reply: a changed
// payload byte, another batch's tag, a tag aimed at another token, client or sequence, a reply
// message dressed as a tag, a reply without the flag, and a reply that drops the flag to pass
// with an attached MAC of zeros all fail with DATA_LOSS.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "services/dataplane/data_plane.h"
#include "services/dataplane/payload_mac.h"
#include "tests/dataplane/gmac_oracle.h"

namespace moe::dataplane {
namespace {

TEST(BatchFrameFlags, TheDetachFlagRoundTripsAndUnknownFlagsAreRefused) {
  for (BatchKind kind : {BatchKind::kRequest, BatchKind::kReply}) {
    BatchFrame f;
    f.token = 42;
    f.kind = kind;
    f.flags = kDetachTag;
    const std::string bytes = EncodeBatchFrame(f);
    EXPECT_EQ(static_cast<uint8_t>(bytes[14]), kDetachTag);
    auto g = ParseBatchFrame(bytes, kind, 0);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->flags, kDetachTag);
    std::string unknown = bytes, reserved = bytes;
    unknown[14] = 2;
    reserved[15] = 1;
    for (const std::string& b : {unknown, reserved}) {
      auto r = ParseBatchFrame(b, kind, 0);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  BatchFrame tag;
  tag.kind = BatchKind::kReplyTag;
  tag.flags = kDetachTag;  // a tag message has no flags
  EXPECT_FALSE(ParseBatchFrame(EncodeBatchFrame(tag), BatchKind::kReplyTag, 0).ok());
  EXPECT_EQ(ReplyTagToken(0x1234), 0x1235u);
  EXPECT_EQ(ReplyTagToken(ReplyTagToken(0x1234)), 0x1234u);
}

class DetachedTag : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = PayloadMac::Create(key_);
    ASSERT_TRUE(m.ok());
    mac_ = std::make_unique<PayloadMac>(std::move(*m));
    payload_.resize(300000);  // past one GHASH step and not a whole number of blocks
    for (size_t i = 0; i < payload_.size(); ++i) payload_[i] = static_cast<uint8_t>(i * 131 + 7);
  }
  // The reply a shard sends first (the flag, a MAC of zeros), and its frame's bytes.
  static BatchFrame Reply(uint64_t token, uint64_t sequence, uint8_t flags = kDetachTag) {
    return BatchFrame{token, BatchKind::kReply, kClient, sequence, 100, {}, flags};
  }
  static std::string ReplyFrame(uint64_t token, uint64_t sequence, uint8_t flags = kDetachTag) {
    return EncodeBatchFrame(Reply(token, sequence, flags));
  }
  std::string Tag(const BatchFrame& reply) const {
    return ReplyTagFrame(*mac_, reply, payload_.data(), payload_.size());
  }
  absl::Status Check(const std::string& reply, const std::string& tag, uint64_t sequence = 9) {
    auto r = HashDetachedReply(*mac_, reply, payload_.data(), payload_.size(), kClient, sequence);
    if (!r.ok()) return r.status();
    return CheckReplyTag(*r, tag);
  }
  static constexpr uint64_t kClient = 5;
  const std::string key_ = RandomBytes(kMacKeyBytes);
  std::unique_ptr<PayloadMac> mac_;
  std::vector<uint8_t> payload_;
};

TEST_F(DetachedTag, TheTagIsTheGmacOfTheReplyFrameAndPayload) {
  const std::string reply = ReplyFrame(0x7000, 9);
  const std::string tag = Tag(Reply(0x7000, 9));
  auto t = ParseBatchFrame(tag, BatchKind::kReplyTag, 0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->token, 0x7001u);
  EXPECT_EQ(t->client_id, kClient);
  EXPECT_EQ(t->sequence, 9u);
  EXPECT_EQ(t->header_bytes, 0u);
  EXPECT_EQ(t->mac, OnePass(key_, Direction::kToAttention, 9, std::string(MacPrefix(reply)),
                            payload_.data(), payload_.size()));
  EXPECT_TRUE(Check(reply, tag).ok());
}

TEST_F(DetachedTag, OnlyTheTagOfThisReplyPasses) {
  const std::string reply = ReplyFrame(0x7000, 9);
  const std::string tag = Tag(Reply(0x7000, 9));
  // Another batch of the same connection (sequence 10), and the same reply to another token.
  const std::string other_batch = Tag(Reply(0x7000, 10));
  const std::string other_token = Tag(Reply(0x9000, 9));
  // The right MAC under a frame that names another client, sequence or token, or another kind.
  auto with = [&](int at, uint64_t v, int bytes) {
    std::string b = tag;
    for (int i = 0; i < bytes; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
    return b;
  };
  const std::vector<std::pair<std::string, const char*>> bad = {
      {other_batch, "another batch's tag"},
      {other_token, "a tag for another token"},
      {with(16, kClient + 1, 8), "another client"},
      {with(24, 10, 8), "another sequence"},
      {with(0, 0x7002, 8), "another token"},
      {with(13, static_cast<uint64_t>(BatchKind::kReply), 1), "a reply dressed as a tag"},
      {with(40, 0, 8), "half the MAC zeroed"},
      {tag.substr(0, 55), "a short frame"},
  };
  for (const auto& [b, why] : bad) {
    EXPECT_EQ(Check(reply, b).code(), absl::StatusCode::kDataLoss) << why;
  }
  payload_[123456] ^= 1;
  EXPECT_EQ(Check(reply, tag).code(), absl::StatusCode::kDataLoss) << "a changed payload byte";
  payload_[123456] ^= 1;
  EXPECT_TRUE(Check(reply, tag).ok());
  EXPECT_EQ(Check(reply, tag, /*sequence=*/8).code(), absl::StatusCode::kDataLoss);
}

// The flag is covered by the MAC and decides which check applies: a reply without it is not
// taken as detached, and a detached reply is never opened with the (zero) MAC in its frame, nor
// with the flag removed.
TEST_F(DetachedTag, TheFlagDecidesTheCheckAndCannotBeDropped) {
  const std::string detached = ReplyFrame(0x7000, 9);
  const std::string tag = Tag(Reply(0x7000, 9));
  EXPECT_EQ(Check(ReplyFrame(0x7000, 9, /*flags=*/0), tag).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(
      OpenReplyFrame(*mac_, detached, payload_.data(), payload_.size(), kClient, 9).status().code(),
      absl::StatusCode::kDataLoss);
  // The flag dropped and the tag's MAC put in the frame: the MAC covered the flag.
  BatchFrame dropped{0x7000, BatchKind::kReply, kClient, 9, 100, {}, 0};
  dropped.mac = ParseBatchFrame(tag, BatchKind::kReplyTag, 0)->mac;
  EXPECT_EQ(
      OpenReplyFrame(*mac_, EncodeBatchFrame(dropped), payload_.data(), payload_.size(), kClient, 9)
          .status()
          .code(),
      absl::StatusCode::kDataLoss);
  // An attached reply sealed the usual way still opens.
  BatchFrame attached{0x7000, BatchKind::kReply, kClient, 9, 100, {}, 0};
  const std::string sealed =
      SealBatchFrame(*mac_, Direction::kToAttention, attached, payload_.data(), payload_.size());
  EXPECT_TRUE(OpenReplyFrame(*mac_, sealed, payload_.data(), payload_.size(), kClient, 9).ok());
}

}  // namespace
}  // namespace moe::dataplane
