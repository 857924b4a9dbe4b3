#include "services/tools/load_generator.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/common/random.h"
#include "services/tensor/bf16.h"

namespace moe::tools {

using tensor::Bf16;

std::string LoadReport::Format() const {
  std::string s = absl::StrFormat(
      "requests %d (ok %d) in %.2f s: %.1f tokens/s; latency ms p50 %.2f p90 %.2f p99 %.2f max "
      "%.2f",
      requests, ok, seconds, tokens_per_second, p50_ms, p90_ms, p99_ms, max_ms);
  for (const auto& [code, n] : errors) {
    absl::StrAppend(&s, "\n  errors ", code, ": ", n, " (first: ", first_error.at(code), ")");
  }
  return s;
}

absl::StatusOr<LoadReport> RunLoad(client::MoeClient& client, const LoadOptions& o) {
  if (o.hidden <= 0 || o.tokens <= 0 || o.concurrency <= 0 || o.distinct_batches <= 0) {
    return absl::InvalidArgumentError("load generator needs hidden, tokens, concurrency > 0");
  }
  // Inputs ~N(0, 1) in bf16, as SyntheticHiddenStates makes them, one batch per seed.
  std::vector<std::vector<Bf16>> inputs(static_cast<size_t>(o.distinct_batches));
  for (int b = 0; b < o.distinct_batches; ++b) {
    Rng rng(MixSeed(o.seed, {static_cast<uint64_t>(b)}));
    inputs[b].resize(static_cast<size_t>(o.tokens * o.hidden));
    for (Bf16& v : inputs[b]) v = Bf16::FromFloat(rng.Normal());
  }
  std::mutex mu;
  LoadReport report;
  std::vector<double> latencies;
  std::atomic<int64_t> issued{0};
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + absl::ToChronoNanoseconds(o.duration);
  std::vector<std::thread> threads;
  for (int w = 0; w < o.concurrency; ++w) {
    threads.emplace_back([&, w] {
      for (int64_t i = w;; i += o.concurrency) {
        if (std::chrono::steady_clock::now() >= until) return;
        if (o.stop != nullptr && o.stop->load()) return;
        if (issued.fetch_add(1) >= o.max_requests) return;
        const std::vector<Bf16>& x = inputs[static_cast<size_t>(i % o.distinct_batches)];
        const auto t0 = std::chrono::steady_clock::now();
        absl::StatusOr<client::ForwardResult> r =
            client.Forward(o.layer, x, o.tokens, o.hidden, o.forward);
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        std::lock_guard<std::mutex> lock(mu);
        ++report.requests;
        if (r.ok()) {
          ++report.ok;
          report.tokens_ok += o.tokens;
          latencies.push_back(ms);
        } else {
          const std::string code = absl::StatusCodeToString(r.status().code());
          if (report.errors[code]++ == 0) {
            report.first_error[code] = std::string(r.status().message());
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  report.tokens_per_second = report.tokens_ok / std::max(report.seconds, 1e-9);
  if (!latencies.empty()) {
    std::sort(latencies.begin(), latencies.end());
    auto pct = [&](double p) {
      const size_t i = static_cast<size_t>(p * static_cast<double>(latencies.size() - 1) + 0.5);
      return latencies[std::min(i, latencies.size() - 1)];
    };
    report.p50_ms = pct(0.5);
    report.p90_ms = pct(0.9);
    report.p99_ms = pct(0.99);
    report.max_ms = latencies.back();
  }
  return report;
}

}  // namespace moe::tools
