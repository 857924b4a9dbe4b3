// MXFP8 (E4M3 + E8M0 per 32) against brute force over all 256 codes: the decode table, the
// round trip, nearest-even encoding with saturation at 448, NaN and -0, and the block scale
// 2^ceil(log2(amax / 448)) at and around its edges.
#include "services/numerics/mxfp8.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "services/numerics/precision.h"

namespace moe::numerics {
namespace {

// The E4M3 value of a code by its definition, independently of E4M3ToFloat's arithmetic.
double Definition(int c) {
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  const double mag = e == 0 ? m / 8.0 * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -mag : mag;
}

bool IsNaNCode(int c) { return (c & 0x7F) == 0x7F; }

// The nearest finite code by exhaustive search; ties to the even code (mantissa bit 0 clear);
// beyond 448 saturates.
uint8_t BruteForce(float v) {
  if (std::fabs(v) >= 448.0f) return std::signbit(v) ? 0xFE : 0x7E;
  int best = -1;
  double best_d = 0;
  for (int c = 0; c < 256; ++c) {
    if (IsNaNCode(c) || (std::signbit(v) != ((c & 0x80) != 0))) continue;
    const double d = std::fabs(static_cast<double>(v) - Definition(c));
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(Mxfp8, DecodeTableMatchesTheDefinitionForAll256Codes) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = E4M3ToFloat(static_cast<uint8_t>(c));
    if (IsNaNCode(c)) {
      EXPECT_TRUE(std::isnan(v)) << c;
      ++nans;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), Definition(c)) << c;
  }
  EXPECT_EQ(nans, 2);
  EXPECT_EQ(E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(E4M3ToFloat(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  for (int c = 1; c <= 0x7E; ++c) EXPECT_GT(E4M3ToFloat(c), E4M3ToFloat(c - 1)) << c;
}

TEST(Mxfp8, EveryCodeRoundTripsAndNaNAndZeroKeepTheirSign) {
  for (int c = 0; c < 256; ++c) {
    if (IsNaNCode(c)) continue;
    EXPECT_EQ(FloatToE4M3(E4M3ToFloat(static_cast<uint8_t>(c))), c) << c;
  }
  EXPECT_EQ(FloatToE4M3(std::nanf("")), 0x7F);
  EXPECT_EQ(FloatToE4M3(-std::nanf("")), 0xFF);
  EXPECT_EQ(FloatToE4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToE4M3(1e30f), 0x7E);
  EXPECT_EQ(FloatToE4M3(-INFINITY), 0xFE);
}

TEST(Mxfp8, EncodingIsTheNearestCodeWithTiesToEven) {
  std::vector<float> probes;
  // Every midpoint between neighbouring magnitudes (ties), and just either side of it.
  for (int c = 0; c < 0x7E; ++c) {
    const float mid = (E4M3ToFloat(c) + E4M3ToFloat(c + 1)) / 2;  // exact: one more bit
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) {
      probes.push_back(v);
      probes.push_back(-v);
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f), unit(-1.0f, 1.0f);
  for (int i = 0; i < 20000; ++i) probes.push_back(unit(rng) * std::exp2(exponent(rng)));
  for (float v : {447.9f, 448.0f, 460.0f, 464.0f, 1e-12f, 0.0f}) probes.push_back(v);
  int ties = 0;
  for (float v : probes) {
    ASSERT_EQ(FloatToE4M3(v), BruteForce(v)) << v;
    ties += (v == (E4M3ToFloat(BruteForce(v)) + E4M3ToFloat(BruteForce(v) ^ 1)) / 2);
  }
  EXPECT_GT(ties, 100);  // the midpoints were really ties
}

TEST(Mxfp8, BlockScaleIsTheSmallestPowerOfTwoThatFitsAmaxUnder448) {
  uint8_t codes[32], scale;
  float v[32] = {}, back[32];
  QuantizeMxfp8Block(v, codes, &scale);
  EXPECT_EQ(scale, 0);  // all zero: 2^-127, codes 0
  for (uint8_t c : codes) EXPECT_EQ(c, 0);
  for (int k : {-20, -3, 0, 1, 7, 40}) {
    v[5] = std::ldexp(448.0f, k);  // exactly 448 x 2^k: scale 2^k, the element 448
    QuantizeMxfp8Block(v, codes, &scale);
    EXPECT_EQ(static_cast<int>(scale) - kE8M0Bias, k);
    EXPECT_EQ(codes[5], 0x7E);
    v[5] = std::nextafter(std::ldexp(448.0f, k), INFINITY);  // just above: the next power
    QuantizeMxfp8Block(v, codes, &scale);
    EXPECT_EQ(static_cast<int>(scale) - kE8M0Bias, k + 1);
  }
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (int trial = 0; trial < 200; ++trial) {
    for (float& x : v) x = n(rng);
    QuantizeMxfp8Block(v, codes, &scale);
    DequantizeMxfp8Block(codes, scale, back);
    const float s = E8M0ToFloat(scale);
    for (int i = 0; i < 32; ++i) {
      EXPECT_EQ(codes[i], FloatToE4M3(v[i] / s));  // the element rule, exactly
      // Within half a step of the value's binade (3 mantissa bits), or of the subnormal step.
      const float step = std::ldexp(s, std::max(std::ilogb(std::fabs(v[i]) / s), -6) - 3);
      EXPECT_LE(std::fabs(back[i] - v[i]), step / 2) << v[i];
    }
  }
}

// The precision modes are named once (precision_mode.h's names, precision.h's table): each
// name parses to its mode and back; anything else is refused listing both.
TEST(Precision, NamedParsedAndListedFromOneTable) {
  for (Precision p : {Precision::kW4A16, Precision::kW4A8}) {
    auto back = ParsePrecision(PrecisionName(p));
    ASSERT_TRUE(back.ok()) << PrecisionName(p);
    EXPECT_EQ(*back, p);
    EXPECT_STREQ(kPrecisions.Name(p), PrecisionName(p));
  }
  EXPECT_EQ(kPrecisions.Choices(), "w4a16|w4a8");
  auto bad = ParsePrecision("w4a4");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "precision 'w4a4' is not one of w4a16, w4a8");
}

}  // namespace
}  // namespace moe::numerics
