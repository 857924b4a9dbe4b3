// The CPU backend against this machine's limits, in one run (issue: expert kernels at the limit
// on every x86 CPU).
//
//   scripts/bench.sh            (builds, writes a k3 checkpoint under out/ if missing, runs this)
//   build/tests/cpu_layer_bench [--checkpoint DIR] [--isa avx2,avx512] [--threads 1,2]
//                               [--reference_tokens 1] [--layer_isa avx2,avx512]
//
// 1. Limits, measured here: streaming read of 1 GiB with all threads; the fp32 FMA peak of each
//    ISA (services/numerics/cpu/machine_limits.h) with 1 and all threads; the AVX-512 BF16
//    dot-product peak where the CPU has it.
// 2. The machine's chosen kernels (kernel_choice.h: read from the cache or measured), then each
//    ISA (default: every one the CPU has above scalar) on its own table, per thread count: the
//    routed experts at the K3 shape (D 3584, I 3072) on the threaded expert path, weights
//    streamed from DRAM (64 experts = 1.1 GB, more than any cache): 1-8 tokens per expert as
//    weight bytes/s over the read bandwidth and over the roof min(bandwidth, FMA peak / (4 flops
//    per byte x tokens)); 16-256 tokens per expert as FLOP/s over the peak of the instruction that
//    multiplies (the fp32 FMA peak, the bf16 dot peak for vdpbf16ps kernels); a CLIFF row
//    where FLOP/s falls as tokens grow. At 1, 4, 64, 256 also in W4A8 (MXFP8 activations,
//    docs/math.md section 6): its time next to W4A16's.
// 3. Dense bf16 projections: T = 1 over a 1.06 GB weight (K3 shared-expert gate rows x 12, so it
//    streams from DRAM) as bytes/s, T = 256 on [6144 x 7168] as FLOP/s; OpenBLAS sgemm on fp32
//    copies for comparison (Debian's OpenBLAS has no bf16 GEMM).
// 4. A whole k3 layer from the checkpoint, on the chosen kernels and per --layer_isa: tokens/s
//    at T = 1, 16, 64, 256, 1024, 4096 (--layer_tokens) with the share of each stage and whether
//    tokens/s ever falls as T grows, the reference path at --reference_tokens, peak memory.
// One table at the end. Timing is wall clock, median of the repetitions.
#include <immintrin.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/flags.h"
#include "services/common/random.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/cpu/machine_limits.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/moe_layer.h"
#include "tests/bench/cpu_bench_common.h"
#include "tests/bench/random_experts.h"

#ifdef MOE_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace moe::bench {
namespace {

using numerics::cpu::CpuMoeLayer;
using numerics::cpu::Isa;
using numerics::cpu::IsaName;
using numerics::cpu::KernelsFor;
using tensor::Bf16;

// Routed experts at the K3 shape on the threaded expert path (RunExperts), for one ISA and
// thread count. Decode rows are judged against min(bandwidth, FMA peak / intensity): with t
// tokens per expert every packed byte (2 weights) carries 4 t flops.
// `k` is a set's own table (panel kernel from kPrefillTokens) or the machine's chosen one.
void ExpertBench(const ExpertSet& set64, const ExpertSet& set16, const ExpertSet& set8,
                 const numerics::cpu::KernelTable& k, const std::string& name, int threads,
                 const Limits& lim, const std::vector<int64_t>& counts) {
  const ModelConfig cfg = *PresetConfig("k3");
  const Isa isa = k.isa;
  ThreadPool pool(threads);
  const double fma = lim.fma[static_cast<int>(isa)][threads > 1 ? 1 : 0];
  const double bandwidth = threads > 1 ? lim.bandwidth : lim.bandwidth_one;
  const std::string tag = name + ", " + std::to_string(threads) + "t: ";
  double previous = 0;  // FLOP/s at the previous count: a fall is a cliff
  for (int64_t per_expert : counts) {
    const ExpertSet& set = per_expert >= 256 ? set8 : (per_expert >= 16 ? set16 : set64);
    const int64_t experts = set.w.expert_hi;
    ModelConfig c = cfg;
    c.num_experts = experts;
    // per_expert tokens, each routed to every expert: every expert sees per_expert tokens.
    numerics::Routing r;
    r.tokens = per_expert;
    r.top_k = experts;
    for (int64_t t = 0; t < per_expert; ++t) {
      for (int64_t e = 0; e < experts; ++e) {
        r.expert_ids.push_back(static_cast<int32_t>(e));
        r.weights.push_back(1.0f / experts);
      }
    }
    ModelConfig zc = c;
    zc.hidden = c.latent;
    const std::vector<Bf16> z = checkpoint::SyntheticHiddenStates(zc, per_expert, 3);
    const double s = Median(per_expert >= 64 ? 2 : 4, [&] {
      auto y = numerics::cpu::RunExperts(k, &pool, c, set.w, r, z.data());
      volatile uint16_t sink = y[0].bits;
      (void)sink;
    });
    // W4A8: the same experts on MXFP8 activations as they arrive at a shard (z quantized by the
    // attention node: not timed), h quantized after SiTU inside (timed).
    if (per_expert == 1 || per_expert == 4 || per_expert == 64 || per_expert == 256) {
      const numerics::Mxfp8Rows z8 = numerics::QuantizeMxfp8Rows(z.data(), per_expert, c.latent);
      const double s8 = Median(per_expert >= 64 ? 2 : 4, [&] {
        auto y = numerics::cpu::RunExperts(k, &pool, c, set.w, r, z8);
        volatile uint16_t sink = y[0].bits;
        (void)sink;
      });
      Add(tag + std::to_string(per_expert) + " tok/expert, W4A8 vs W4A16",
          F("%.2f vs ", 1e3 * s8) + F("%.2f ms", 1e3 * s), F("W4A8 takes %.2fx", s8 / s));
    }
    const double weight_bytes = static_cast<double>(experts) * cfg.ExpertBytes();
    const double flops = 2.0 * 3 * cfg.latent * cfg.intermediate * per_expert * experts;
    const std::string path =
        per_expert >= k.panel_from && k.mxfp4_rows_tm != nullptr ? " [panel]" : " [rows]";
    if (per_expert > 1 && flops / s < 0.95 * previous) {
      Add(tag + std::to_string(per_expert) + " tok/expert: CLIFF",
          F("%.1f GFLOP/s", flops / s / 1e9) + F(" < %.1f", previous / 1e9), "", "",
          "FLOP/s never falls as T grows");
    }
    previous = std::max(previous, flops / s);
    if (per_expert <= 8) {
      const double roof = std::min(bandwidth, fma / (4.0 * per_expert));
      const double target = per_expert == 1 ? 0.85 : 0.6;
      const double frac = weight_bytes / s / (per_expert == 1 ? bandwidth : roof);
      Add(tag + std::to_string(per_expert) + " tok/expert, weights" + path,
          F("%.1f GB/s", weight_bytes / s / 1e9) + F(" %.0f GF/s", flops / s / 1e9),
          F("bw %.1f", bandwidth / 1e9) + F(" roof %.1f GB/s", roof / 1e9), Judge(frac, target),
          per_expert == 1 ? ">= 0.85 of bw" : ">= 0.6 of roof");
    } else if (k.mxfp4_rows_tm != nullptr &&
               k.mxfp4_rows_tm == numerics::cpu::AmxKernels().mxfp4_rows_tm &&
               per_expert >= k.panel_from) {
      // The AMX panel: against 1 TFLOP/s on 2 cores (the target) and the unit's peak.
      Add(tag + std::to_string(per_expert) + " tok/expert, FLOP/s" + path,
          F("%.1f GFLOP/s", flops / s / 1e9), F("amx peak %.1f GFLOP/s", lim.amx / 1e9),
          F("%.2f", flops / s / lim.amx) + (flops / s >= 1e12 ? " ok" : " SHORT"), ">= 1 TFLOP/s");
    } else {
      // The relevant peak: the bf16 dot peak where the kernel that ran multiplies on vdpbf16ps
      // (the BF16 rows, the BF16 pair panel), the fp32 FMA peak otherwise.
      const bool panel = per_expert >= k.panel_from && k.mxfp4_rows_tm != nullptr;
      const bool dot = panel ? k.tm_layout == numerics::cpu::MxLayout::kBf16PairsTm
                             : k.mx_layout == numerics::cpu::MxLayout::kBf16Pairs;
      const double peak = dot && lim.bf16 > 0 ? lim.bf16 : fma;
      Add(tag + std::to_string(per_expert) + " tok/expert, FLOP/s" + path,
          F("%.1f GFLOP/s", flops / s / 1e9),
          F(dot ? "bf16 %.1f GFLOP/s" : "fma %.1f GFLOP/s", peak / 1e9),
          Judge(flops / s / peak, 0.7), dot ? ">= 0.7 of bf16" : ">= 0.7 of fma");
    }
  }
}

// Dense projections on PackedLinear (bit-exact with the reference) against OpenBLAS sgemm on
// fp32 copies (twice the bytes: what the fp32 route would cost in memory too).
void DenseBench(Isa isa, const Limits& lim) {
  const numerics::cpu::KernelTable& k = KernelsFor(isa);
  ThreadPool pool(kThreads);
  const double fma = lim.fma[static_cast<int>(isa)][1];
  const std::string tag = std::string(IsaName(isa)) + ": dense ";
  auto random_weights = [](int64_t n, uint64_t seed) {
    std::vector<Bf16> v(static_cast<size_t>(n));
    Rng rng(seed);
    for (Bf16& b : v) b = Bf16::FromFloat(0.01f * rng.Normal());
    return v;
  };
  auto random_x = [](int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    Rng rng(5);
    for (float& v : x) v = tensor::RoundBf16(rng.Normal());
    return x;
  };
  {  // T = 1 streams 1.06 GB of bf16 weights
    const int64_t out = 6144 * 12, in = 7168;
    const std::vector<Bf16> w = random_weights(out * in, 4);
    const auto packed = numerics::cpu::PackedLinear::Pack(w.data(), out, in);
    const std::vector<float> x = random_x(in);
    std::vector<float> y(static_cast<size_t>(packed.padded_out()));
    const double s = Median(5, [&] { packed.Apply(k, &pool, x.data(), 1, y.data()); });
    const double bytes = 2.0 * out * in;
    Add(tag + "T=1 [73728x7168] bf16", F("%.1f GB/s", bytes / s / 1e9),
        F("bw %.1f GB/s", lim.bandwidth / 1e9), Judge(bytes / s / lim.bandwidth, 0.8),
        ">= 0.8 of bw");
#ifdef MOE_HAVE_OPENBLAS
    if (isa == numerics::cpu::DetectIsa()) {
      std::vector<float> wf(w.size());
      for (size_t i = 0; i < w.size(); ++i) wf[i] = w[i].ToFloat();
      std::vector<float> yb(static_cast<size_t>(out));
      const double sb = Median(5, [&] {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(out),
                    static_cast<blasint>(in), 1.0f, wf.data(), static_cast<blasint>(in), x.data(),
                    1, 0.0f, yb.data(), 1);
      });
      Add("OpenBLAS sgemv T=1, fp32 weights", F("%.1f GB/s of bf16", bytes / sb / 1e9),
          F("bw %.1f GB/s", lim.bandwidth / 1e9), F("%.2f", bytes / sb / lim.bandwidth));
    }
#endif
  }
  {  // T = 256 on the K3 shared-expert gate shape
    const int64_t out = 6144, in = 7168, tokens = 256;
    const std::vector<Bf16> w = random_weights(out * in, 6);
    const auto packed = numerics::cpu::PackedLinear::Pack(w.data(), out, in);
    const std::vector<float> x = random_x(tokens * in);
    std::vector<float> y(static_cast<size_t>(tokens * packed.padded_out()));
    const double s = Median(3, [&] { packed.Apply(k, &pool, x.data(), tokens, y.data()); });
    const double flops = 2.0 * out * in * tokens;
    Add(tag + "T=256 [6144x7168] bf16", F("%.1f GFLOP/s", flops / s / 1e9),
        F("fma %.1f GFLOP/s", fma / 1e9), Judge(flops / s / fma, 0.7), ">= 0.7 of fma");
#ifdef MOE_HAVE_OPENBLAS
    if (isa == numerics::cpu::DetectIsa()) {
      std::vector<float> wf(w.size());
      for (size_t i = 0; i < w.size(); ++i) wf[i] = w[i].ToFloat();
      std::vector<float> yb(static_cast<size_t>(tokens * out));
      const double sb = Median(3, [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(tokens),
                    static_cast<blasint>(out), static_cast<blasint>(in), 1.0f, x.data(),
                    static_cast<blasint>(in), wf.data(), static_cast<blasint>(in), 0.0f, yb.data(),
                    static_cast<blasint>(out));
      });
      const double best = lim.fma[static_cast<int>(numerics::cpu::DetectIsa())][1];
      Add("OpenBLAS sgemm T=256, fp32 weights", F("%.1f GFLOP/s", flops / sb / 1e9),
          F("fma %.1f (best ISA)", best / 1e9), F("%.2f", flops / sb / best));
    }
#endif
  }
}

void LayerBench(const std::string& ckpt_dir, const std::vector<Isa>& isas,
                const std::vector<int64_t>& ref_tokens, const std::vector<int64_t>& layer_tokens) {
  auto ckpt = checkpoint::Checkpoint::Open(ckpt_dir);
  if (!ckpt.ok()) {
    std::printf("whole layer: skipped (%s)\n", std::string(ckpt.status().message()).c_str());
    return;
  }
  auto cfg = (*ckpt)->LoadConfig();
  if (!cfg.ok()) return;
  const int64_t layer = cfg->first_moe_layer;
  const auto t0 = Clock::now();
  auto weights = checkpoint::LoadMoeLayer(**ckpt, *cfg, layer, {});
  if (!weights.ok()) {
    std::printf("whole layer: %s\n", std::string(weights.status().message()).c_str());
    return;
  }
  const double expert_bytes = static_cast<double>(cfg->num_experts) * cfg->ExpertBytes();
  double last_rate = 0;
  auto run = [&](const std::string& name, int64_t tokens, int reps,
                 const std::function<absl::StatusOr<numerics::LayerOutput>(
                     const std::vector<Bf16>&, numerics::LayerTimings*)>& forward) {
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(*cfg, tokens, 11);
    numerics::LayerTimings best;
    double best_total = 1e30;
    for (int i = 0; i < reps; ++i) {
      numerics::LayerTimings t;
      const auto s = Clock::now();
      if (!forward(x, &t).ok()) return;
      const double total = Seconds(s);
      if (reps > 1 && i == 0) continue;  // warm-up
      if (total < best_total) {
        best_total = total;
        best = t;
      }
    }
    const double sum = best.Total();
    char shares[200];
    std::snprintf(shares, sizeof(shares),
                  "router %.0f%% down %.0f%% experts %.0f%% comb+norm %.0f%% up %.0f%% shared "
                  "%.0f%%",
                  100 * best.router / sum, 100 * best.down_proj / sum, 100 * best.experts / sum,
                  100 * best.combine_norm / sum, 100 * best.up_proj / sum, 100 * best.shared / sum);
    Add(name + " layer T=" + std::to_string(tokens),
        F("%.2f tok/s", tokens / best_total) + F(" (%.3f s)", best_total), shares);
    last_rate = tokens / best_total;
  };
  // The reference first, on its own copy of the dense weights (a CPU layer takes ownership).
  for (int64_t t : ref_tokens) {
    run("reference", t, 1, [&](const std::vector<Bf16>& x, numerics::LayerTimings* timings) {
      return numerics::ref::MoeLayerForward(*cfg, *weights, x, x.size() / cfg->hidden, cfg->hidden,
                                            nullptr, timings);
    });
  }
  double packed = 0;
  // The machine's chosen kernels first (the auto choice, as a service runs them), then each set
  // on its own table (panel kernel from kPrefillTokens).
  for (size_t i = 0; i <= isas.size(); ++i) {
    numerics::cpu::CpuLayerOptions o;
    std::string name = "chosen";
    if (i > 0) {
      o.kernels = &KernelsFor(isas[i - 1]);
      name = IsaName(isas[i - 1]);
    }
    // The last ISA takes the loaded weights; earlier ones a copy of the dense part (experts
    // are borrowed views of the mapped checkpoint either way).
    auto layer_or = CpuMoeLayer::Create(*cfg, i == isas.size() ? std::move(*weights) : *weights, o);
    if (!layer_or.ok()) return;
    CpuMoeLayer& cpu = **layer_or;
    if (i == 0) {
      Add("k3 layer load + pack", F("%.1f s", Seconds(t0)));
      name += " (" + numerics::cpu::KernelsName(cpu.kernels()) + ")";
    }
    packed = expert_bytes + static_cast<double>(cpu.packed_dense_bytes()) + cfg->num_experts * 4.0 +
             cfg->latent * 2.0;
    double best_rate = 0;
    int64_t fell_at = 0;
    for (int64_t t : layer_tokens) {
      run(name, t, t >= 256 ? 3 : 5,
          [&](const std::vector<Bf16>& x, numerics::LayerTimings* timings) {
            return cpu.Forward(x, x.size() / cfg->hidden, cfg->hidden, nullptr, timings);
          });
      // A fall of more than the machine's noise (5%) as T grows is a cliff.
      if (last_rate < 0.95 * best_rate && fell_at == 0) fell_at = t;
      best_rate = std::max(best_rate, last_rate);
    }
    Add(name + " layer: tok/s as T grows",
        fell_at == 0 ? std::string("never falls") : "falls at T=" + std::to_string(fell_at), "", "",
        "never falls");
  }
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  const double rss = ru.ru_maxrss * 1024.0;
  Add("peak RSS after the layer runs", F("%.2f GB", rss / 1e9), F("%.2f GB packed", packed / 1e9),
      F("%.3f", rss / packed), "<= 1.10 (+ benchmark copies)");
}

std::vector<Isa> ParseIsas(const char* s) {
  std::vector<Isa> v;
  for (auto p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    auto isa = numerics::cpu::ParseIsa(p);
    if (!isa.ok()) {
      std::fprintf(stderr, "%s\n", std::string(isa.status().message()).c_str());
      std::exit(2);
    }
    if (numerics::cpu::CapIsa(*isa) != *isa) {
      std::printf("ISA %s: not on this CPU, skipped\n", IsaName(*isa));
      continue;
    }
    v.push_back(*isa);
  }
  return v;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  using namespace moe::bench;
  using moe::numerics::cpu::DetectIsa;
  std::string ckpt;
  std::vector<int64_t> ref_tokens = {1};
  std::vector<int64_t> thread_counts = {1, kThreads};
  std::vector<int64_t> layer_tokens = {1, 16, 64, 256, 1024, 4096};
  std::vector<int64_t> expert_tokens = {1, 2, 4, 8, 16, 32, 64, 256};
  std::vector<Isa> isas;
  for (Isa isa : moe::numerics::cpu::kSimdIsas) {
    if (static_cast<int>(isa) <= static_cast<int>(DetectIsa())) isas.push_back(isa);
  }
  std::vector<Isa> layer_isas;
  std::string isa_list, layer_isa_list;
  moe::SvcFlags f("cpu_layer_bench", "The CPU backend against this machine's limits.");
  f.String("checkpoint", &ckpt, "k3 checkpoint for the whole-layer rows (empty: skipped)");
  f.IntList("reference_tokens", &ref_tokens, "batch sizes for the scalar reference layer");
  f.IntList("threads", &thread_counts, "thread counts of the expert rows");
  f.IntList("layer_tokens", &layer_tokens, "batch sizes T of the whole-layer rows");
  f.IntList("expert_tokens", &expert_tokens,
            "tokens per expert of the expert rows (8 experts from 256 up, 16 from 16, else 64)");
  f.String("isa", &isa_list, "ISAs of the expert and dense rows (default: all the CPU has)");
  f.String("layer_isa", &layer_isa_list, "ISAs of the whole-layer rows (default: as --isa)");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  if (!isa_list.empty()) isas = ParseIsas(isa_list.c_str());
  layer_isas = layer_isa_list.empty() ? isas : ParseIsas(layer_isa_list.c_str());
  for (Isa isa : moe::numerics::cpu::kSimdIsas) {
    if (static_cast<int>(isa) > static_cast<int>(DetectIsa())) {
      std::printf("ISA %s: not on this CPU, its kernels are not measured\n", IsaName(isa));
    }
  }
  std::printf("cpu_layer_bench: %d hardware threads, best ISA %s\n", kThreads,
              IsaName(DetectIsa()));
  Limits lim;
  {
    moe::ThreadPool all(kThreads), one(1);
    lim.bandwidth = moe::numerics::cpu::MeasureReadBandwidth(&all, int64_t{1} << 30, 5);
    lim.bandwidth_one = moe::numerics::cpu::MeasureReadBandwidth(&one, int64_t{1} << 30, 3);
    Add("limit: streaming read, 1 GiB, all threads", F("%.1f GB/s", lim.bandwidth / 1e9),
        F("1 thread %.1f", lim.bandwidth_one / 1e9));
    // Every set the CPU has (the chosen kernels' rows are judged by their decode set's peak).
    for (Isa isa : moe::numerics::cpu::kSimdIsas) {
      if (moe::numerics::cpu::CapIsa(isa) != isa) continue;
      const auto& k = KernelsFor(isa);
      lim.fma[static_cast<int>(isa)][0] = moe::numerics::cpu::MeasureFmaPeak(k, &one, 0.2);
      lim.fma[static_cast<int>(isa)][1] = moe::numerics::cpu::MeasureFmaPeak(k, &all, 0.2);
      Add(std::string("limit: fp32 FMA peak, ") + IsaName(isa),
          F("%.1f GFLOP/s", lim.fma[static_cast<int>(isa)][1] / 1e9),
          F("1 thread %.1f", lim.fma[static_cast<int>(isa)][0] / 1e9));
    }
    if (__builtin_cpu_supports("avx512bf16")) {
      lim.bf16 = moe::numerics::cpu::MeasureBf16DotPeak(&all, 0.2);
      Add("limit: bf16 dot peak (vdpbf16ps)", F("%.1f GFLOP/s", lim.bf16 / 1e9));
    }
    if (moe::numerics::cpu::DetectIsa() == Isa::kAvx512Amx) {
      lim.amx = AmxPeak();
      Add("limit: AMX bf16 peak (tdpbf16ps)", F("%.1f GFLOP/s", lim.amx / 1e9));
    } else {
      std::printf("AMX: not on this CPU (or not granted by the OS): the AMX panel is not run\n");
    }
  }
  if (!isas.empty()) {
    const moe::ModelConfig cfg = *moe::PresetConfig("k3");
    const ExpertSet set64 = RandomExperts(cfg, 64), set16 = RandomExperts(cfg, 16),
                    set8 = RandomExperts(cfg, 8);
    // The machine's choice at the K3 shape (read from this machine's cache, or measured now).
    moe::numerics::cpu::KernelChoiceOptions ko;
    ko.latent = cfg.latent;
    ko.intermediate = cfg.intermediate;
    const moe::numerics::cpu::KernelChoice& chosen = moe::numerics::cpu::ChooseKernels(ko);
    Add("chosen kernels (" + chosen.source + ")", std::string("decode ") + IsaName(chosen.decode),
        std::string("prefill ") + IsaName(chosen.prefill) + " from " +
            (chosen.panel_from >= moe::numerics::cpu::kNoPanel ? std::string("never")
                                                               : std::to_string(chosen.panel_from)),
        "", chosen.seconds > 0 ? F("probe %.2f s", chosen.seconds) : "from cache");
    for (int threads : thread_counts) {
      ExpertBench(set64, set16, set8, chosen.table,
                  "chosen " + moe::numerics::cpu::KernelsName(chosen.table), threads, lim,
                  expert_tokens);
    }
    for (Isa isa : isas) {
      for (int threads : thread_counts) {
        ExpertBench(set64, set16, set8, KernelsFor(isa), IsaName(isa), threads, lim, expert_tokens);
      }
    }
  }
  for (Isa isa : isas) DenseBench(isa, lim);
  if (!ckpt.empty()) LayerBench(ckpt, layer_isas, ref_tokens, layer_tokens);
  std::printf("\n| %-46s | %-24s | %-30s | %-12s | %-16s |\n|%s|%s|%s|%s|%s|\n", "measure", "value",
              "limit / shares", "fraction", "target", std::string(48, '-').c_str(),
              std::string(26, '-').c_str(), std::string(32, '-').c_str(),
              std::string(14, '-').c_str(), std::string(18, '-').c_str());
  for (const Row& r : g_rows) {
    std::printf("| %-46s | %-24s | %-30s | %-12s | %-16s |\n", r.what.c_str(), r.value.c_str(),
                r.limit.c_str(), r.fraction.c_str(), r.target.c_str());
  }
  return 0;
}
