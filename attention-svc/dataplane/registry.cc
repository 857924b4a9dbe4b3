#include "attention-svc/dataplane/registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attention-svc/dataplane/fake/fake_client_half.h"
#include "attention-svc/dataplane/shm/shm_client_half.h"
#include "attention-svc/dataplane/ucx/ucx_client_half.h"

namespace moe::attention_svc {

const std::vector<ClientBackend>& ClientBackends() {
  static const std::vector<ClientBackend> kBackends = {
      {"ucx", &StartUcxClientHalf},
      {"fake", &StartFakeClientHalf},
      {"shm", &StartShmClientHalf},
  };
  return kBackends;
}

std::vector<std::string> ClientBackendNames() {
  std::vector<std::string> names;
  for (const ClientBackend& b : ClientBackends()) names.emplace_back(b.name);
  return names;
}

absl::StatusOr<std::unique_ptr<ClientHalf>> StartClientHalf(const std::string& name,
                                                            ClientHalfOptions options) {
  for (const ClientBackend& b : ClientBackends()) {
    if (name == b.name) return b.start(std::move(options));
  }
  return absl::NotFoundError(absl::StrCat("no data-plane backend '", name, "' (there are ",
                                          absl::StrJoin(ClientBackendNames(), ", "), ")"));
}

}  // namespace moe::attention_svc
