// Quantile Balancing at K3 shape: one exact step and one histogram accumulate + solve over a
// window of m = 16384 tokens, n = 896 experts, k = 16, next to this machine's single-thread
// streaming-read bandwidth measured in the same run (QB reads each fp32 score a few times).
//
//   build/tests/qb_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include <cmath>
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "services/common/random.h"
#include "services/numerics/qb.h"

namespace moe::numerics {
namespace {

constexpr int64_t kTokens = 16384, kExperts = 896, kTopK = 16;

const std::vector<float>& Scores() {
  static const std::vector<float>* s = [] {
    auto* v = new std::vector<float>(static_cast<size_t>(kTokens * kExperts));
    Rng rng(1);
    std::vector<float> offset(kExperts);
    for (float& o : offset) o = 3.0f * static_cast<float>(std::pow(rng.Uniform(), 3.0));
    for (int64_t i = 0; i < kTokens; ++i) {
      for (int64_t j = 0; j < kExperts; ++j) {
        (*v)[i * kExperts + j] = 1.0f / (1.0f + std::exp(-(rng.Normal() + offset[j])));
      }
    }
    return v;
  }();
  return *s;
}

void SetScoreCounters(benchmark::State& state) {
  const double bytes = static_cast<double>(kTokens * kExperts * sizeof(float));
  state.counters["score_bytes_per_s"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
}

// The limit: one thread streaming a 1 GiB buffer (sum of 64-bit words).
void BM_StreamReadOneThread(benchmark::State& state) {
  const size_t words = (size_t{1} << 30) / 8;
  std::vector<uint64_t> buf(words);
  for (size_t i = 0; i < words; ++i) buf[i] = i;
  for (auto _ : state) {
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i < words; i += 4) {
      a += buf[i];
      b += buf[i + 1];
      c += buf[i + 2];
      d += buf[i + 3];
    }
    benchmark::DoNotOptimize(a + b + c + d);
  }
  state.counters["bytes_per_s"] = benchmark::Counter(static_cast<double>(words * 8),
                                                     benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_StreamReadOneThread)->Unit(benchmark::kMillisecond)->Iterations(3);

void BM_RouteLoads(benchmark::State& state) {
  const std::vector<float>& s = Scores();
  const std::vector<float> bias(kExperts, 0.0f);
  for (auto _ : state) benchmark::DoNotOptimize(RouteLoads(s, kTokens, kExperts, bias, kTopK));
  SetScoreCounters(state);
}
BENCHMARK(BM_RouteLoads)->Unit(benchmark::kMillisecond);

void BM_QbExactStep(benchmark::State& state) {
  const std::vector<float>& s = Scores();
  const std::vector<float> bias(kExperts, 0.0f);
  for (auto _ : state) benchmark::DoNotOptimize(QbExactStep(s, kTokens, kExperts, bias, kTopK));
  SetScoreCounters(state);
}
BENCHMARK(BM_QbExactStep)->Unit(benchmark::kMillisecond);

void BM_QbHistogramAccumulateSolve(benchmark::State& state) {
  const std::vector<float>& s = Scores();
  const std::vector<float> bias(kExperts, 0.0f);
  QbWindow w;
  w.top_k = kTopK;
  w.bins = static_cast<int32_t>(state.range(0));
  size_t wire_bytes = 0;
  for (auto _ : state) {
    auto h = QbHistogram::Create(w, bias);
    benchmark::DoNotOptimize(h->Accumulate(s, kTokens));
    benchmark::DoNotOptimize(h->Solve());
    state.PauseTiming();
    wire_bytes = h->Serialize().size();
    state.ResumeTiming();
  }
  SetScoreCounters(state);
  state.counters["serialized_bytes"] = static_cast<double>(wire_bytes);
  state.counters["dense_u32_bytes"] = static_cast<double>(kExperts * w.bins * 4);
}
BENCHMARK(BM_QbHistogramAccumulateSolve)->Arg(100)->Arg(1000)->Unit(benchmark::kMillisecond);

// What an attention node pays per batch (attention-svc/node_stats.cc): one batch of T tokens
// (the argument) counted into the open window's histogram at K3 shape, 1000 bins.
void BM_QbHistogramAccumulateBatch(benchmark::State& state) {
  const std::vector<float>& s = Scores();
  const int64_t t = state.range(0);
  QbWindow w;
  w.top_k = kTopK;
  auto h = QbHistogram::Create(w, std::vector<float>(kExperts, 0.0f));
  int64_t at = 0;
  for (auto _ : state) {
    if (at + t > kTokens) at = 0;
    benchmark::DoNotOptimize(
        h->Accumulate(absl::MakeConstSpan(s).subspan(static_cast<size_t>(at * kExperts),
                                                     static_cast<size_t>(t * kExperts)),
                      t));
    at += t;
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(t), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_QbHistogramAccumulateBatch)
    ->Arg(1)
    ->Arg(4)
    ->Arg(16)
    ->Arg(64)
    ->Arg(256)
    ->Arg(1024)
    ->Unit(benchmark::kMicrosecond);

void BM_QbHistogramWire(benchmark::State& state) {
  const std::vector<float>& s = Scores();
  QbWindow w;
  w.top_k = kTopK;
  auto h = QbHistogram::Create(w, std::vector<float>(kExperts, 0.0f));
  (void)h->Accumulate(s, kTokens);
  size_t bytes = 0;
  for (auto _ : state) {
    const std::string wire = h->Serialize();
    bytes = wire.size();
    benchmark::DoNotOptimize(QbHistogram::Deserialize(wire));
  }
  state.counters["serialized_bytes"] = static_cast<double>(bytes);
}
BENCHMARK(BM_QbHistogramWire)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moe::numerics
