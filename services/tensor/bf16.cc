#include "services/tensor/bf16.h"

#include "services/tensor/simd_clones.h"

namespace moe::tensor {
namespace {

constexpr size_t kBlock = 1024;

// Whether one of bits[0, kBlock) has all exponent bits set: the exponent plus 0x0080 reaches bit
// 15 only then. No branch in the loop, so -O2 vectorizes it.
MOE_SIMD_CLONES bool BlockHasNonFinite(const uint16_t* bits) {
  uint16_t any = 0;  // 16-bit lanes throughout (a wider accumulator halves the lanes)
  for (size_t i = 0; i < kBlock; ++i) {
    any |= static_cast<uint16_t>(static_cast<uint16_t>((bits[i] & 0x7f80u) + 0x0080u) & 0x8000u);
  }
  return any != 0;
}

}  // namespace

size_t FirstNonFinite(const Bf16* v, size_t n) {
  // Bf16 is a standard-layout struct whose first (only) member is its bits.
  const auto* bits = reinterpret_cast<const uint16_t*>(v);
  size_t i = 0;
  while (i + kBlock <= n && !BlockHasNonFinite(bits + i)) i += kBlock;
  for (; i < n; ++i) {
    if ((bits[i] & 0x7f80u) == 0x7f80u) return i;
  }
  return n;
}

}  // namespace moe::tensor
