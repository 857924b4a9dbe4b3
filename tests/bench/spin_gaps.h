// What a polling thread loses on this machine, measured in the same run as the figures it
// bounds: one thread per CPU the process may use spins reading the clock, and every gap of 10 us
// or more between two reads (an interrupt, a preemption, the hypervisor) is counted. A round
// trip whose two ends poll on two CPUs for R us meets such a gap with probability about
// 2 x rate x (R + gap); where that is 1% or more, its p99 is at least p50 plus a typical gap,
// however the data plane is built. In the 2-vCPU Firecracker guests here each CPU lost ~250 gaps
// of 20-50 us a second (1.7% of its time), the rate of its timer tick, so a T = 1 round trip of
// 14 us had a p99 of 37-67 us (docs/data-plane.md).
//
//   const bench::SpinGaps g = bench::MeasureSpinGaps(1.0);
//   std::printf("%s\n", g.Describe(p50_us).c_str());
#ifndef MOE_TESTS_BENCH_SPIN_GAPS_H_
#define MOE_TESTS_BENCH_SPIN_GAPS_H_

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "services/common/cpus.h"

namespace moe::bench {

struct SpinGaps {
  int threads = 0;
  double per_second = 0;  // gaps >= 10 us per second per thread
  double median_us = 0;   // of those gaps
  double lost = 0;        // share of a spinning thread's time in them

  // The chance that a round trip of `rtt_us` polled on two CPUs meets a gap, and what that
  // implies for its p99.
  std::string Describe(double rtt_us) const {
    const double hit = std::min(1.0, 2 * per_second * (rtt_us + median_us) * 1e-6);
    return absl::StrFormat(
        "spinning threads (%d, same run): %.0f gaps/s each of >= 10 us, median %.1f us, %.2f%% "
        "of the time; a %.1f us round trip polled on two CPUs meets one in ~%.1f%% of round "
        "trips%s",
        threads, per_second, median_us, 100 * lost, rtt_us, 100 * hit,
        hit >= 0.01 ? absl::StrFormat(": p99 >= p50 + ~%.0f us on this machine", median_us)
                    : std::string());
  }
};

inline SpinGaps MeasureSpinGaps(double seconds) {
  using Clock = std::chrono::steady_clock;
  const int n = std::max(1, UsableCpus());
  std::vector<std::vector<double>> gaps(n);
  std::vector<std::thread> threads;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      auto last = Clock::now();
      for (auto now = last; now < end; last = now) {
        now = Clock::now();
        const double us = std::chrono::duration<double, std::micro>(now - last).count();
        if (us >= 10 && gaps[i].size() < 1000000) gaps[i].push_back(us);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<double> all;
  for (const auto& g : gaps) all.insert(all.end(), g.begin(), g.end());
  SpinGaps s;
  s.threads = n;
  s.per_second = static_cast<double>(all.size()) / n / seconds;
  double sum = 0;
  for (double g : all) sum += g;
  s.lost = sum * 1e-6 / n / seconds;
  if (!all.empty()) {
    std::nth_element(all.begin(), all.begin() + all.size() / 2, all.end());
    s.median_us = all[all.size() / 2];
  }
  return s;
}

}  // namespace moe::bench

#endif  // MOE_TESTS_BENCH_SPIN_GAPS_H_
