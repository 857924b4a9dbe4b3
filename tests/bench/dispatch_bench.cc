// The data plane's own cost, next to the raw transport measured in the same run (issue: data
// plane, second generation). An expert server with the echo backend (no expert compute: each
// row answered with its activations) runs in this process; this process's attention-side
// channel (in-band gRPC, or UCX with the hello, random tags and both MACs) sends it one dispatch
// message per round trip: T tokens, each routed to the k experts the server hosts, so T x D
// activations go out and T x k x D bf16 rows come back, as one shard of a K3-shaped layer sees.
// Round trips are timed one at a time (p50, p99 over --seconds or --iterations), and
// `ucx_perftest` (Debian ucx-utils) measures the raw UCX one-way latency of both payload sizes
// and the tag bandwidth over the same transports: the raw round trip is lat(z) + lat(y). The
// split: "worker RTT" is our UcxWorker's round trip of the same sizes between two workers of
// this process (the progress-thread hand-offs, no gRPC), "gRPC header RTT" a batch the server
// refuses at once (the Dispatch stream both ways, no payload, no compute).
//
//   scripts/bench.sh --dispatch    or
//   build/tests/dispatch_bench [--preset mid|k3] [--tokens 1,16,64,256] [--seconds 2]
//                              [--data_planes grpc,shm,ucx_shm,ucx_tcp] [--raw=true]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "attention-svc/expert_channel_grpc.h"
#include "services/common/flags.h"
#include "services/common/model_config.h"
#include "services/dataplane/payload_mac.h"
#include "services/dataplane/ucx_worker.h"
#include "tests/bench/memcpy_bandwidth.h"
#include "tests/bench/spin_gaps.h"
#include "tests/bench/ucx_floor.h"
#include "tests/common/echo_shard.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

// This process's page faults, context switches and CPU time so far (both ends of the round trip
// run in this process): the split of a round trip's cost that a wall-clock p50 hides.
struct Usage {
  double minor_faults = 0, switches = 0, cpu_us = 0;
  static Usage Now() {
    rusage r{};
    getrusage(RUSAGE_SELF, &r);
    auto us = [](const timeval& t) { return t.tv_sec * 1e6 + t.tv_usec; };
    return {static_cast<double>(r.ru_minflt), static_cast<double>(r.ru_nvcsw + r.ru_nivcsw),
            us(r.ru_utime) + us(r.ru_stime)};
  }
  Usage PerRoundTrip(const Usage& before, size_t n) const {
    const double d = std::max<size_t>(n, 1);
    return {(minor_faults - before.minor_faults) / d, (switches - before.switches) / d,
            (cpu_us - before.cpu_us) / d};
  }
};

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

struct Options {
  std::string preset = "mid", tokens_list = "1,16,64,256", planes = "grpc,shm,ucx_shm,ucx_tcp";
  double seconds = 2;
  int64_t iterations = 20000;
  bool raw = true;
  int progress_spin_us = 0;
  int poll_max_us = expert_svc::ExpertServerOptions{}.ucx_poll_max_us;
  int64_t detach_tag_from =
      static_cast<int64_t>(attention_svc::ChannelOptions{}.detach_reply_tag_from);
};

// The payload integrity check's cost on this machine: AES-256-GMAC over a k3 T = 16 reply.
double GmacGbps() {
  auto mac = dataplane::PayloadMac::Create(dataplane::RandomBytes(dataplane::kMacKeyBytes));
  std::vector<uint8_t> payload(1835008, 3);
  int64_t n = 0;
  const auto t0 = Clock::now();
  while (n < 10000 && std::chrono::duration<double>(Clock::now() - t0).count() < 0.3) {
    (void)mac->Compute(dataplane::Direction::kToExpert, static_cast<uint64_t>(n), payload.data(),
                       payload.size());
    ++n;
  }
  return payload.size() * n / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9;
}

// The header alone: a batch the server refuses at once (a layer it does not host) travels the
// Dispatch stream both ways with no payload and no compute. p50 us.
double HeaderRoundTripUs(const std::string& endpoint, int64_t d, double seconds) {
  attention_svc::DispatchMessage none;
  none.z = tensor::Activations::FromBf16({}, 0, d);
  attention_svc::DispatchHeader bad;
  bad.layer = 9999;
  bad.latent = d;
  bad.timeout_ms = 20000;
  auto stream_only =
      std::make_unique<attention_svc::GrpcExpertChannel>("echo-0", endpoint, 1 << 30, "");
  std::vector<double> us;
  const auto t0 = Clock::now();
  for (int i = 0; i < 20000; ++i) {
    if (i >= 3 && std::chrono::duration<double>(Clock::now() - t0).count() > seconds) break;
    const auto s = Clock::now();
    (void)stream_only->Send(bad, none)->Wait(absl::Now() + absl::Seconds(20));
    if (i >= 3) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - s).count());
  }
  return Percentile(us, 0.5);
}

// UCX_TLS of a data plane's name.
std::string PlaneTls(const std::string& plane) {
  if (plane == "ucx_tcp") return "tcp";
  if (plane == "ucx_cma") return "posix,cma";
  return "posix";
}

// One (lane, T) row: round trips for --seconds after 3 warm-up ones (at least one timed,
// however slow), their cost split by getrusage, the raw transport next to them. Returns the p50
// in us (-1: the batch failed).
double RoundTripRow(testing::EchoShard& shard, const ModelConfig& cfg, const Options& o,
                    const std::string& plane, int64_t t, double header_us, int* port) {
  // The shm lane's raw floor is UCX's shared memory (posix) in the same run.
  const bool ucx = plane != "grpc";
  const std::string tls = PlaneTls(plane);
  const int64_t d = cfg.latent, k = cfg.top_k;
  const testing::EchoBatch batch = testing::MakeEchoBatch(cfg, t);
  std::vector<double> us;
  Usage before;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < o.iterations + 3; ++i) {
    if (i == 3) before = Usage::Now();
    if (i >= 4 && std::chrono::duration<double>(Clock::now() - t0).count() > o.seconds) break;
    const auto s = Clock::now();
    auto reply =
        shard.channel().Send(batch.header, batch.message)->Wait(absl::Now() + absl::Seconds(20));
    const double e = std::chrono::duration<double, std::micro>(Clock::now() - s).count();
    if (!reply.ok()) {
      std::fprintf(stderr, "%s T %lld: %s\n", plane.c_str(), static_cast<long long>(t),
                   reply.status().ToString().c_str());
      return -1;
    }
    if (i >= 3) us.push_back(e);
  }
  const Usage per_rt = Usage::Now().PerRoundTrip(before, us.size());
  const size_t zb = static_cast<size_t>(t * d * 2), yb = static_cast<size_t>(t * k * d * 2);
  double raw_rtt = -1, raw_bw = -1;
  const double worker_us = ucx ? bench::WorkerRoundTripUs(tls, zb, yb, o.seconds) : -1;
  if (o.raw && ucx) {
    const auto lz = bench::PerfTest(tls, "tag_lat", zb, (*port)++);
    const auto ly = bench::PerfTest(tls, "tag_lat", yb, (*port)++);
    const auto bw = bench::PerfTest(tls, "tag_bw", yb, (*port)++);
    if (lz.first > 0 && ly.first > 0) raw_rtt = lz.first + ly.first;
    raw_bw = bw.second > 0 ? bw.second * 1.048576e6 / 1e9 : -1;
  }
  const double p50 = Percentile(us, 0.5), p99 = Percentile(us, 0.99);
  auto num = [](double v) { return v > 0 ? absl::StrFormat("%.1f", v) : std::string("-"); };
  std::printf(
      "| %s | %s | %lld | %zu | %zu | %zu | %.1f | %.1f | %s | %s | %s | %s | %.2f | %s | %.0f | "
      "%.1f | %.0f |\n",
      plane.c_str(), shard.lanes().c_str(), static_cast<long long>(t), zb, yb, us.size(), p50, p99,
      num(raw_rtt).c_str(), num(worker_us).c_str(), num(header_us).c_str(),
      raw_rtt > 0 ? absl::StrFormat("%.1f", p50 - raw_rtt).c_str() : "-",
      (zb + yb) / (p50 * 1e-6) / 1e9, raw_bw > 0 ? absl::StrFormat("%.2f", raw_bw).c_str() : "-",
      per_rt.minor_faults, per_rt.switches, per_rt.cpu_us);
  std::fflush(stdout);
  return p50;
}

int Main(int argc, char** argv) {
  Options o;
  SvcFlags f("dispatch_bench", "The data plane's round trip against the raw UCX transport.");
  f.String("preset", &o.preset, "model shape: mid or k3");
  f.String("tokens", &o.tokens_list, "T values (tokens per message)");
  f.String("data_planes", &o.planes,
           "grpc, ucx_shm (UCX_TLS posix), ucx_cma (posix,cma: the receiver pulls large "
           "messages), ucx_tcp (UCX_TLS tcp), shm (the project's memfd rings; its raw column is "
           "UCX posix)");
  f.Double("seconds", &o.seconds, "seconds per point (after 3 warm-up round trips)");
  f.Int64("iterations", &o.iterations, "at most this many round trips per point");
  f.Bool("raw", &o.raw, "also run ucx_perftest for the raw transport");
  f.Int("progress_spin_us", &o.progress_spin_us,
        "both ends' UCX progress threads poll this long after activity (--ucx_progress_spin_us)");
  f.Int("poll_max_us", &o.poll_max_us,
        "both ends' poll window grows up to this (--ucx_poll_max_us; 100: the fixed window of "
        "before)");
  f.Int64("detach_tag_from", &o.detach_tag_from,
          "replies of this many bytes or more get their MAC in a message after them "
          "(--ucx_detach_tag_from_bytes); 0: never, the attached MAC of before");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  auto cfg = PresetConfig(o.preset);
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", cfg.status().ToString().c_str());
    return 2;
  }
  std::vector<int64_t> ts;
  for (absl::string_view t : absl::StrSplit(o.tokens_list, ','))
    ts.push_back(std::stoll(std::string(t)));
  std::printf(
      "preset %s: D %lld, k %lld; memcpy %.1f GB/s; payload MAC (AES-256-GMAC) %.1f GB/s; the "
      "services' UCX shared-memory FIFO %s (ucx_perftest's: the environment's or UCX's own)\n\n",
      o.preset.c_str(), static_cast<long long>(cfg->latent), static_cast<long long>(cfg->top_k),
      bench::MemcpyBandwidth() / 1e9, GmacGbps(),
      dataplane::SharedMemoryFifoShape("posix").c_str());
  std::printf(
      "| data plane | lanes | T | z bytes | y bytes | round trips | p50 us | p99 us | raw UCX "
      "RTT us | worker RTT us | gRPC header RTT us | added p50 us | service GB/s | raw tag_bw "
      "GB/s | faults per RT | switches per RT | CPU us per RT |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  int port = 14000 + static_cast<int>(getpid() % 1000) * 10;
  const bench::SpinGaps gaps = bench::MeasureSpinGaps(1.0);
  double smallest_p50 = -1;  // of the first UCX lane's first T
  for (absl::string_view plane_view : absl::StrSplit(o.planes, ',')) {
    const std::string plane(plane_view);
    const std::string tls = PlaneTls(plane);
    auto shard = plane == "shm" ? testing::EchoShard::StartBackend(o.preset, "shm", o.poll_max_us)
                                : testing::EchoShard::Start(o.preset, plane != "grpc" ? tls : "",
                                                            /*batch_messages=*/true,
                                                            o.progress_spin_us, o.poll_max_us,
                                                            static_cast<size_t>(o.detach_tag_from));
    if (!shard.ok()) {
      std::fprintf(stderr, "echo shard: %s\n", shard.status().ToString().c_str());
      return 1;
    }
    const double header_us = HeaderRoundTripUs((*shard)->endpoint(), cfg->latent, o.seconds);
    for (int64_t t : ts) {
      const double p50 = RoundTripRow(**shard, *cfg, o, plane, t, header_us, &port);
      if (plane != "grpc" && smallest_p50 < 0) smallest_p50 = p50;
    }
  }
  // What bounds the p99 of the smallest polled round trip here, whatever the data plane does.
  if (smallest_p50 > 0) std::printf("\n%s\n", gaps.Describe(smallest_p50).c_str());
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }
