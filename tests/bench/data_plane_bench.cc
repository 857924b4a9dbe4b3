// The UCX data plane alone (services/dataplane/ucx_worker.h), next to this machine's memcpy
// bandwidth measured in the same run: two workers of this process, each on its own progress
// thread, bounce a message of the dispatch sizes back and forth (send, then the same size back,
// as a batch and its reply), over the transports UCX_TLS selects.
//
//   build/tests/data_plane_bench [--tls "posix;posix,cma;tcp"] [--seconds 1]
//
// Sizes: 7 KiB (one k3 latent row), 1.8 MB (k3 T = 16 per-pair reply of one shard with all
// 16 experts), 29 MB (k3 T = 256).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "services/common/cpus.h"
#include "services/common/flags.h"
#include "services/dataplane/gf128.h"
#include "services/dataplane/payload_mac.h"
#include "services/dataplane/ucx_worker.h"
#include "services/tensor/bf16.h"
#include "tests/bench/memcpy_bandwidth.h"

namespace moe {
namespace {

using Clock = std::chrono::steady_clock;

// The previous scan (four values per 64-bit word, a branch per word), for comparison.
size_t FirstNonFiniteByWords(const tensor::Bf16* v, size_t n) {
  constexpr uint64_t kExponents = 0x7f807f807f807f80ull, kOne = 0x0080008000800080ull;
  constexpr uint64_t kTop = 0x8000800080008000ull;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    uint64_t w;
    std::memcpy(&w, v + i, sizeof(w));
    if ((((w & kExponents) + kOne) & kTop) != 0) break;
  }
  for (; i < n; ++i) {
    if ((v[i].bits & 0x7f80u) == 0x7f80u) return i;
  }
  return n;
}

// The receive path's check for non-finite activations (tensor::FirstNonFinite) on the mid
// preset's T = 256 request (256 KiB, in L2) and a k3 T = 16 reply's size (1.8 MB), all finite.
void NonFiniteScan() {
  std::printf(
      "| non-finite scan (bf16) | FirstNonFinite: GB/s, us | four per word (before): GB/s, us "
      "|\n|---|---|---|\n");
  for (size_t bytes : {size_t{256} << 10, size_t{1835008}}) {
    std::vector<tensor::Bf16> v(bytes / 2, tensor::Bf16::FromFloat(0.5f));
    double rate[2], us[2];
    for (int way = 0; way < 2; ++way) {
      int64_t n = 0;
      size_t found = 0;
      const auto t0 = Clock::now();
      while (n < 1000000 && std::chrono::duration<double>(Clock::now() - t0).count() < 0.3) {
        found += way == 0 ? tensor::FirstNonFinite(v.data(), v.size())
                          : FirstNonFiniteByWords(v.data(), v.size());
        ++n;
      }
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (found != v.size() * n) std::printf("(a value was found where none is)\n");
      rate[way] = bytes * n / s / 1e9;
      us[way] = 1e6 * s / n;
    }
    std::printf("| %.2f MB | %.1f, %.1f | %.1f, %.1f |\n", bytes / 1e6, rate[0], us[0], rate[1],
                us[1]);
  }
  std::printf("\n");
}

int Main(int argc, char** argv) {
  std::string tls_list = "posix;posix,cma;tcp";
  double seconds = 1;
  SvcFlags f("data_plane_bench", "UCX round trips of dispatch-sized messages.");
  f.String("tls", &tls_list, "UCX_TLS values to try, separated by ';'");
  f.Double("seconds", &seconds, "seconds per point");
  if (int rc = f.Parse(argc, argv); rc >= 0) return rc;
  if (!dataplane::UcxBuilt()) {
    std::printf("built without UCX\n");
    return 0;
  }
  std::printf("memcpy bandwidth (read+write): %.1f GB/s\n", bench::MemcpyBandwidth() / 1e9);
  // The payload integrity check's cost (AES-256-GMAC): one pass on this thread (the wide GHASH
  // where the CPU has it), and what Compute does (in pieces on the MAC pool from
  // kParallelMacBytes, or kParallelWideMacBytes with the wide GHASH), on a k3 T = 16 reply of
  // one shard, the mid preset's T = 256 reply and a k3 T = 256 reply.
  auto mac = dataplane::PayloadMac::Create(dataplane::RandomBytes(dataplane::kMacKeyBytes));
  std::printf(
      "GHASH: %s\n| payload MAC (AES-256-GMAC) | one pass: GB/s, us | Compute (%d CPUs): GB/s, us "
      "|\n"
      "|---|---|---|\n",
      dataplane::WideGhash() ? dataplane::GhashWidthName(dataplane::WidestGhash()) : "OpenSSL's",
      UsableCpus());
  for (size_t bytes : {size_t{1835008}, size_t{2} << 20, size_t{29360128}}) {
    std::vector<uint8_t> payload(bytes, 3);
    double rate[2], us[2];
    for (int way = 0; way < 2; ++way) {
      int64_t n = 0;
      const auto t0 = Clock::now();
      while (n < 100000 && std::chrono::duration<double>(Clock::now() - t0).count() < 0.5) {
        const auto d = dataplane::Direction::kToExpert;
        const uint64_t seq = static_cast<uint64_t>(n);
        (void)(way == 0 ? mac->ComputeInPieces(d, seq, payload.data(), bytes, {}, bytes, nullptr)
                        : mac->Compute(d, seq, payload.data(), bytes));
        ++n;
      }
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      rate[way] = bytes * n / s / 1e9;
      us[way] = 1e6 * s / n;
    }
    std::printf("| %.1f MB | %.2f, %.1f | %.2f, %.1f |\n", bytes / 1e6, rate[0], us[0], rate[1],
                us[1]);
  }
  std::printf("\n");
  NonFiniteScan();
  std::printf(
      "| UCX_TLS | lanes UCX selected | bytes | round trips | us per round trip | GB/s (both "
      "ways) |\n"
      "|---|---|---|---|---|---|\n");
  for (absl::string_view tls_view : absl::StrSplit(tls_list, ';')) {
    const std::string tls(tls_view);
    dataplane::UcxOptions o;
    o.tls = tls;
    auto a = dataplane::UcxWorker::Create(o);
    auto b = dataplane::UcxWorker::Create(o);
    if (!a.ok() || !b.ok()) {
      std::printf("| %s | - | - | unavailable: %s | - |\n", tls.c_str(),
                  std::string((a.ok() ? b.status() : a.status()).message()).c_str());
      continue;
    }
    auto ab = (*a)->Connect((*b)->address(), nullptr);
    auto ba = (*b)->Connect((*a)->address(), nullptr);
    if (!ab.ok() || !ba.ok()) return 1;
    const auto lane = (*a)->Lanes(*ab);
    const std::string lanes = lane.ok() ? lane->Describe() : "?";
    for (size_t bytes : {size_t{7168}, size_t{1835008}, size_t{29360128}}) {
      auto out_a = (*a)->Buffer(bytes), in_b = (*b)->Buffer(bytes);
      auto out_b = (*b)->Buffer(bytes), in_a = (*a)->Buffer(bytes);
      if (!out_a.ok() || !in_b.ok() || !out_b.ok() || !in_a.ok()) return 1;
      std::memset((*out_a)->data(), 1, bytes);
      std::memset((*out_b)->data(), 2, bytes);
      int64_t n = 0;
      uint64_t tag = 1;
      const auto t0 = Clock::now();
      // Bounded in time and in count.
      while (n < 1000000 && std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
        const absl::Time deadline = absl::Now() + absl::Seconds(10);
        // Chunks take tags tag, tag + 1, ...: the two directions 1000 apart.
        auto r1 = (*b)->Recv(tag, *in_b, bytes, deadline);
        auto s1 = (*a)->Send(*ab, tag, *out_a, bytes, deadline);
        auto r2 = (*a)->Recv(tag + 1000, *in_a, bytes, deadline);
        if (!r1->Wait(deadline).ok()) return 1;
        auto s2 = (*b)->Send(*ba, tag + 1000, *out_b, bytes, deadline);
        if (!r2->Wait(deadline).ok() || !s1->Wait(deadline).ok() || !s2->Wait(deadline).ok()) {
          return 1;
        }
        tag += 2000;
        ++n;
      }
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      std::printf("| %s | %s | %zu | %lld | %.1f | %.2f |\n", tls.c_str(), lanes.c_str(), bytes,
                  static_cast<long long>(n), 1e6 * s / n, 2.0 * bytes * n / s / 1e9);
    }
  }
  return 0;
}

}  // namespace
}  // namespace moe

int main(int argc, char** argv) { return moe::Main(argc, argv); }
