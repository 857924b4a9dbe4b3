// The expert server's data-plane backends by name (the --data_plane values besides auto and
// grpc). A new transport is a folder next to ucx/ and fake/ and one line in registry.cc; the
// attention node's registry (attention-svc/dataplane/registry.h) has the twin line.
//
//   std::vector<std::string> names = ServerBackendNames();  // {"ucx", "fake"}
//   MOE_ASSIGN_OR_RETURN(std::unique_ptr<ServerHalf> h, StartServerHalf("ucx", options));
#ifndef MOE_EXPERT_SVC_DATAPLANE_REGISTRY_H_
#define MOE_EXPERT_SVC_DATAPLANE_REGISTRY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "expert-svc/dataplane/server_half.h"

namespace moe::expert_svc {

struct ServerBackend {
  const char* name;
  absl::StatusOr<std::unique_ptr<ServerHalf>> (*start)(ServerHalfOptions options);
};

const std::vector<ServerBackend>& ServerBackends();
std::vector<std::string> ServerBackendNames();

// The named backend started; NOT_FOUND naming the registered ones, or the backend's own error.
absl::StatusOr<std::unique_ptr<ServerHalf>> StartServerHalf(const std::string& name,
                                                            ServerHalfOptions options);

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_DATAPLANE_REGISTRY_H_
