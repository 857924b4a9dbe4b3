// What cpu_layer_bench's parts share: wall-clock medians, the AMX TDPBF16PS peak probe, the
// result rows (printed as they come and kept for the table at the end), the measured limits.
#ifndef MOE_TESTS_BENCH_CPU_BENCH_COMMON_H_
#define MOE_TESTS_BENCH_CPU_BENCH_COMMON_H_

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace moe::bench {

using Clock = std::chrono::steady_clock;

inline const int kThreads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

inline double Seconds(Clock::time_point a) {
  return std::chrono::duration<double>(Clock::now() - a).count();
}

// Median wall time of `reps` runs of fn (after one warm-up).
inline double Median(int reps, const std::function<void()>& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto s = Clock::now();
    fn();
    t.push_back(Seconds(s));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// TDPBF16PS peak (the AMX set's panel instruction): four independent 16 x 16 fp32 accumulators
// over register-resident A and B tiles, all threads.
struct AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
__attribute__((target("amx-tile,amx-bf16"))) inline void AmxLoop(int64_t iters) {
  alignas(64) AmxConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
  alignas(64) uint16_t a[16 * 32];
  for (uint16_t& v : a) v = 0x3c00;  // bf16 2^-7
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, a, 64);
  _tile_loadd(7, a, 64);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[256];
  _tile_stored(0, out, 64);
  _tile_release();
  volatile float sink = out[0];
  (void)sink;
}

// Median seconds of loop(iters) run on every hardware thread at once.
inline double OnAllThreads(void (*loop)(int64_t), int64_t iters) {
  return Median(3, [&] {
    std::vector<std::thread> t;
    for (int i = 1; i < kThreads; ++i) t.emplace_back(loop, iters);
    loop(iters);
    for (auto& x : t) x.join();
  });
}

inline double AmxPeak() {
  constexpr int64_t kIters = 2000000;
  return 2.0 * 16 * 16 * 32 * 4 * kIters * kThreads / OnAllThreads(AmxLoop, kIters);
}

struct Row {
  std::string what, value, limit, fraction, target;
};
inline std::vector<Row> g_rows;  // every row printed, for the table at the end

inline void Add(std::string what, std::string value, std::string limit = "",
                std::string fraction = "", std::string target = "") {
  std::printf("  %-46s %-22s %-30s %-12s %s\n", what.c_str(), value.c_str(), limit.c_str(),
              fraction.c_str(), target.c_str());
  std::fflush(stdout);
  g_rows.push_back({what, value, limit, fraction, target});
}

inline std::string F(const char* fmt, double v) {
  char b[64];
  std::snprintf(b, sizeof(b), fmt, v);
  return b;
}

// "0.83 ok" or "0.61 SHORT" against a target fraction.
inline std::string Judge(double fraction, double target) {
  return F("%.2f", fraction) + (fraction >= target ? " ok" : " SHORT");
}

struct Limits {
  double bandwidth = 0;      // all threads
  double bandwidth_one = 0;  // one thread (what a 1-thread row can read at most)
  double fma[5][2] = {};     // [isa][0: one thread, 1: all threads]
  double bf16 = 0;
  double amx = 0;  // TDPBF16PS peak, all threads
};

}  // namespace moe::bench

#endif  // MOE_TESTS_BENCH_CPU_BENCH_COMMON_H_
