// What of router-svc's control plane survives a restart or a kill -9: per layer, every bias
// version (with reason and time) and the mode; per shard, its registration (lease, endpoint,
// ranges, data plane), so that a shard that keeps heartbeating through the restart keeps its
// place and the first placement after it is complete. Behind a small interface; SQLite in WAL
// mode (Debian libsqlite3-dev) is the store, each write one transaction, in the main db file
// when it returns (the WAL is checkpointed after each: writes are rare).
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
  // When the state was made (router-svc --initialize); 0: never, an empty or lost store that
  // router-svc refuses to start on without --initialize.
  int64_t initialized_unix_ms = 0;
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
  // A registration removed (its lease long expired).
  virtual absl::Status DeleteShard(const std::string& name) = 0;
  // Marks the store as a cluster's state (see StoredState::initialized_unix_ms).
  virtual absl::Status MarkInitialized(int64_t unix_ms) = 0;
};

// The database at path (WAL journal, synchronous FULL, the WAL checkpointed into the main
// file after every write: a copy of the db file alone, or a kill -9 and a lost -wal file, loses
// nothing committed). create: a missing file is made (router-svc --initialize); otherwise
// NOT_FOUND naming the path.
absl::StatusOr<std::unique_ptr<StateStore>> OpenSqliteStore(const std::string& path,
                                                            bool create = true);

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_STATE_STORE_H_
