// The UCX backend's server half (server_half.h): the shard's UCX worker and its clients
// (ucx_data_plane.h) behind the ServerHalf interface, the UCX fields of OpenDataPlane, and the
// previous release's protocol (the header on the Dispatch stream, the payloads as tagged UCX
// messages) as its StreamEndpoint.
//
//   MOE_ASSIGN_OR_RETURN(std::unique_ptr<ServerHalf> h, StartUcxServerHalf(options));
#ifndef MOE_EXPERT_SVC_DATAPLANE_UCX_UCX_SERVER_HALF_H_
#define MOE_EXPERT_SVC_DATAPLANE_UCX_UCX_SERVER_HALF_H_

#include <memory>

#include "absl/status/statusor.h"
#include "expert-svc/dataplane/server_half.h"

namespace moe::expert_svc {

// FAILED_PRECONDITION when UCX is not built in or its worker does not start. Without on_batch the
// shard answers OpenDataPlane with batch_messages false (the previous release's protocol only).
absl::StatusOr<std::unique_ptr<ServerHalf>> StartUcxServerHalf(ServerHalfOptions options);

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_DATAPLANE_UCX_UCX_SERVER_HALF_H_
