// Reading the Prometheus text format in tests: the sum of the samples of one metric whose labels
// contain every given `key="value"` pair, scraped from a service's /metrics over loopback.
//
//   const double ucx = ScrapeSum(cluster.attention_metrics(), "moe_wire_bytes_total",
//                                {"peer=\"expert\"", "transport=\"ucx\""});
#ifndef MOE_TESTS_COMMON_METRICS_TEXT_H_
#define MOE_TESTS_COMMON_METRICS_TEXT_H_

#include <sstream>
#include <string>
#include <vector>

#include "tests/common/http_client.h"

namespace moe::testing {

inline double MetricSum(const std::string& text, const std::string& name,
                        const std::vector<std::string>& labels) {
  std::istringstream in(text);
  std::string line;
  double sum = 0;
  while (std::getline(in, line)) {
    if (line.rfind(name + "{", 0) != 0 && line.rfind(name + " ", 0) != 0) continue;
    bool all = true;
    for (const std::string& l : labels) all &= line.find(l) != std::string::npos;
    const size_t space = line.rfind(' ');
    if (all && space != std::string::npos) sum += std::stod(line.substr(space + 1));
  }
  return sum;
}

// endpoint: "127.0.0.1:port".
inline double ScrapeSum(const std::string& endpoint, const std::string& name,
                        const std::vector<std::string>& labels) {
  const int port = std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
  const std::string r =
      HttpExchange(port, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  return MetricSum(HttpBodyOf(r), name, labels);
}

}  // namespace moe::testing

#endif  // MOE_TESTS_COMMON_METRICS_TEXT_H_
