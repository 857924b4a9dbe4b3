// The fake backend's server half (server_half.h) on the in-process wire
// (services/dataplane/fake_wire.h): the same handshake and the same sealed batch messages as UCX
// (OpenDataPlane's client id, hello secret and MAC key; a hello that binds the client to its
// reply address; BatchFrame with the connection's AES-GMAC; the replay window), with no library
// below them. For tests of the layers above the wire, and the template of a new transport.
//
//   MOE_ASSIGN_OR_RETURN(std::unique_ptr<ServerHalf> h, StartFakeServerHalf(options));
#ifndef MOE_EXPERT_SVC_DATAPLANE_FAKE_FAKE_SERVER_HALF_H_
#define MOE_EXPERT_SVC_DATAPLANE_FAKE_FAKE_SERVER_HALF_H_

#include <memory>

#include "absl/status/statusor.h"
#include "expert-svc/dataplane/server_half.h"

namespace moe::expert_svc {

// FAILED_PRECONDITION without on_batch (the fake has no previous protocol).
absl::StatusOr<std::unique_ptr<ServerHalf>> StartFakeServerHalf(ServerHalfOptions options);

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_DATAPLANE_FAKE_FAKE_SERVER_HALF_H_
