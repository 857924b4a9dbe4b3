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
//   MOE_ASSIGN_OR_RETURN(PayloadMac mac, PayloadMac::Create(key));  // 32 bytes
//   std::string tag = mac.Compute(Direction::kToExpert, sequence, bytes, n);
//   if (!mac.Verify(Direction::kToExpert, sequence, bytes, n, tag)) { ...DATA_LOSS... }
#ifndef MOE_SERVICES_DATAPLANE_PAYLOAD_MAC_H_
#define MOE_SERVICES_DATAPLANE_PAYLOAD_MAC_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace moe::dataplane {

constexpr size_t kMacKeyBytes = 32;
constexpr size_t kMacBytes = 16;

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

 private:
  explicit PayloadMac(std::string key) : key_(std::move(key)) {}
  std::string key_;
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
