#include "services/metrics/metrics_server.h"

#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include <exception>

#include "absl/strings/str_cat.h"
#include "services/metrics/http_server.h"
#include "services/metrics/process_collector.h"

namespace moe::metrics {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& host,
                                                                    int port) {
  std::unique_ptr<MetricsServer> m(new MetricsServer());
  m->registry_ = std::make_shared<prometheus::Registry>();
  const std::string address = host.find(':') != std::string::npos
                                  ? absl::StrCat("[", host, "]:", port)
                                  : absl::StrCat(host, ":", port);
  try {  // civetweb reports a failed bind by throwing; nothing else here throws
    // Idle or slow scrapers cannot blind it: many workers, 3 s per request, no keep-alive,
    // 16 KiB of headers (http_server.h).
    m->exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", address, "num_threads", absl::StrCat(kHttpWorkers), "request_timeout_ms",
        absl::StrCat(kHttpRequestTimeoutMs), "enable_keep_alive", "no", "max_request_size",
        "16384"});
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics endpoint: cannot listen on ", address, ": ", e.what()));
  }
  m->exposer_->RegisterCollectable(m->registry_);
  m->process_ = std::make_shared<ProcessCollector>();
  m->exposer_->RegisterCollectable(m->process_);
  const std::vector<int> ports = m->exposer_->GetListeningPorts();
  if (ports.empty()) return absl::UnavailableError("metrics endpoint: no listening port");
  m->port_ = ports[0];
  return m;
}

void MetricsServer::Add(const std::shared_ptr<prometheus::Collectable>& c) {
  exposer_->RegisterCollectable(c);
}

MetricsServer::~MetricsServer() {
  if (exposer_ != nullptr) StopCivetPromptly(port_, [this] { exposer_.reset(); });
}

}  // namespace moe::metrics
