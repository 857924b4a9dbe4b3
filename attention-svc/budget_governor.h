// Dynamic k's automatic mode (docs/math.md section 4.1): a cap on the expert budgets an
// attention node serves, stepped down one expert per interval toward a floor while the node is
// overloaded (its request queue or its recent p99 latency past a bound) and back up one per
// interval once it has been clear for a few intervals. It only decides; attention-svc applies
// the cap (min with the layer's budget and the request's), logs and exports each step.
//
//   BudgetGovernor g(options, /*top_k=*/16);
//   g.Observe(latency_seconds);              // every finished forward
//   g.ObserveQueue(queued);                  // whenever the queue is sampled
//   if (int step = g.Tick(/*ceiling=*/16)) log(step, g.cap());   // every interval
#ifndef MOE_ATTENTION_SVC_BUDGET_GOVERNOR_H_
#define MOE_ATTENTION_SVC_BUDGET_GOVERNOR_H_

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace moe::attention_svc {

struct BudgetGovernorOptions {
  int32_t floor = 0;            // 0: off; else the lowest cap (1..top-k)
  int64_t queue_bound = 8;      // overloaded: more requests than this waited for a worker
  double p99_ms = 0;            // overloaded: the interval's p99 forward latency above (0: unused)
  int64_t interval_ms = 250;    // one decision per interval
  int32_t clear_intervals = 4;  // intervals without overload before a step up
};

class BudgetGovernor {
 public:
  BudgetGovernor(const BudgetGovernorOptions& options, int32_t top_k);

  bool enabled() const { return options_.floor > 0; }
  std::chrono::milliseconds interval() const {
    return std::chrono::milliseconds(options_.interval_ms);
  }
  int32_t cap() const;
  void Observe(double latency_seconds);
  void ObserveQueue(int64_t queued);
  // One interval's decision. ceiling: the highest budget any hosted layer serves (a cap above it
  // limits nothing, so a step down starts from it). Returns -1 (stepped down), +1 (up) or 0;
  // *why says what the interval saw.
  int Tick(int32_t ceiling, std::string* why);

 private:
  const BudgetGovernorOptions options_;
  const int32_t top_k_;
  mutable std::mutex mu_;
  int32_t cap_;
  int32_t clear_ = 0;
  int64_t max_queued_ = 0;
  std::vector<double> latencies_;  // this interval's, bounded
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_BUDGET_GOVERNOR_H_
