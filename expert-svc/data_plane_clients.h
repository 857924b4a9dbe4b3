// The attention nodes that opened the out-of-band data plane of an expert server
// (ExpertService.OpenDataPlane, docs/data-plane.md): a client id per node, never reused by this
// process, and the UCX endpoint its replies go to. A node that opens again from the same worker
// (a reconnect) replaces its old entry; a node whose endpoint fails is forgotten.
//
//   DataPlaneClients clients(256);
//   MOE_ASSIGN_OR_RETURN(uint64_t id, clients.Open(*worker, request.worker_address()));
//   MOE_ASSIGN_OR_RETURN(uint64_t ep, clients.Endpoint(id));  // NOT_FOUND once forgotten
#ifndef MOE_EXPERT_SVC_DATA_PLANE_CLIENTS_H_
#define MOE_EXPERT_SVC_DATA_PLANE_CLIENTS_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"

namespace moe::dataplane {
class UcxWorker;
}

namespace moe::expert_svc {

class DataPlaneClients {
 public:
  explicit DataPlaneClients(int max_clients) : max_clients_(max_clients) {}

  // A new client id with an endpoint to `address` on `worker` (which must not outlive this).
  // INVALID_ARGUMENT for an empty or over-64-KiB address, RESOURCE_EXHAUSTED past max_clients.
  absl::StatusOr<uint64_t> Open(dataplane::UcxWorker& worker, const std::string& address);
  // The endpoint of a client; NOT_FOUND for an unknown or forgotten one.
  absl::StatusOr<uint64_t> Endpoint(uint64_t client) const;

 private:
  struct Client {
    uint64_t endpoint = 0;
    std::string address;
  };
  const int max_clients_;
  mutable std::mutex mu_;
  std::map<uint64_t, Client> clients_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_DATA_PLANE_CLIENTS_H_
