// The standard Prometheus process metrics, read from /proc at every scrape (prometheus-cpp 1.0
// has no process collector): process_cpu_seconds_total, process_resident_memory_bytes,
// process_virtual_memory_bytes, process_open_fds, process_max_fds, process_threads,
// process_start_time_seconds. The names and meanings are the ones client_golang and
// client_python export, so stock dashboards work. And ScrapedCounter: a counter read at scrape.
#ifndef MOE_SERVICES_METRICS_PROCESS_COLLECTOR_H_
#define MOE_SERVICES_METRICS_PROCESS_COLLECTOR_H_

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace moe::metrics {

class ProcessCollector final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override;
};

// A counter family whose values are read at every scrape from counts kept elsewhere (the UCX
// worker's dropped messages): `read` returns (label value, count) pairs of the one label
// `label`. Stop() before what `read` reads goes away: later scrapes report nothing.
class ScrapedCounter final : public prometheus::Collectable {
 public:
  using Read = std::function<std::vector<std::pair<std::string, double>>()>;
  ScrapedCounter(std::string name, std::string help, std::string label, Read read)
      : name_(std::move(name)),
        help_(std::move(help)),
        label_(std::move(label)),
        read_(std::move(read)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;
  void Stop();

 private:
  const std::string name_, help_, label_;
  mutable std::mutex mu_;
  Read read_;
};

// moe_ucx_messages_dropped_total{kind}, read at every scrape (UcxWorker::DroppedByKind).
std::shared_ptr<ScrapedCounter> UcxMessagesDropped(ScrapedCounter::Read read);
// The same, read from each of a service's data-plane halves (anything with DroppedByKind()),
// their counts side by side; the halves must outlive the counter's Stop().
template <typename Half>
std::shared_ptr<ScrapedCounter> UcxMessagesDropped(std::vector<Half*> halves) {
  return UcxMessagesDropped([halves = std::move(halves)] {
    std::vector<std::pair<std::string, double>> all;
    for (Half* h : halves) {
      for (auto& d : h->DroppedByKind()) all.push_back(std::move(d));
    }
    return all;
  });
}

}  // namespace moe::metrics

#endif  // MOE_SERVICES_METRICS_PROCESS_COLLECTOR_H_
