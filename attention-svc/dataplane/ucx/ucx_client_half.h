// The UCX backend's client half (client_half.h): this node's UCX worker, and a
// UcxExpertChannel (expert_channel_ucx.h) per shard on it.
//
//   MOE_ASSIGN_OR_RETURN(std::unique_ptr<ClientHalf> h, StartUcxClientHalf(options));
#ifndef MOE_ATTENTION_SVC_DATAPLANE_UCX_UCX_CLIENT_HALF_H_
#define MOE_ATTENTION_SVC_DATAPLANE_UCX_UCX_CLIENT_HALF_H_

#include <memory>

#include "absl/status/statusor.h"
#include "attention-svc/dataplane/client_half.h"

namespace moe::attention_svc {

// FAILED_PRECONDITION when UCX is not built in or its worker does not start.
absl::StatusOr<std::unique_ptr<ClientHalf>> StartUcxClientHalf(ClientHalfOptions options);

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_DATAPLANE_UCX_UCX_CLIENT_HALF_H_
