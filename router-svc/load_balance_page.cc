#include "router-svc/load_balance_page.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "services/common/secret_file.h"

namespace moe::router_svc {

// The page's files, embedded at build time from router-svc/web/ (cmake/embed_file.cmake).
namespace web {
extern const char kIndexHtml[];
extern const std::size_t kIndexHtmlSize;
extern const char kAppJs[];
extern const std::size_t kAppJsSize;
extern const char kStyleCss[];
extern const std::size_t kStyleCssSize;
}  // namespace web

namespace {

metrics::HttpResponse Json(int status, const nlohmann::json& j) {
  return {status, "application/json", j.dump()};
}

metrics::HttpResponse Error(const absl::Status& s) {
  int status = 500;
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
      status = 400;
      break;
    case absl::StatusCode::kPermissionDenied:
      status = 403;
      break;
    case absl::StatusCode::kNotFound:
      status = 404;
      break;
    case absl::StatusCode::kFailedPrecondition:
      status = 412;
      break;
    default:
      break;
  }
  return Json(status,
              {{"error", std::string(s.message())}, {"code", absl::StatusCodeToString(s.code())}});
}

metrics::HttpResponse JsonOr(const absl::StatusOr<nlohmann::json>& j) {
  return j.ok() ? Json(200, *j) : Error(j.status());
}

}  // namespace

LoadBalancePage::LoadBalancePage(std::string admin_token, PageCallbacks callbacks)
    : admin_token_(std::move(admin_token)), cb_(std::move(callbacks)) {}

metrics::HttpResponse LoadBalancePage::Handle(const metrics::HttpRequest& req) const {
  if (req.method == "GET" && (req.path == "/" || req.path == "/index.html")) {
    return {200, "text/html; charset=utf-8", std::string(web::kIndexHtml, web::kIndexHtmlSize)};
  }
  if (req.method == "GET" && req.path == "/app.js") {
    return {200, "text/javascript; charset=utf-8", std::string(web::kAppJs, web::kAppJsSize)};
  }
  if (req.method == "GET" && req.path == "/style.css") {
    return {200, "text/css; charset=utf-8", std::string(web::kStyleCss, web::kStyleCssSize)};
  }
  if (req.method == "GET" && req.path == "/api/layers") return Json(200, cb_.layers());
  int32_t layer = 0;
  auto it = req.query.find("layer");
  if (it == req.query.end() || !absl::SimpleAtoi(it->second, &layer)) {
    if (req.path.rfind("/api/", 0) == 0) {
      return Error(absl::InvalidArgumentError("the query needs ?layer=<MoE layer>"));
    }
    return {404, "text/plain; charset=utf-8", "not found\n"};
  }
  if (req.method == "GET" && req.path == "/api/state") return JsonOr(cb_.state(layer));
  if (req.path == "/api/rebalance" || req.path == "/api/rollback" || req.path == "/api/budget") {
    if (req.method != "POST") return {405, "text/plain; charset=utf-8", "POST only\n"};
    // The page changes the bias only when router-svc has a token and the request carries it.
    auto token = req.headers.find("x-moe-admin-token");
    if (admin_token_.empty()) {
      return Error(absl::PermissionDeniedError(
          "router-svc was started without an admin token (--admin_token_file): the page cannot "
          "change the bias"));
    }
    if (token == req.headers.end() || !SecretEquals(token->second, admin_token_)) {
      return Error(absl::PermissionDeniedError(token == req.headers.end() || token->second.empty()
                                                   ? "an admin token is required"
                                                   : "the admin token is wrong"));
    }
    if (req.path == "/api/rebalance") return JsonOr(cb_.rebalance(layer));
    if (req.path == "/api/budget") {
      int32_t k_avg = 0;
      auto v = req.query.find("k_avg");
      if (v == req.query.end() || !absl::SimpleAtoi(v->second, &k_avg)) {
        return Error(absl::InvalidArgumentError("budget needs ?k_avg=<experts per token>"));
      }
      return JsonOr(cb_.budget(layer, k_avg));
    }
    uint64_t to = 0;
    auto v = req.query.find("to");
    if (v == req.query.end() || !absl::SimpleAtoi(v->second, &to)) {
      return Error(absl::InvalidArgumentError("rollback needs ?to=<version>"));
    }
    return JsonOr(cb_.rollback(layer, to));
  }
  return {404, "text/plain; charset=utf-8", "not found\n"};
}

void BudgetActivity::Cap(const std::string& node, int32_t cap, int64_t unix_ms) {
  auto it = node_cap.find(node);
  if (it == node_cap.end()) {
    if (node_cap.size() >= kMaxNodes) return;
    it = node_cap.emplace(node, 0).first;
  }
  if (it->second == cap) return;
  it->second = cap;
  events.push_back({unix_ms, node, cap});
  if (events.size() > kMaxEvents) events.pop_front();
}

nlohmann::json LayerStateJson(const BiasLedger& ledger, const LoadWindow& w,
                              const std::vector<ShardLoad>& shard_loads,
                              const std::vector<int32_t>& shard_of, int64_t rebalances,
                              const BudgetActivity& budget) {
  const numerics::BalanceMetrics b = numerics::ComputeBalance(w.window_loads(), shard_of);
  const bool any = w.window_tokens() > 0;
  const double target = static_cast<double>(w.window_tokens()) * w.top_k() / w.experts();
  nlohmann::json j;
  j["layer"] = w.layer();
  j["bias_version"] = ledger.current().version;
  j["mode"] = BiasModeName(ledger.mode());
  j["window_tokens"] = w.window_tokens();
  j["total_tokens"] = w.total_tokens();
  j["loads"] = w.window_loads();
  j["target"] = target;
  j["max_vio"] = any ? b.max_vio : 0.0;
  j["cv"] = any ? b.cv : 0.0;
  j["dead"] = any ? b.dead : 0;
  j["shard_max_over_mean"] = any ? b.shard_max_over_mean : 0.0;
  j["noise_floor"] = any ? numerics::NoiseFloorMaxVio(w.experts(), target) : 0.0;
  j["rebalances"] = rebalances;
  j["shards"] = nlohmann::json::array();
  for (const ShardLoad& x : shard_loads) {
    j["shards"].push_back({{"name", x.name},
                           {"lo", x.lo},
                           {"hi", x.hi},
                           {"load", x.load},
                           {"healthy", x.healthy},
                           {"quarantined", x.quarantined},
                           {"data_plane", x.data_plane},
                           {"lanes", x.lanes}});
  }
  const ExpertBudget& eb = ledger.current().budget;
  int32_t served = eb.thresholds.empty() ? static_cast<int32_t>(w.top_k()) : eb.k_avg;
  for (const auto& [node, cap] : budget.node_cap) {
    if (cap > 0 && !eb.thresholds.empty()) served = std::min(served, cap);
  }
  nlohmann::json events = nlohmann::json::array();
  for (const BudgetActivity::Event& e : budget.events) {
    events.push_back({{"unix_ms", e.unix_ms}, {"node", e.node}, {"cap", e.cap}});
  }
  j["budget"] = {{"k_avg", eb.k_avg},
                 {"k", w.top_k()},
                 {"k_min", eb.k_min},
                 {"solved", !eb.thresholds.empty()},
                 {"solved_from_tokens", eb.solved_from_tokens},
                 {"served", served},
                 {"checks", budget.checks},
                 {"mean_rel_diff", budget.checks > 0 ? budget.rel_diff_sum / budget.checks : 0.0},
                 {"mean_mass_kept", budget.checks > 0 ? budget.mass_kept_sum / budget.checks : 1.0},
                 {"mean_top1_agreement", budget.checks > 0 ? budget.top1_sum / budget.checks : 1.0},
                 {"events", events}};
  j["history"] = nlohmann::json::array();
  for (const BiasVersion& h : ledger.history()) {
    j["history"].push_back(
        {{"version", h.version}, {"reason", h.reason}, {"created_unix_ms", h.created_unix_ms}});
  }
  return j;
}

}  // namespace moe::router_svc
