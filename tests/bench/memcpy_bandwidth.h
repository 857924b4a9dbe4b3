// The copy bandwidth of this machine (read + write bytes per second of a 256 MiB memcpy, best
// of 3), the yardstick the benchmarks print next to the bytes/s they move.
#ifndef MOE_TESTS_BENCH_MEMCPY_BANDWIDTH_H_
#define MOE_TESTS_BENCH_MEMCPY_BANDWIDTH_H_

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace moe::bench {

inline double MemcpyBandwidth() {
  using Clock = std::chrono::steady_clock;
  const size_t n = size_t{256} << 20;
  std::vector<char> a(n, 1), b(n, 2);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), n);
    best = std::max(best, 2.0 * n / std::chrono::duration<double>(Clock::now() - t0).count());
    a[rep] = b[n - 1 - rep];  // the copies are used
  }
  return best;
}

}  // namespace moe::bench

#endif  // MOE_TESTS_BENCH_MEMCPY_BANDWIDTH_H_
