// The one place where absl::Status and grpc::Status meet (STYLE.md "Errors"). Codes map one to
// one (both are google.rpc.Code); per-message codes inside stream replies use the same numbers.
//
//   return transport::ToGrpc(status);                    // in a service handler
//   absl::Status s = transport::FromGrpc(grpc_status);   // in a client
//   SetBatchStatus(status, &reply);                      // one batch of a Dispatch stream
#ifndef MOE_SERVICES_TRANSPORT_STATUS_CONVERT_H_
#define MOE_SERVICES_TRANSPORT_STATUS_CONVERT_H_

#include <string>

#include "absl/status/status.h"

namespace grpc {
class Status;
}  // namespace grpc

namespace moe::v1 {
class DispatchReply;
}  // namespace moe::v1

namespace moe::transport {

grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status);
// A code number from a message field (unknown numbers become UNKNOWN).
absl::Status FromCode(int code, const std::string& message);

// The status of one batch inside a Dispatch stream (its reply's code and message fields):
// written by the expert server, read by the attention node, here and nowhere else.
void SetBatchStatus(const absl::Status& status, v1::DispatchReply* reply);
// OK, or the reply's code with `prefix: message`.
absl::Status BatchStatus(const v1::DispatchReply& reply, const std::string& prefix);

}  // namespace moe::transport

#endif  // MOE_SERVICES_TRANSPORT_STATUS_CONVERT_H_
