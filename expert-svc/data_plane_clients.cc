#include "expert-svc/data_plane_clients.h"

#include "absl/strings/str_cat.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/ucx_worker.h"

namespace moe::expert_svc {

absl::StatusOr<uint64_t> DataPlaneClients::Open(dataplane::UcxWorker& worker,
                                                const std::string& address) {
  if (address.empty() || address.size() > (64 << 10)) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_address of ", address.size(), " bytes (need 1 to 65536)"));
  }
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = clients_.begin(); it != clients_.end();) {
      if (it->second.address == address) {
        worker.Disconnect(it->second.endpoint);
        it = clients_.erase(it);
      } else {
        ++it;
      }
    }
    if (static_cast<int>(clients_.size()) >= max_clients_) {
      return absl::ResourceExhaustedError(
          absl::StrCat(max_clients_, " data-plane clients already (--max_data_plane_clients)"));
    }
    if (next_ > dataplane::kMaxClientId) {
      return absl::ResourceExhaustedError("data-plane client ids exhausted");
    }
    id = next_++;
  }
  // A failed peer (its process died) is forgotten; its id is never given again.
  absl::StatusOr<uint64_t> ep = worker.Connect(address, [this, id](const absl::Status&) {
    std::lock_guard<std::mutex> lock(mu_);
    clients_.erase(id);
  });
  if (!ep.ok()) return ep.status();
  std::lock_guard<std::mutex> lock(mu_);
  clients_[id] = Client{*ep, address};
  return id;
}

absl::StatusOr<uint64_t> DataPlaneClients::Endpoint(uint64_t client) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = clients_.find(client);
  if (it == clients_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown data-plane client ", client, " (call OpenDataPlane again)"));
  }
  return it->second.endpoint;
}

}  // namespace moe::expert_svc
