// Dynamic k (issue 30, docs/math.md section 4.1) on a local cluster: what each expert budget
// buys and costs, then the automatic mode under an overload.
//
//   scripts/bench.sh --budget [--preset mid | --preset k3 | --checkpoint DIR] [--budgets 8,6,4,2]
//                             [--tokens 64] [--seconds 4] [--calibration_tokens 4096]
//
// Budgets: one cluster (automatic mode off). Calibration traffic fills router-svc's window, then
// SetExpertBudget(k) solves the threshold table with the layer serving the full top-k; each
// budget is then a per-request cap (ForwardOptions.expert_budget) on the same table. Per budget:
// tokens/s and p50/p99 latency of --concurrency closed-loop clients for --seconds; on probe
// batches (other tokens than the calibration's) the (token, expert) pairs per token, the dispatch
// bytes per token (activations out plus replies in), and the relative L2 difference of the layer
// output from the same batch at full k.
//
// Overload: a second cluster with one attention worker and the automatic mode on (floor k/4,
// bound 2 queued, 250 ms steps). Phases of 1, then 8, then 1 requests in flight; every 0.5 s a
// line: offered load, the node's cap (moe_auto_expert_budget), experts per token served, p99 and
// errors of that half second.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/common/flags.h"
#include "services/numerics/dynamic_k.h"
#include "services/tools/load_generator.h"
#include "services/tools/local_cluster.h"
#include "tests/bench/bench_checkpoint.h"
#include "tests/common/metrics_text.h"

namespace moe::bench {
namespace {

using tensor::Bf16;

double RelDiff(const std::vector<Bf16>& a, const std::vector<Bf16>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i].ToFloat(), y = b[i].ToFloat();
    d += (x - y) * (x - y);
    n += y * y;
  }
  return n > 0 ? std::sqrt(d / n) : 0.0;
}

struct Options {
  std::string checkpoint, preset = "mid";
  std::vector<int64_t> budgets;
  int64_t tokens = 64, calibration_tokens = 4096;
  double seconds = 4;
  int concurrency = 2, shards = 2;
  bool overload = true;
};

// A started cluster and an admin client of it.
struct Bench {
  std::unique_ptr<tools::LocalCluster> cluster;
  std::unique_ptr<client::MoeClient> client;
};

absl::StatusOr<Bench> StartBench(const tools::LocalClusterOptions& co) {
  Bench b;
  auto cluster = tools::LocalCluster::Start(co);
  if (!cluster.ok()) return cluster.status();
  b.cluster = std::move(*cluster);
  client::ClientOptions clo = b.cluster->client_options();
  clo.admin_token = "bench";
  clo.timeout = absl::Seconds(600);
  auto client = client::MoeClient::Create(clo);
  if (!client.ok()) return client.status();
  b.client = std::move(*client);
  return b;
}

// Calibration traffic, then the table solved with the layer keeping the full top-k (requests
// cap it).
absl::StatusOr<v1::LayerBias> CalibrateAndSolve(client::MoeClient& client, const ModelConfig& cfg,
                                                const Options& o) {
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  for (int64_t sent = 0, i = 0; sent < o.calibration_tokens; sent += o.tokens, ++i) {
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, o.tokens, 50000 + i);
    if (auto r = client.Forward(layer, x, o.tokens, cfg.hidden); !r.ok()) return r.status();
  }
  // The table is solved from the router's window: wait until the reports hold the calibration
  // (bounded: 10 s), else a full-k budget is published with no table to cap requests by.
  int64_t sent = 0;
  for (int64_t s = 0; s < o.calibration_tokens; s += o.tokens) sent += o.tokens;
  for (int i = 0; i < 100; ++i) {
    auto stats = client.GetLoadStats(layer);
    if (stats.ok() && stats->window_tokens() >= sent) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  absl::StatusOr<v1::LayerBias> set = absl::UnknownError("no budget");
  for (int i = 0; i < 100 && !set.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    set = client.SetExpertBudget(layer, static_cast<int32_t>(cfg.top_k));
  }
  return set;
}

// One row of the budget table: probes against full k, then closed-loop load under the cap.
absl::Status BudgetRow(client::MoeClient& client, const ModelConfig& cfg, const Options& o,
                       int64_t b, double* full_tps) {
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  constexpr int kProbes = 4;
  client::ForwardOptions fo;
  fo.expert_budget = static_cast<int32_t>(b);
  client::ForwardOptions full;
  full.expert_budget = static_cast<int32_t>(cfg.top_k);
  double pairs = 0, bytes = 0, diff = 0, served_tokens = 0, mass = 0, top1 = 0;
  for (int p = 0; p < kProbes; ++p) {
    const std::vector<Bf16> x = checkpoint::SyntheticHiddenStates(cfg, o.tokens, 90000 + p);
    auto got = client.Forward(layer, x, o.tokens, cfg.hidden, fo);
    auto want = client.Forward(layer, x, o.tokens, cfg.hidden, full);
    if (!got.ok()) return got.status();
    if (!want.ok()) return want.status();
    pairs += static_cast<double>(got->routed_pairs);
    bytes += static_cast<double>(got->dispatch_bytes_sent + got->dispatch_bytes_received);
    served_tokens += static_cast<double>(o.tokens);
    diff += RelDiff(got->out, want->out);
    mass += got->routing_mass_kept;
    std::vector<float> a(got->out.size()), f(want->out.size());
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = got->out[i].ToFloat();
      f[i] = want->out[i].ToFloat();
    }
    top1 += numerics::Top1Agreement(a.data(), f.data(), o.tokens, cfg.hidden);
  }
  tools::LoadOptions lo;
  lo.layer = layer;
  lo.hidden = cfg.hidden;
  lo.concurrency = o.concurrency;
  lo.tokens = o.tokens;
  lo.duration = absl::Seconds(o.seconds);
  lo.distinct_batches = 8;
  lo.seed = 123;
  lo.forward = fo;
  auto load = tools::RunLoad(client, lo);
  if (!load.ok()) return load.status();
  if (b == cfg.top_k) *full_tps = load->tokens_per_second;
  std::printf(
      "| %lld | %.2f | %.0f | %s | %.1f | %.1f | %.1f | %.4f | %.3f | %.3f |\n",
      static_cast<long long>(b), pairs / served_tokens, load->tokens_per_second,
      *full_tps > 0 ? absl::StrFormat("%.2fx", load->tokens_per_second / *full_tps).c_str() : "-",
      load->p50_ms, load->p99_ms, bytes / served_tokens / 1024.0, diff / kProbes, mass / kProbes,
      top1 / kProbes);
  std::fflush(stdout);
  return absl::OkStatus();
}

// Half a second of `in_flight` closed-loop requests on the overloaded node: one table line.
absl::Status OverloadStep(client::MoeClient& client, const std::string& metrics,
                          const ModelConfig& cfg, int64_t tokens, int in_flight, double t) {
  const double tok0 = testing::ScrapeSum(metrics, "moe_budget_tokens_total", {"kind=\"tokens\""});
  const double pair0 = testing::ScrapeSum(metrics, "moe_budget_tokens_total", {"kind=\"pairs\""});
  tools::LoadOptions lo;
  lo.layer = static_cast<int32_t>(cfg.first_moe_layer);
  lo.hidden = cfg.hidden;
  lo.concurrency = in_flight;
  lo.tokens = tokens;
  lo.duration = absl::Milliseconds(500);
  lo.distinct_batches = 8;
  lo.seed = 7 + static_cast<uint64_t>(t * 2);
  auto r = tools::RunLoad(client, lo);
  if (!r.ok()) return r.status();
  const double tok1 = testing::ScrapeSum(metrics, "moe_budget_tokens_total", {"kind=\"tokens\""});
  const double pair1 = testing::ScrapeSum(metrics, "moe_budget_tokens_total", {"kind=\"pairs\""});
  int64_t errors = 0;
  for (const auto& [code, n] : r->errors) errors += n;
  std::printf("| %.1f | %d | %.0f | %.2f | %.0f | %.1f | %lld |\n", t + 0.5, in_flight,
              testing::ScrapeSum(metrics, "moe_auto_expert_budget", {}),
              tok1 > tok0 ? (pair1 - pair0) / (tok1 - tok0) : 0.0, r->tokens_per_second, r->p99_ms,
              static_cast<long long>(errors));
  std::fflush(stdout);
  return absl::OkStatus();
}

// The automatic mode under an overload: a second cluster with one worker, phases of 1, 8, 1
// requests in flight.
absl::Status Overload(tools::LocalClusterOptions oo, const ModelConfig& cfg, const Options& o) {
  const int64_t floor = std::max<int64_t>(1, cfg.top_k / 4);
  oo.attention_args = {"--report_interval_ms=200",
                       "--workers=1",
                       absl::StrCat("--budget_auto_floor=", floor),
                       "--budget_auto_queue=2",
                       "--budget_auto_interval_ms=250",
                       "--budget_check_every=16"};
  auto bench = StartBench(oo);
  if (!bench.ok()) return bench.status();
  auto set = CalibrateAndSolve(*bench->client, cfg, o);
  if (!set.ok()) return set.status();
  std::printf(
      "\nOverload: one attention worker, automatic mode floor %lld, bound 2 queued, "
      "250 ms steps; %lld tokens per request\n\n| t s | in flight | cap | experts/token "
      "| tokens/s | p99 ms | errors |\n|---|---|---|---|---|---|---|\n",
      static_cast<long long>(floor), static_cast<long long>(o.tokens));
  const std::string metrics = bench->cluster->attention_metrics();
  double t = 0;
  for (const auto& [in_flight, phase_s] :
       std::vector<std::pair<int, double>>{{1, 3}, {8, 6}, {1, 6}}) {
    for (double s = 0; s < phase_s; s += 0.5, t += 0.5) {
      if (auto st = OverloadStep(*bench->client, metrics, cfg, o.tokens, in_flight, t); !st.ok()) {
        return st;
      }
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the last report
  const double checks =
      testing::ScrapeSum(metrics, "moe_budget_checks_total", {"outcome=\"measured\""});
  const double sum = testing::ScrapeSum(metrics, "moe_budget_output_rel_diff_sum", {});
  std::printf(
      "\nsteps down %.0f, up %.0f; the node's sampled full-k checks: %.0f measured, mean "
      "relative output difference %.4f\n",
      testing::ScrapeSum(metrics, "moe_budget_steps_total", {"direction=\"down\""}),
      testing::ScrapeSum(metrics, "moe_budget_steps_total", {"direction=\"up\""}), checks,
      checks > 0 ? sum / checks : 0.0);
  return absl::OkStatus();
}

// The budgets on one cluster (automatic mode off).
absl::Status Budgets(const tools::LocalClusterOptions& co, const ModelConfig& cfg,
                     const std::string& dir, const Options& o) {
  auto bench = StartBench(co);
  if (!bench.ok()) return bench.status();
  client::MoeClient& client = *bench->client;
  auto set = CalibrateAndSolve(client, cfg, o);
  if (!set.ok()) return set.status();
  // Wait until the attention node routes with the new version.
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  const std::vector<Bf16> probe0 = checkpoint::SyntheticHiddenStates(cfg, 1, 7);
  for (int i = 0; i < 100; ++i) {
    auto r = client.Forward(layer, probe0, 1, cfg.hidden);
    if (r.ok() && r->bias_version == set->version()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::printf(
      "checkpoint %s (H %lld, D %lld, E %lld, k %lld), %d shards; thresholds solved from "
      "%lld tokens (bias version %llu)\n",
      dir.c_str(), static_cast<long long>(cfg.hidden), static_cast<long long>(cfg.latent),
      static_cast<long long>(cfg.num_experts), static_cast<long long>(cfg.top_k), o.shards,
      static_cast<long long>(set->budget().solved_from_tokens()),
      static_cast<unsigned long long>(set->version()));
  std::printf(
      "\n| budget | experts/token | tokens/s | vs full k | p50 ms | p99 ms | dispatch "
      "KB/token | rel. output diff vs full k | routing weight kept | top-1 agreement "
      "|\n|---|---|---|---|---|---|---|---|---|---|\n");
  double full_tps = 0;
  for (int64_t b : o.budgets) {
    if (auto st = BudgetRow(client, cfg, o, b, &full_tps); !st.ok()) return st;
  }
  bench->cluster->Stop();
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  Options o;
  SvcFlags f("budget_bench", "Dynamic k on a local cluster: budgets, then an overload.");
  f.String("checkpoint", &o.checkpoint, "checkpoint directory (empty: synthetic --preset)");
  f.String("preset", &o.preset, "synthetic preset when no checkpoint");
  f.IntList("budgets", &o.budgets, "budgets to measure (default: k, 3k/4, k/2, k/4)");
  f.Int64("tokens", &o.tokens, "tokens per request");
  f.Int64("calibration_tokens", &o.calibration_tokens, "tokens sent before the thresholds");
  f.Double("seconds", &o.seconds, "seconds of traffic per budget");
  f.Int("concurrency", &o.concurrency, "requests in flight per budget");
  f.Int("shards", &o.shards, "expert shards");
  f.Bool("overload", &o.overload, "run the overload experiment too");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  absl::StatusOr<std::string> dir = BenchCheckpoint(o.checkpoint, o.preset, "moe_budget_bench_");
  if (!dir.ok()) {
    std::fprintf(stderr, "%s\n", dir.status().ToString().c_str());
    return 1;
  }
  auto ckpt = checkpoint::Checkpoint::Open(*dir);
  if (!ckpt.ok()) return 1;
  const ModelConfig cfg = *(*ckpt)->LoadConfig();
  const int64_t k = cfg.top_k;
  if (o.budgets.empty()) o.budgets = {k, 3 * k / 4, k / 2, k / 4};
  tools::LocalClusterOptions co;
  co.checkpoint = *dir;
  co.num_shards = o.shards;
  co.admin_token = "bench";
  co.attention_args = {"--report_interval_ms=200", "--budget_check_every=0"};
  absl::Status st = Budgets(co, cfg, *dir, o);
  if (st.ok() && o.overload) st = Overload(co, cfg, o);
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) { return moe::bench::Main(argc, argv); }
