// The shm backend's client half (client_half.h; services/dataplane/shm_lane.h): per shard, after
// OpenDataPlane over the authenticated gRPC call, a sealed memfd of two rings (kShmClientRing
// each way) and two eventfds handed to the shard in a hello on its Unix socket. A batch is one
// record written straight into the ring to the shard; the thread that waits for a reply reads
// the ring from the shard itself (one waiter at a time reads for all, the others sleep until it
// hands over), spinning a bounded while, then sleeping on its eventfd; a reply's rows are read
// in place while the replies held leave half the ring free. A batch or a reply larger than half
// a ring, and every batch to a shard it cannot open to (no shm offered, its socket not in this
// network namespace or not of this user), goes to the next backend (ChannelOptions::next:
// UCX under auto), else in band (counted "fallback") where allowed.
//
//   MOE_ASSIGN_OR_RETURN(std::unique_ptr<ClientHalf> h, StartShmClientHalf(options));
#ifndef MOE_ATTENTION_SVC_DATAPLANE_SHM_SHM_CLIENT_HALF_H_
#define MOE_ATTENTION_SVC_DATAPLANE_SHM_SHM_CLIENT_HALF_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "attention-svc/dataplane/client_half.h"

namespace moe::attention_svc {

// Each ring's bytes (pages come as batches reach them, the first MiB's again and again:
// dataplane::kShmReuseFrom; each is charged to whoever writes it first: the ring to the shard to
// the node, the ring back to the shard).
constexpr uint64_t kShmClientRing = uint64_t{64} << 20;

absl::StatusOr<std::unique_ptr<ClientHalf>> StartShmClientHalf(ClientHalfOptions options);

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_DATAPLANE_SHM_SHM_CLIENT_HALF_H_
