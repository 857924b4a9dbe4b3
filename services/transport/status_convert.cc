#include "services/transport/status_convert.h"

#include <grpcpp/support/status.h>

#include "moe/v1/expert.pb.h"

namespace moe::transport {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpc(const grpc::Status& status) {
  return FromCode(static_cast<int>(status.error_code()), status.error_message());
}

absl::Status FromCode(int code, const std::string& message) {
  if (code == 0) return absl::OkStatus();
  if (code < 0 || code > 16) code = static_cast<int>(absl::StatusCode::kUnknown);
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

void SetBatchStatus(const absl::Status& status, v1::DispatchReply* reply) {
  reply->set_code(static_cast<int>(status.code()));
  reply->set_message(std::string(status.message()));
}

absl::Status BatchStatus(const v1::DispatchReply& reply, const std::string& prefix) {
  if (reply.code() == 0) return absl::OkStatus();
  return FromCode(reply.code(), prefix + ": " + reply.message());
}

}  // namespace moe::transport
