// The expert server tests' view of a /metrics page: one sample by name and labels, and the page
// once the production check has matched a number of batches.
#ifndef MOE_TESTS_EXPERT_SVC_METRICS_PAGE_H_
#define MOE_TESTS_EXPERT_SVC_METRICS_PAGE_H_

#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/http_client.h"

namespace moe::expert_svc::testing {

// The value of the first sample of `name` whose labels contain every part of `labels` in a
// Prometheus text page; NaN when there is none.
inline double Sample(const std::string& page, const std::string& name,
                     const std::vector<std::string>& labels) {
  size_t pos = 0;
  while ((pos = page.find(name, pos)) != std::string::npos) {
    const size_t eol = page.find('\n', pos);
    const std::string line = page.substr(pos, eol - pos);
    pos = eol;
    if (line.size() <= name.size() || (line[name.size()] != '{' && line[name.size()] != ' ')) {
      continue;
    }
    bool all = true;
    for (const std::string& l : labels) all &= line.find(l) != std::string::npos;
    if (all) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return std::nan("");
}

// The /metrics page once `matches` production checks have matched (polled for at most 20 s).
inline std::string PageWithMatches(int metrics_port, double matches) {
  std::string page;
  for (int i = 0; i < 200; ++i) {
    page = moe::testing::HttpBodyOf(moe::testing::HttpExchange(
        metrics_port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
    if (Sample(page, "moe_expert_verified_batches_total", {"result=\"match\""}) >= matches) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return page;
}

}  // namespace moe::expert_svc::testing

#endif  // MOE_TESTS_EXPERT_SVC_METRICS_PAGE_H_
