// The one place router-svc's domain types meet the wire contract (proto/moe/v1/router.proto):
// bias versions, modes, placement snapshots, balance figures, reports and ranges.
//
//   *resp = ToProto(ledger.current());
//   MOE_ASSIGN_OR_RETURN(BiasMode m, FromProto(req.mode()));
#ifndef MOE_ROUTER_SVC_ROUTER_PROTO_H_
#define MOE_ROUTER_SVC_ROUTER_PROTO_H_

#include <vector>

#include "absl/status/statusor.h"
#include "moe/v1/router.pb.h"
#include "router-svc/bias_ledger.h"
#include "router-svc/load_window.h"
#include "router-svc/placement_registry.h"
#include "services/numerics/qb.h"

namespace moe::router_svc {

v1::BiasMode ToProto(BiasMode m);
// INVALID_ARGUMENT for UNSPECIFIED or an unknown value.
absl::StatusOr<BiasMode> FromProto(v1::BiasMode m);
v1::LayerBias ToProto(const BiasVersion& v);
v1::ExpertBudget ToProto(const ExpertBudget& b);
ExpertBudget FromProto(const v1::ExpertBudget& b);
v1::Placement ToProto(const PlacementSnapshot& s);
void FillBalance(const numerics::BalanceMetrics& m, v1::Balance* b);
StatsReport FromProto(const v1::ReportStatsRequest& req);
std::vector<LayerRange> FromProto(const google::protobuf::RepeatedPtrField<v1::ExpertRange>& r);
// GetLoadStats of one layer.
void FillLoadStats(const BiasLedger& ledger, const LoadWindow& window,
                   const PlacementRegistry& registry, int64_t rebalances, v1::LoadStats* s);

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_ROUTER_PROTO_H_
