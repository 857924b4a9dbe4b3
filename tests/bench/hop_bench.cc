// The hop between an attention node and its expert shards, as DeepEP publishes its dispatch and
// combine (issue: the data plane, third generation): per lane, P echo shards (the data plane
// without expert compute: each row answered with its activations) run in this process, and one
// attention-side UCX worker with a channel to each sends every shard T tokens routed to its k
// experts, then waits for all P replies: one dispatch + combine. Printed per (lane, P, T): p50 and
// p99 of the whole hop, the bytes on the wire (activations out, bf16 rows back, all peers), and
// the floors measured in the same run (ucx_perftest's raw one-way latencies of the same sizes,
// and this project's worker alone: one polled message each way, no gRPC, no MAC, no compute).
// Then the goodput when 1, 2, 4, 8 senders (each its own worker and channel, like attention
// nodes) hit one shard at once, and the decode-step cost of a 92-layer K3 stack projected from
// the hop's p50 (92 x p50: the hops alone, no attention or expert compute).
//
// Every process of this benchmark shares this machine's CPUs: on 2 vCPUs the shards' compute
// threads, the progress threads and the senders contend, which a deployment (shards on their
// own hosts) does not.
//
//   scripts/bench.sh --cluster    or
//   build/tests/hop_bench [--preset mid] [--tokens 1,8,32,128,256] [--peers 1,2,4]
//                         [--senders 1,2,4,8] [--data_planes shm,ucx_shm,ucx_tcp,grpc]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "attention-svc/dataplane/registry.h"
#include "attention-svc/dataplane/ucx/expert_channel_ucx.h"
#include "attention-svc/expert_channel_grpc.h"
#include "expert-svc/expert_server.h"
#include "services/common/flags.h"
#include "services/common/model_config.h"
#include "services/dataplane/ucx_worker.h"
#include "tests/bench/memcpy_bandwidth.h"
#include "tests/bench/spin_gaps.h"
#include "tests/bench/ucx_floor.h"
#include "tests/common/echo_shard.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

std::vector<int64_t> Ints(const std::string& list) {
  std::vector<int64_t> out;
  for (absl::string_view v : absl::StrSplit(list, ',')) out.push_back(std::stoll(std::string(v)));
  return out;
}

// The attention side of one sender: a worker (UCX lanes) or a backend's client half (shm), and
// a channel to each shard.
struct Sender {
  std::unique_ptr<dataplane::UcxWorker> worker;
  std::unique_ptr<attention_svc::ClientHalf> half;
  std::vector<std::shared_ptr<attention_svc::ExpertChannel>> channels;
};

// tls "shm": the shm backend's half; empty: gRPC in band; else UCX with that UCX_TLS.
absl::StatusOr<Sender> MakeSender(const std::string& tls, const std::vector<std::string>& endpoints,
                                  const std::string& node, int poll_max_us) {
  Sender s;
  if (tls == "shm") {
    attention_svc::ClientHalfOptions ho;
    ho.node = node;
    ho.poll_spin_max = std::chrono::microseconds(poll_max_us);
    auto half = attention_svc::StartClientHalf("shm", ho);
    if (!half.ok()) return half.status();
    s.half = std::move(*half);
  } else if (!tls.empty()) {
    dataplane::UcxOptions uo;
    uo.tls = tls;
    uo.name = node;
    uo.poll_spin_max = std::chrono::microseconds(poll_max_us);
    auto w = dataplane::UcxWorker::Create(uo);
    if (!w.ok()) return w.status();
    s.worker = std::move(*w);
  }
  for (size_t i = 0; i < endpoints.size(); ++i) {
    const std::string shard = absl::StrFormat("echo-%d", i);
    if (tls.empty()) {
      s.channels.push_back(
          std::make_unique<attention_svc::GrpcExpertChannel>(shard, endpoints[i], 1 << 30, ""));
    } else {
      attention_svc::ChannelOptions co;
      co.shard = shard;
      co.endpoint = endpoints[i];
      co.max_message_bytes = 1 << 30;
      co.node = node;
      co.fallback_in_band = false;
      if (s.half != nullptr) {
        s.channels.push_back(s.half->MakeChannel(std::move(co)));
      } else {
        s.channels.push_back(
            std::make_unique<attention_svc::UcxExpertChannel>(std::move(co), s.worker.get()));
      }
    }
  }
  return s;
}

// One hop: the batch to the first `peers` channels, then every reply. False on any failure.
bool Hop(Sender& s, int peers, const testing::EchoBatch& b) {
  std::vector<std::unique_ptr<attention_svc::ExpertCall>> calls;
  for (int p = 0; p < peers; ++p) calls.push_back(s.channels[p]->Send(b.header, b.message));
  bool ok = true;
  for (auto& c : calls) {
    auto r = c->Wait(absl::Now() + absl::Seconds(30));
    if (!r.ok()) {
      std::fprintf(stderr, "hop: %s\n", r.status().ToString().c_str());
      ok = false;
    }
  }
  return ok;
}

struct Options {
  std::string preset = "mid", tokens_list = "1,8,32,128,256", peers_list = "1,2,4",
              senders_list = "1,2,4,8", planes = "shm,ucx_shm,ucx_tcp,grpc";
  double seconds = 1;
  int64_t sender_tokens = 8, layers = 92;
  bool raw = true;
  int poll_max_us = expert_svc::ExpertServerOptions{}.ucx_poll_max_us;
  int goodput_rounds = 3;
};

// One (lane, P, T) row: hops for --seconds after 3 warm-up hops; with P = 1 on UCX, the raw
// transport's and the bare worker's round trips next to it. Returns the p50 in us (-1: failed).
double HopRow(Sender& sender, const ModelConfig& cfg, const Options& o, const std::string& plane,
              const std::string& tls, int64_t p, int64_t t, int* port) {
  const testing::EchoBatch b = testing::MakeEchoBatch(cfg, t);
  const size_t zb = static_cast<size_t>(t * cfg.latent * 2), yb = b.reply_bytes;
  std::vector<double> us;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < 200003; ++i) {
    if (i >= 4 && std::chrono::duration<double>(Clock::now() - t0).count() > o.seconds) break;
    const auto s = Clock::now();
    if (!Hop(sender, static_cast<int>(p), b)) return -1;
    if (i >= 3) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - s).count());
  }
  double raw_rtt = -1, worker_rtt = -1;
  if (!tls.empty() && p == 1) {
    const std::string raw_tls = tls == "shm" ? "posix" : tls;
    if (o.raw) {
      const auto lz = bench::PerfTest(raw_tls, "tag_lat", zb, (*port)++);
      const auto ly = bench::PerfTest(raw_tls, "tag_lat", yb, (*port)++);
      if (lz.first > 0 && ly.first > 0) raw_rtt = lz.first + ly.first;
    }
    worker_rtt = bench::WorkerRoundTripUs(raw_tls, zb, yb, std::min(o.seconds, 0.5));
  }
  const double p50 = Percentile(us, 0.5), p99 = Percentile(us, 0.99);
  auto num = [](double v) { return v > 0 ? absl::StrFormat("%.1f", v) : std::string("-"); };
  std::printf("| %s | %lld | %lld | %zu | %zu | %.1f | %.1f | %.1f | %.2f | %s | %s | %.2f |\n",
              plane.c_str(), static_cast<long long>(p), static_cast<long long>(t),
              static_cast<size_t>(p) * (zb + yb), us.size(), p50, p99, p99 / p50,
              p * (zb + yb) / (p50 * 1e-6) / 1e9, num(raw_rtt).c_str(), num(worker_rtt).c_str(),
              o.layers * p50 / 1e3);
  std::fflush(stdout);
  return p50;
}

// The first n senders hit one shard back to back for `seconds`: their hops (-1 if one failed).
int64_t RunSenders(std::vector<Sender>& senders, int64_t n, const testing::EchoBatch& sb,
                   double seconds, double* secs) {
  std::atomic<int64_t> hops{0};
  std::atomic<bool> failed{false};
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int64_t i = 0; i < n; ++i) {
    threads.emplace_back([&, sp = &senders[i]] {
      while (std::chrono::duration<double>(Clock::now() - start).count() < seconds) {
        if (!Hop(*sp, 1, sb)) {
          failed.store(true);
          return;
        }
        hops.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  *secs = std::chrono::duration<double>(Clock::now() - start).count();
  return failed.load() ? -1 : hops.load();
}

// Goodput of S senders (each its own worker and channel) hitting one shard at once, back to
// back for --seconds, every S in turn and the whole series --goodput_rounds times (interleaved,
// so that a noisy minute on a shared machine hits every S alike; one round's S = 1 moved 1.4x
// from one run to the next): one table row per S, the median round and every round.
void Goodput(const ModelConfig& cfg, const Options& o, const std::string& plane,
             const std::string& tls, const std::string& endpoint) {
  std::printf(
      "\n%s: S senders to one shard, T = %lld each, back to back for %.1f s, %d rounds\n\n"
      "| lane | S | hops (median round) | goodput GB/s (median round) | each round GB/s | vs one "
      "sender (medians) |\n|---|---|---|---|---|---|\n",
      plane.c_str(), static_cast<long long>(o.sender_tokens), o.seconds, o.goodput_rounds);
  const testing::EchoBatch sb = testing::MakeEchoBatch(cfg, o.sender_tokens);
  const double bytes_per_hop =
      static_cast<double>(o.sender_tokens * cfg.latent * 2) + sb.reply_bytes;
  const std::vector<int64_t> ss = Ints(o.senders_list);
  std::vector<Sender> senders;
  for (int64_t i = 0; i < *std::max_element(ss.begin(), ss.end()); ++i) {
    auto s = MakeSender(tls, {endpoint}, absl::StrFormat("sender-%d", i), o.poll_max_us);
    if (!s.ok()) break;
    senders.push_back(std::move(*s));
  }
  for (auto& s : senders) (void)Hop(s, 1, sb);                        // open every data plane first
  std::map<int64_t, std::vector<std::pair<double, int64_t>>> rounds;  // S -> (GB/s, hops)
  for (int r = 0; r < o.goodput_rounds; ++r) {
    for (int64_t n : ss) {
      if (n > static_cast<int64_t>(senders.size())) continue;
      double secs = 0;
      const int64_t hops = RunSenders(senders, n, sb, o.seconds, &secs);
      rounds[n].emplace_back(hops < 0 ? -1.0 : hops * bytes_per_hop / secs / 1e9, hops);
    }
  }
  auto median = [&](int64_t n) {
    std::vector<std::pair<double, int64_t>> v = rounds[n];
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double one = rounds.count(ss.front()) != 0 ? median(ss.front()).first : 0;
  for (int64_t n : ss) {
    if (rounds.count(n) == 0) continue;
    const auto [goodput, hops] = median(n);
    std::string each;
    for (const auto& [g, h] : rounds[n]) {
      absl::StrAppend(&each, each.empty() ? "" : ", ",
                      h < 0 ? std::string("failed") : absl::StrFormat("%.2f", g));
    }
    std::printf(
        "| %s | %lld | %lld | %.2f | %s | %s |\n", plane.c_str(), static_cast<long long>(n),
        static_cast<long long>(hops), goodput, each.c_str(),
        goodput < 0 || one <= 0 ? "failed" : absl::StrFormat("%.2f", goodput / one).c_str());
  }
  std::fflush(stdout);
}

// One lane: echo shards in this process, the hop table, then the goodput table.
absl::Status Lane(const ModelConfig& cfg, const Options& o, const std::string& plane, int* port) {
  // shm: the project's memfd rings; its raw columns are UCX shared memory's.
  const std::string tls = plane == "ucx_shm"   ? "posix"
                          : plane == "ucx_tcp" ? "tcp"
                          : plane == "shm"     ? "shm"
                                               : "";
  if (!tls.empty() && tls != "shm" && !dataplane::UcxBuilt()) return absl::OkStatus();
  const std::vector<int64_t> ts = Ints(o.tokens_list), ps = Ints(o.peers_list);
  const int max_peers = static_cast<int>(*std::max_element(ps.begin(), ps.end()));
  std::vector<std::unique_ptr<expert_svc::ExpertServer>> shards;
  std::vector<std::string> endpoints;
  for (int i = 0; i < max_peers; ++i) {
    expert_svc::ExpertServerOptions so = testing::EchoServerOptions(
        o.preset, cfg.top_k, tls == "shm" ? "" : tls, absl::StrFormat("echo-%d", i));
    if (tls == "shm") so.data_plane = dataplane::DataPlane{"shm"};
    so.ucx_poll_max_us = o.poll_max_us;
    auto s = expert_svc::ExpertServer::Start(so);
    if (!s.ok()) return s.status();
    endpoints.push_back(absl::StrFormat("127.0.0.1:%d", (*s)->port()));
    shards.push_back(std::move(*s));
  }
  auto sender = MakeSender(tls, endpoints, "hop-0", o.poll_max_us);
  if (!sender.ok()) return sender.status();
  std::printf(
      "\n%s: one hop = dispatch + combine to P shards (T tokens x k experts each)\n\n"
      "| lane | P | T | bytes on the wire | hops | p50 us | p99 us | p99/p50 | GB/s | raw UCX "
      "RTT us (one peer) | worker RTT us (one peer) | %lld-layer decode step ms |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      plane.c_str(), static_cast<long long>(o.layers));
  double smallest_p50 = -1;  // one peer, the first T
  for (int64_t p : ps) {
    for (int64_t t : ts) {
      const double p50 = HopRow(*sender, cfg, o, plane, tls, p, t, port);
      if (smallest_p50 < 0) smallest_p50 = p50;
    }
  }
  // What bounds that hop's p99 here, whatever the data plane does (measured now, in this run).
  if (smallest_p50 > 0 && plane != "grpc") {
    std::printf("\n%s\n", bench::MeasureSpinGaps(1.0).Describe(smallest_p50).c_str());
  }
  Goodput(cfg, o, plane, tls, endpoints[0]);
  for (auto& s : shards) s->Shutdown(absl::Seconds(1));
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  Options o;
  SvcFlags f("hop_bench", "The attention-to-shards hop: dispatch + combine per lane and peers.");
  f.String("preset", &o.preset, "model shape: mid or k3");
  f.String("tokens", &o.tokens_list, "tokens per peer (T)");
  f.String("peers", &o.peers_list, "shards one hop reaches (P)");
  f.String("senders", &o.senders_list, "senders hitting one shard at once (goodput)");
  f.Int64("sender_tokens", &o.sender_tokens, "T of the senders' batches");
  f.String("data_planes", &o.planes,
           "ucx_shm (UCX_TLS posix), ucx_tcp (UCX_TLS tcp), grpc, shm (the project's memfd rings)");
  f.Double("seconds", &o.seconds, "seconds per point (after 3 warm-up hops)");
  f.Int64("layers", &o.layers, "MoE layers of the projected decode step (K3: 92)");
  f.Bool("raw", &o.raw, "also run ucx_perftest for the raw transport");
  f.Int("goodput_rounds", &o.goodput_rounds,
        "the senders' series (every S in turn) this many times; medians reported");
  f.Int("poll_max_us", &o.poll_max_us,
        "both ends' poll window grows up to this (--ucx_poll_max_us; 100: the fixed window of "
        "before)");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  if (o.goodput_rounds < 1) {
    std::fprintf(stderr, "--goodput_rounds must be at least 1\n");
    return 2;
  }
  auto cfg = PresetConfig(o.preset);
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", cfg.status().ToString().c_str());
    return 2;
  }
  std::printf(
      "preset %s: D %lld, k %lld; memcpy %.1f GB/s; %u CPUs; the services' UCX shared-memory FIFO "
      "%s\n",
      o.preset.c_str(), static_cast<long long>(cfg->latent), static_cast<long long>(cfg->top_k),
      bench::MemcpyBandwidth() / 1e9, std::thread::hardware_concurrency(),
      dataplane::SharedMemoryFifoShape("posix").c_str());
  int port = 13500;
  for (absl::string_view pv : absl::StrSplit(o.planes, ',')) {
    if (absl::Status st = Lane(*cfg, o, std::string(pv), &port); !st.ok()) {
      std::fprintf(stderr, "%s: %s\n", std::string(pv).c_str(), st.ToString().c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }
