// The disaggregated layer against the in-process layer, in one run (issue: services).
//
//   scripts/bench.sh --cluster     or
//   build/tests/cluster_bench [--checkpoint DIR | --preset mid] [--tokens 16,64,256]
//                             [--seconds 4] [--shards 2] [--reply_mode per_pair|partial_sum]
//
// For each batch size T: tokens/s of CpuMoeLayer::Forward in this process (all cores) and of
// Forward through attention-svc with the experts on expert-svc shards (real processes on
// loopback, same checkpoint, same cores), one request at a time, so the ratio is the cost of
// disaggregation per batch; then the cluster with 2 requests in flight (the attention node
// overlaps one batch's dense work with another's experts). Dispatch bytes are the tensor
// payloads the attention node reports: one latent row per distinct token and shard out, and
// per (token, expert) bf16 rows or per-token fp32 partial sums back. A memcpy probe gives this
// machine's copy bandwidth as the yardstick for bytes/s.
// Timing is wall clock; each point runs for --seconds after one warm-up request.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/common/flags.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/tools/load_generator.h"
#include "services/tools/local_cluster.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

double MemcpyBandwidth() {
  const size_t n = size_t{256} << 20;
  std::vector<char> a(n, 1), b(n, 2);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), n);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, 2.0 * n / s);  // read + write
    a[rep] = b[n - 1 - rep];
  }
  return best;
}

int Main(int argc, char** argv) {
  std::string checkpoint, preset = "mid", reply_mode = "per_pair";
  std::vector<int64_t> sizes = {16, 64, 256};
  double seconds = 4;
  int shards = 2;
  int expert_threads = 0;  // per expert-svc process (0: all cores)
  SvcFlags f("cluster_bench", "The disaggregated layer on loopback vs in process.");
  f.String("checkpoint", &checkpoint, "checkpoint directory (empty: synthetic --preset)");
  f.String("preset", &preset, "synthetic preset when no checkpoint");
  f.Double("seconds", &seconds, "seconds per point");
  f.Int("shards", &shards, "expert shards");
  f.Int("expert_threads", &expert_threads, "threads per expert-svc process (0: all cores)");
  f.String("reply_mode", &reply_mode, "per_pair|partial_sum");
  f.IntList("tokens", &sizes, "batch sizes, comma-separated");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  if (checkpoint.empty()) {
    checkpoint = "/tmp/moe_cluster_bench_" + preset;
    auto cfg = PresetConfig(preset);
    if (!cfg.ok()) return 2;
    checkpoint::SyntheticOptions so;
    so.router_skew = 1.0;
    if (absl::Status s = checkpoint::WriteSyntheticCheckpoint(*cfg, checkpoint, so); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
  }
  auto ckpt = checkpoint::Checkpoint::Open(checkpoint);
  if (!ckpt.ok()) return 1;
  const ModelConfig cfg = *(*ckpt)->LoadConfig();
  auto weights = checkpoint::LoadMoeLayer(**ckpt, cfg, cfg.first_moe_layer, {});
  if (!weights.ok()) return 1;
  auto local = numerics::cpu::CpuMoeLayer::Create(cfg, std::move(*weights), {});
  if (!local.ok()) return 1;

  tools::LocalClusterOptions co;
  co.checkpoint = checkpoint;
  co.num_shards = shards;
  co.reply_mode = reply_mode;
  if (expert_threads > 0) co.expert_args = {"--threads=" + std::to_string(expert_threads)};
  auto cluster = tools::LocalCluster::Start(co);
  if (!cluster.ok()) {
    std::fprintf(stderr, "%s\n", cluster.status().ToString().c_str());
    return 1;
  }
  client::ClientOptions clo;
  clo.attention = (*cluster)->attention_endpoint();
  auto client = client::MoeClient::Create(clo);
  const double copy_bw = MemcpyBandwidth();
  std::printf("checkpoint %s (H %lld, D %lld, E %lld, k %lld), %d shards, %s replies\n",
              checkpoint.c_str(), static_cast<long long>(cfg.hidden),
              static_cast<long long>(cfg.latent), static_cast<long long>(cfg.num_experts),
              static_cast<long long>(cfg.top_k), shards, reply_mode.c_str());
  std::printf("memcpy bandwidth (read+write): %.1f GB/s\n\n", copy_bw / 1e9);
  std::printf(
      "| T | in-process tok/s | cluster tok/s (1 in flight) | ratio | overhead | "
      "cluster tok/s (2 in flight) | dispatch GB/s (wall) | dispatch GB/s (in dispatch) |"
      " dispatch share |\n|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> stage_lines;
  for (int64_t t : sizes) {
    const std::vector<tensor::Bf16> x = checkpoint::SyntheticHiddenStates(cfg, t, 1000 + t);
    // In process.
    (void)(*local)->Forward(x, t, cfg.hidden);
    int64_t n_local = 0;
    numerics::LayerTimings lt;
    auto t0 = Clock::now();
    while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
      (void)(*local)->Forward(x, t, cfg.hidden, nullptr, &lt);
      ++n_local;
    }
    const double local_tps = n_local * t / std::chrono::duration<double>(Clock::now() - t0).count();
    // Cluster, one request at a time.
    (void)(*client)->Forward(static_cast<int32_t>(cfg.first_moe_layer), x, t, cfg.hidden);
    int64_t n_remote = 0;
    double dispatch_s = 0, bytes = 0;
    double stages[3] = {0, 0, 0};
    t0 = Clock::now();
    while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
      auto r = (*client)->Forward(static_cast<int32_t>(cfg.first_moe_layer), x, t, cfg.hidden);
      if (!r.ok()) {
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        return 1;
      }
      dispatch_s += r->seconds.dispatch();
      bytes += static_cast<double>(r->dispatch_bytes_sent + r->dispatch_bytes_received);
      stages[0] += r->seconds.router() + r->seconds.down_proj();
      stages[1] += r->seconds.combine_norm();
      stages[2] += r->seconds.up_proj() + r->seconds.shared();
      ++n_remote;
    }
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    const double remote_tps = n_remote * t / wall;
    stage_lines.push_back(absl::StrFormat(
        "| %d | %.2f / %.2f | %.2f / %.2f (experts / dispatch) | %.2f / %.2f | %.2f / %.2f |", t,
        1e3 * (lt.router + lt.down_proj) / n_local, 1e3 * stages[0] / n_remote,
        1e3 * lt.experts / n_local, 1e3 * dispatch_s / n_remote, 1e3 * lt.combine_norm / n_local,
        1e3 * stages[1] / n_remote, 1e3 * (lt.up_proj + lt.shared) / n_local,
        1e3 * stages[2] / n_remote));
    // Cluster, two requests in flight.
    tools::LoadOptions lo;
    lo.layer = static_cast<int32_t>(cfg.first_moe_layer);
    lo.hidden = cfg.hidden;
    lo.concurrency = 2;
    lo.tokens = t;
    lo.duration = absl::Seconds(seconds);
    lo.distinct_batches = 2;
    auto two = tools::RunLoad(**client, lo);
    std::printf("| %lld | %.0f | %.0f | %.3f | %+.1f%% | %.0f | %.3f | %.3f | %.2f |\n",
                static_cast<long long>(t), local_tps, remote_tps, remote_tps / local_tps,
                100.0 * (local_tps / remote_tps - 1.0), two.ok() ? two->tokens_per_second : 0.0,
                bytes / wall / 1e9, bytes / dispatch_s / 1e9, dispatch_s / wall);
    std::fflush(stdout);
  }
  std::printf(
      "\nms per batch, in-process / cluster (1 in flight):\n| T | router+down | experts "
      "| combine+norm | up+shared |\n|---|---|---|---|---|\n");
  for (const std::string& l : stage_lines) std::printf("%s\n", l.c_str());
  std::printf("\noverhead = in-process tok/s / cluster tok/s - 1 (target at T = 256: <= 15%%)\n");
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }
