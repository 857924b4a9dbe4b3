// An expert server's window metrics (the last 10 s): the busy ratio and the achieved fractions of
// the machine's limits are the window's sums, exactly, however many batches it holds, and what
// ended more than 10 s ago leaves it.
#include <prometheus/registry.h>

#include <chrono>
#include <string>

#include "gtest/gtest.h"
#include "services/metrics/service_metrics.h"

namespace moe::metrics {
namespace {

using Clock = std::chrono::steady_clock;

// The value of a gauge family's only series, or -1 when it has none.
double Gauge(prometheus::Registry& r, const std::string& name) {
  for (const auto& f : r.Collect()) {
    if (f.name == name && f.metric.size() == 1) return f.metric[0].gauge.value;
  }
  return -1;
}

TEST(ExpertMetricsWindow, SumsOfEveryBatchInTheLastTenSeconds) {
  prometheus::Registry r;
  ExpertMetrics m(r, {1}, "shard-0");
  m.SetMachineLimits(/*read_bytes_per_second=*/1e10, /*fma_flops_per_second=*/1e12, "avx2");
  const Clock::time_point t0 = Clock::now();
  EXPECT_EQ(Gauge(r, "moe_expert_weight_bandwidth_fraction"), -1);  // no compute yet: absent
  // 200,000 small batches within 2 s (a decode-rate stream: 100 per 1 ms), each 10 us of
  // compute, 4,096 bytes of weights and 1e6 FLOPs: 2 s busy, 819.2 MB, 2e11 FLOPs.
  for (int i = 0; i < 200000; ++i) {
    m.BatchDone(1, 0, 10e-6, 8, 4096, 1e6, t0 + std::chrono::microseconds(10 * i));
  }
  const Clock::time_point t_end = t0 + std::chrono::microseconds(10 * 200000);
  m.Tick(t_end);
  EXPECT_DOUBLE_EQ(Gauge(r, "moe_expert_busy_ratio"), 2.0 / 10.0);
  EXPECT_DOUBLE_EQ(Gauge(r, "moe_expert_weight_bandwidth_fraction"), 819.2e6 / 2.0 / 1e10);
  EXPECT_DOUBLE_EQ(Gauge(r, "moe_expert_fma_peak_fraction"), 2e11 / 2.0 / 1e12);
  // One long batch 5 s later: 1 s more in the window.
  m.BatchDone(1, 0, 1.0, 8, 1e9, 1e12, t_end + std::chrono::seconds(5));
  EXPECT_DOUBLE_EQ(Gauge(r, "moe_expert_busy_ratio"), 3.0 / 10.0);
  // 11 s after the stream ended, only the long batch is left; 11 s after that, nothing (the
  // fractions keep the last window's values).
  m.Tick(t_end + std::chrono::seconds(11) + std::chrono::milliseconds(200));
  EXPECT_DOUBLE_EQ(Gauge(r, "moe_expert_busy_ratio"), 1.0 / 10.0);
  EXPECT_DOUBLE_EQ(Gauge(r, "moe_expert_weight_bandwidth_fraction"), 1e9 / 1.0 / 1e10);
  m.Tick(t_end + std::chrono::seconds(16) + std::chrono::milliseconds(200));
  EXPECT_DOUBLE_EQ(Gauge(r, "moe_expert_busy_ratio"), 0.0);
  EXPECT_DOUBLE_EQ(Gauge(r, "moe_expert_weight_bandwidth_fraction"), 1e9 / 1.0 / 1e10);
}

}  // namespace
}  // namespace moe::metrics
