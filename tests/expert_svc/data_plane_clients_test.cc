// The expert server's data-plane clients, a pure registry: fresh secrets per client, a hello
// binds only with the right secret, once, to one endpoint; a reconnect from the same node
// replaces the old client; the client limit; malformed hellos refused by name.
#include "expert-svc/data_plane_clients.h"

#include <gtest/gtest.h>

#include "services/dataplane/data_plane.h"

namespace moe::expert_svc {
namespace {

using dataplane::EncodeHello;

TEST(DataPlaneClients, AHelloBindsOnlyWithTheRightSecretOnce) {
  DataPlaneClients clients(4);
  uint64_t replaced = 99;
  auto a = clients.Open("attention-0", &replaced);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(replaced, 0u);
  EXPECT_EQ(a->hello_secret.size(), dataplane::kHelloSecretBytes);
  EXPECT_EQ(a->mac_key.size(), dataplane::kMacKeyBytes);
  auto b = clients.Open("attention-1", &replaced);
  ASSERT_TRUE(b.ok());
  EXPECT_NE(a->hello_secret, b->hello_secret);
  EXPECT_NE(a->mac_key, b->mac_key);
  EXPECT_NE(a->ack_tag, b->ack_tag);
  // Not bound yet.
  EXPECT_EQ(clients.Get(a->id).status().code(), absl::StatusCode::kFailedPrecondition);
  struct Case {
    std::string hello;
    absl::StatusCode code;
  };
  for (const Case& c : {
           Case{"", absl::StatusCode::kInvalidArgument},
           Case{std::string(200, 'x'), absl::StatusCode::kInvalidArgument},
           Case{EncodeHello({a->id, b->hello_secret}), absl::StatusCode::kPermissionDenied},
           Case{EncodeHello({12345, a->hello_secret}), absl::StatusCode::kNotFound},
       }) {
    EXPECT_EQ(clients.Bind(c.hello, 7).status().code(), c.code);
  }
  EXPECT_EQ(clients.Get(a->id).status().code(), absl::StatusCode::kFailedPrecondition);
  auto bound = clients.Bind(EncodeHello({a->id, a->hello_secret}), 7);
  ASSERT_TRUE(bound.ok()) << bound.status();
  EXPECT_EQ(bound->endpoint, 7u);
  EXPECT_TRUE(clients.Bind(EncodeHello({a->id, a->hello_secret}), 7).ok());  // a retry
  EXPECT_EQ(clients.Bind(EncodeHello({a->id, a->hello_secret}), 8).status().code(),
            absl::StatusCode::kAlreadyExists);
  auto got = clients.Get(a->id);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->endpoint, 7u);
  // The key works both ways.
  const uint8_t data[3] = {1, 2, 3};
  auto mac = dataplane::PayloadMac::Create(a->mac_key);
  ASSERT_TRUE(mac.ok());
  EXPECT_TRUE(got->mac->Verify(dataplane::Direction::kToExpert, 1, data, 3,
                               mac->Compute(dataplane::Direction::kToExpert, 1, data, 3)));
}

TEST(DataPlaneClients, ReconnectsReplaceTheirOldEntryWithinTheLimit) {
  DataPlaneClients clients(/*max_clients=*/2);
  uint64_t replaced = 0;
  auto first = clients.Open("n0", &replaced);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(clients.Bind(EncodeHello({first->id, first->hello_secret}), 11).ok());
  auto again = clients.Open("n0", &replaced);  // the same node reconnects
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(replaced, 11u);  // the old endpoint, for the caller to forget
  EXPECT_NE(again->id, first->id);
  EXPECT_EQ(clients.Get(first->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(clients.size(), 1);
  // UCX reused n0's endpoint (its peer died) for n1's hello: n0 reconnecting must not take it.
  auto n1 = clients.Open("n1", &replaced);
  ASSERT_TRUE(n1.ok());
  ASSERT_TRUE(clients.Bind(EncodeHello({again->id, again->hello_secret}), 12).ok());
  ASSERT_TRUE(clients.Bind(EncodeHello({n1->id, n1->hello_secret}), 12).ok());
  auto third = clients.Open("n0", &replaced);
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(replaced, 0u) << "n1's endpoint would be closed under it";
  EXPECT_TRUE(clients.Get(n1->id).ok());
  auto full = clients.Open("n2", &replaced);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("--max_data_plane_clients"), absl::string_view::npos);
  EXPECT_EQ(clients.Open(std::string(200, 'n'), &replaced).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::expert_svc

namespace moe::expert_svc {
namespace {

// Full, the least recently used client idle for a minute makes room (attention pods replaced
// under new names never reconnect); a client in use is never evicted, and then a new one is
// refused by name.
TEST(DataPlaneClients, WhenFullTheLeastRecentlyUsedIdleClientMakesRoom) {
  DataPlaneClients clients(2);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  uint64_t replaced = 0;
  auto a = clients.Open("a", &replaced, t0);
  auto b = clients.Open("b", &replaced, t0);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(clients.Bind(EncodeHello({a->id, a->hello_secret}), 21).ok());
  ASSERT_TRUE(clients.Bind(EncodeHello({b->id, b->hello_secret}), 22).ok());
  // Ten seconds on: both in use recently, none goes.
  auto c = clients.Open("c", &replaced, t0 + absl::Seconds(10));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("none idle for 1m"), std::string::npos) << c.status();
  // a sends a batch at 30 s; at 70 s b (idle since 0) is the one evicted, its endpoint returned.
  ASSERT_TRUE(clients.Get(a->id, t0 + absl::Seconds(30)).ok());
  c = clients.Open("c", &replaced, t0 + absl::Seconds(70));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(replaced, 22u);
  EXPECT_EQ(clients.Get(b->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(clients.Get(a->id).ok());
  EXPECT_EQ(clients.size(), 2);
}

// A batch message's sequence (its MAC nonce) is claimed once per client: a replay, one older
// than the window, sequence 0 and unknown or replaced clients are refused; sequences may come
// out of order within the window (threads of one attention node race to send).
TEST(DataPlaneClients, ASequenceIsClaimedOnceWithinItsWindow) {
  DataPlaneClients clients(4);
  uint64_t replaced = 0;
  auto a = clients.Open("attention-0", &replaced);
  auto b = clients.Open("attention-1", &replaced);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(clients.ClaimSequence(a->id, 5));
  EXPECT_FALSE(clients.ClaimSequence(a->id, 5));  // replay
  EXPECT_TRUE(clients.ClaimSequence(b->id, 5));   // another client's own numbering
  EXPECT_TRUE(clients.ClaimSequence(a->id, 3));   // late, in the window
  EXPECT_FALSE(clients.ClaimSequence(a->id, 3));
  EXPECT_TRUE(clients.ClaimSequence(a->id, 4));
  EXPECT_FALSE(clients.ClaimSequence(a->id, 0));
  EXPECT_FALSE(clients.ClaimSequence(999, 1));  // unknown client
  const uint64_t far = 5 + DataPlaneClients::kReplayWindow;
  EXPECT_TRUE(clients.ClaimSequence(a->id, far));
  EXPECT_FALSE(clients.ClaimSequence(a->id, 5));  // seen
  EXPECT_FALSE(clients.ClaimSequence(a->id, 2));  // older than the window: cannot tell, refused
  EXPECT_TRUE(clients.ClaimSequence(a->id, 6));   // the oldest the window still holds
  EXPECT_TRUE(clients.ClaimSequence(a->id, far - 1));
  EXPECT_TRUE(clients.ClaimSequence(a->id, far + 3 * DataPlaneClients::kReplayWindow));
  EXPECT_FALSE(clients.ClaimSequence(a->id, far));  // the window moved past it
  // A reconnect replaces the client: its id claims nothing any more.
  auto a2 = clients.Open("attention-0", &replaced);
  ASSERT_TRUE(a2.ok());
  EXPECT_FALSE(clients.ClaimSequence(a->id, far + 10 * DataPlaneClients::kReplayWindow));
  EXPECT_TRUE(clients.ClaimSequence(a2->id, 1));
}

// The batch frame: what is encoded parses back; anything but a well-formed frame of the kind
// asked for is refused by name, as is a header longer than the payload.
TEST(BatchFrame, RoundTripsAndRefusesAnythingElse) {
  dataplane::BatchFrame f;
  f.token = 0x0102030405060708ULL;
  f.kind = dataplane::BatchKind::kReply;
  f.client_id = 77;
  f.sequence = 1234567;
  f.header_bytes = 300;
  f.mac = std::string(16, 'm');
  const std::string bytes = dataplane::EncodeBatchFrame(f);
  ASSERT_EQ(bytes.size(), dataplane::kBatchFrameBytes);
  EXPECT_EQ(static_cast<uint8_t>(bytes[0]), 0x08);  // the token first, little-endian
  auto g = dataplane::ParseBatchFrame(bytes, dataplane::BatchKind::kReply, 300);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->token, f.token);
  EXPECT_EQ(g->client_id, 77u);
  EXPECT_EQ(g->sequence, 1234567u);
  EXPECT_EQ(g->header_bytes, 300u);
  EXPECT_EQ(g->mac, f.mac);
  EXPECT_EQ(dataplane::MacPrefix(bytes), bytes.substr(0, dataplane::kBatchFrameMacOffset));
  // The MAC's bytes are not part of what it covers.
  dataplane::BatchFrame unsealed = f;
  unsealed.mac.clear();
  EXPECT_EQ(dataplane::MacPrefix(dataplane::EncodeBatchFrame(unsealed)),
            dataplane::MacPrefix(bytes));
  struct Case {
    std::string bytes;
    dataplane::BatchKind kind;
    size_t payload;
    const char* why;
  };
  std::string magic = bytes, version = bytes, reserved = bytes;
  magic[9] = 'X';
  version[12] = 2;
  reserved[36] = 1;
  for (const Case& c : std::vector<Case>{
           {bytes.substr(0, 55), dataplane::BatchKind::kReply, 300, "a frame has 56"},
           {bytes + "x", dataplane::BatchKind::kReply, 300, "a frame has 56"},
           {magic, dataplane::BatchKind::kReply, 300, "MOEB"},
           {version, dataplane::BatchKind::kReply, 300, "MOEB"},
           {reserved, dataplane::BatchKind::kReply, 300, "reserved"},
           {bytes, dataplane::BatchKind::kRequest, 300, "kind"},
           {bytes, dataplane::BatchKind::kReply, 299, "header"},
       }) {
    auto r = dataplane::ParseBatchFrame(c.bytes, c.kind, c.payload);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.why;
    EXPECT_NE(r.status().message().find(c.why), std::string::npos) << r.status();
  }
}

TEST(ValidateOutOfBand, OnlySizesInRangeAndASixteenByteMacReachUcx) {
  struct Case {
    int64_t activation, reply;
    size_t mac;
    bool ok;
  };
  constexpr int64_t kMax = 1 << 20;
  for (const Case& c : {Case{1, 0, 16, true}, Case{kMax, kMax, 16, true}, Case{0, 8, 16, false},
                        Case{kMax + 1, 8, 16, false}, Case{-5, 8, 16, false},
                        Case{8, -1, 16, false}, Case{8, kMax + 1, 16, false}, Case{8, 8, 15, false},
                        Case{8, 8, 0, false}, Case{8, 8, 17, false}}) {
    OutOfBandHeader h;
    h.activation_bytes = c.activation;
    h.reply_bytes = c.reply;
    h.activation_mac.assign(c.mac, 'm');
    const absl::Status s = ValidateOutOfBand(h, kMax, "shard-0, batch 3");
    EXPECT_EQ(s.ok(), c.ok) << c.activation << " " << c.reply << " " << c.mac << ": " << s;
    if (!s.ok()) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find("shard-0, batch 3"), absl::string_view::npos);
    }
  }
}

}  // namespace
}  // namespace moe::expert_svc
