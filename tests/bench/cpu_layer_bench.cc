// The CPU backend against this machine's limits, in one run (issue: CPU kernels).
//
//   scripts/bench.sh            (builds, writes a k3 checkpoint under out/ if missing, runs this)
//   build/tests/cpu_layer_bench --checkpoint DIR [--reference-tokens 1,16,64]
//
// 1. Limits, measured here: streaming read of 1 GiB with all threads; fp32 FMA and AVX-512
//    BF16 dot-product peaks (register-resident loops, all threads).
// 2. K3 expert shape (D 3584, I 3072) on the threaded expert path: decode with 1, 4, 16 tokens
//    per expert over 64 experts (1.1 GB of MXFP4, more than the last-level cache) as weight
//    bytes/s over the read bandwidth; prefill with 256 tokens per expert as FLOP/s over the
//    fp32 FMA peak.
// 3. A whole k3 layer from the checkpoint: tokens/s at T = 1, 16, 64, 256, 1024 with the share
//    of each stage, the reference path at the --reference-tokens sizes, and the peak resident
//    memory against the packed weights.
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
#include "services/common/random.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/moe_layer.h"

#ifdef MOE_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace moe::bench {
namespace {

using numerics::cpu::CpuMoeLayer;
using numerics::cpu::ThreadPool;
using tensor::Bf16;
using Clock = std::chrono::steady_clock;

const int kThreads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

double Seconds(Clock::time_point a) {
  return std::chrono::duration<double>(Clock::now() - a).count();
}

// Median wall time of `reps` runs of fn (after one warm-up unless warm is false).
double Median(int reps, const std::function<void()>& fn, bool warm = true) {
  if (warm) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto s = Clock::now();
    fn();
    t.push_back(Seconds(s));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Runs fn(thread) on kThreads threads at once.
void OnAllThreads(const std::function<void(int)>& fn) {
  std::vector<std::thread> th;
  for (int i = 1; i < kThreads; ++i) th.emplace_back(fn, i);
  fn(0);
  for (auto& t : th) t.join();
}

double StreamReadBandwidth() {
  const size_t bytes = size_t{1} << 30;
  std::vector<uint64_t> buf(bytes / 8);
  OnAllThreads([&](int t) {  // first touch by the reading thread
    const size_t n = buf.size() / kThreads;
    for (size_t i = t * n; i < (t + 1) * n; ++i) buf[i] = i;
  });
  const double s = Median(5, [&] {
    OnAllThreads([&](int t) {
      const size_t n = buf.size() / kThreads;
      const uint64_t* p = buf.data() + t * n;
      uint64_t a = 0, b = 0, c = 0, d = 0;
      for (size_t i = 0; i < n; i += 4) {
        a += p[i];
        b += p[i + 1];
        c += p[i + 2];
        d += p[i + 3];
      }
      volatile uint64_t sink = a + b + c + d;
      (void)sink;
    });
  });
  return bytes / s;
}

// Register-resident loops (12 independent accumulators, more than FMA latency x ports).
__attribute__((target("avx512f"))) void FmaLoop(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.0001f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12  // the accumulators must live in registers, not in a stack array
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, sum);
  volatile float sink = out[0];
  (void)sink;
}

__attribute__((target("avx512f,avx512bf16"))) void DotLoop(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_setzero_ps();
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3a80);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, sum);
  volatile float sink = out[0];
  (void)sink;
}

constexpr int64_t kPeakIters = 20000000;

double Fp32FmaPeak() {
  const double s = Median(3, [] { OnAllThreads([](int) { FmaLoop(kPeakIters); }); });
  return 2.0 * 16 * 12 * kPeakIters * kThreads / s;
}

double Bf16DotPeak() {
  const double s = Median(3, [] { OnAllThreads([](int) { DotLoop(kPeakIters); }); });
  return 2.0 * 32 * 12 * kPeakIters * kThreads / s;
}

// `experts` K3-shape experts with random MXFP4 bytes (scales near 2^-5, like trained weights).
struct ExpertSet {
  std::vector<std::vector<uint8_t>> bytes;
  numerics::MoeLayerWeights w;
};

ExpertSet RandomExperts(const ModelConfig& cfg, int64_t experts) {
  ExpertSet s;
  s.w.expert_lo = 0;
  s.w.expert_hi = experts;
  s.w.experts.resize(experts);
  s.bytes.reserve(static_cast<size_t>(experts * 6));  // keeps references to elements valid
  const int64_t d = cfg.latent, in = cfg.intermediate;
  for (int64_t e = 0; e < experts; ++e) {
    numerics::Mxfp4Matrix* mats[] = {&s.w.experts[e].w1, &s.w.experts[e].w3, &s.w.experts[e].w2};
    for (int m = 0; m < 3; ++m) {
      const int64_t rows = m == 2 ? d : in, cols = m == 2 ? in : d;
      s.bytes.emplace_back(static_cast<size_t>(rows * cols / 2));
      std::vector<uint8_t>& packed = s.bytes.back();
      Rng rng(MixSeed(9, {static_cast<uint64_t>(e), static_cast<uint64_t>(m)}));
      for (size_t i = 0; i + 8 <= packed.size(); i += 8) {
        const uint64_t r = rng.Next();
        std::memcpy(packed.data() + i, &r, 8);
      }
      s.bytes.emplace_back(static_cast<size_t>(rows * cols / 32));
      std::vector<uint8_t>& scales = s.bytes.back();
      for (uint8_t& v : scales) v = static_cast<uint8_t>(120 + rng.Next() % 4);
      *mats[m] = {rows, cols, packed.data(), scales.data()};
    }
  }
  return s;
}

struct Row {
  std::string what, value, limit, fraction, target;
};
std::vector<Row> g_rows;

void Add(std::string what, std::string value, std::string limit = "", std::string fraction = "",
         std::string target = "") {
  std::printf("  %-44s %s\n", what.c_str(), value.c_str());
  std::fflush(stdout);
  g_rows.push_back({what, value, limit, fraction, target});
}

std::string F(const char* fmt, double v) {
  char b[64];
  std::snprintf(b, sizeof(b), fmt, v);
  return b;
}

// Decode rows are judged against the roofline min(bandwidth, bf16 peak / intensity): with t
// tokens per expert every packed byte (2 weights) carries 4 t flops, so from t = 4 on this
// machine the experts are compute-bound and the bandwidth target cannot be reached.
void ExpertBench(double bandwidth, double fma_peak, double bf16_peak) {
  ModelConfig cfg = *PresetConfig("k3");
  const numerics::cpu::KernelTable& k = numerics::cpu::KernelsFor(numerics::cpu::ActiveIsa());
  ThreadPool pool(kThreads);
  for (int64_t per_expert : {1, 4, 16, 256}) {
    const int64_t experts = per_expert >= 256 ? 8 : 64;
    ModelConfig c = cfg;
    c.num_experts = experts;
    ExpertSet set = RandomExperts(c, experts);
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
    const std::vector<Bf16> z = checkpoint::SyntheticHiddenStates(
        [&] {
          ModelConfig h = c;
          h.hidden = c.latent;
          return h;
        }(),
        per_expert, 3);
    const double s = Median(per_expert >= 256 ? 2 : 5, [&] {
      auto y = numerics::cpu::RunExperts(k, &pool, c, set.w, r, z.data());
      volatile uint16_t sink = y[0].bits;
      (void)sink;
    });
    const double weight_bytes = static_cast<double>(experts) * cfg.ExpertBytes();
    const double flops = 2.0 * 3 * cfg.latent * cfg.intermediate * per_expert * experts;
    if (per_expert < 256) {
      const double roof = std::min(bandwidth, bf16_peak / (4.0 * per_expert));
      Add("decode, " + std::to_string(per_expert) + " tok/expert: weight read",
          F("%.1f GB/s", weight_bytes / s / 1e9),
          F("%.1f GB/s bw", bandwidth / 1e9) + F(", roof %.1f", roof / 1e9),
          F("%.2f", weight_bytes / s / bandwidth) + F(" / %.2f", weight_bytes / s / roof),
          ">= 0.8 of bw");
    } else {
      Add("prefill, 256 tok/expert: FLOP/s", F("%.1f GFLOP/s", flops / s / 1e9),
          F("bf16 %.1f", bf16_peak / 1e9) + F(", fp32 %.1f", fma_peak / 1e9),
          F("%.2f", flops / s / bf16_peak) + F(" / %.2f", flops / s / fma_peak), ">= 0.5");
    }
  }
}

// Dense projection at the K3 shared-expert gate shape ([6144, 7168] bf16): our PackedLinear
// against OpenBLAS sgemm (fp32 weights) when the bench was built with it.
void DenseBench(double bandwidth, double bf16_peak, double fma_peak) {
  const int64_t out = 6144, in = 7168;
  const std::vector<Bf16> w = [&] {
    std::vector<Bf16> v(static_cast<size_t>(out * in));
    Rng rng(4);
    for (Bf16& b : v) b = Bf16::FromFloat(0.01f * rng.Normal());
    return v;
  }();
  const numerics::cpu::PackedLinear packed = numerics::cpu::PackedLinear::Pack(w.data(), out, in);
  const numerics::cpu::KernelTable& k = numerics::cpu::KernelsFor(numerics::cpu::ActiveIsa());
  ThreadPool pool(kThreads);
  for (int64_t tokens : {1, 256}) {
    std::vector<float> x(static_cast<size_t>(tokens * in));
    Rng rng(5);
    for (float& v : x) v = tensor::RoundBf16(rng.Normal());
    std::vector<float> y(static_cast<size_t>(tokens * packed.padded_out()));
    const double s =
        Median(tokens == 1 ? 10 : 3, [&] { packed.Apply(k, &pool, x.data(), tokens, y.data()); });
    const double bytes = 2.0 * out * in, flops = 2.0 * out * in * tokens;
    if (tokens == 1) {
      Add("dense [6144x7168] T=1, own kernel", F("%.1f GB/s", bytes / s / 1e9),
          F("%.1f GB/s", bandwidth / 1e9), F("%.2f", bytes / s / bandwidth));
    } else {
      Add("dense [6144x7168] T=256, own kernel", F("%.1f GFLOP/s", flops / s / 1e9),
          F("%.1f GFLOP/s fma", fma_peak / 1e9), F("%.2f", flops / s / fma_peak));
    }
#ifdef MOE_HAVE_OPENBLAS
    // Debian's OpenBLAS is built without its bf16 GEMM (the header declares cblas_sbgemm, the
    // library lacks it), so the comparison is sgemm on an fp32 copy of the weights (twice the
    // bytes: what the fp32 route would cost in memory too).
    static const std::vector<float> wf = [&] {
      std::vector<float> v(w.size());
      for (size_t i = 0; i < w.size(); ++i) v[i] = w[i].ToFloat();
      return v;
    }();
    std::vector<float> yb(static_cast<size_t>(tokens * out));
    const double sb = Median(tokens == 1 ? 10 : 3, [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(tokens),
                  static_cast<blasint>(out), static_cast<blasint>(in), 1.0f, x.data(),
                  static_cast<blasint>(in), wf.data(), static_cast<blasint>(in), 0.0f, yb.data(),
                  static_cast<blasint>(out));
    });
    if (tokens == 1) {
      Add("dense [6144x7168] T=1, OpenBLAS sgemm fp32", F("%.1f GB/s of bf16", bytes / sb / 1e9),
          F("%.1f GB/s", bandwidth / 1e9), F("%.2f", bytes / sb / bandwidth));
    } else {
      Add("dense [6144x7168] T=256, OpenBLAS sgemm fp32", F("%.1f GFLOP/s", flops / sb / 1e9),
          F("%.1f GFLOP/s fma", fma_peak / 1e9), F("%.2f", flops / sb / fma_peak));
    }
#endif
  }
}

void LayerBench(const std::string& ckpt_dir, const std::vector<int64_t>& ref_tokens) {
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
  // The reference runs on its own copy of the dense weights (the CPU layer takes ownership).
  numerics::MoeLayerWeights ref_weights = *weights;
  auto layer_or = CpuMoeLayer::Create(*cfg, std::move(*weights), {});
  if (!layer_or.ok()) return;
  CpuMoeLayer& cpu = **layer_or;
  Add("k3 layer load + pack", F("%.1f s", Seconds(t0)));
  const double packed = expert_bytes + static_cast<double>(cpu.packed_dense_bytes()) +
                        cfg->num_experts * 4.0 + cfg->latent * 2.0;
  auto run = [&](bool reference, int64_t tokens) {
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(*cfg, tokens, 11);
    numerics::LayerTimings best;
    double best_total = 1e30;
    const int reps = reference ? 1 : (tokens >= 256 ? 2 : 4);
    for (int i = 0; i < reps + (reference ? 0 : 1); ++i) {
      numerics::LayerTimings t;
      const auto s = Clock::now();
      auto y = reference ? numerics::ref::MoeLayerForward(*cfg, ref_weights, x, tokens, cfg->hidden,
                                                          nullptr, &t)
                         : cpu.Forward(x, tokens, cfg->hidden, nullptr, &t);
      const double total = Seconds(s);
      if (!y.ok()) return;
      if (!reference && i == 0) continue;  // warm-up
      if (total < best_total) {
        best_total = total;
        best = t;
      }
    }
    const double sum = best.Total();
    char shares[200];
    std::snprintf(
        shares, sizeof(shares),
        "router %.0f%% down %.0f%% experts %.0f%% comb+norm %.0f%% up %.0f%% shared %.0f%%",
        100 * best.router / sum, 100 * best.down_proj / sum, 100 * best.experts / sum,
        100 * best.combine_norm / sum, 100 * best.up_proj / sum, 100 * best.shared / sum);
    Add(std::string(reference ? "reference" : "cpu") + " layer T=" + std::to_string(tokens),
        F("%.2f tok/s", tokens / best_total) + F(" (%.3f s)", best_total), shares);
  };
  for (int64_t t : {1, 16, 64, 256, 1024}) run(false, t);
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  const double rss = ru.ru_maxrss * 1024.0;
  Add("peak RSS after cpu forwards", F("%.2f GB", rss / 1e9), F("%.2f GB packed", packed / 1e9),
      F("%.3f", rss / packed), "<= 1.10 (plus the reference's dense copy 0.4 GB)");
  for (int64_t t : ref_tokens) run(true, t);
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  using namespace moe::bench;
  std::string ckpt;
  std::vector<int64_t> ref_tokens = {1, 16};
  bool skip_limits = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--checkpoint" && i + 1 < argc) {
      ckpt = argv[++i];
    } else if (a == "--reference-tokens" && i + 1 < argc) {
      ref_tokens.clear();
      for (auto p : absl::StrSplit(argv[++i], ',', absl::SkipEmpty())) {
        int64_t v;
        if (absl::SimpleAtoi(p, &v)) ref_tokens.push_back(v);
      }
    } else if (a == "--skip-limits") {
      skip_limits = true;
    } else {
      std::fprintf(stderr, "usage: cpu_layer_bench [--checkpoint DIR] [--reference-tokens 1,16]\n");
      return 2;
    }
  }
  std::printf("cpu_layer_bench: %d threads, ISA %s\n", kThreads,
              moe::numerics::cpu::IsaName(moe::numerics::cpu::ActiveIsa()));
  double bw = 21e9, fma = 130e9, bf16 = 180e9;  // typical values here, used with --skip-limits
  if (!skip_limits) {
    bw = StreamReadBandwidth();
    Add("limit: streaming read, 1 GiB, all threads", F("%.1f GB/s", bw / 1e9));
    if (__builtin_cpu_supports("avx512f")) {
      fma = Fp32FmaPeak();
      Add("limit: fp32 FMA peak (AVX-512)", F("%.1f GFLOP/s", fma / 1e9));
    }
    if (__builtin_cpu_supports("avx512bf16")) {
      bf16 = Bf16DotPeak();
      Add("limit: bf16 dot peak (vdpbf16ps)", F("%.1f GFLOP/s", bf16 / 1e9));
    }
  }
  ExpertBench(bw, fma, bf16);
  DenseBench(bw, bf16, fma);
  if (!ckpt.empty()) LayerBench(ckpt, ref_tokens);
  std::printf("\n| %-44s | %-26s | %-18s | %-8s | %-10s |\n|%s|%s|%s|%s|%s|\n", "measure", "value",
              "limit / shares", "fraction", "target", std::string(46, '-').c_str(),
              std::string(28, '-').c_str(), std::string(20, '-').c_str(),
              std::string(10, '-').c_str(), std::string(12, '-').c_str());
  for (const Row& r : g_rows) {
    std::printf("| %-44s | %-26s | %-18s | %-8s | %-10s |\n", r.what.c_str(), r.value.c_str(),
                r.limit.c_str(), r.fraction.c_str(), r.target.c_str());
  }
  return 0;
}
