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
  ASSERT_TRUE(clients.Open("n1", &replaced).ok());
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
