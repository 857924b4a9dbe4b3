// The Prometheus endpoint of a service: a prometheus-cpp registry (and other collectables)
// serialized in the text format at GET /metrics by the process's HTTP server (http_server.h) on
// its own port (0: any free port; read it back with port()).
//
//   MOE_ASSIGN_OR_RETURN(auto metrics, MetricsServer::Start("127.0.0.1", 0));
//   ExpertMetrics m(metrics->registry(), /*layers=*/{1}, "shard-0");
#ifndef MOE_SERVICES_METRICS_METRICS_SERVER_H_
#define MOE_SERVICES_METRICS_METRICS_SERVER_H_

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace prometheus {
class Collectable;
class Registry;
}  // namespace prometheus

namespace moe::metrics {

class HttpServer;
struct HttpRequest;
struct HttpResponse;

class MetricsServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& host, int port);
  ~MetricsServer();

  prometheus::Registry& registry() { return *registry_; }
  // Another collectable scraped at /metrics (held weakly: it goes when its owner drops it).
  void Add(const std::shared_ptr<prometheus::Collectable>& c);
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  HttpResponse Scrape(const HttpRequest& r);

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> process_;  // process_* metrics
  std::mutex mu_;
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables_;
  std::unique_ptr<HttpServer> server_;  // last: stopped first
  int port_ = 0;
};

}  // namespace moe::metrics

#endif  // MOE_SERVICES_METRICS_METRICS_SERVER_H_
