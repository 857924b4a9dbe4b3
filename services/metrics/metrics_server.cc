#include "services/metrics/metrics_server.h"

#include <prometheus/collectable.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/metrics/http_server.h"
#include "services/metrics/process_collector.h"

namespace moe::metrics {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& host,
                                                                    int port) {
  std::unique_ptr<MetricsServer> m(new MetricsServer());
  m->registry_ = std::make_shared<prometheus::Registry>();
  m->process_ = std::make_shared<ProcessCollector>();
  m->Add(m->registry_);
  m->Add(m->process_);
  // The same server as the page and the REST front (http_server.h): idle and slow scrapers
  // hold a socket each, never a thread; a scrape has no body.
  HttpServerOptions o;
  o.workers = 2;
  o.max_body_bytes = 0;
  auto server = HttpServer::Start(
      host, port, [self = m.get()](const HttpRequest& r) { return self->Scrape(r); }, o);
  if (!server.ok()) {
    return absl::UnavailableError(absl::StrCat("metrics endpoint: ", server.status().message()));
  }
  m->server_ = std::move(*server);
  m->port_ = m->server_->port();
  return m;
}

void MetricsServer::Add(const std::shared_ptr<prometheus::Collectable>& c) {
  std::lock_guard<std::mutex> lock(mu_);
  collectables_.push_back(c);
}

HttpResponse MetricsServer::Scrape(const HttpRequest& r) {
  if (r.path != "/metrics") return {404, "text/plain; charset=utf-8", "not found: /metrics\n"};
  if (r.method != "GET" && r.method != "HEAD") {
    return {405, "text/plain; charset=utf-8", "GET /metrics\n", {{"Allow", "GET, HEAD"}}};
  }
  std::vector<std::shared_ptr<prometheus::Collectable>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = collectables_.begin(); it != collectables_.end();) {
      if (auto c = it->lock()) {
        live.push_back(std::move(c));
        ++it;
      } else {
        it = collectables_.erase(it);  // its owner dropped it
      }
    }
  }
  std::vector<prometheus::MetricFamily> families;
  for (const auto& c : live) {
    std::vector<prometheus::MetricFamily> f = c->Collect();
    families.insert(families.end(), std::make_move_iterator(f.begin()),
                    std::make_move_iterator(f.end()));
  }
  return {200, "text/plain; version=0.0.4; charset=utf-8",
          prometheus::TextSerializer().Serialize(families)};
}

MetricsServer::~MetricsServer() {
  if (server_ != nullptr) server_->Stop();
}

}  // namespace moe::metrics
