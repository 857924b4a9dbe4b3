// Arithmetic in GF(2^128) as GCM defines it (NIST SP 800-38D, section 6.3): a 16-byte block is
// a polynomial whose first byte's most significant bit is the coefficient of x^0, multiplied
// modulo x^128 + x^7 + x^2 + x + 1. GHASH is linear in its blocks, so the GHASH of a message can
// be joined from the GHASH values of its consecutive pieces with these operations: the payload
// MAC (payload_mac.cc) hashes the pieces of a large payload on several threads and joins them
// into the tag one pass over the whole payload gives, bit for bit.
//
//   Gf128 h = Gf128::Load(block);          // 16 bytes as GCM reads them
//   Gf128 y = Mul(x ^ h, h);               // one GHASH step
//   Gf128 hm = Pow(h, 4096);               // h^4096: skips a 64 KiB piece
#ifndef MOE_SERVICES_DATAPLANE_GF128_H_
#define MOE_SERVICES_DATAPLANE_GF128_H_

#include <cstddef>
#include <cstdint>

namespace moe::dataplane {

struct Gf128 {
  uint64_t hi = 0;  // bytes 0-7, big-endian (coefficients x^0 .. x^63, x^0 in the top bit)
  uint64_t lo = 0;  // bytes 8-15

  static Gf128 Load(const uint8_t* block);
  void Store(uint8_t* block) const;
  static Gf128 One() { return {uint64_t{1} << 63, 0}; }
  friend Gf128 operator^(Gf128 a, Gf128 b) { return {a.hi ^ b.hi, a.lo ^ b.lo}; }
  friend bool operator==(Gf128 a, Gf128 b) { return a.hi == b.hi && a.lo == b.lo; }
};

// x * y with the CPU's carry-less multiply (PCLMULQDQ) when it has one, else MulReference.
// Both take the same time whatever the operands (no branch or table lookup on their bits).
Gf128 Mul(Gf128 x, Gf128 y);
// SP 800-38D's Algorithm 1, one bit at a time: the independent definition Mul is tested
// against, and the fallback of a CPU without PCLMULQDQ.
Gf128 MulReference(Gf128 x, Gf128 y);
// h^m (m >= 0; h^0 = One()) by squaring and multiplying.
Gf128 Pow(Gf128 h, uint64_t m);
// GCM's final length block: the additional data's and the text's lengths in bits, 64 bits each.
Gf128 LengthBlock(uint64_t aad_bytes, uint64_t text_bytes);

// Blocks per step of the wide GHASH (a multiple of 4).
constexpr int kGhashStepBlocks = 64;

// GHASH's key h with its powers h^1 .. h^kGhashStepBlocks.
struct GhashKey {
  explicit GhashKey(Gf128 h);
  Gf128 powers[kGhashStepBlocks];  // powers[i] = h^(i + 1)
};

// How many blocks one carry-less multiply instruction of GhashBlocks takes.
enum class GhashWidth {
  kOne,  // PCLMULQDQ (or the bit-by-bit multiply), a block at a time
  k256,  // AVX2 VPCLMULQDQ (AMD Zen 3 and later, Intel Ice Lake and later): 2 blocks
  k512,  // AVX-512 VPCLMULQDQ (AMD Zen 4 and later, Intel Ice Lake and later): 4 blocks
};
// Whether this CPU has the instructions of `width` (kOne: always).
bool GhashWidthAvailable(GhashWidth width);
// The widest this CPU has.
GhashWidth WidestGhash();
// "AVX2 VPCLMULQDQ, 2 blocks a multiply": for benchmarks and logs.
const char* GhashWidthName(GhashWidth width);

// GHASH's state after `blocks` whole 16-byte blocks of `data` from state y: y = (y ^ X_j) h for
// each block. With k512 or k256 and a CPU that has it, kGhashStepBlocks blocks per step against
// their powers of h (4 or 2 blocks per multiply, reduced once per step; a width the CPU lacks
// falls back to the next narrower one); otherwise a block at a time with Mul. All give the same
// state.
Gf128 GhashBlocks(const GhashKey& key, Gf128 y, const uint8_t* data, size_t blocks,
                  GhashWidth width = WidestGhash());
// Whether GhashBlocks takes several blocks per multiply on this CPU (the payload MAC then hashes
// with it instead of OpenSSL's GMAC).
bool WideGhash();

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_GF128_H_
