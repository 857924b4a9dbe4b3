// The shm backend's server half (server_half.h; services/dataplane/shm_lane.h): a Unix socket in
// the abstract namespace where a node that opened the data plane over the authenticated gRPC call
// says hello with its secret and hands over a sealed memfd of two rings and two eventfds. One
// thread of this half waits on every client's doorbell; the compute thread between batches polls
// the rings itself. Each request is copied out of the ring into this process's own memory before
// anything reads it (the node can write the ring at any time), then handed to the core; a
// reply's outputs are computed into their slot in the node's ring (NewReplyBuffer). For a node and
// a shard on one host (a pod's containers, a local cluster): nothing leaves the host, and only a
// process of the same user that holds the secret can say hello.
//
//   MOE_ASSIGN_OR_RETURN(std::unique_ptr<ServerHalf> h, StartShmServerHalf(options));
#ifndef MOE_EXPERT_SVC_DATAPLANE_SHM_SHM_SERVER_HALF_H_
#define MOE_EXPERT_SVC_DATAPLANE_SHM_SHM_SERVER_HALF_H_

#include <memory>

#include "absl/status/statusor.h"
#include "expert-svc/dataplane/server_half.h"

namespace moe::expert_svc {

// FAILED_PRECONDITION without on_batch (the shm lane speaks batch messages only).
absl::StatusOr<std::unique_ptr<ServerHalf>> StartShmServerHalf(ServerHalfOptions options);

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_DATAPLANE_SHM_SHM_SERVER_HALF_H_
