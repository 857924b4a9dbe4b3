// moe-tool: the project's command-line utility (the one `main` under services/, a thin shell
// over services/tools/layer_runner).
//
//   moe-tool synth --config mid --out /tmp/ckpt --skew 1.0 --seed 1 [--layers 1,2]
//                  [--shard_mb 4096] [--single_file] [--threads 2] [--dense_only]
//   moe-tool config --config mid [--out config.json]
//   moe-tool ranges --config k3 --shards 8 --replicas 2
//   moe-tool forward --checkpoint /tmp/ckpt [--layer 1] [--tokens 64] [--seed 7]
//                    [--input x.safetensors] [--output y.safetensors] [--repeat 1]
//                    [--backend cpu|ref]
//   moe-tool kernels --config k3 [--isa auto] [--measure] [--pin]
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/status/statusor.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/flags.h"
#include "services/common/logging.h"
#include "services/common/progress.h"
#include "services/common/version.h"
#include "services/metrics/metric_table.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/placement/placement.h"
#include "services/tools/layer_runner.h"

namespace {

constexpr char kUsage[] =
    "usage: moe-tool COMMAND [flags]   (moe-tool COMMAND --help lists a command's flags)\n"
    "  synth    write a synthetic checkpoint (config, shards, index)\n"
    "  config   print or write a preset's config.json\n"
    "  ranges   print the placement table of even expert ranges\n"
    "  forward  run one layer forward from a checkpoint and time it\n"
    "  kernels  the CPU kernels chosen for a shape on this CPU, with the probe's timings\n"
    "  metrics  print the metrics reference page (docs/metrics.md) from the metric table\n"
    "presets: k3, mid, tiny\n";

int Usage() {
  std::fputs(kUsage, stderr);
  return 2;
}

// A required flag that was not given.
int Missing(const char* command, const char* flag) {
  std::fprintf(stderr, "moe-tool %s: --%s is required (see --help)\n", command, flag);
  return 2;
}

absl::StatusOr<moe::ModelConfig> Config(const std::string& config) {
  auto cfg = moe::ResolveConfig(config);
  if (!cfg.ok()) std::fprintf(stderr, "error: %s\n", std::string(cfg.status().message()).c_str());
  return cfg;
}

int Synth(int argc, char** argv) {
  std::string config, out;
  moe::checkpoint::SyntheticOptions opt;
  int64_t shard_mb = opt.shard_bytes >> 20;
  bool dense_only = false;
  moe::SvcFlags f("moe-tool synth", "Writes a synthetic checkpoint: config.json, shards, index.");
  f.String("config", &config, "preset (k3, mid, tiny) or a config.json");
  f.String("out", &out, "output directory");
  f.Uint64("seed", &opt.seed, "seed of every tensor");
  f.Double("skew", &opt.router_skew, "router skew (0: balanced in expectation)");
  f.IntList("layers", &opt.layers, "MoE layers, comma-separated (empty: the first)");
  f.Int64("shard_mb", &shard_mb, "experts split into shards of about this many MB");
  f.Bool("single_file", &opt.single_file, "one model.safetensors, no index (small models)");
  f.Int("threads", &opt.threads, "generator threads");
  f.Bool("dense_only", &dense_only, "no expert tensors: enough for router-svc and attention-svc");
  f.Int64("expert_lo", &opt.expert_lo, "first expert written");
  f.Int64("expert_hi", &opt.expert_hi, "one past the last expert written (-1: all)");
  std::string ranges_file;
  int64_t ordinal = -1;
  f.String("ranges_file", &ranges_file,
           "placement table (JSON): write only this pod's range (as expert-svc reads it)");
  f.Int64("ordinal", &ordinal, "with --ranges_file: -1 reads it from $HOSTNAME");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  if (!ranges_file.empty()) {
    std::ifstream rf(ranges_file);
    const std::string text((std::istreambuf_iterator<char>(rf)), std::istreambuf_iterator<char>());
    const char* host = std::getenv("HOSTNAME");
    auto range = moe::placement::PodRange(text, ordinal, host != nullptr ? host : "");
    if (!rf || !range.ok()) {
      std::fprintf(stderr, "error: %s: %s\n", ranges_file.c_str(),
                   rf ? std::string(range.status().message()).c_str() : "cannot read");
      return 1;
    }
    opt.expert_lo = range->lo;
    opt.expert_hi = range->hi;
  }
  if (config.empty()) return Missing("synth", "config");
  if (out.empty()) return Missing("synth", "out");
  auto cfg = Config(config);
  if (!cfg.ok()) return 1;
  opt.shard_bytes = shard_mb << 20;
  opt.experts = !dense_only;
  moe::InitLogging("moe-tool");
  moe::Progress progress("writing the " + cfg->name + " checkpoint to " + out, 0);
  opt.on_progress = [&](int64_t written, int64_t total) { progress.Update(written, total); };
  moe::checkpoint::SyntheticReport rep;
  absl::Status st = moe::checkpoint::WriteSyntheticCheckpoint(*cfg, out, opt, &rep);
  progress.Done();
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  std::printf("wrote %s checkpoint to %s: %.1f MB in %d shard(s), %.1f s (%.0f MB/s)\n",
              cfg->name.c_str(), out.c_str(), rep.bytes / 1e6, rep.shards, rep.seconds,
              rep.bytes / 1e6 / rep.seconds);
  return 0;
}

int Forward(int argc, char** argv) {
  moe::tools::ForwardRequest req;
  moe::SvcFlags f("moe-tool forward", "Runs one layer forward from a checkpoint and times it.");
  f.String("checkpoint", &req.checkpoint, "checkpoint directory or file");
  f.Int64("layer", &req.layer, "MoE layer (-1: the first)");
  f.Int64("tokens", &req.tokens, "synthetic input tokens when there is no --input");
  f.Uint64("seed", &req.input_seed, "seed of the synthetic input");
  f.String("input", &req.input, "safetensors file with x [T, H] (BF16 or F32)");
  f.String("output", &req.output, "safetensors file for x, out, expert_ids, weights");
  f.Int("repeat", &req.repeat, "forwards to time (the fastest is reported)");
  f.String("backend", &req.backend, "cpu (optimized) or ref (scalar reference)");
  f.String("precision", &req.precision,
           "w4a16 or w4a8 (MXFP8 expert inputs, docs/math.md section 6)");
  f.Bool("w4a8_h_via_bf16", &req.w4a8_h_via_bf16,
         "W4A8: round h to bf16 before MXFP8 (the project's order before; default: from fp32)");
  f.Int64("budget", &req.budget,
          "dynamic k: serve this expert budget (1..top-k - 1) with thresholds solved from a "
          "calibration batch (0: the full top-k)");
  f.Double("top_p", &req.top_p,
           "dynamic k's second mode: keep the fewest experts whose share of the token's top-k "
           "router weight reaches this (0: off; docs/math.md 4.1)");
  f.Int64("budget_calibration_tokens", &req.budget_calibration_tokens,
          "dynamic k: tokens of the calibration batch (0: the fewest whose window floor at the "
          "budget is at most --budget_window_floor)");
  f.Double("budget_window_floor", &req.budget_window_floor,
           "dynamic k: the kept-load MaxVio the calibration window's sampling noise may leave");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  if (req.checkpoint.empty()) return Missing("forward", "checkpoint");
  auto rep = moe::tools::RunLayerForward(req);
  if (!rep.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(rep.status().message()).c_str());
    return 1;
  }
  const moe::numerics::LayerTimings& t = rep->timings;
  const double total = t.Total();
  std::printf("preset %s, layer %" PRId64 ", %" PRId64 " tokens, backend %s\n",
              rep->config.name.c_str(), rep->layer, rep->tokens, rep->backend.c_str());
  std::printf("load %.3f s; forward %.4f s (%.1f tokens/s)\n", rep->load_seconds, total,
              rep->tokens / total);
  std::printf(
      "  router %.4f s | down-proj %.4f s | experts %.4f s | combine+norm %.4f s | "
      "up-proj %.4f s | shared %.4f s\n",
      t.router, t.down_proj, t.experts, t.combine_norm, t.up_proj, t.shared);
  std::printf("checksum fnv1a64=%016" PRIx64 " sum|out|=%.6f\n", rep->checksum,
              rep->output_abs_sum);
  if (req.budget != 0) {
    std::printf("budget %" PRId64 ": thresholds from %" PRId64
                " calibration tokens, window floor (kept-load MaxVio of their sampling noise) "
                "%.3f%s\n",
                req.budget, rep->budget_calibration_tokens, rep->budget_window_floor,
                rep->budget_window_floor > req.budget_window_floor ? " (above the bound)" : "");
  }
  return 0;
}

// Writes a preset's (or a parsed file's) config.json: the Helm chart's model ConfigMap comes
// from here.
int ConfigCommand(int argc, char** argv) {
  std::string config, out;
  moe::SvcFlags f("moe-tool config", "Prints (or writes) a preset's config.json.");
  f.String("config", &config, "preset (k3, mid, tiny) or a config.json");
  f.String("out", &out, "write here instead of stdout");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  if (config.empty()) return Missing("config", "config");
  auto cfg = Config(config);
  if (!cfg.ok()) return 1;
  const std::string json = moe::ToHfConfigJson(*cfg);
  if (out.empty()) {
    std::fputs(json.c_str(), stdout);
    return 0;
  }
  FILE* file = std::fopen(out.c_str(), "w");
  if (file == nullptr || std::fputs(json.c_str(), file) < 0 || std::fclose(file) != 0) {
    std::fprintf(stderr, "error: cannot write %s\n", out.c_str());
    return 1;
  }
  return 0;
}

// The placement table of `shards` even ranges x `replicas` (services/placement): what the Helm
// chart renders into its ranges.json (tests/deploy/chart_test.sh compares them).
int Ranges(int argc, char** argv) {
  std::string config;
  int64_t shards = 2, replicas = 1;
  moe::SvcFlags f("moe-tool ranges", "Prints the placement table of even expert ranges.");
  f.String("config", &config, "preset (k3, mid, tiny) or a config.json");
  f.Int64("shards", &shards, "expert ranges");
  f.Int64("replicas", &replicas, "replicas per range");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  if (config.empty()) return Missing("ranges", "config");
  auto cfg = Config(config);
  if (!cfg.ok()) return 1;
  if (shards < 1 || shards > cfg->num_experts || replicas < 1) {
    std::fprintf(stderr, "error: --shards must lie in [1, E = %lld], --replicas at least 1\n",
                 static_cast<long long>(cfg->num_experts));
    return 2;
  }
  std::printf("%s\n", moe::placement::RangeTableJson(
                          moe::placement::EvenTable(cfg->num_experts, shards, replicas))
                          .c_str());
  return 0;
}

// The kernel choice of this CPU for a shape (numerics/cpu/kernel_choice.h): from this machine's
// cache (or measured and cached), or measured now (--measure); --pin writes it pinned.
int Kernels(int argc, char** argv) {
  namespace cpu = moe::numerics::cpu;
  std::string config;
  cpu::KernelSets sets = cpu::DefaultKernelSets();
  bool measure = false, pin = false;
  moe::SvcFlags f("moe-tool kernels",
                  "The CPU kernels every process of this machine runs for a shape: the cached "
                  "choice (measured first when there is none), or a new measurement.");
  f.String("config", &config, "preset (k3, mid, tiny) or a config.json");
  f.Typed("isa", &sets, cpu::KernelSetsName, cpu::ParseKernelSets,
          "auto (every set of this CPU) or one set");
  f.Bool("measure", &measure, "measure now and print, without reading or writing the cache");
  f.Bool("pin", &pin, "write the choice to the cache file with pinned = true");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  if (config.empty()) return Missing("kernels", "config");
  auto cfg = Config(config);
  if (!cfg.ok()) return 1;
  cpu::KernelChoiceOptions o;
  o.sets = sets;
  o.latent = cfg->latent;
  o.intermediate = cfg->intermediate;
  if (measure) o.cache_dir.clear();
  const cpu::KernelChoice& c = cpu::ChooseKernels(o);
  std::printf("cpu: %s\nchoice: %s\n", cpu::CpuModel().c_str(), c.Summary().c_str());
  if (c.measured_at > 0) {
    std::printf("measured: %s, %d attempt(s), load average %.2f, read %.1f GB/s\n",
                c.steady ? "steady" : ("UNSTEADY (" + c.unsteady + ")").c_str(), c.attempts,
                c.load_average, c.read_bytes_per_second / 1e9);
  }
  // Two tables: the median GFLOP/s of each probe, then how far its repetitions spread.
  for (bool spread : {false, true}) {
    if (c.timings.empty()) break;
    std::printf("%-11s %-6s", "set", "kernel");
    for (int64_t t : {1, 2, 4, 8, 16, 32, 64, 128})
      std::printf(" %7lld", static_cast<long long>(t));
    std::printf(spread ? "   (spread of the repetitions, over the median; bound %.2f)\n"
                       : "   (GFLOP/s at tokens per expert, median)\n",
                cpu::kProbeSpreadBound);
    for (cpu::Isa isa : {cpu::Isa::kScalar, cpu::Isa::kAvx2, cpu::Isa::kAvx512,
                         cpu::Isa::kAvx512Bf16, cpu::Isa::kAvx512Amx}) {
      for (bool panel : {false, true}) {
        std::string line;
        for (int64_t t : {1, 2, 4, 8, 16, 32, 64, 128}) {
          std::string cell = "      -";
          for (const cpu::KernelTiming& k : c.timings) {
            if (k.isa == isa && k.panel == panel && k.tokens == t) {
              char b[32];
              std::snprintf(b, sizeof(b), spread ? " %7.3f" : " %7.1f",
                            spread ? k.spread : k.flops_per_second / 1e9);
              cell = b;
            }
          }
          line += cell;
        }
        if (line.find_first_not_of(" -") == std::string::npos) continue;
        std::printf("%-11s %-6s%s\n", cpu::IsaName(isa), panel ? "panel" : "rows", line.c_str());
      }
    }
  }
  if (pin) {
    const std::string dir = cpu::DefaultKernelCacheDir();
    if (dir.empty()) {
      std::fprintf(stderr, "error: no cache directory (MOE_KERNEL_CACHE=off or no HOME)\n");
      return 1;
    }
    const std::string path = cpu::KernelChoicePath(dir, c.sets, o.latent, o.intermediate);
    std::ofstream out(path, std::ios::trunc);
    out << cpu::FormatKernelChoice(c, o.latent, o.intermediate, /*pinned=*/true);
    out.close();
    if (!out) {
      std::fprintf(stderr, "error: cannot write %s\n", path.c_str());
      return 1;
    }
    std::printf("pinned: %s\n", path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage();
  const std::string cmd = argv[1];
  if (cmd == "--help" || cmd == "-h") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (cmd == "--version") {
    std::printf("moe-tool %s\n", moe::BuildVersion());
    return 0;
  }
  if (cmd == "synth") return Synth(argc, argv);
  if (cmd == "config") return ConfigCommand(argc, argv);
  if (cmd == "ranges") return Ranges(argc, argv);
  if (cmd == "forward") return Forward(argc, argv);
  if (cmd == "kernels") return Kernels(argc, argv);
  if (cmd == "metrics") {
    std::fputs(moe::metrics::MetricsReferencePage().c_str(), stdout);
    return 0;
  }
  std::fprintf(stderr, "moe-tool: unknown command '%s'\n", cmd.c_str());
  return Usage();
}
