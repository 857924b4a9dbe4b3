// What of router-svc's control plane survives a restart or a kill -9: per layer, every bias
// version (with reason and time) and the mode; per shard, its registration (lease, endpoint,
// ranges, data plane), so that a shard that keeps heartbeating through the restart keeps its
// place and the first placement after it is complete. Behind a small interface; SQLite in WAL
// mode (Debian libsqlite3-dev) is the store, each write one transaction, on disk when it
// returns.
//
//   MOE_ASSIGN_OR_RETURN(auto store, OpenSqliteStore("/var/lib/moe/router.db"));
//   MOE_ASSIGN_OR_RETURN(StoredState s, store->Load());
//   MOE_RETURN_IF_ERROR(store->PutBiasVersion(ledger.current()));
#ifndef MOE_ROUTER_SVC_STATE_STORE_H_
#define MOE_ROUTER_SVC_STATE_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "router-svc/bias_ledger.h"
#include "router-svc/placement_registry.h"

namespace moe::router_svc {

struct StoredLayer {
  BiasMode mode = BiasMode::kRebalance;
  int64_t continuous_tokens = 0;
  std::vector<BiasVersion> history;  // version == index, from 0
};

struct StoredShard {
  std::string name, endpoint, data_plane;
  uint64_t lease = 0;
  std::vector<LayerRange> ranges;
};

struct StoredState {
  std::map<int32_t, StoredLayer> layers;
  std::vector<StoredShard> shards;
};

class StateStore {
 public:
  virtual ~StateStore() = default;
  // DATA_LOSS when the stored history has a gap (a version missing) or a row is malformed.
  virtual absl::StatusOr<StoredState> Load() = 0;
  virtual absl::Status PutBiasVersion(const BiasVersion& v) = 0;
  virtual absl::Status PutMode(int32_t layer, BiasMode mode, int64_t continuous_tokens) = 0;
  virtual absl::Status PutShard(const StoredShard& shard) = 0;
};

// The database at path (created with its tables if missing; WAL journal, synchronous FULL).
absl::StatusOr<std::unique_ptr<StateStore>> OpenSqliteStore(const std::string& path);

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_STATE_STORE_H_
