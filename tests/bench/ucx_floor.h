// The floors a data-plane benchmark prints next to its own figures, measured in the same run:
// the raw UCX transport (`ucx_perftest`, Debian ucx-utils) and this project's UCX worker alone
// (two workers of this process, one polled message each way: no gRPC, no MAC, no compute).
#ifndef MOE_TESTS_BENCH_UCX_FLOOR_H_
#define MOE_TESTS_BENCH_UCX_FLOOR_H_

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "services/dataplane/ucx_worker.h"

namespace moe::bench {

// ucx_perftest's "Final:" line: iterations, latency typical/avg/overall (us), bandwidth
// avg/overall (MB/s), message rate avg/overall. Returns {typical latency us, overall MB/s}, or
// {-1, -1} when the tool is missing or failed.
inline std::pair<double, double> PerfTest(const std::string& tls, const char* test, size_t bytes,
                                          int port) {
  const int64_t n =
      std::clamp<int64_t>(static_cast<int64_t>(4e8 / std::max<size_t>(bytes, 1)), 20, 20000);
  const std::string cmd = absl::StrFormat(
      "command -v ucx_perftest >/dev/null || exit 1; "
      "(UCX_TLS=%s timeout 60 ucx_perftest -p %d -t %s -s %d -n %d >/dev/null 2>&1 &); "
      "sleep 0.4; UCX_TLS=%s timeout 60 ucx_perftest 127.0.0.1 -p %d -t %s -s %d -n %d 2>&1",
      tls, port, test, bytes, n, tls, port, test, bytes, n);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, -1};
  char line[512];
  std::pair<double, double> out{-1, -1};
  while (std::fgets(line, sizeof(line), p) != nullptr) {
    double it, lat, avg, overall, bw, bw_all;
    if (std::sscanf(line, " Final: %lf %lf %lf %lf %lf %lf", &it, &lat, &avg, &overall, &bw,
                    &bw_all) == 6) {
      out = {lat, bw_all};
    }
  }
  pclose(p);
  return out;
}

// The round trip of our own UCX worker (services/dataplane/ucx_worker.h) between two workers of
// this process, as the services use it: z out as one request message, whose handler answers y as
// one reply message straight from the worker's thread, the caller polling (Await): the transport
// with this project's worker and no gRPC, no MAC, no compute. p50 in us.
inline double WorkerRoundTripUs(const std::string& tls, size_t zb, size_t yb, double seconds) {
  dataplane::UcxOptions o;
  o.tls = tls;
  auto a = dataplane::UcxWorker::Create(o);
  auto b = dataplane::UcxWorker::Create(o);
  if (!a.ok() || !b.ok()) return -1;
  auto ab = (*a)->Connect((*b)->address(), nullptr);
  auto ba = (*b)->Connect((*a)->address(), nullptr);
  auto out_a = (*a)->Buffer(zb), in_a = (*a)->Buffer(yb), out_b = (*b)->Buffer(yb);
  if (!ab.ok() || !ba.ok() || !out_a.ok() || !in_a.ok() || !out_b.ok()) return -1;
  dataplane::UcxWorker* server = b->get();
  const uint64_t back = *ba;
  std::shared_ptr<dataplane::UcxBuffer> reply = *out_b;
  server->OnMessage([server, back, reply, yb](std::string_view header, size_t length) {
    dataplane::UcxWorker::MessageSink sink;
    auto in = server->Buffer(std::max<size_t>(length, 1));
    if (!in.ok()) return sink;
    sink.buffer = *in;
    sink.done = [server, back, reply, yb, h = std::string(header)](const absl::Status& s, size_t) {
      if (s.ok()) {
        (void)server->SendMessage(back, dataplane::UcxWorker::Message::kReply, h, reply, yb,
                                  absl::Now() + absl::Seconds(10));
      }
    };
    return sink;
  });
  std::vector<double> us;
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < 20000; ++i) {
    if (i >= 3 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds)
      break;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    const auto s = std::chrono::steady_clock::now();
    std::string token(8, '\0');
    for (int j = 0; j < 8; ++j) token[j] = static_cast<char>((i >> (8 * j)) & 0xff);
    auto got = (*a)->ExpectMessage(i, *in_a, deadline);
    auto sent = (*a)->SendMessage(*ab, dataplane::UcxWorker::Message::kRequest, token, *out_a, zb,
                                  deadline);
    if (!(*a)->Await(*got, deadline, (*a)->poll_spin()).ok()) return -1;
    if (!sent->Wait(deadline).ok()) return -1;
    if (i >= 3)
      us.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s).count());
  }
  std::sort(us.begin(), us.end());
  return us.empty() ? -1 : us[us.size() / 2];
}

}  // namespace moe::bench

#endif  // MOE_TESTS_BENCH_UCX_FLOOR_H_
