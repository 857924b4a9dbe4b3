// libFuzzer target: the bytes a UCX peer controls before it is trusted (docs/data-plane.md):
// the hello an expert server parses and binds (DataPlaneClients::Bind), and, on the same bytes,
// the lanes parser (its input is UCX's own report, fuzzed anyway), and the out-of-band header's
// sizes and MAC before they reach a UCX receive, a batch message's frame, and the replay window.
// Invariants: only the exact hello of the opened client binds it, and then to the endpoint given; a
// bound client stays bound to it; the lanes' kind is one of its five values and names no transport
// twice.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>

#include "expert-svc/data_plane_clients.h"
#include "services/dataplane/data_plane.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moe::expert_svc::DataPlaneClients;
  const std::string in(reinterpret_cast<const char*>(data), size);
  static DataPlaneClients* clients = nullptr;
  static uint64_t id = 0;
  static std::string good;
  if (clients == nullptr) {
    clients = new DataPlaneClients(4);
    uint64_t replaced = 0;
    auto c = clients->Open("fuzz", &replaced);
    if (!c.ok()) __builtin_trap();
    id = c->id;
    good = moe::dataplane::EncodeHello({c->id, c->hello_secret});
  }
  auto bound = clients->Bind(in, 42);
  if (bound.ok() && in != good) __builtin_trap();
  if (bound.ok() && bound->endpoint != 42) __builtin_trap();
  auto parsed = moe::dataplane::ParseHello(in);
  if (parsed.ok() && moe::dataplane::EncodeHello(*parsed) != in) __builtin_trap();
  const moe::dataplane::UcxLanes lanes = moe::dataplane::ParseUcxLanes(in);
  static const std::set<std::string> kinds = {"shm", "tcp", "rdma", "mixed", "none"};
  if (kinds.count(lanes.kind) == 0) __builtin_trap();
  std::set<std::string> seen(lanes.transports.begin(), lanes.transports.end());
  if (seen.size() != lanes.transports.size()) __builtin_trap();
  if (lanes.transports.empty() != (lanes.kind == "none")) __builtin_trap();
  (void)lanes.Describe();
  (void)id;
  // The same bytes as an out-of-band header: only sizes in range and a 16-byte MAC pass, the
  // sizes UCX would then be asked to receive.
  if (size >= 17) {
    moe::expert_svc::OutOfBandHeader h;
    int64_t a = 0, r = 0;
    std::memcpy(&a, data, 8);
    std::memcpy(&r, data + 8, 8);
    h.activation_bytes = a;
    h.reply_bytes = r;
    h.activation_mac.assign(reinterpret_cast<const char*>(data) + 16,
                            std::min<size_t>(size - 16, data[16] % 20));
    constexpr int64_t kMax = 256 << 20;
    const bool ok = moe::expert_svc::ValidateOutOfBand(h, kMax, "fuzz").ok();
    if (ok && (a < 1 || a > kMax || r < 0 || r > kMax || h.activation_mac.size() != 16)) {
      __builtin_trap();
    }
  }
  // The same bytes as a batch message's frame, for every kind and the payload size the first
  // byte picks: a parsed frame encodes back to the same bytes, its header fits the payload, and
  // its flags are known ones (none on a reply tag).
  for (auto kind : {moe::dataplane::BatchKind::kRequest, moe::dataplane::BatchKind::kReply,
                    moe::dataplane::BatchKind::kReplyTag}) {
    const size_t payload = size > 0 ? data[0] * 16u : 0;
    auto f = moe::dataplane::ParseBatchFrame(in, kind, payload);
    if (f.ok() && (moe::dataplane::EncodeBatchFrame(*f) != in || f->header_bytes > payload ||
                   (f->flags & ~moe::dataplane::kDetachTag) != 0 ||
                   (kind == moe::dataplane::BatchKind::kReplyTag && f->flags != 0))) {
      __builtin_trap();
    }
  }
  // A sequence claimed is never claimed again (the replay window).
  if (size >= 8) {
    uint64_t seq = 0;
    std::memcpy(&seq, data, 8);
    seq %= 1u << 20;
    if (clients->ClaimSequence(id, seq) && clients->ClaimSequence(id, seq)) __builtin_trap();
  }
  return 0;
}
