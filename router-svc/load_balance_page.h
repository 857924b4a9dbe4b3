// The load-balance page router-svc serves (--web_port): the embedded HTML, JS and CSS
// (router-svc/web/) and the JSON API behind them. It owns no state: it reads and changes the
// router only through the callbacks it is given, and it decides who may change the bias (the
// POSTs need the header X-Moe-Admin-Token equal to the router's admin token; without a
// configured token the page cannot change the bias at all).
//
//   LoadBalancePage page(admin_token, callbacks);
//   HttpServer::Start(host, port, [&](const HttpRequest& r) { return page.Handle(r); });
#ifndef MOE_ROUTER_SVC_LOAD_BALANCE_PAGE_H_
#define MOE_ROUTER_SVC_LOAD_BALANCE_PAGE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "router-svc/bias_ledger.h"
#include "router-svc/load_window.h"
#include "router-svc/placement_registry.h"
#include "services/metrics/http_server.h"

namespace moe::router_svc {

// What the attention nodes reported about dynamic k for one layer (docs/math.md 4.1): each
// node's automatic cap and the changes of it as a time line, and the sampled full-k checks since
// the current version (their count and summed relative output difference).
struct BudgetActivity {
  static constexpr size_t kMaxNodes = 64;    // nodes beyond are not tracked
  static constexpr size_t kMaxEvents = 256;  // the oldest change drops out
  struct Event {
    int64_t unix_ms = 0;
    std::string node;
    int32_t cap = 0;
  };
  std::map<std::string, int32_t> node_cap;
  std::deque<Event> events;
  int64_t checks = 0;
  double rel_diff_sum = 0;
  double mass_kept_sum = 0, top1_sum = 0;  // the same checks' (ReportStatsRequest.budget_*)
  // A node's cap at a report (0: its automatic mode is off); a change joins the time line.
  void Cap(const std::string& node, int32_t cap, int64_t unix_ms);
};

struct PageCallbacks {
  std::function<nlohmann::json()> layers;                              // GET /api/layers
  std::function<absl::StatusOr<nlohmann::json>(int32_t layer)> state;  // GET /api/state
  std::function<absl::StatusOr<nlohmann::json>(int32_t layer)> rebalance;
  std::function<absl::StatusOr<nlohmann::json>(int32_t layer, uint64_t to)> rollback;
  std::function<absl::StatusOr<nlohmann::json>(int32_t layer, int32_t k_avg)> budget;
};

class LoadBalancePage {
 public:
  LoadBalancePage(std::string admin_token, PageCallbacks callbacks);
  metrics::HttpResponse Handle(const metrics::HttpRequest& req) const;

 private:
  const std::string admin_token_;
  const PageCallbacks cb_;
};

// A layer's window as the page shows it (GET /api/state): loads, target, imbalance, noise
// floor, per-shard loads and health, the bias versions.
// budget: the version's budget with what the nodes reported (served cap, checks, time line).
nlohmann::json LayerStateJson(const BiasLedger& ledger, const LoadWindow& window,
                              const std::vector<ShardLoad>& shard_loads,
                              const std::vector<int32_t>& shard_of, int64_t rebalances,
                              const BudgetActivity& budget);

}  // namespace moe::router_svc

#endif  // MOE_ROUTER_SVC_LOAD_BALANCE_PAGE_H_
