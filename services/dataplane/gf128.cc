#include "services/dataplane/gf128.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moe::dataplane {

Gf128 Gf128::Load(const uint8_t* block) {
  Gf128 g;
  for (int i = 0; i < 8; ++i) {
    g.hi = (g.hi << 8) | block[i];
    g.lo = (g.lo << 8) | block[8 + i];
  }
  return g;
}

void Gf128::Store(uint8_t* block) const {
  for (int i = 0; i < 8; ++i) {
    block[7 - i] = static_cast<uint8_t>(hi >> (8 * i));
    block[15 - i] = static_cast<uint8_t>(lo >> (8 * i));
  }
}

Gf128 MulReference(Gf128 x, Gf128 y) {
  // Z accumulates V = y * x^i for every set bit x_i of x; V steps by one power of x, the bit
  // that leaves at x^127 folded back as R = 11100001 || 0^120. Masks instead of branches.
  Gf128 z, v = y;
  for (int i = 0; i < 128; ++i) {
    const uint64_t bit = i < 64 ? (x.hi >> (63 - i)) & 1 : (x.lo >> (127 - i)) & 1;
    const uint64_t take = uint64_t{0} - bit;
    z.hi ^= v.hi & take;
    z.lo ^= v.lo & take;
    const uint64_t fold = uint64_t{0} - (v.lo & 1);
    v.lo = (v.lo >> 1) | (v.hi << 63);
    v.hi = (v.hi >> 1) ^ ((uint64_t{0xE1} << 56) & fold);
  }
  return z;
}

namespace {

#if defined(__x86_64__)
// In a 128-bit register holding (hi, lo) as one integer, bit k is the coefficient of x^(127-k):
// GCM's order reflected. The carry-less product of two reflected values is the reflected
// 255-bit product one bit short, hence the shift left by one before the reduction, which folds
// the low half into the high half modulo the reflected x^128 + x^7 + x^2 + x + 1.
__attribute__((target("pclmul,sse4.1"))) Gf128 MulClmul(Gf128 x, Gf128 y) {
  const __m128i a = _mm_set_epi64x(static_cast<int64_t>(x.hi), static_cast<int64_t>(x.lo));
  const __m128i b = _mm_set_epi64x(static_cast<int64_t>(y.hi), static_cast<int64_t>(y.lo));
  __m128i low = _mm_clmulepi64_si128(a, b, 0x00);
  __m128i high = _mm_clmulepi64_si128(a, b, 0x11);
  const __m128i mid =
      _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x10), _mm_clmulepi64_si128(a, b, 0x01));
  low = _mm_xor_si128(low, _mm_slli_si128(mid, 8));
  high = _mm_xor_si128(high, _mm_srli_si128(mid, 8));

  // high:low <<= 1, across the 32-bit lanes and the two halves.
  const __m128i low_out = _mm_srli_epi32(low, 31);
  const __m128i high_out = _mm_srli_epi32(high, 31);
  low = _mm_or_si128(_mm_slli_epi32(low, 1), _mm_slli_si128(low_out, 4));
  high = _mm_or_si128(_mm_slli_epi32(high, 1),
                      _mm_or_si128(_mm_slli_si128(high_out, 4), _mm_srli_si128(low_out, 12)));

  // Reduction: the first phase folds by x^63, x^62, x^57 (shifts 31, 30, 25 within lanes), the
  // second by x^1, x^2, x^7.
  __m128i t = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi32(low, 31), _mm_slli_epi32(low, 30)),
                            _mm_slli_epi32(low, 25));
  const __m128i carry = _mm_srli_si128(t, 4);
  low = _mm_xor_si128(low, _mm_slli_si128(t, 12));
  t = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi32(low, 1), _mm_srli_epi32(low, 2)),
                    _mm_srli_epi32(low, 7));
  low = _mm_xor_si128(low, _mm_xor_si128(t, carry));
  high = _mm_xor_si128(high, low);
  return {static_cast<uint64_t>(_mm_extract_epi64(high, 1)),
          static_cast<uint64_t>(_mm_extract_epi64(high, 0))};
}

bool HasClmul() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}
#endif

}  // namespace

Gf128 Mul(Gf128 x, Gf128 y) {
#if defined(__x86_64__)
  if (HasClmul()) return MulClmul(x, y);
#endif
  return MulReference(x, y);
}

Gf128 Pow(Gf128 h, uint64_t m) {
  Gf128 r = Gf128::One();
  for (Gf128 b = h; m != 0; m >>= 1) {
    if (m & 1) r = Mul(r, b);
    if (m > 1) b = Mul(b, b);
  }
  return r;
}

Gf128 LengthBlock(uint64_t aad_bytes, uint64_t text_bytes) {
  return {aad_bytes * 8, text_bytes * 8};
}

}  // namespace moe::dataplane
