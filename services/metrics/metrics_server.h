// The Prometheus endpoint of a service (prometheus-cpp): a registry plus an HTTP exposer on its
// own port (0: any free port; read it back with port()). Scraped at /metrics.
//
//   MOE_ASSIGN_OR_RETURN(auto metrics, MetricsServer::Start("127.0.0.1", 0));
//   ExpertMetrics m(metrics->registry(), /*layers=*/{1}, "shard-0");
#ifndef MOE_SERVICES_METRICS_METRICS_SERVER_H_
#define MOE_SERVICES_METRICS_METRICS_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace prometheus {
class Collectable;
class Exposer;
class Registry;
}  // namespace prometheus

namespace moe::metrics {

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
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<prometheus::Collectable> process_;  // process_* metrics
  int port_ = 0;
};

}  // namespace moe::metrics

#endif  // MOE_SERVICES_METRICS_METRICS_SERVER_H_
