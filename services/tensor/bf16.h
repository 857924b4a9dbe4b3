// bfloat16: storage type and conversions with round-to-nearest-even.
//
// bf16 keeps the top 16 bits of an IEEE fp32 (1 sign, 8 exponent, 7 mantissa bits), so every
// bf16 is exactly representable in fp32 and the product of two bf16 values is exact in fp32
// (8 + 8 significant bits <= 24). The reference kernels rely on that: their fp32 sums of
// bf16 x bf16 products round only at the additions.
//
//   moe::tensor::Bf16 h = moe::tensor::Bf16::FromFloat(1.0f / 3.0f);  // RNE
//   float f = h.ToFloat();                                              // exact
#ifndef MOE_SERVICES_TENSOR_BF16_H_
#define MOE_SERVICES_TENSOR_BF16_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace moe::tensor {

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Rounds fp32 to the nearest bf16 bit pattern, ties to even. NaN stays NaN (quiet, sign kept);
// values beyond the bf16 range round to +-Inf as IEEE rounding requires.
inline uint16_t RoundToBf16Bits(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float Bf16BitsToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// A bf16 value. Trivially copyable, 2 bytes, so arrays of it match the safetensors BF16 layout.
struct Bf16 {
  uint16_t bits = 0;

  static Bf16 FromBits(uint16_t b) { return Bf16{b}; }
  static Bf16 FromFloat(float f) { return Bf16{RoundToBf16Bits(f)}; }
  float ToFloat() const { return Bf16BitsToFloat(bits); }
};
static_assert(sizeof(Bf16) == 2, "Bf16 must be exactly two bytes");

// The index of the first value of v[0, n) that is not finite (all 8 exponent bits set: an
// infinity or a NaN), or n when all are. Blocks of 1,024 values are tested without a branch
// (vectorized for the CPU: AVX2 16 values an instruction), and only a block that has one is
// looked through value by value: every batch's activations are scanned on the shard's receive
// path (bf16.cc; tests/bench/data_plane_bench.cc measures it: 2.6-3.2x the word-at-a-time scan
// of before on a Zen 3).
size_t FirstNonFinite(const Bf16* v, size_t n);

// Rounds an fp32 value through bf16 and back: the "bf16(...)" of docs/math.md section 4.
inline float RoundBf16(float f) { return Bf16BitsToFloat(RoundToBf16Bits(f)); }

}  // namespace moe::tensor

#endif  // MOE_SERVICES_TENSOR_BF16_H_
