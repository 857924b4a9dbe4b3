// The disaggregated layer against the in-process layer, per data plane, in one run (issues:
// services, data plane).
//
//   scripts/bench.sh --cluster     or
//   build/tests/cluster_bench [--checkpoint DIR | --preset mid] [--tokens 1,16,64,256]
//                             [--seconds 4] [--shards 2] [--reply_mode per_pair|partial_sum]
//                             [--data_planes grpc,auto,ucx_shm,ucx_tcp,ucx_shm+mb2]
//
// For each batch size T: tokens/s of CpuMoeLayer::Forward in this process (all cores) and of
// Forward through attention-svc with the experts on expert-svc shards (real processes on
// loopback, same checkpoint, same cores), one request at a time, so the ratio is the cost of
// disaggregation per batch; then the cluster with 2 requests in flight (the attention node
// overlaps one batch's dense work with another's experts). Each data plane gets its own
// cluster: in-band gRPC, UCX over shared memory (UCX_TLS posix; ucx_cma: posix,cma, where the
// receiver pulls a large reply) and UCX over TCP on loopback;
// p50/p99 are of the dispatch stage (send to every shard, wait for every reply) per request.
// Dispatch bytes are the tensor payloads the attention node reports: one latent row per distinct
// token and shard out, and per (token, expert) bf16 rows or per-token fp32 partial sums back. A
// memcpy probe gives this machine's copy bandwidth as the yardstick for bytes/s. Timing is wall
// clock; each point runs for --seconds after one warm-up request.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/moe_client.h"
#include "services/common/flags.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/tools/load_generator.h"
#include "services/tools/local_cluster.h"
#include "tests/bench/bench_checkpoint.h"
#include "tests/bench/memcpy_bandwidth.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

// The value of a data plane's "+<key>N" suffix ("ucx_shm+mb2+poll100", key "mb": "2"), or "".
std::string Suffix(const std::string& name, const std::string& key) {
  std::vector<std::string> parts = absl::StrSplit(name, '+');
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i].rfind(key, 0) == 0) return parts[i].substr(key.size());
  }
  return "";
}
// The flags both services get for a data plane ("ucx_shm+poll100": both poll for at most 100
// us, the fixed window before the learned one; "+mb2": see AttentionOnlyArgs).
std::vector<std::string> DataPlaneArgs(const std::string& name) {
  const std::string base = name.substr(0, name.find('+'));
  std::vector<std::string> args;
  if (base == "grpc") args = {"--data_plane=grpc"};
  if (base == "ucx_shm") args = {"--data_plane=ucx", "--ucx_tls=posix"};
  if (base == "ucx_cma") args = {"--data_plane=ucx", "--ucx_tls=posix,cma"};
  if (base == "ucx_tcp") args = {"--data_plane=ucx", "--ucx_tls=tcp"};
  if (base == "shm") args = {"--data_plane=shm"};
  if (base == "auto") args = {"--data_plane=auto"};  // what users run: shm on one host
  if (const std::string poll = Suffix(name, "poll"); !args.empty() && !poll.empty()) {
    args.push_back("--ucx_poll_max_us=" + poll);
  }
  return args;
}
// "+mb2": attention-svc splits each request into 2 micro-batches; "+detach0": its replies' MACs
// stay attached (--ucx_detach_tag_from_bytes=0).
std::vector<std::string> AttentionOnlyArgs(const std::string& name) {
  std::vector<std::string> args;
  if (const std::string mb = Suffix(name, "mb"); !mb.empty()) {
    args.push_back("--micro_batches=" + mb);
  }
  if (const std::string detach = Suffix(name, "detach"); !detach.empty()) {
    args.push_back("--ucx_detach_tag_from_bytes=" + detach);
  }
  return args;
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

struct Point {
  double tps = 0, tps2 = 0, payload_gbs = 0, p50_ms = 0, p99_ms = 0, dispatch_share = 0;
  double stages_ms[4] = {0, 0, 0, 0};  // router+down, dispatch, combine+norm, up+shared
};

struct Options {
  std::string checkpoint, preset = "mid", reply_mode = "per_pair", work_dir;
  std::vector<int64_t> sizes = {1, 16, 64, 256};
  std::string data_planes = "grpc,auto,ucx_shm,ucx_tcp,ucx_shm+mb2";
  double seconds = 4;
  int shards = 2;
  int expert_threads = 0;     // per expert-svc process (0: the local cluster's share)
  int attention_threads = 0;  // of attention-svc (0: the local cluster's: every CPU)
};

// The in-process layer at every T: tokens/s, stage times and calls.
struct InProcess {
  std::map<int64_t, double> tps;
  std::map<int64_t, numerics::LayerTimings> timings;
  std::map<int64_t, int64_t> calls;
};

InProcess MeasureInProcess(numerics::cpu::CpuMoeLayer& local, const ModelConfig& cfg,
                           const Options& o) {
  InProcess r;
  for (int64_t t : o.sizes) {
    const std::vector<tensor::Bf16> x = checkpoint::SyntheticHiddenStates(cfg, t, 1000 + t);
    (void)local.Forward(x, t, cfg.hidden);
    int64_t n = 0;
    numerics::LayerTimings lt;
    const auto t0 = Clock::now();
    while (std::chrono::duration<double>(Clock::now() - t0).count() < o.seconds) {
      (void)local.Forward(x, t, cfg.hidden, nullptr, &lt);
      ++n;
    }
    r.tps[t] = n * t / std::chrono::duration<double>(Clock::now() - t0).count();
    r.timings[t] = lt;
    r.calls[t] = n;
  }
  return r;
}

// One point: --seconds of one request at a time through the cluster (stage times from the
// responses), then --seconds with 2 in flight.
absl::StatusOr<Point> MeasurePoint(client::MoeClient& client, const ModelConfig& cfg,
                                   const Options& o, int64_t t) {
  const int32_t layer = static_cast<int32_t>(cfg.first_moe_layer);
  const std::vector<tensor::Bf16> x = checkpoint::SyntheticHiddenStates(cfg, t, 1000 + t);
  (void)client.Forward(layer, x, t, cfg.hidden);
  int64_t n = 0;
  double dispatch_s = 0, bytes = 0;
  std::vector<double> dispatch_each;
  Point pt;
  const auto t0 = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - t0).count() < o.seconds) {
    auto r = client.Forward(layer, x, t, cfg.hidden);
    if (!r.ok()) return r.status();
    dispatch_s += r->seconds.dispatch();
    dispatch_each.push_back(r->seconds.dispatch());
    bytes += static_cast<double>(r->dispatch_bytes_sent + r->dispatch_bytes_received);
    pt.stages_ms[0] += r->seconds.router() + r->seconds.down_proj();
    pt.stages_ms[1] += r->seconds.dispatch();
    pt.stages_ms[2] += r->seconds.combine_norm();
    pt.stages_ms[3] += r->seconds.up_proj() + r->seconds.shared();
    ++n;
  }
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  pt.tps = n * t / wall;
  pt.payload_gbs = bytes / dispatch_s / 1e9;
  pt.p50_ms = 1e3 * Quantile(dispatch_each, 0.5);
  pt.p99_ms = 1e3 * Quantile(dispatch_each, 0.99);
  pt.dispatch_share = dispatch_s / wall;
  for (double& v : pt.stages_ms) v = 1e3 * v / static_cast<double>(n);
  tools::LoadOptions lo;
  lo.layer = layer;
  lo.hidden = cfg.hidden;
  lo.concurrency = 2;
  lo.tokens = t;
  lo.duration = absl::Seconds(o.seconds);
  lo.distinct_batches = 2;
  auto two = tools::RunLoad(client, lo);
  pt.tps2 = two.ok() ? two->tokens_per_second : 0.0;
  // Failed requests count no tokens: say what they were, not only a low figure.
  if (!two.ok()) {
    std::fprintf(stderr, "T=%lld, 2 in flight: %s\n", static_cast<long long>(t),
                 two.status().ToString().c_str());
  } else {
    for (const auto& [code, count] : two->errors) {
      std::fprintf(stderr, "T=%lld, 2 in flight: %lld of %lld requests failed with %s: %s\n",
                   static_cast<long long>(t), static_cast<long long>(count),
                   static_cast<long long>(two->requests), code.c_str(),
                   two->first_error.at(code).c_str());
    }
  }
  return pt;
}

// Every T on a cluster of its own for the data plane `plane`.
absl::Status MeasurePlane(const std::string& plane, const ModelConfig& cfg, const Options& o,
                          std::map<std::pair<std::string, int64_t>, Point>* points) {
  tools::LocalClusterOptions co;
  co.checkpoint = o.checkpoint;
  co.num_shards = o.shards;
  co.reply_mode = o.reply_mode;
  if (!o.work_dir.empty()) co.work_dir = o.work_dir + "/" + plane;
  co.expert_args = DataPlaneArgs(plane);
  co.attention_args = DataPlaneArgs(plane);
  for (const std::string& a : AttentionOnlyArgs(plane)) co.attention_args.push_back(a);
  if (co.expert_args.empty()) return absl::InvalidArgumentError("unknown data plane " + plane);
  if (o.expert_threads > 0) {
    co.expert_args.push_back("--threads=" + std::to_string(o.expert_threads));
  }
  if (o.attention_threads > 0) {
    co.attention_args.push_back("--threads=" + std::to_string(o.attention_threads));
  }
  auto cluster = tools::LocalCluster::Start(co);
  if (!cluster.ok()) return cluster.status();
  client::ClientOptions clo;
  clo.attention = (*cluster)->attention_endpoint();
  auto client = client::MoeClient::Create(clo);
  if (!client.ok()) return client.status();
  for (int64_t t : o.sizes) {
    auto pt = MeasurePoint(**client, cfg, o, t);
    if (!pt.ok()) return pt.status();
    (*points)[{plane, t}] = *pt;
    std::fprintf(stderr, "%s T=%lld: %.0f tok/s\n", plane.c_str(), static_cast<long long>(t),
                 pt->tps);
  }
  return absl::OkStatus();
}

void PrintTables(const Options& o, const std::vector<std::string>& planes, InProcess& local,
                 std::map<std::pair<std::string, int64_t>, Point>& points) {
  std::printf(
      "| T | data plane | in-process tok/s | cluster tok/s (1 in flight) | overhead | "
      "overhead / gRPC's | cluster tok/s (2 in flight) | payload GB/s (in dispatch) | "
      "dispatch p50 ms | dispatch p99 ms | dispatch share |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t t : o.sizes) {
    const double grpc_over =
        points.count({"grpc", t}) ? local.tps[t] / points[{"grpc", t}].tps - 1.0 : 0.0;
    for (const std::string& plane : planes) {
      const Point& pt = points[{plane, t}];
      const double over = local.tps[t] / pt.tps - 1.0;
      std::printf("| %lld | %s | %.0f | %.0f | %+.1f%% | %s | %.0f | %.3f | %.2f | %.2f | %.2f |\n",
                  static_cast<long long>(t), plane.c_str(), local.tps[t], pt.tps, 100.0 * over,
                  plane == "grpc" || grpc_over <= 0
                      ? "-"
                      : absl::StrFormat("%.2f", over / grpc_over).c_str(),
                  pt.tps2, pt.payload_gbs, pt.p50_ms, pt.p99_ms, pt.dispatch_share);
    }
  }
  std::printf(
      "\nms per batch, in-process (experts) / cluster (dispatch), 1 in flight:\n| T | data plane "
      "| router+down | experts / dispatch | combine+norm | up+shared "
      "|\n|---|---|---|---|---|---|\n");
  for (int64_t t : o.sizes) {
    const numerics::LayerTimings& lt = local.timings[t];
    const double n = static_cast<double>(local.calls[t]);
    for (const std::string& plane : planes) {
      const Point& pt = points[{plane, t}];
      std::printf("| %lld | %s | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f |\n",
                  static_cast<long long>(t), plane.c_str(), 1e3 * (lt.router + lt.down_proj) / n,
                  pt.stages_ms[0], 1e3 * lt.experts / n, pt.stages_ms[1], 1e3 * lt.combine_norm / n,
                  pt.stages_ms[2], 1e3 * (lt.up_proj + lt.shared) / n, pt.stages_ms[3]);
    }
  }
  std::printf(
      "\noverhead = in-process tok/s / cluster tok/s - 1. Targets (data-plane issue): UCX shared "
      "memory <= +5%% at T = 256 and <= +10%% at T = 16, and at most half of gRPC's overhead at "
      "every T (overhead / gRPC's <= 0.5)\n");
}

int Main(int argc, char** argv) {
  Options o;
  SvcFlags f("cluster_bench", "The disaggregated layer on loopback vs in process.");
  f.String("checkpoint", &o.checkpoint, "checkpoint directory (empty: synthetic --preset)");
  f.String("work_dir", &o.work_dir,
           "keep each data plane's cluster (its logs) in <work_dir>/<plane> (empty: removed)");
  f.String("preset", &o.preset, "synthetic preset when no checkpoint");
  f.Double("seconds", &o.seconds, "seconds per point");
  f.Int("shards", &o.shards, "expert shards");
  f.Int("expert_threads", &o.expert_threads,
        "threads per expert-svc process (0: the CPUs this process may use over the cluster's "
        "processes)");
  f.Int("attention_threads", &o.attention_threads,
        "threads of attention-svc (0: the CPUs this process may use)");
  f.String("reply_mode", &o.reply_mode, "per_pair|partial_sum");
  f.IntList("tokens", &o.sizes, "batch sizes, comma-separated");
  f.String("data_planes", &o.data_planes,
           "comma-separated: grpc, ucx_shm, ucx_cma (UCX_TLS posix,cma), ucx_tcp, shm (the "
           "project's memfd rings), auto (the default: shm on one host); +mbN: N "
           "micro-batches (ucx_shm+mb2); +pollN: both services poll for at most N us "
           "(ucx_shm+poll100: the fixed window of before); +detach0: replies' MACs attached "
           "(ucx_cma+detach0)");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  absl::StatusOr<std::string> dir =
      bench::BenchCheckpoint(o.checkpoint, o.preset, "moe_cluster_bench_");
  if (!dir.ok()) {
    std::fprintf(stderr, "%s\n", dir.status().ToString().c_str());
    return 1;
  }
  o.checkpoint = *dir;
  auto ckpt = checkpoint::Checkpoint::Open(o.checkpoint);
  if (!ckpt.ok()) return 1;
  const ModelConfig cfg = *(*ckpt)->LoadConfig();
  auto weights = checkpoint::LoadMoeLayer(**ckpt, cfg, cfg.first_moe_layer, {});
  if (!weights.ok()) return 1;
  auto local = numerics::cpu::CpuMoeLayer::Create(cfg, std::move(*weights), {});
  if (!local.ok()) return 1;
  const double copy_bw = bench::MemcpyBandwidth();
  std::printf("checkpoint %s (H %lld, D %lld, E %lld, k %lld), %d shards, %s replies\n",
              o.checkpoint.c_str(), static_cast<long long>(cfg.hidden),
              static_cast<long long>(cfg.latent), static_cast<long long>(cfg.num_experts),
              static_cast<long long>(cfg.top_k), o.shards, o.reply_mode.c_str());
  std::printf("memcpy bandwidth (read+write): %.1f GB/s\n\n", copy_bw / 1e9);
  InProcess in_process = MeasureInProcess(**local, cfg, o);
  // The in-process layer's memory goes before the cluster's processes load theirs: at K3's
  // shape (a 16 GB layer) both at once do not fit a 23 GB machine, and the cluster then pays
  // for page faults the in-process run never saw.
  local->reset();
  std::map<std::pair<std::string, int64_t>, Point> points;
  std::vector<std::string> planes;
  for (absl::string_view p : absl::StrSplit(o.data_planes, ',')) planes.emplace_back(p);
  for (const std::string& plane : planes) {
    if (absl::Status st = MeasurePlane(plane, cfg, o, &points); !st.ok()) {
      std::fprintf(stderr, "%s: %s\n", plane.c_str(), st.ToString().c_str());
      return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
  }
  PrintTables(o, planes, in_process, points);
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }
