#include "attention-svc/budget_governor.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace moe::attention_svc {

namespace {
constexpr size_t kMaxLatencies = 4096;  // per interval; beyond, the newest replace at random
}  // namespace

BudgetGovernor::BudgetGovernor(const BudgetGovernorOptions& options, int32_t top_k)
    : options_(options), top_k_(top_k), cap_(top_k) {}

int32_t BudgetGovernor::cap() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cap_;
}

void BudgetGovernor::Observe(double latency_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  if (latencies_.size() < kMaxLatencies) {
    latencies_.push_back(latency_seconds);
  } else {
    latencies_[static_cast<size_t>(latency_seconds * 1e9) % kMaxLatencies] = latency_seconds;
  }
}

void BudgetGovernor::ObserveQueue(int64_t queued) {
  std::lock_guard<std::mutex> lock(mu_);
  max_queued_ = std::max(max_queued_, queued);
}

int BudgetGovernor::Tick(int32_t ceiling, std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  double p99_ms = 0;
  if (!latencies_.empty()) {
    const size_t i = std::min(latencies_.size() - 1, latencies_.size() * 99 / 100);
    std::nth_element(latencies_.begin(), latencies_.begin() + static_cast<int64_t>(i),
                     latencies_.end());
    p99_ms = 1e3 * latencies_[i];
  }
  const bool queue_over = max_queued_ > options_.queue_bound;
  const bool latency_over = options_.p99_ms > 0 && p99_ms > options_.p99_ms;
  *why = absl::StrFormat("queue peak %d (bound %d), p99 %.1f ms (bound %s) over %d forwards",
                         max_queued_, options_.queue_bound, p99_ms,
                         options_.p99_ms > 0 ? absl::StrFormat("%.1f", options_.p99_ms) : "none",
                         latencies_.size());
  latencies_.clear();
  max_queued_ = 0;
  if (!enabled()) return 0;
  const int32_t floor = std::min(options_.floor, top_k_);
  ceiling = std::clamp(ceiling, floor, top_k_);
  if (queue_over || latency_over) {
    clear_ = 0;
    const int32_t from = std::min(cap_, ceiling);
    if (from <= floor) return 0;
    cap_ = from - 1;
    return -1;
  }
  if (cap_ >= top_k_ || ++clear_ < options_.clear_intervals) return 0;
  clear_ = 0;
  cap_ = cap_ + 1 >= ceiling ? top_k_ : cap_ + 1;  // at the ceiling it no longer limits
  return +1;
}

}  // namespace moe::attention_svc
