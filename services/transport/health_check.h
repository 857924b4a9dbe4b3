// Clients of the standard gRPC health service (grpc.health.v1.Health/Check) and of server
// reflection (grpc.reflection.v1alpha), without generated code for either: their requests are a
// few fixed bytes. Used by the SDK (readiness), the local cluster launcher and tests.
//
//   MOE_ASSIGN_OR_RETURN(bool serving, transport::CheckHealth("127.0.0.1:7001", absl::Seconds(2)));
#ifndef MOE_SERVICES_TRANSPORT_HEALTH_CHECK_H_
#define MOE_SERVICES_TRANSPORT_HEALTH_CHECK_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace moe::transport {

// True when the status of `service` ("" = the server overall) is SERVING.
absl::StatusOr<bool> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                 absl::Duration timeout, const std::string& service = "");
absl::StatusOr<bool> CheckHealth(const std::string& endpoint, absl::Duration timeout,
                                 const std::string& service = "");

// The service names the server lists through reflection (ListServices).
absl::StatusOr<std::vector<std::string>> ListServices(const std::string& endpoint,
                                                      absl::Duration timeout);

}  // namespace moe::transport

#endif  // MOE_SERVICES_TRANSPORT_HEALTH_CHECK_H_
