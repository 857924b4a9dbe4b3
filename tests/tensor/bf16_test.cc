#include "services/tensor/bf16.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "services/tensor/dtype.h"

namespace moe::tensor {
namespace {

uint16_t Bits(float f) { return RoundToBf16Bits(f); }

TEST(Bf16, ExactValuesKeepTheirBits) {
  EXPECT_EQ(Bits(1.0f), 0x3f80);
  EXPECT_EQ(Bits(-2.0f), 0xc000);
  EXPECT_EQ(Bits(0.0f), 0x0000);
  EXPECT_EQ(Bits(-0.0f), 0x8000);
  EXPECT_EQ(Bf16BitsToFloat(0x3fc0), 1.5f);
}

TEST(Bf16, TiesRoundToEven) {
  // 1 + 2^-8 lies halfway between 1.0 (mantissa ...0, even) and 1 + 2^-7 (odd): down to 1.0.
  EXPECT_EQ(Bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
  EXPECT_EQ(Bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  // Just above a tie rounds up, just below rounds down.
  EXPECT_EQ(Bits(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
  EXPECT_EQ(Bits(1.0f + std::ldexp(1.0f, -8) - std::ldexp(1.0f, -20)), 0x3f80);
  EXPECT_EQ(Bits(-(1.0f + 3 * std::ldexp(1.0f, -8))), 0xbf82);
}

TEST(Bf16, OverflowInfinityAndNaN) {
  EXPECT_EQ(Bits(std::numeric_limits<float>::max()), 0x7f80);  // rounds past the largest bf16
  EXPECT_EQ(Bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(Bits(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(Bf16BitsToFloat(0x7f7f), 0x1.fep127f);  // largest finite bf16 stays finite
  EXPECT_EQ(Bits(0x1.fep127f), 0x7f7f);
  const uint16_t nan = Bits(std::nanf(""));
  EXPECT_TRUE(std::isnan(Bf16BitsToFloat(nan)));
  // A NaN whose payload sits only in the low 16 bits must not turn into Inf.
  EXPECT_TRUE(std::isnan(Bf16BitsToFloat(Bits(BitsToFloat(0x7f800001u)))));
}

TEST(Bf16, SubnormalsRoundLikeNormals) {
  EXPECT_EQ(Bits(BitsToFloat(0x00010000u)), 0x0001);
  EXPECT_EQ(Bits(BitsToFloat(0x00008000u)), 0x0000);  // tie, down to even 0
  EXPECT_EQ(Bits(BitsToFloat(0x00018000u)), 0x0002);  // tie, up to even 2
}

TEST(Bf16, RoundTripOfEveryBf16IsExact) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = Bf16BitsToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(Bits(f), b);
  }
}

// Against std::isfinite of every bf16 bit pattern, alone and at each position of arrays of
// finite neighbours (the largest finite values included, whose exponent bits are 0xfe), so every
// lane of a word and every tail length is tried.
TEST(Bf16, FirstNonFiniteFindsEveryInfinityAndNaN) {
  const uint16_t finite_fill[] = {0x7f7f, 0xff7f, 0x0000, 0x8000, 0x3f80, 0x0001, 0x7f00};
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const Bf16 v = Bf16::FromBits(static_cast<uint16_t>(b));
    const bool finite = std::isfinite(v.ToFloat());
    ASSERT_EQ(FirstNonFinite(&v, 1), finite ? 1u : 0u) << std::hex << b;
  }
  for (size_t n = 0; n <= 13; ++n) {
    std::vector<Bf16> row(n);
    for (size_t i = 0; i < n; ++i) row[i] = Bf16::FromBits(finite_fill[i % 7]);
    EXPECT_EQ(FirstNonFinite(row.data(), n), n) << n;
    for (uint16_t bad : {0x7f80, 0xff80, 0x7fc0, 0xffff, 0x7f81}) {
      for (size_t at = 0; at < n; ++at) {
        std::vector<Bf16> r = row;
        r[at] = Bf16::FromBits(bad);
        EXPECT_EQ(FirstNonFinite(r.data(), n), at) << n << " " << at << " " << std::hex << bad;
        if (at + 2 >= n) continue;
        r[at + 2] = Bf16::FromBits(0x7f80);  // only the first is reported
        EXPECT_EQ(FirstNonFinite(r.data(), n), at) << n << " " << at << " " << std::hex << bad;
      }
    }
  }
}

// Past the branch-free blocks (1,024 values): lengths around one, two and many blocks, each bad
// pattern at the first and last value of each block, the first of the tail and the very last,
// against a plain loop over std::isfinite.
TEST(Bf16, FirstNonFiniteFindsItInEveryBlockAndTail) {
  auto oracle = [](const std::vector<Bf16>& r) {
    for (size_t i = 0; i < r.size(); ++i) {
      if (!std::isfinite(r[i].ToFloat())) return i;
    }
    return r.size();
  };
  constexpr size_t kBlock = 1024;
  for (size_t n : {1000u, 1023u, 1024u, 1025u, 2047u, 2048u, 2049u, 5000u}) {
    std::vector<Bf16> row(n);
    for (size_t i = 0; i < n; ++i) row[i] = Bf16::FromBits(static_cast<uint16_t>(0x7f7f - i % 3));
    EXPECT_EQ(FirstNonFinite(row.data(), n), n) << n;
    std::vector<size_t> places = {0, n - 1, n / kBlock * kBlock};
    for (size_t b = 0; b + kBlock <= n; b += kBlock) {
      places.push_back(b);
      places.push_back(b + kBlock - 1);
    }
    for (uint16_t bad : {0x7f80, 0xff80, 0x7fc0, 0xffff}) {
      for (size_t at : places) {
        if (at >= n) continue;
        std::vector<Bf16> r = row;
        r[at] = Bf16::FromBits(bad);
        if (at + 1100 < n) r[at + 1100] = Bf16::FromBits(0x7f80);  // a later one, another block
        ASSERT_EQ(FirstNonFinite(r.data(), n), oracle(r))
            << n << " " << at << " " << std::hex << bad;
        ASSERT_EQ(FirstNonFinite(r.data(), n), at);
      }
    }
  }
}

TEST(DType, ParsesSafetensorsNames) {
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kU8), 1u);
  EXPECT_STREQ(DTypeName(DType::kF8E4M3), "F8_E4M3");
  EXPECT_FALSE(ParseDType("bf16").ok());
  EXPECT_FALSE(ParseDType("F4").ok());
}

}  // namespace
}  // namespace moe::tensor
