// The standard Prometheus process metrics, read from /proc at every scrape (prometheus-cpp 1.0
// has no process collector): process_cpu_seconds_total, process_resident_memory_bytes,
// process_virtual_memory_bytes, process_open_fds, process_max_fds, process_threads,
// process_start_time_seconds. The names and meanings are the ones client_golang and
// client_python export, so stock dashboards work.
#ifndef MOE_SERVICES_METRICS_PROCESS_COLLECTOR_H_
#define MOE_SERVICES_METRICS_PROCESS_COLLECTOR_H_

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <vector>

namespace moe::metrics {

class ProcessCollector final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override;
};

}  // namespace moe::metrics

#endif  // MOE_SERVICES_METRICS_PROCESS_COLLECTOR_H_
