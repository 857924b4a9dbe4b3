// A closed-loop load generator on MoeClient: `concurrency` threads each send Forward requests of
// `tokens` synthetic tokens back to back until `duration` passes (or max_requests, or *stop),
// and the report gives tokens/s, latency percentiles and errors by status code.
// Every loop is bounded in time and count.
//
//   LoadOptions o; o.layer = 1; o.hidden = cfg.hidden; o.duration = absl::Seconds(10);
//   MOE_ASSIGN_OR_RETURN(LoadReport r, RunLoad(*client, o));
#ifndef MOE_SERVICES_TOOLS_LOAD_GENERATOR_H_
#define MOE_SERVICES_TOOLS_LOAD_GENERATOR_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/client/moe_client.h"

namespace moe::tools {

struct LoadOptions {
  int32_t layer = 1;
  int64_t hidden = 0;  // H of the model
  int concurrency = 4;
  int64_t tokens = 64;  // per request
  absl::Duration duration = absl::Seconds(10);
  int64_t max_requests = 1000000;
  uint64_t seed = 1;
  int distinct_batches = 16;  // inputs cycle through this many synthetic batches
  client::ForwardOptions forward;
  const std::atomic<bool>* stop = nullptr;  // checked between requests
};

struct LoadReport {
  int64_t requests = 0, ok = 0, tokens_ok = 0;
  double seconds = 0;
  double tokens_per_second = 0;
  double p50_ms = 0, p90_ms = 0, p99_ms = 0, max_ms = 0;
  std::map<std::string, int64_t> errors;           // status code name -> count
  std::map<std::string, std::string> first_error;  // status code name -> first message
  std::string Format() const;
};

absl::StatusOr<LoadReport> RunLoad(client::MoeClient& client, const LoadOptions& options);

}  // namespace moe::tools

#endif  // MOE_SERVICES_TOOLS_LOAD_GENERATOR_H_
