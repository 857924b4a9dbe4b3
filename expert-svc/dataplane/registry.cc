#include "expert-svc/dataplane/registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "expert-svc/dataplane/fake/fake_server_half.h"
#include "expert-svc/dataplane/shm/shm_server_half.h"
#include "expert-svc/dataplane/ucx/ucx_server_half.h"

namespace moe::expert_svc {

const std::vector<ServerBackend>& ServerBackends() {
  static const std::vector<ServerBackend> kBackends = {
      {"ucx", &StartUcxServerHalf},
      {"fake", &StartFakeServerHalf},
      {"shm", &StartShmServerHalf},
  };
  return kBackends;
}

std::vector<std::string> ServerBackendNames() {
  std::vector<std::string> names;
  for (const ServerBackend& b : ServerBackends()) names.emplace_back(b.name);
  return names;
}

absl::StatusOr<std::unique_ptr<ServerHalf>> StartServerHalf(const std::string& name,
                                                            ServerHalfOptions options) {
  for (const ServerBackend& b : ServerBackends()) {
    if (name == b.name) return b.start(std::move(options));
  }
  return absl::NotFoundError(absl::StrCat("no data-plane backend '", name, "' (there are ",
                                          absl::StrJoin(ServerBackendNames(), ", "), ")"));
}

}  // namespace moe::expert_svc
