// The fake backend's client half (client_half.h) on the in-process wire
// (services/dataplane/fake_wire.h): each shard's channel opens the data plane with
// OpenDataPlane, says hello with its reply address, and sends each batch as one sealed message
// (BatchFrame and the connection's AES-GMAC, as UCX does), the reply coming back the same way.
// It reaches only shards in this process (tests; the template of a new transport).
//
//   MOE_ASSIGN_OR_RETURN(std::unique_ptr<ClientHalf> h, StartFakeClientHalf({}));
#ifndef MOE_ATTENTION_SVC_DATAPLANE_FAKE_FAKE_CLIENT_HALF_H_
#define MOE_ATTENTION_SVC_DATAPLANE_FAKE_FAKE_CLIENT_HALF_H_

#include <memory>

#include "absl/status/statusor.h"
#include "attention-svc/dataplane/client_half.h"

namespace moe::attention_svc {

absl::StatusOr<std::unique_ptr<ClientHalf>> StartFakeClientHalf(ClientHalfOptions options);

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_DATAPLANE_FAKE_FAKE_CLIENT_HALF_H_
