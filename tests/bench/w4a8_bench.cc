// W4A8 against W4A16 on one local cluster (issue: W4A8 MXFP8 latent activations): the same
// requests in both modes (ForwardOptions.precision), so quality and speed are compared on the
// same processes, inputs and routing.
//
//   build/tests/w4a8_bench [--preset mid | --checkpoint DIR] [--tokens 16,64,256]
//                          [--quality_tokens 64] [--seconds 3] [--data_plane grpc|ucx_shm]
//
// Quality: the layer output of W4A8 against W4A16 on --quality_tokens synthetic tokens: relative
// RMS error, the largest error in bf16 ulps of its row's RMS (numerics/tolerance.h), and whether
// routing (expert ids and weights) is identical. Speed, per T and mode: tokens/s of one client
// in a loop for --seconds, the activation bytes sent to the shards per forward, and the dispatch
// time (first message out to last reply in), median.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/common/flags.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/tolerance.h"
#include "services/tools/local_cluster.h"
#include "tests/bench/bench_checkpoint.h"

namespace moe::bench {
namespace {

using tensor::Bf16;
using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

absl::StatusOr<client::ForwardResult> ForwardIn(client::MoeClient& client, const ModelConfig& cfg,
                                                const std::vector<Bf16>& x, int64_t tokens,
                                                v1::Precision p, bool routing) {
  client::ForwardOptions o;
  o.precision = p;
  o.return_routing = routing;
  return client.Forward(static_cast<int32_t>(cfg.first_moe_layer), x, tokens, cfg.hidden, o);
}

// Quality on the same inputs: W4A8 against W4A16 through the cluster.
absl::Status Quality(client::MoeClient& client, const ModelConfig& cfg, int64_t tokens) {
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, tokens, 77);
  auto a16 = ForwardIn(client, cfg, x, tokens, v1::PRECISION_W4A16, true);
  if (!a16.ok()) return a16.status();
  auto a8 = ForwardIn(client, cfg, x, tokens, v1::PRECISION_W4A8, true);
  if (!a8.ok()) return a8.status();
  double num = 0, den = 0;
  for (size_t i = 0; i < a16->out.size(); ++i) {
    const double d = double{a8->out[i].ToFloat()} - a16->out[i].ToFloat();
    num += d * d;
    den += double{a16->out[i].ToFloat()} * a16->out[i].ToFloat();
  }
  numerics::UlpStats stats;
  stats.AddRows(a8->out.data(), a16->out.data(), tokens, cfg.hidden);
  const bool same_routing = a8->expert_ids == a16->expert_ids && a8->weights == a16->weights;
  std::printf(
      "quality, W4A8 vs W4A16, %lld tokens: relative RMS error %.3e, max error %.1f bf16 ulps "
      "of the row RMS, %.1f%% of outputs differ, routing identical: %s\n",
      static_cast<long long>(tokens), std::sqrt(num / den), stats.max_row_ulps,
      100.0 * static_cast<double>(stats.differing) / static_cast<double>(stats.total),
      same_routing ? "yes" : "NO");
  return absl::OkStatus();
}

// One speed row per mode at T tokens: --seconds (at least 2 calls) after a warm-up.
absl::Status SpeedRows(client::MoeClient& client, const ModelConfig& cfg, int64_t t,
                       double seconds) {
  const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, t, 1000 + t);
  int64_t bytes16 = 0;
  for (v1::Precision p : {v1::PRECISION_W4A16, v1::PRECISION_W4A8}) {
    if (auto w = ForwardIn(client, cfg, x, t, p, false); !w.ok()) return w.status();
    int64_t n = 0, bytes = 0;
    std::vector<double> dispatch;
    const auto t0 = Clock::now();
    while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds || n < 2) {
      auto r = ForwardIn(client, cfg, x, t, p, false);
      if (!r.ok()) return r.status();
      bytes = r->dispatch_bytes_sent;
      dispatch.push_back(r->seconds.dispatch());
      ++n;
    }
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    if (p == v1::PRECISION_W4A16) bytes16 = bytes;
    char share[32] = "";
    if (p == v1::PRECISION_W4A8) {
      std::snprintf(share, sizeof(share), " (%.4f of W4A16)",
                    static_cast<double>(bytes) / static_cast<double>(bytes16));
    }
    std::printf("| %lld | %s | %.1f | %lld%s | %.2f |\n", static_cast<long long>(t),
                p == v1::PRECISION_W4A8 ? "W4A8" : "W4A16", static_cast<double>(n * t) / wall,
                static_cast<long long>(bytes), share, 1e3 * Median(dispatch));
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  std::string checkpoint, preset = "mid", data_plane = "grpc";
  std::vector<int64_t> sizes = {16, 64, 256};
  int64_t quality_tokens = 64;
  double seconds = 3;
  int shards = 2;
  SvcFlags f("w4a8_bench", "W4A8 against W4A16 on one local cluster: quality and speed.");
  f.String("checkpoint", &checkpoint, "checkpoint directory (empty: synthetic --preset)");
  f.String("preset", &preset, "synthetic preset when no checkpoint");
  f.IntList("tokens", &sizes, "batch sizes of the speed rows, comma-separated");
  f.Int64("quality_tokens", &quality_tokens, "tokens of the quality comparison");
  f.Double("seconds", &seconds, "seconds per speed point and mode");
  f.Int("shards", &shards, "expert shards");
  f.String("data_plane", &data_plane, "grpc or ucx_shm");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  tools::LocalClusterOptions co;
  co.num_shards = shards;
  if (data_plane == "ucx_shm") {
    co.expert_args = co.attention_args = {"--data_plane=ucx", "--ucx_tls=posix"};
  } else if (data_plane == "grpc") {
    co.expert_args = co.attention_args = {"--data_plane=grpc"};
  } else {
    std::fprintf(stderr, "--data_plane must be grpc or ucx_shm\n");
    return 2;
  }
  absl::Status st = [&]() -> absl::Status {
    absl::StatusOr<std::string> dir = BenchCheckpoint(checkpoint, preset, "moe_w4a8_bench_");
    if (!dir.ok()) return dir.status();
    auto ckpt = checkpoint::Checkpoint::Open(*dir);
    if (!ckpt.ok()) return ckpt.status();
    const ModelConfig cfg = *(*ckpt)->LoadConfig();
    co.checkpoint = *dir;
    co.start_timeout = absl::Minutes(10);  // k3 shards map 7.9 GB each
    auto cluster = tools::LocalCluster::Start(co);
    if (!cluster.ok()) return cluster.status();
    client::ClientOptions clo = (*cluster)->client_options();
    clo.timeout = absl::Minutes(5);
    auto client = client::MoeClient::Create(clo);
    if (!client.ok()) return client.status();
    std::printf("%s (H %lld, D %lld, E %lld, k %lld), %d shards, %s, per-pair replies\n",
                dir->c_str(), static_cast<long long>(cfg.hidden),
                static_cast<long long>(cfg.latent), static_cast<long long>(cfg.num_experts),
                static_cast<long long>(cfg.top_k), shards, data_plane.c_str());
    if (absl::Status q = Quality(**client, cfg, quality_tokens); !q.ok()) return q;
    std::printf(
        "\n| T | mode | tokens/s | activation bytes sent per forward | dispatch ms (median) |\n"
        "|---:|---|---:|---:|---:|\n");
    for (int64_t t : sizes) {
      if (absl::Status r = SpeedRows(**client, cfg, t, seconds); !r.ok()) return r;
    }
    return absl::OkStatus();
  }();
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) { return moe::bench::Main(argc, argv); }
