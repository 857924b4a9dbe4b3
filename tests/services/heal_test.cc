// The expert tier heals itself (docs/survive.md): 4 shards, 2 replicas per range, a durable
// router, two clients sending Forward requests with a 3 s deadline, and a campaign of random
// faults on one replica at a time, each one of: kill -9 and a restart, SIGSTOP for 1 s then
// SIGCONT, a graceful stop (SIGTERM) and a restart. No admin acts: a restarted shard registers
// by itself and the attention node opens its data plane to it again. Counted: answers right,
// failed, wrong (must be 0) and past their deadline (must be 0); the time from a replica's
// restart until the router counts every shard healthy again (must be <= 5 s); p99 steady vs
// during faults, printed. MOE_HEAL_FAULTS sets the campaign's length (8 here; scripts/soak.sh
// runs 100), MOE_HEAL_SEED its faults. MOE_HEAL_LOAD=0.8 replaces the two closed-loop clients
// by an open-loop generator at that share of the capacity measured first (8 closed-loop clients
// without pauses for 3 s): requests start on a fixed schedule whatever the answers, and each
// latency counts from its scheduled start (a request that waits for a free sender is late by
// that wait too).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/services/cluster_fixtures.h"
#include "tests/services/cluster_test_base.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;
using tensor::Bf16;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

double P99(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(0.99 * v.size()))];
}

// Requests on a fixed schedule at `rate` per second, sent by `senders` threads (each takes the
// next scheduled start, waits for it, sends), until Stop; every sample's latency from its
// scheduled start. Bounded: 600 s.
struct OpenLoop {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> ok{0}, failed{0}, wrong{0}, hung{0};
  std::vector<std::string> errors;
  std::mutex mu;
  std::vector<testing::Traffic::Sample> samples;
  std::vector<std::thread> threads;
  std::atomic<int64_t> next{0};

  void Start(const tools::LocalCluster& c, int32_t layer, const std::vector<Bf16>& x,
             int64_t tokens, int64_t hidden, const std::vector<Bf16>& want, double rate,
             int senders, absl::Duration timeout) {
    const Clock::time_point t0 = Clock::now();
    const auto until = t0 + std::chrono::seconds(600);
    for (int t = 0; t < senders; ++t) {
      threads.emplace_back([=, &c] {
        auto client = testing::ClientFor(c);
        client::ForwardOptions o;
        o.timeout = timeout;
        while (!stop.load() && Clock::now() < until) {
          const int64_t i = next++;
          const Clock::time_point at = t0 + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(i / rate));
          std::this_thread::sleep_until(at);
          if (stop.load()) break;
          auto r = client->Forward(layer, x, tokens, hidden, o);
          const double ms = std::chrono::duration<double, std::milli>(Clock::now() - at).count();
          const bool right = r.ok() && testing::SameBits(r->out, want);
          if (ms > absl::ToDoubleMilliseconds(timeout) + 1000) ++hung;
          std::lock_guard<std::mutex> lock(mu);
          samples.push_back({at, ms, right, r.ok() && !right});
          if (!r.ok()) {
            if (errors.size() < 5) errors.push_back(r.status().ToString());
            ++failed;
          } else {
            ++(right ? ok : wrong);
          }
        }
      });
    }
  }
  void Stop() {
    stop = true;
    for (std::thread& t : threads) t.join();
  }
};

class ClusterHeal : public testing::ClusterTest {
 public:
  struct Fault {
    Clock::time_point start, end;  // end: every shard healthy again
  };

 protected:
  double Healthy() { return RouterMetric("moe_expert_shards", {"health=\"healthy\""}); }

  // Seconds from `from` until the router counts all 4 shards healthy (bounded: 30 s).
  double SecondsToHealthy(Clock::time_point from) {
    while (Healthy() != 4 && Clock::now() - from < std::chrono::seconds(30)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return std::chrono::duration<double>(Clock::now() - from).count();
  }

  // One fault on shard i; returns the seconds from its replacement's start (or SIGCONT) until
  // every shard is healthy again.
  double Inject(int kind, int i) {
    tools::LocalCluster& c = cluster();
    if (kind == 0) {
      EXPECT_TRUE(c.SignalShard(i, SIGKILL).ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    } else if (kind == 1) {
      EXPECT_TRUE(c.SignalShard(i, SIGSTOP).ok());
      std::this_thread::sleep_for(std::chrono::seconds(1));
      EXPECT_TRUE(c.SignalShard(i, SIGCONT).ok());
      return SecondsToHealthy(Clock::now());
    } else {
      EXPECT_TRUE(c.StopShard(i).ok());
    }
    EXPECT_TRUE(c.RestartShard(i).ok());
    return SecondsToHealthy(Clock::now());
  }
};

// p99 of the requests answered right that started before steady_end, and of those that started
// during a fault (from its injection until every shard was healthy again), with their counts
// and the slowest of the latter.
struct Latencies {
  double p99_steady = 0, p99_during = 0, max_during = 0;
  size_t n_steady = 0, n_during = 0;
};

Latencies Split(const std::vector<testing::Traffic::Sample>& samples, Clock::time_point steady_end,
                const std::vector<ClusterHeal::Fault>& windows) {
  std::vector<double> steady, during;
  for (const auto& s : samples) {
    if (!s.ok) continue;
    if (s.start < steady_end) steady.push_back(s.ms);
    if (std::any_of(windows.begin(), windows.end(), [&](const ClusterHeal::Fault& w) {
          return s.start >= w.start && s.start < w.end;
        })) {
      during.push_back(s.ms);
    }
  }
  Latencies l;
  l.p99_steady = P99(steady);
  l.p99_during = P99(during);
  l.max_during = during.empty() ? 0 : *std::max_element(during.begin(), during.end());
  l.n_steady = steady.size();
  l.n_during = during.size();
  return l;
}

TEST_F(ClusterHeal, RandomFaultsOnReplicasUnderLoadLoseNothing) {
  UsePreset("tiny", {{0, 8}, {8, 16}, {0, 8}, {8, 16}});
  options().router_args = {"--heartbeat_interval_ms=200"};
  ASSERT_NO_FATAL_FAILURE(StartCluster());
  const int faults = EnvInt("MOE_HEAL_FAULTS", 8);
  const unsigned seed = static_cast<unsigned>(EnvInt("MOE_HEAL_SEED", 43));
  const std::vector<Bf16> x = Hidden(4, 51), want = Want(x, 4);
  const char* load_env = std::getenv("MOE_HEAL_LOAD");
  const double load = load_env != nullptr ? std::atof(load_env) : 0.0;
  testing::Traffic a, b;
  OpenLoop open;
  double capacity = 0;
  if (load > 0) {
    OpenLoop probe;  // 8 senders, every start already due: closed loop without pauses
    probe.Start(cluster(), layer(), x, 4, hidden(), want, 1e9, 8, absl::Seconds(3));
    std::this_thread::sleep_for(std::chrono::seconds(3));
    probe.Stop();
    capacity = static_cast<double>(probe.ok.load()) / 3.0;
    ASSERT_GT(capacity, 0);
    open.Start(cluster(), layer(), x, 4, hidden(), want, load * capacity, 16, absl::Seconds(3));
  } else {
    a.record = b.record = true;
    a.Start(cluster(), layer(), x, 4, hidden(), want, absl::Seconds(3));
    b.Start(cluster(), layer(), x, 4, hidden(), want, absl::Seconds(3));
  }
  std::this_thread::sleep_for(std::chrono::seconds(3));  // the steady window
  const Clock::time_point steady_end = Clock::now();
  std::mt19937 rng(seed);
  std::vector<Fault> windows;
  int kinds[3] = {0, 0, 0};
  double worst_back = 0;
  for (int f = 0; f < faults; ++f) {
    const int kind = static_cast<int>(rng() % 3), shard = static_cast<int>(rng() % 4);
    ++kinds[kind];
    const Clock::time_point start = Clock::now();
    const double back = Inject(kind, shard);
    worst_back = std::max(worst_back, back);
    EXPECT_LE(back, 5.0) << "fault " << f << " (kind " << kind << ") on shard-" << shard;
    windows.push_back({start, Clock::now()});
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // steady again between faults
  }
  a.Stop();
  b.Stop();
  open.Stop();
  std::vector<testing::Traffic::Sample> samples = a.samples;
  samples.insert(samples.end(), b.samples.begin(), b.samples.end());
  samples.insert(samples.end(), open.samples.begin(), open.samples.end());
  const Latencies l = Split(samples, steady_end, windows);
  const int64_t ok = a.ok + b.ok + open.ok, failed = a.failed + b.failed + open.failed,
                wrong = a.wrong + b.wrong + open.wrong, late = a.hung + b.hung + open.hung;
  if (load > 0) {
    std::printf("[heal] open loop at %.2f of a measured capacity of %.1f requests/s (%.1f/s)\n",
                load, capacity, load * capacity);
  }
  std::printf(
      "[heal] %d faults (kill -9 + restart %d, SIGSTOP 1 s %d, SIGTERM + restart %d), seed %u\n"
      "[heal] requests %zu: ok %lld, failed %lld, wrong %lld, past deadline %lld\n"
      "[heal] p99 steady %.1f ms (%zu), during faults %.1f ms (%zu): %.2fx (slowest %.1f ms); "
      "every shard healthy at most %.2f s after a replacement started\n",
      faults, kinds[0], kinds[1], kinds[2], seed, samples.size(), static_cast<long long>(ok),
      static_cast<long long>(failed), static_cast<long long>(wrong), static_cast<long long>(late),
      l.p99_steady, l.n_steady, l.p99_during, l.n_during,
      l.p99_during / std::max(l.p99_steady, 1e-9), l.max_during, worst_back);
  for (const auto* t : {&a, &b}) {
    for (const std::string& e : t->errors) std::printf("[heal] a failure: %s\n", e.c_str());
  }
  for (const std::string& e : open.errors) std::printf("[heal] a failure: %s\n", e.c_str());
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(late, 0);
  EXPECT_GT(ok, faults);
  for (const auto& [name, pid] : cluster().Processes()) {  // every process up, answers right
    EXPECT_EQ(::kill(pid, 0), 0) << name << " is gone";
  }
  ExpectOracleAnswer(4, 52);
}

}  // namespace
}  // namespace moe
