// libFuzzer target: what an shm peer writes into a ring before the reader trusts it
// (services/dataplane/shm_lane.h; docs/data-plane.md, "The shm data plane"). The input is the
// writer's position (8 bytes), the reader's position the writer sees (8 bytes), where in the ring
// the reader starts (4 bytes), then the ring's bytes from there. Invariants: every record Peek
// returns lies inside the ring, payload 64-byte aligned and sizes as its head says; the reader
// never moves past the writer's position nor more than a ring; a writer never hands out a slot
// outside the ring, whatever position the reader claims.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "services/dataplane/shm_lane.h"

namespace {
using moe::dataplane::ShmDirection;
using moe::dataplane::ShmRegion;
using moe::dataplane::ShmRing;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ShmRegion* region = [] {
    auto r = ShmRegion::Create(moe::dataplane::kShmMinRing);
    Check(r.ok());
    return new ShmRegion(std::move(*r));
  }();
  if (size < 20) return 0;
  const uint64_t cap = region->ring_bytes();
  uint8_t* base = region->base();
  std::memset(base, 0, moe::dataplane::kShmControlBytes);
  uint8_t* ring = base + moe::dataplane::kShmControlBytes;
  // The reader starts where the input says (bytes 16-19: a multiple of 64 in the ring), moved
  // there by two records a writer keeping the protocol published and the reader freed.
  uint32_t at_in = 0;
  std::memcpy(&at_in, data + 16, 4);
  const uint64_t start = at_in % (cap / 64) * 64;
  ShmRing reader = region->Ring(ShmDirection::kToShard, -1);
  ShmRing lawful = region->Ring(ShmDirection::kToShard, -1);
  for (uint64_t left = start; left > 0;) {
    const uint64_t rec = std::min<uint64_t>(left, cap / 2);
    auto s = lawful.Reserve(0, rec - 64);
    Check(s.ok() && s->pad == 0);
    lawful.Publish(*s, {0, 0});
    auto r = reader.Peek();
    Check(r.ok() && r->has_value());
    reader.Release(**r);
    left -= rec;
  }
  // Then the input: the writer's position past that, and the ring's bytes from there (wrapping).
  uint64_t head = 0;
  std::memcpy(&head, data, 8);
  head += start;
  std::memcpy(base + moe::dataplane::kShmToShardHead, &head, 8);
  const size_t n = std::min<size_t>(size - 20, cap);
  const size_t first = std::min<size_t>(n, cap - start);
  std::memcpy(ring + start, data + 20, first);
  std::memcpy(ring, data + 20 + first, n - first);
  for (int i = 0; i < 4096; ++i) {
    auto r = reader.Peek();
    if (!r.ok() || !r->has_value()) break;
    const auto& rec = **r;
    Check(rec.header >= ring && rec.header + rec.header_bytes <= ring + cap);
    Check(rec.payload >= ring && rec.payload + rec.payload_bytes <= ring + cap);
    Check(reinterpret_cast<uintptr_t>(rec.payload) % 64 == 0);
    Check(rec.end <= head && rec.record_bytes <= cap);
    if (i % 2 == 0) reader.Release(rec);
  }
  Check(reader.held() <= cap);
  // The writer of the other ring, against the reader's position the input claims.
  std::memset(base + moe::dataplane::kShmToNodeTail, 0, 8);
  std::memcpy(base + moe::dataplane::kShmToNodeTail, data + 8, 8);
  ShmRing writer = region->Ring(ShmDirection::kToNode, -1);
  uint8_t* back = ring + cap;
  for (int i = 0; i < 8; ++i) {
    auto s = writer.Reserve(data[i] * 37u, (data[8 + i] + 1u) * 4099u);
    if (!s.ok()) break;
    Check(s->payload >= back && s->payload + s->payload_bytes <= back + cap);
    Check(ShmRing::HeaderAt(*s, s->header_bytes) >= back);
    writer.Publish(*s, {1, 1});
  }
  return 0;
}
