// The few-token decode of the routed experts: streamed from DRAM against the same call with
// every expert cache-resident, next to this machine's read bandwidth measured in the same run
// (issue: the 1-token decode overlaps its memory stream).
//
//   build/tests/decode_bench [--tokens 1,2,4,8] [--experts 64] [--runs 10] [--isa avx512bf16]
//                            [--threads 2]          (scripts/bench.sh --kernels runs both forms)
//
// Per set (default: the machine's chosen decode set, then every set the CPU has above scalar),
// per tokens per expert, at the K3 expert shape on the threaded expert path (RunExperts, all
// threads): `runs` timed calls over `experts` experts whose weights (17.3 MB each, 1.1 GB for
// 64) stream from DRAM, and as many over the same number of experts that all point at one
// expert's weights (17.3 MB: L3-resident, not L2: it is streamed from L3, so it bounds the
// decode by the L3's bandwidth as well as by the arithmetic). Decode rows add the arithmetic
// alone: the table's row kernel on one work item (128 rows of w1, 230 KB at the K3 shape)
// per thread, L2-resident, repeated, in weight bytes per second. Reported: p10 and p50 of
// each, weight bytes per second, the DRAM time over the cache-resident time (1.0 is perfect
// overlap of memory and arithmetic), p10 over the read bandwidth, and GFLOP/s at p50 of both
// (what prefill counts are judged by: `--experts 4 --tokens 64,...,4096`). The read bandwidth is
// measured before each row (the best of 3 passes of 1 GiB), because a neighbour on a shared
// host moves it by half between minutes (34 and 60 GB/s on one CPU model).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/flags.h"
#include "services/common/model_config.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/machine_limits.h"
#include "tests/bench/random_experts.h"

namespace moe::bench {
namespace {

using numerics::cpu::Isa;
using numerics::cpu::KernelTable;
using Clock = std::chrono::steady_clock;

// Sorted wall times of `runs` calls (after one warm-up).
std::vector<double> Times(int runs, const std::function<void()>& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) {
    const auto s = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - s).count());
  }
  std::sort(t.begin(), t.end());
  return t;
}

// The p-th fraction of sorted times (nearest rank).
double Quantile(const std::vector<double>& t, double p) {
  const size_t i = static_cast<size_t>(p * static_cast<double>(t.size() - 1) + 0.5);
  return t[std::min(i, t.size() - 1)];
}

using Sets = std::vector<std::pair<std::string, const KernelTable*>>;

// The sets to run: the chosen decode set, then every set this CPU runs; or those named.
absl::StatusOr<Sets> ChooseSets(const std::string& isa_list, const moe::ModelConfig& cfg) {
  namespace cpu = moe::numerics::cpu;
  Sets sets;
  if (isa_list.empty()) {
    cpu::KernelChoiceOptions ko;
    ko.latent = cfg.latent;
    ko.intermediate = cfg.intermediate;
    const cpu::KernelChoice& chosen = cpu::ChooseKernels(ko);
    sets.push_back({"chosen " + cpu::KernelsName(chosen.table), &chosen.table});
    for (Isa isa : cpu::kSimdIsas) {
      if (cpu::CapIsa(isa) == isa) sets.push_back({cpu::IsaName(isa), &cpu::KernelsFor(isa)});
    }
    return sets;
  }
  for (absl::string_view name : absl::StrSplit(isa_list, ',', absl::SkipEmpty())) {
    const absl::StatusOr<Isa> isa = cpu::ParseIsa(name);
    if (!isa.ok() || cpu::CapIsa(*isa) != *isa) {
      return absl::InvalidArgumentError("--isa " + std::string(name) + ": not a set this CPU runs");
    }
    sets.push_back({cpu::IsaName(*isa), &cpu::KernelsFor(*isa)});
  }
  return sets;
}

// Every expert once per token, weight 1/experts.
moe::numerics::Routing EveryExpert(int64_t tokens, int experts) {
  moe::numerics::Routing r;
  r.tokens = tokens;
  r.top_k = experts;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) {
      r.expert_ids.push_back(static_cast<int32_t>(e));
      r.weights.push_back(1.0f / static_cast<float>(experts));
    }
  }
  return r;
}

// The decode's arithmetic alone: every thread runs the table's row kernel over its own 128 rows
// of expert 0's w1 (L2-resident after the first call) `reps` times; weight bytes per second of
// all threads, the best of 3 passes.
double ArithmeticAlone(const KernelTable& k, ThreadPool& pool, const moe::numerics::Mxfp4Matrix& m,
                       const moe::tensor::Bf16* z, int64_t tokens) {
  namespace cpu = moe::numerics::cpu;
  constexpr int64_t kRows = 128, kReps = 200;
  std::vector<float> x(static_cast<size_t>(tokens * m.cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = z[i].ToFloat();
  const int64_t ld = cpu::ActivationSlots(k, m.cols);
  std::vector<float> xp(static_cast<size_t>(tokens * ld));
  cpu::PrepareActivations(k, x.data(), tokens, m.cols, xp.data());
  const int items = pool.size();
  std::vector<std::vector<float>> out(static_cast<size_t>(items),
                                      std::vector<float>(static_cast<size_t>(tokens * kRows)));
  double best = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const auto start = Clock::now();
    pool.ParallelFor(items, [&](int64_t i) {
      const int64_t r0 = (i * kRows) % m.rows;
      for (int64_t rep = 0; rep < kReps; ++rep) {
        k.mxfp4_rows(m.packed, m.scales, m.cols, r0, r0 + kRows, xp.data(), ld, tokens,
                     out[static_cast<size_t>(i)].data(), kRows);
      }
    });
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, items * kReps * kRows * (m.cols / 2.0 + m.cols / 32.0) / s);
  }
  return best;
}

struct Row {
  std::string name;
  const KernelTable* table;
  double fma_peak, bf16_peak;
};

// One table row: `runs` calls from DRAM and as many cache-resident, next to the read bandwidth
// measured just before.
void DecodeRow(const Row& row, ThreadPool& pool, const moe::ModelConfig& cfg, const ExpertSet& set,
               const moe::numerics::MoeLayerWeights& cache_resident, int experts, int runs,
               int64_t tokens) {
  namespace cpu = moe::numerics::cpu;
  const moe::numerics::Routing r = EveryExpert(tokens, experts);
  moe::ModelConfig zc = cfg;
  zc.hidden = cfg.latent;
  const std::vector<moe::tensor::Bf16> z = moe::checkpoint::SyntheticHiddenStates(zc, tokens, 3);
  const double read = cpu::MeasureReadBandwidth(&pool, int64_t{1} << 30, 3);
  auto run = [&](const moe::numerics::MoeLayerWeights& w) {
    return Times(runs, [&] {
      auto y = cpu::RunExperts(*row.table, &pool, cfg, w, r, z.data());
      volatile uint16_t sink = y[0].bits;
      (void)sink;
    });
  };
  const std::vector<double> dram = run(set.w), hot = run(cache_resident);
  const bool rows_kernel = tokens < row.table->panel_from || row.table->mxfp4_rows_tm == nullptr;
  const double alone = rows_kernel ? ArithmeticAlone(*row.table, pool, cache_resident.experts[0].w1,
                                                     z.data(), tokens)
                                   : 0;
  const double d10 = Quantile(dram, 0.1), h10 = Quantile(hot, 0.1);
  const double flops = 2.0 * 3 * cfg.latent * cfg.intermediate * tokens * experts;
  const double weight_bytes = static_cast<double>(experts) * cfg.ExpertBytes();
  // Bytes per second and their fraction of the read judge decode counts only (from 16 tokens
  // per expert the arithmetic bounds a call): "-" there.
  const bool decode = tokens <= 8;
  // From 16 tokens, the fraction of the peak of the instruction that multiplies in the kernel
  // that ran (the AMX panel's unit is not probed here: "-").
  const KernelTable* table = row.table;
  const bool panel = table->mxfp4_rows_tm != nullptr && tokens >= table->panel_from;
  const bool dot = panel ? table->tm_layout == cpu::MxLayout::kBf16PairsTm
                         : table->mx_layout == cpu::MxLayout::kBf16Pairs;
  const bool amx = panel && table->mxfp4_rows_tm == cpu::AmxKernels().mxfp4_rows_tm;
  const double peak = dot ? row.bf16_peak : row.fma_peak;
  const std::string of_peak = decode || amx || peak <= 0
                                  ? "-"
                                  : absl::StrFormat("%.2f", flops / Quantile(dram, 0.5) / peak);
  std::printf(
      "| %s | %lld | %.1f | %.2f | %.2f | %.2f | %.2f | %s | %s | %.2f | %s | %.0f | %.0f | %s "
      "|\n",
      row.name.c_str(), static_cast<long long>(tokens), read / 1e9, 1e3 * d10,
      1e3 * Quantile(dram, 0.5), 1e3 * h10, 1e3 * Quantile(hot, 0.5),
      decode ? absl::StrFormat("%.1f", weight_bytes / d10 / 1e9).c_str() : "-",
      decode ? absl::StrFormat("%.2f", weight_bytes / d10 / read).c_str() : "-", d10 / h10,
      decode && alone > 0 ? absl::StrFormat("%.1f (%.2f)", alone / 1e9, alone / read).c_str() : "-",
      flops / Quantile(dram, 0.5) / 1e9, flops / Quantile(hot, 0.5) / 1e9, of_peak.c_str());
  std::fflush(stdout);
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  using namespace moe::bench;
  namespace cpu = moe::numerics::cpu;
  std::vector<int64_t> token_counts = {1, 2, 4, 8};
  int experts = 64, runs = 10;
  std::string isa_list;
  moe::SvcFlags f("decode_bench",
                  "Routed-expert decode from DRAM vs cache-resident, next to the read bandwidth.");
  f.IntList("tokens", &token_counts, "tokens per expert");
  f.Int("experts", &experts, "experts per call (64: 1.1 GB of K3 weights)");
  f.Int("runs", &runs, "timed calls per row (p10 and p50 of these)");
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  f.Int("threads", &threads, "threads of the expert pool (default: every hardware thread)");
  f.String("isa", &isa_list, "sets to run (default: the chosen decode set, then every set)");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  moe::ThreadPool pool(threads);
  moe::ModelConfig cfg = *moe::PresetConfig("k3");
  cfg.num_experts = experts;
  const absl::StatusOr<Sets> sets = ChooseSets(isa_list, cfg);
  if (!sets.ok()) {
    std::fprintf(stderr, "%s\n", std::string(sets.status().message()).c_str());
    return 2;
  }
  std::printf("decode_bench: %d threads, %lld experts of %.1f MB (K3 shape), %lld runs per row\n",
              threads, static_cast<long long>(experts), cfg.ExpertBytes() / 1e6,
              static_cast<long long>(runs));
  // The peaks prefill counts are judged by, measured here: the fp32 FMA peak of each set and the
  // vdpbf16ps peak (the BF16 rows and pair panel multiply on it).
  const double bf16_peak = cpu::MeasureBf16DotPeak(&pool, 0.2);
  std::printf("limits: bf16 dot peak (vdpbf16ps) %.1f GFLOP/s", bf16_peak / 1e9);
  std::vector<Row> rows;
  for (const auto& [name, table] : *sets) {
    rows.push_back({name, table, cpu::MeasureFmaPeak(*table, &pool, 0.2), bf16_peak});
    std::printf(", fp32 FMA %s %.1f", name.c_str(), rows.back().fma_peak / 1e9);
  }
  std::printf(" GFLOP/s (%d threads)\n", threads);
  const ExpertSet set = RandomExperts(cfg, experts);
  // As many experts, every one pointing at expert 0's weights (17.3 MB: L3-resident here).
  moe::numerics::MoeLayerWeights cache_resident = set.w;
  cache_resident.experts.assign(cache_resident.experts.size(), set.w.experts[0]);
  std::printf(
      "| set | tokens/expert | read GB/s | DRAM p10 ms | p50 ms | cache-resident p10 ms | p50 ms "
      "| DRAM p10 GB/s | of read | DRAM / cache-resident (p10) | arithmetic alone GB/s (of read) "
      "| GFLOP/s DRAM p50 | cache-resident | of the peak (p50) |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& row : rows) {
    for (int64_t tokens : token_counts) {
      DecodeRow(row, pool, cfg, set, cache_resident, experts, runs, tokens);
    }
  }
  return 0;
}
