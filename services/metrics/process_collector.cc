#include "services/metrics/process_collector.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "services/metrics/metric_table.h"

namespace moe::metrics {
namespace {

prometheus::MetricFamily One(const char* name, const char* help, prometheus::MetricType type,
                             double value) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(m);
  return f;
}

int64_t OpenFds() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int64_t n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n - 1;  // the directory stream's own descriptor
}

}  // namespace

std::vector<prometheus::MetricFamily> ProcessCollector::Collect() const {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> out;
  // /proc/self/stat: fields after the ")" that ends the command name (which may hold spaces).
  std::ifstream stat_file("/proc/self/stat");
  const std::string stat((std::istreambuf_iterator<char>(stat_file)),
                         std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close != std::string::npos) {
    std::istringstream fields(stat.substr(close + 2));
    std::string f[24];  // f[0] is field 3 (state)
    for (std::string& x : f) fields >> x;
    const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
    const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
    // utime 14, stime 15, num_threads 20, starttime 22, vsize 23, rss 24 (proc(5), 1-based).
    out.push_back(One("process_cpu_seconds_total", "User and system CPU time in seconds",
                      MetricType::Counter, (std::stod(f[11]) + std::stod(f[12])) / tick));
    out.push_back(
        One("process_threads", "Threads of the process", MetricType::Gauge, std::stod(f[17])));
    out.push_back(One("process_virtual_memory_bytes", "Virtual memory size in bytes",
                      MetricType::Gauge, std::stod(f[20])));
    out.push_back(One("process_resident_memory_bytes", "Resident set size in bytes",
                      MetricType::Gauge, std::stod(f[21]) * page));
    std::ifstream uptime_file("/proc/uptime");
    double uptime = 0;
    uptime_file >> uptime;
    const double boot = static_cast<double>(::time(nullptr)) - uptime;
    out.push_back(One("process_start_time_seconds", "Start time since the Unix epoch in seconds",
                      MetricType::Gauge, boot + std::stod(f[19]) / tick));
  }
  out.push_back(One("process_open_fds", "Open file descriptors", MetricType::Gauge,
                    static_cast<double>(OpenFds())));
  rlimit lim;
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0) {
    out.push_back(One("process_max_fds", "Limit on open file descriptors", MetricType::Gauge,
                      static_cast<double>(lim.rlim_cur)));
  }
  return out;
}

std::vector<prometheus::MetricFamily> ScrapedCounter::Collect() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!read_) return {};
  prometheus::MetricFamily f;
  f.name = name_;
  f.help = help_;
  f.type = prometheus::MetricType::Counter;
  for (const auto& [value, count] : read_()) {
    prometheus::ClientMetric m;
    m.label.push_back({label_, value});
    m.counter.value = count;
    f.metric.push_back(m);
  }
  return {f};
}

std::shared_ptr<ScrapedCounter> UcxMessagesDropped(ScrapedCounter::Read read) {
  return std::make_shared<ScrapedCounter>("moe_ucx_messages_dropped_total",
                                          HelpOf("moe_ucx_messages_dropped_total"), "kind",
                                          std::move(read));
}

void ScrapedCounter::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  read_ = nullptr;
}

}  // namespace moe::metrics
