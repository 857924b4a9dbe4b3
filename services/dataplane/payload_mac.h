// The integrity check of out-of-band payloads (docs/data-plane.md, docs/security.md): AES-256
// GMAC (NIST SP 800-38D: GCM with the payload as additional data and nothing encrypted) under a
// key that only the two ends of one data-plane connection hold (the expert server draws it and
// hands it to the attention node inside the authenticated OpenDataPlane call). The 96-bit nonce
// is (direction, the connection's batch sequence): never reused under one key, because each
// connection numbers its batches once. A payload that does not carry the tag computed over its
// exact bytes is refused before it is computed on (expert) or combined (attention node).
//
// GMAC rather than HMAC-SHA-256: the payloads are MiBs per batch and GHASH runs on the carry-less
// multiply units (several GB/s per core; tests/bench/data_plane_bench.cc measures it next to
// memcpy), where SHA-256 would cost more than the transfer itself.
//
// A payload of kParallelMacBytes or more is hashed in pieces of kMacPieceBytes on a pool of
// threads (the CPUs the process may use) and the pieces' GHASH values are joined in GF(2^128)
// (gf128.h): the tag is the one a single pass gives, bit for bit, so the wire is unchanged and
// either end may hash either way. One pass over 2 MiB takes ~230 us on a Zen 5 core, two
// threads ~150 (tests/bench/data_plane_bench.cc). From 2 MiB because below that, on two vCPUs
// shared with the other end's pollers, waking a helper cost what it saved (docs/data-plane.md).
//
//   MOE_ASSIGN_OR_RETURN(PayloadMac mac, PayloadMac::Create(key));  // 32 bytes
//   std::string tag = mac.Compute(Direction::kToExpert, sequence, bytes, n);
//   if (!mac.Verify(Direction::kToExpert, sequence, bytes, n, tag)) { ...DATA_LOSS... }
#ifndef MOE_SERVICES_DATAPLANE_PAYLOAD_MAC_H_
#define MOE_SERVICES_DATAPLANE_PAYLOAD_MAC_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "services/dataplane/gf128.h"

namespace moe {
class ThreadPool;
}

namespace moe::dataplane {

constexpr size_t kMacKeyBytes = 32;
constexpr size_t kMacBytes = 16;
// From this many bytes (prefix and data) a tag is computed in pieces on the MAC pool: about 250
// us of one pass here with OpenSSL's GHASH, or with the wide one (gf128.h, ~2-3x faster).
constexpr size_t kParallelMacBytes = size_t{2} << 20;
constexpr size_t kParallelWideMacBytes = size_t{8} << 20;
constexpr size_t kMacPieceBytes = size_t{64} << 10;

enum class Direction : uint8_t { kToExpert = 1, kToAttention = 2 };

class PayloadMac {
 public:
  // INVALID_ARGUMENT unless the key has kMacKeyBytes.
  static absl::StatusOr<PayloadMac> Create(const std::string& key);

  // The 16-byte tag of prefix || data[0, n) (either may be empty). A batch message's frame is
  // the prefix (data_plane.h, MacPrefix): fixed-size, so the concatenation is unambiguous.
  std::string Compute(Direction direction, uint64_t sequence, const uint8_t* data, size_t n,
                      std::string_view prefix = {}) const;
  // Constant-time comparison of the tag computed over prefix || data with `tag`.
  bool Verify(Direction direction, uint64_t sequence, const uint8_t* data, size_t n,
              const std::string& tag, std::string_view prefix = {}) const;

  // Compute's tag, hashed in pieces of piece_bytes (a multiple of 16, more than the prefix) on
  // `pool` (the calling thread too; alone without a pool) and joined. Compute takes this path
  // from kParallelMacBytes, on a process-wide pool, unless that pool is busy with another
  // payload; public so that tests can compare it with one pass at any size and piece. Without a
  // pool, `between` runs between consecutive pieces (a sender progresses its transport there).
  std::string ComputeInPieces(Direction direction, uint64_t sequence, const uint8_t* data, size_t n,
                              std::string_view prefix, size_t piece_bytes, ThreadPool* pool,
                              const std::function<void()>& between = {}) const;

 private:
  PayloadMac(std::string key, uint64_t id, Gf128 h)
      : key_(std::move(key)), id_(id), h_(h), ghash_(h) {}
  // The tag of prefix || data under the nonce's IV: GHASH on this CPU's widest carry-less
  // multiply (gf128.h) when it has VPCLMULQDQ (AVX-512 or AVX2), else OpenSSL's GMAC. The same
  // value either way.
  Gf128 Tag(const unsigned char iv[12], std::string_view prefix, const uint8_t* data,
            size_t n) const;
  std::string key_;
  uint64_t id_;  // names the key in each thread's cached cipher context
  Gf128 h_;      // GHASH's key: AES_key(0^128)
  GhashKey ghash_;
};

// Cryptographically secure random bytes (OpenSSL's DRBG). A DRBG that fails aborts the process:
// nothing safe can continue without it.
std::string RandomBytes(size_t n);
// A random 64-bit value from the same generator (tags a non-member cannot predict).
uint64_t RandomU64();
// Equal bytes, compared in time that does not depend on where they differ.
bool ConstantTimeEqual(std::string_view a, std::string_view b);

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_PAYLOAD_MAC_H_
