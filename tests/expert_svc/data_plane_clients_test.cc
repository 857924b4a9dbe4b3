// The expert server's data-plane clients, with real UCX workers of this process (TCP): ids never
// reused, a reconnect from the same worker replaces the old client, the client limit, bad
// addresses.
#include "expert-svc/data_plane_clients.h"

#include <gtest/gtest.h>

#include "services/dataplane/ucx_worker.h"

namespace moe::expert_svc {
namespace {

std::unique_ptr<dataplane::UcxWorker> Worker() {
  dataplane::UcxOptions o;
  o.tls = "tcp";
  auto w = dataplane::UcxWorker::Create(o);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : nullptr;
}

TEST(DataPlaneClients, ReconnectsReplaceTheirOldEntryWithinTheLimit) {
  if (!dataplane::UcxBuilt()) GTEST_SKIP() << "built without UCX";
  auto server = Worker(), a = Worker(), b = Worker();
  ASSERT_NE(b, nullptr);
  DataPlaneClients clients(/*max_clients=*/1);
  auto first = clients.Open(*server, a->address());
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(clients.Endpoint(*first).ok());
  auto again = clients.Open(*server, a->address());  // the same node reconnects
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(*again, *first);
  EXPECT_EQ(clients.Endpoint(*first).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(clients.Endpoint(*again).ok());
  auto other = clients.Open(*server, b->address());  // a second node: past the limit of 1
  EXPECT_EQ(other.status().code(), absl::StatusCode::kResourceExhausted) << other.status();
  EXPECT_EQ(clients.Open(*server, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(clients.Open(*server, std::string((64 << 10) + 1, 'x')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe::expert_svc
