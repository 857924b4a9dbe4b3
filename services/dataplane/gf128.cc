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
// In a 128-bit register holding (hi, lo) as one integer (a block's bytes reversed), bit k is the
// coefficient of x^(127-k): GCM's order reflected. The carry-less product of two reflected
// values is the reflected 255-bit product one bit short, hence the shift left by one before the
// reduction, which folds the low half into the high half modulo the reflected
// x^128 + x^7 + x^2 + x + 1. Both steps are linear: a sum of products is reduced once.
inline __attribute__((always_inline, target("pclmul,sse4.1"))) __m128i Reduce(__m128i low,
                                                                              __m128i high,
                                                                              __m128i mid) {
  low = _mm_xor_si128(low, _mm_slli_si128(mid, 8));
  high = _mm_xor_si128(high, _mm_srli_si128(mid, 8));

  // high:low <<= 1, across the 32-bit lanes and the two halves.
  const __m128i low_out = _mm_srli_epi32(low, 31);
  const __m128i high_out = _mm_srli_epi32(high, 31);
  low = _mm_or_si128(_mm_slli_epi32(low, 1), _mm_slli_si128(low_out, 4));
  high = _mm_or_si128(_mm_slli_epi32(high, 1),
                      _mm_or_si128(_mm_slli_si128(high_out, 4), _mm_srli_si128(low_out, 12)));

  // The first phase folds by x^63, x^62, x^57 (shifts 31, 30, 25 within lanes), the second by
  // x^1, x^2, x^7.
  __m128i t = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi32(low, 31), _mm_slli_epi32(low, 30)),
                            _mm_slli_epi32(low, 25));
  const __m128i carry = _mm_srli_si128(t, 4);
  low = _mm_xor_si128(low, _mm_slli_si128(t, 12));
  t = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi32(low, 1), _mm_srli_epi32(low, 2)),
                    _mm_srli_epi32(low, 7));
  low = _mm_xor_si128(low, _mm_xor_si128(t, carry));
  return _mm_xor_si128(high, low);
}

__attribute__((target("pclmul,sse4.1"))) __m128i ToReg(Gf128 x) {
  return _mm_set_epi64x(static_cast<int64_t>(x.hi), static_cast<int64_t>(x.lo));
}

__attribute__((target("pclmul,sse4.1"))) Gf128 FromReg(__m128i r) {
  return {static_cast<uint64_t>(_mm_extract_epi64(r, 1)),
          static_cast<uint64_t>(_mm_extract_epi64(r, 0))};
}

__attribute__((target("pclmul,sse4.1"))) Gf128 MulClmul(Gf128 x, Gf128 y) {
  const __m128i a = ToReg(x), b = ToReg(y);
  return FromReg(
      Reduce(_mm_clmulepi64_si128(a, b, 0x00), _mm_clmulepi64_si128(a, b, 0x11),
             _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x10), _mm_clmulepi64_si128(a, b, 0x01))));
}

bool HasClmul() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}

bool HasClmul512() {
  static const bool has = HasClmul() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("vpclmulqdq");
  return has;
}

bool HasClmul256() {
  static const bool has =
      HasClmul() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
  return has;
}

// GCC 12 takes the intrinsics' deliberately undefined pass-through operands for uninitialized
// reads inside target("avx512f") functions.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// The XOR of a 512-bit register's four 128-bit lanes.
__attribute__((target("avx512f"))) __m128i SumLanes(__m512i v) {
  v = _mm512_xor_si512(v, _mm512_shuffle_i64x2(v, v, 0x4E));  // lanes 2, 3, 0, 1
  v = _mm512_xor_si512(v, _mm512_shuffle_i64x2(v, v, 0xB1));  // lanes 1, 0, 3, 2
  return _mm512_castsi512_si128(v);
}

// Lane k of the result is h^(top + 1 - k) (p[i] = h^(i + 1)), as (hi, lo) like ToReg.
__attribute__((target("avx512f"))) __m512i FourPowers(const Gf128* p, int top) {
  return _mm512_set_epi64(static_cast<int64_t>(p[top - 3].hi), static_cast<int64_t>(p[top - 3].lo),
                          static_cast<int64_t>(p[top - 2].hi), static_cast<int64_t>(p[top - 2].lo),
                          static_cast<int64_t>(p[top - 1].hi), static_cast<int64_t>(p[top - 1].lo),
                          static_cast<int64_t>(p[top].hi), static_cast<int64_t>(p[top].lo));
}

// One step over n blocks (a multiple of 4, at most kGhashStepBlocks): y' = (y ^ X_1) h^n ^
// X_2 h^(n-1) ^ ... ^ X_n h, four blocks per 512-bit register against four powers, the products
// summed unreduced and reduced once. Only the first register waits for the last step's
// reduction, so with 64 blocks a step the rest of its multiplies run under that reduction.
__attribute__((target("pclmul,sse4.1,avx512f,avx512bw,vpclmulqdq"))) __m128i GhashStep512(
    const __m512i* powers, __m128i acc, const uint8_t* data, int groups) {
  const __m512i reverse = _mm512_set_epi64(
      0x0001020304050607, 0x08090a0b0c0d0e0f, 0x0001020304050607, 0x08090a0b0c0d0e0f,
      0x0001020304050607, 0x08090a0b0c0d0e0f, 0x0001020304050607, 0x08090a0b0c0d0e0f);
  __m512i low = _mm512_setzero_si512(), high = low, mid = low;
  for (int g = 0; g < groups; ++g) {
    __m512i x = _mm512_shuffle_epi8(_mm512_loadu_si512(data + 64 * g), reverse);
    if (g == 0) x = _mm512_xor_si512(x, _mm512_maskz_broadcast_i32x4(0x000F, acc));
    low = _mm512_xor_si512(low, _mm512_clmulepi64_epi128(x, powers[g], 0x00));
    high = _mm512_xor_si512(high, _mm512_clmulepi64_epi128(x, powers[g], 0x11));
    mid = _mm512_ternarylogic_epi64(mid, _mm512_clmulepi64_epi128(x, powers[g], 0x10),
                                    _mm512_clmulepi64_epi128(x, powers[g], 0x01), 0x96);
  }
  return Reduce(SumLanes(low), SumLanes(high), SumLanes(mid));
}

// Whole steps of kGhashStepBlocks, then one of the largest multiple of 4 left: what is left
// (at most 3 blocks) goes to the caller. Returns the blocks taken.
__attribute__((target("pclmul,sse4.1,avx512f,avx512bw,vpclmulqdq"))) size_t GhashWide512(
    const GhashKey& key, Gf128* y, const uint8_t* data, size_t blocks) {
  constexpr int kGroups = kGhashStepBlocks / 4;
  __m128i acc = ToReg(*y);
  const size_t steps = blocks / kGhashStepBlocks;
  if (steps > 0) {  // a message of under 1 KiB needs none of the 16 registers of powers
    __m512i powers[kGroups];
    for (int g = 0; g < kGroups; ++g) {
      powers[g] = FourPowers(key.powers, kGhashStepBlocks - 1 - 4 * g);
    }
    for (size_t s = 0; s < steps; ++s) {
      acc = GhashStep512(powers, acc, data + 16 * kGhashStepBlocks * s, kGroups);
    }
  }
  size_t taken = steps * kGhashStepBlocks;
  if (const int groups = static_cast<int>((blocks - taken) / 4); groups > 0) {
    __m512i last[kGroups];
    for (int g = 0; g < groups; ++g) last[g] = FourPowers(key.powers, 4 * groups - 1 - 4 * g);
    acc = GhashStep512(last, acc, data + 16 * taken, groups);
    taken += 4 * static_cast<size_t>(groups);
  }
  *y = FromReg(acc);
  return taken;
}
#pragma GCC diagnostic pop

// The same on AVX2 VPCLMULQDQ (AMD Zen 3, Intel Ice Lake and later without AVX-512 enabled):
// two blocks per 256-bit register, steps of the same kGhashStepBlocks. Three multiplies per
// register (Karatsuba: the middle term from (x_hi ^ x_lo)(h_hi ^ h_lo)), as Zen 3 takes two
// cycles per 256-bit carry-less multiply: 10.5 GB/s with four, cache-resident.
struct TwoPowers {
  __m256i h;     // lane k: h^(top + 1 - k) as (hi, lo) like ToReg
  __m256i fold;  // lane k: that power's hi ^ lo in its low 64 bits
};

__attribute__((target("avx2"))) TwoPowers PowersAt(const Gf128* p, int top) {
  const Gf128 a = p[top], b = p[top - 1];
  return {_mm256_set_epi64x(static_cast<int64_t>(b.hi), static_cast<int64_t>(b.lo),
                            static_cast<int64_t>(a.hi), static_cast<int64_t>(a.lo)),
          _mm256_set_epi64x(0, static_cast<int64_t>(b.hi ^ b.lo), 0,
                            static_cast<int64_t>(a.hi ^ a.lo))};
}

// The XOR of a 256-bit register's two 128-bit lanes.
__attribute__((target("avx2"))) __m128i SumLanes(__m256i v) {
  return _mm_xor_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

// One step over n blocks (even, at most kGhashStepBlocks), as GhashStep512.
__attribute__((target("pclmul,sse4.1,avx2,vpclmulqdq"))) __m128i GhashStep256(
    const TwoPowers* powers, __m128i acc, const uint8_t* data, int groups) {
  const __m256i reverse = _mm256_set_epi64x(0x0001020304050607, 0x08090a0b0c0d0e0f,
                                            0x0001020304050607, 0x08090a0b0c0d0e0f);
  __m256i low = _mm256_setzero_si256(), high = low, mid = low;
  for (int g = 0; g < groups; ++g) {
    __m256i x = _mm256_shuffle_epi8(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + 32 * g)), reverse);
    if (g == 0) x = _mm256_xor_si256(x, _mm256_zextsi128_si256(acc));
    const __m256i x_fold = _mm256_xor_si256(x, _mm256_shuffle_epi32(x, 0x4E));  // hi ^ lo
    low = _mm256_xor_si256(low, _mm256_clmulepi64_epi128(x, powers[g].h, 0x00));
    high = _mm256_xor_si256(high, _mm256_clmulepi64_epi128(x, powers[g].h, 0x11));
    mid = _mm256_xor_si256(mid, _mm256_clmulepi64_epi128(x_fold, powers[g].fold, 0x00));
  }
  const __m128i l = SumLanes(low), h = SumLanes(high);
  return Reduce(l, h, _mm_xor_si128(SumLanes(mid), _mm_xor_si128(l, h)));
}

// Whole steps, then one of the largest even count left: at most one block goes to the caller.
__attribute__((target("pclmul,sse4.1,avx2,vpclmulqdq"))) size_t GhashWide256(const GhashKey& key,
                                                                             Gf128* y,
                                                                             const uint8_t* data,
                                                                             size_t blocks) {
  constexpr int kGroups = kGhashStepBlocks / 2;
  __m128i acc = ToReg(*y);
  const size_t steps = blocks / kGhashStepBlocks;
  if (steps > 0) {
    TwoPowers powers[kGroups];
    for (int g = 0; g < kGroups; ++g)
      powers[g] = PowersAt(key.powers, kGhashStepBlocks - 1 - 2 * g);
    for (size_t s = 0; s < steps; ++s) {
      acc = GhashStep256(powers, acc, data + 16 * kGhashStepBlocks * s, kGroups);
    }
  }
  size_t taken = steps * kGhashStepBlocks;
  if (const int groups = static_cast<int>((blocks - taken) / 2); groups > 0) {
    TwoPowers last[kGroups];
    for (int g = 0; g < groups; ++g) last[g] = PowersAt(key.powers, 2 * groups - 1 - 2 * g);
    acc = GhashStep256(last, acc, data + 16 * taken, groups);
    taken += 2 * static_cast<size_t>(groups);
  }
  *y = FromReg(acc);
  return taken;
}
#endif

}  // namespace

Gf128 Mul(Gf128 x, Gf128 y) {
#if defined(__x86_64__)
  if (HasClmul()) return MulClmul(x, y);
#endif
  return MulReference(x, y);
}

GhashKey::GhashKey(Gf128 h) {
  powers[0] = h;
  for (int i = 1; i < kGhashStepBlocks; ++i) powers[i] = Mul(powers[i - 1], h);
}

bool GhashWidthAvailable(GhashWidth width) {
#if defined(__x86_64__)
  switch (width) {
    case GhashWidth::k512:
      return HasClmul512();
    case GhashWidth::k256:
      return HasClmul256();
    case GhashWidth::kOne:
      return true;
  }
#endif
  return width == GhashWidth::kOne;
}

GhashWidth WidestGhash() {
  static const GhashWidth widest = GhashWidthAvailable(GhashWidth::k512)   ? GhashWidth::k512
                                   : GhashWidthAvailable(GhashWidth::k256) ? GhashWidth::k256
                                                                           : GhashWidth::kOne;
  return widest;
}

const char* GhashWidthName(GhashWidth width) {
  switch (width) {
    case GhashWidth::k512:
      return "AVX-512 VPCLMULQDQ, 4 blocks a multiply";
    case GhashWidth::k256:
      return "AVX2 VPCLMULQDQ, 2 blocks a multiply";
    case GhashWidth::kOne:
      break;
  }
  return "one block at a time";
}

Gf128 GhashBlocks(const GhashKey& key, Gf128 y, const uint8_t* data, size_t blocks,
                  GhashWidth width) {
#if defined(__x86_64__)
  if (width == GhashWidth::k512 && HasClmul512() && blocks >= 4) {
    const size_t taken = GhashWide512(key, &y, data, blocks);
    data += 16 * taken;
    blocks -= taken;
  } else if (width != GhashWidth::kOne && HasClmul256() && blocks >= 2) {
    const size_t taken = GhashWide256(key, &y, data, blocks);
    data += 16 * taken;
    blocks -= taken;
  }
#endif
  for (size_t i = 0; i < blocks; ++i) y = Mul(y ^ Gf128::Load(data + 16 * i), key.powers[0]);
  return y;
}

bool WideGhash() { return WidestGhash() != GhashWidth::kOne; }

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
