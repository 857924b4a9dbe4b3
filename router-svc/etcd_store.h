// router-svc's state in etcd (Debian etcd-server; its v3 API over gRPC, proto/etcd), for
// several router replicas of which one leads: the same StateStore as the SQLite one, on keys
// under a prefix, plus leader election on an etcd lease.
//
//   <prefix>/leader                     the leader's name, on its lease
//   <prefix>/bias/<layer>/<version>     a moe.v1.LayerBias
//   <prefix>/mode/<layer>               a moe.v1.SetBiasModeRequest
//   <prefix>/shard/<name>               the lease id, a newline, a RegisterExpertServerRequest
//
// Campaign() blocks until this process holds <prefix>/leader (created only if absent, in one
// transaction, on a lease kept alive from then on). Every write afterwards is fenced: it
// applies only while <prefix>/leader still carries this process's lease, so a leader that was
// stopped and outlived its lease cannot overwrite its successor's state. A leader that loses
// its lease is told (on_lost) and must stop serving.
#ifndef MOE_ROUTER_SVC_ETCD_STORE_H_
#define MOE_ROUTER_SVC_ETCD_STORE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "router-svc/state_store.h"

namespace moe::router_svc {

class EtcdStore final : public StateStore {
 public:
  // endpoint: host:port of etcd's client URL; prefix: e.g. "/moe/router".
  static absl::StatusOr<std::unique_ptr<EtcdStore>> Connect(const std::string& endpoint,
                                                            const std::string& prefix);
  ~EtcdStore() override;

  absl::StatusOr<StoredState> Load() override;
  absl::Status PutBiasVersion(const BiasVersion& v) override;
  absl::Status PutMode(int32_t layer, BiasMode mode, int64_t continuous_tokens) override;
  absl::Status PutShard(const StoredShard& shard) override;
  absl::Status DeleteShard(const std::string& name) override;
  absl::Status MarkInitialized(int64_t unix_ms) override;

  // Waits (polling every 200 ms) until this process is the leader, then keeps its lease
  // (TTL ttl_seconds) alive; false when stopping() turned true first. on_lost: called once,
  // from the keep-alive thread, when the lease is gone.
  absl::StatusOr<bool> Campaign(const std::string& name, int64_t ttl_seconds,
                                const std::function<bool()>& stopping,
                                std::function<void()> on_lost);
  // The current leader's name ("" when none).
  absl::StatusOr<std::string> Leader();

 private:
  class Impl;
  explicit EtcdStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_ETCD_STORE_H_
