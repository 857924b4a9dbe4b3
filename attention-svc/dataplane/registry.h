// The attention node's data-plane backends by name (the --data_plane values besides auto and
// grpc). A new transport is a folder next to ucx/ and fake/ and one line in registry.cc; the
// expert server's registry (expert-svc/dataplane/registry.h) has the twin line.
//
//   std::vector<std::string> names = ClientBackendNames();  // {"ucx", "fake"}
//   MOE_ASSIGN_OR_RETURN(std::unique_ptr<ClientHalf> h, StartClientHalf("ucx", options));
#ifndef MOE_ATTENTION_SVC_DATAPLANE_REGISTRY_H_
#define MOE_ATTENTION_SVC_DATAPLANE_REGISTRY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention-svc/dataplane/client_half.h"

namespace moe::attention_svc {

struct ClientBackend {
  const char* name;
  absl::StatusOr<std::unique_ptr<ClientHalf>> (*start)(ClientHalfOptions options);
};

const std::vector<ClientBackend>& ClientBackends();
std::vector<std::string> ClientBackendNames();

// The named backend started; NOT_FOUND naming the registered ones, or the backend's own error.
absl::StatusOr<std::unique_ptr<ClientHalf>> StartClientHalf(const std::string& name,
                                                            ClientHalfOptions options);

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_DATAPLANE_REGISTRY_H_
