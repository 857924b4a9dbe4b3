// moe-tool: the project's command-line utility (the one `main` under services/, a thin shell
// over services/tools/layer_runner).
//
//   moe-tool synth --config mid --out /tmp/ckpt --skew 1.0 --seed 1 [--layers 1,2]
//                  [--shard-mb 4096] [--single-file] [--threads 2]
//   moe-tool forward --checkpoint /tmp/ckpt [--layer 1] [--tokens 64] [--seed 7]
//                    [--input x.safetensors] [--output y.safetensors] [--repeat 1]
//                    [--backend cpu|ref]
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "services/checkpoint/synthetic.h"
#include "services/placement/placement.h"
#include "services/tools/layer_runner.h"

namespace {

using Flags = std::map<std::string, std::string>;

int Usage() {
  std::fprintf(
      stderr,
      "usage:\n"
      "  moe-tool synth --config PRESET|config.json --out DIR [--seed N] [--skew X]\n"
      "                 [--layers L1,L2] [--shard-mb N] [--single-file] [--threads N]\n"
      "                 [--dense-only]   (no expert tensors: enough for router/attention)\n"
      "  moe-tool config --config PRESET|config.json [--out config.json]   (stdout without --out)\n"
      "  moe-tool ranges --config PRESET|config.json [--shards N] [--replicas R]   (placement "
      "table)\n"
      "  moe-tool forward --checkpoint DIR [--layer L] [--tokens T] [--seed N]\n"
      "                   [--input x.safetensors] [--output out.safetensors] [--repeat N]\n"
      "                   [--backend cpu|ref]\n"
      "presets: k3, mid, tiny\n");
  return 2;
}

bool ParseFlags(int argc, char** argv, Flags* flags) {
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      std::fprintf(stderr, "unexpected argument \"%s\"\n", a.c_str());
      return false;
    }
    a = a.substr(2);
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      (*flags)[a.substr(0, eq)] = a.substr(eq + 1);
    } else if (a == "single-file" || a == "dense-only") {
      (*flags)[a] = "1";
    } else if (i + 1 < argc) {
      (*flags)[a] = argv[++i];
    } else {
      std::fprintf(stderr, "flag --%s needs a value\n", a.c_str());
      return false;
    }
  }
  return true;
}

template <typename T>
bool Number(const Flags& f, const char* name, T* out) {
  auto it = f.find(name);
  if (it == f.end()) return true;
  bool ok;
  if constexpr (std::is_same_v<T, double>) {
    ok = absl::SimpleAtod(it->second, out);
  } else {
    ok = absl::SimpleAtoi(it->second, out);
  }
  if (!ok) std::fprintf(stderr, "flag --%s: \"%s\" is not a number\n", name, it->second.c_str());
  return ok;
}

int Synth(const Flags& f) {
  if (!f.count("config") || !f.count("out")) return Usage();
  auto cfg = moe::ResolveConfig(f.at("config"));
  if (!cfg.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(cfg.status().message()).c_str());
    return 1;
  }
  moe::checkpoint::SyntheticOptions opt;
  int64_t shard_mb = opt.shard_bytes >> 20;
  if (!Number(f, "seed", &opt.seed) || !Number(f, "skew", &opt.router_skew) ||
      !Number(f, "shard-mb", &shard_mb) || !Number(f, "threads", &opt.threads)) {
    return 2;
  }
  opt.shard_bytes = shard_mb << 20;
  opt.single_file = f.count("single-file") != 0;
  opt.experts = f.count("dense-only") == 0;
  if (f.count("layers")) {
    for (absl::string_view part : absl::StrSplit(f.at("layers"), ',')) {
      int64_t l;
      if (!absl::SimpleAtoi(part, &l)) {
        std::fprintf(stderr, "flag --layers: \"%s\" is not a list of layer numbers\n",
                     f.at("layers").c_str());
        return 2;
      }
      opt.layers.push_back(l);
    }
  }
  moe::checkpoint::SyntheticReport rep;
  absl::Status st = moe::checkpoint::WriteSyntheticCheckpoint(*cfg, f.at("out"), opt, &rep);
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(st.message()).c_str());
    return 1;
  }
  std::printf("wrote %s checkpoint to %s: %.1f MB in %d shard(s), %.1f s (%.0f MB/s)\n",
              cfg->name.c_str(), f.at("out").c_str(), rep.bytes / 1e6, rep.shards, rep.seconds,
              rep.bytes / 1e6 / rep.seconds);
  return 0;
}

int Forward(const Flags& f) {
  if (!f.count("checkpoint")) return Usage();
  moe::tools::ForwardRequest req;
  req.checkpoint = f.at("checkpoint");
  if (!Number(f, "layer", &req.layer) || !Number(f, "tokens", &req.tokens) ||
      !Number(f, "seed", &req.input_seed) || !Number(f, "repeat", &req.repeat)) {
    return 2;
  }
  if (f.count("input")) req.input = f.at("input");
  if (f.count("output")) req.output = f.at("output");
  if (f.count("backend")) req.backend = f.at("backend");
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
  return 0;
}

// Writes a preset's (or a parsed file's) config.json: the Helm chart's model ConfigMap comes
// from here.
int Config(const Flags& f) {
  if (!f.count("config")) return Usage();
  auto cfg = moe::ResolveConfig(f.at("config"));
  if (!cfg.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(cfg.status().message()).c_str());
    return 1;
  }
  const std::string json = moe::ToHfConfigJson(*cfg);
  if (!f.count("out")) {
    std::fputs(json.c_str(), stdout);
    return 0;
  }
  FILE* out = std::fopen(f.at("out").c_str(), "w");
  if (out == nullptr || std::fputs(json.c_str(), out) < 0 || std::fclose(out) != 0) {
    std::fprintf(stderr, "error: cannot write %s\n", f.at("out").c_str());
    return 1;
  }
  return 0;
}

// The placement table of `shards` even ranges x `replicas` (services/placement): what the Helm
// chart renders into its ranges.json (tests/deploy/chart_test.sh compares them).
int Ranges(const Flags& f) {
  if (!f.count("config")) return Usage();
  auto cfg = moe::ResolveConfig(f.at("config"));
  int64_t shards = 2, replicas = 1;
  if (!cfg.ok() || (f.count("shards") && !absl::SimpleAtoi(f.at("shards"), &shards)) ||
      (f.count("replicas") && !absl::SimpleAtoi(f.at("replicas"), &replicas)) || shards < 1 ||
      shards > cfg->num_experts || replicas < 1) {
    std::fprintf(stderr, "error: %s\n",
                 cfg.ok() ? "--shards must lie in [1, E], --replicas at least 1"
                          : std::string(cfg.status().message()).c_str());
    return 1;
  }
  std::printf("%s\n", moe::placement::RangeTableJson(
                          moe::placement::EvenTable(cfg->num_experts, shards, replicas))
                          .c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage();
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) return 2;
  const std::string cmd = argv[1];
  if (cmd == "synth") return Synth(flags);
  if (cmd == "config") return Config(flags);
  if (cmd == "ranges") return Ranges(flags);
  if (cmd == "forward") return Forward(flags);
  return Usage();
}
