#include "services/numerics/cpu/machine_limits.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace moe::numerics::cpu {

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Sums 8-byte words with 4 independent chains (loads, not adds, are the limit).
uint64_t SumWords(const uint64_t* p, size_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i + 4 <= n; i += 4) {
    a += p[i];
    b += p[i + 1];
    c += p[i + 2];
    d += p[i + 3];
  }
  return a + b + c + d;
}

}  // namespace

double MeasureReadBandwidth(ThreadPool* pool, int64_t bytes, int passes) {
  // Items of 4 MiB handed out dynamically: every thread streams, whatever the scheduler does.
  constexpr int64_t kItemBytes = int64_t{4} << 20;
  const int64_t items = std::max<int64_t>(1, bytes / kItemBytes);
  const size_t words = static_cast<size_t>(items * kItemBytes / 8);
  // mmap, so that the pages are first touched (and placed) by the threads that read them.
  void* mem = mmap(nullptr, words * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 0;
  uint64_t* buf = static_cast<uint64_t*>(mem);
  const size_t per_item = static_cast<size_t>(kItemBytes / 8);
  pool->ParallelFor(items, [&](int64_t i) {
    uint64_t* p = buf + i * per_item;
    for (size_t j = 0; j < per_item; ++j) p[j] = j;
  });
  std::vector<double> rates;
  std::vector<uint64_t> sinks(static_cast<size_t>(items));
  for (int pass = 0; pass < std::max(1, passes); ++pass) {
    const auto start = Clock::now();
    pool->ParallelFor(items, [&](int64_t i) { sinks[i] = SumWords(buf + i * per_item, per_item); });
    rates.push_back(static_cast<double>(words * 8) / Since(start));
  }
  volatile uint64_t sink = sinks[0];
  (void)sink;
  munmap(mem, words * 8);
  // The best pass: a neighbour's burst lowers some passes, none raises one above the machine.
  return *std::max_element(rates.begin(), rates.end());
}

namespace {

// The best of 3 passes of `probe` on every thread, each item calibrated to about seconds / 8.
double MeasurePeak(double (*probe)(int64_t), ThreadPool* pool, double seconds) {
  // Calibrate the iterations of one item to about seconds / 8 on one thread.
  int64_t iters = 1 << 14;
  for (;;) {
    const auto start = Clock::now();
    probe(iters);
    const double s = Since(start);
    if (s >= seconds / 64 || iters >= (int64_t{1} << 34)) {
      iters = std::max<int64_t>(1, static_cast<int64_t>(iters * (seconds / 8) / std::max(s, 1e-9)));
      break;
    }
    iters *= 4;
  }
  const int64_t items = 8 * pool->size();  // dynamic items: every thread busy until the end
  std::vector<double> rates;
  std::vector<double> flops(static_cast<size_t>(items));
  for (int pass = 0; pass < 3; ++pass) {
    const auto start = Clock::now();
    pool->ParallelFor(items, [&](int64_t i) { flops[i] = probe(iters); });
    double total = 0;
    for (double f : flops) total += f;
    rates.push_back(total / Since(start));
  }
  return *std::max_element(rates.begin(), rates.end());
}

}  // namespace

double MeasureFmaPeak(const KernelTable& k, ThreadPool* pool, double seconds) {
  return MeasurePeak(k.fma_probe, pool, seconds);
}

double MeasureBf16DotPeak(ThreadPool* pool, double seconds) {
  if (CapIsa(Isa::kAvx512Bf16) != Isa::kAvx512Bf16) return 0;
  return MeasurePeak(KernelsFor(Isa::kAvx512Bf16).dot_probe, pool, seconds);
}

MachineLimits MeasureMachineLimits(const KernelTable& k, ThreadPool* pool,
                                   const LimitsOptions& options) {
  const auto start = Clock::now();
  MachineLimits m;
  m.isa = k.isa;
  m.threads = pool->size();
  m.read_bytes_per_second = MeasureReadBandwidth(pool, options.read_bytes, options.read_passes);
  m.fma_flops_per_second = MeasureFmaPeak(k, pool, options.fma_seconds);
  m.seconds = Since(start);
  return m;
}

}  // namespace moe::numerics::cpu
