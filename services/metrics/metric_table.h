// The one table of the project's metrics: name, type, labels, the HELP text /metrics exports,
// the documentation's meaning, and the names operators know from elsewhere (Triton's
// nv_inference_* and the Gateway API Inference Extension's model-server semantics). The
// services register each metric by its name and take its HELP from here; docs/metrics.md is
// generated from it (`moe-tool metrics > docs/metrics.md`, checked by ctest docs.metrics_page).
//
//   BuildCounter().Name("moe_errors_total").Help(HelpOf("moe_errors_total"))
#ifndef MOE_SERVICES_METRICS_METRIC_TABLE_H_
#define MOE_SERVICES_METRICS_METRIC_TABLE_H_

#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace moe::metrics {

struct MetricInfo {
  absl::string_view name;
  absl::string_view type;     // counter, gauge or histogram
  absl::string_view labels;   // comma-separated label names ("" none)
  absl::string_view help;     // the HELP line /metrics exports
  absl::string_view doc;      // the meaning, in the reference page (Markdown)
  absl::string_view triton;   // the Triton metric an operator would read instead ("" none)
  absl::string_view gateway;  // the Gateway API Inference Extension semantic it serves ("" none)
  // How to read this metric as the Triton one ("": the same quantity).
  absl::string_view triton_how = "";
};

absl::Span<const MetricInfo> AllMetrics();
// The row of a metric; aborts naming it when it has none.
const MetricInfo& Metric(absl::string_view name);
std::string HelpOf(absl::string_view name);
// The reference page (docs/metrics.md): the mapping to Triton's and the gateway's names, then
// every metric.
std::string MetricsReferencePage();

}  // namespace moe::metrics

#endif  // MOE_SERVICES_METRICS_METRIC_TABLE_H_
