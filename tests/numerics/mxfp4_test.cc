#include "services/numerics/mxfp4.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "services/common/random.h"

namespace moe::numerics {
namespace {

TEST(Mxfp4, E2M1TableDecodesEveryCode) {
  // Scale byte 127 is 2^0, so each code decodes to its table value.
  const float expected[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0f, -0.5, -1, -1.5, -2, -3, -4, -6};
  std::vector<uint8_t> codes(32), packed(16);
  for (int i = 0; i < 32; ++i) codes[i] = static_cast<uint8_t>(i % 16);
  PackMxfp4Row(codes.data(), 32, packed.data());
  const uint8_t scale = 127;
  float out[32];
  DequantizeMxfp4Row(packed.data(), &scale, 32, out);
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(out[i], expected[i % 16]) << "code " << i % 16;
    EXPECT_EQ(std::signbit(out[i]), i % 16 >= 8) << "code " << i % 16;
  }
}

TEST(Mxfp4, PackingPutsEvenColumnInLowNibble) {
  const uint8_t codes[2] = {0x3, 0xA};
  uint8_t packed = 0;
  PackMxfp4Row(codes, 2, &packed);
  EXPECT_EQ(packed, 0xA3);
  uint8_t back[2];
  UnpackMxfp4Row(&packed, 2, back);
  EXPECT_EQ(back[0], 0x3);
  EXPECT_EQ(back[1], 0xA);
}

TEST(Mxfp4, E8M0Edges) {
  EXPECT_EQ(E8M0ToFloat(127), 1.0f);
  EXPECT_EQ(E8M0ToFloat(128), 2.0f);
  EXPECT_EQ(E8M0ToFloat(126), 0.5f);
  EXPECT_EQ(E8M0ToFloat(0), std::ldexp(1.0f, -127));  // subnormal in fp32, still exact
  EXPECT_EQ(E8M0ToFloat(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(E8M0ToFloat(0xFF)));
  // The smallest scale times the smallest code is still exact (2^-128).
  EXPECT_EQ(kE2M1Values[1] * E8M0ToFloat(0), std::ldexp(1.0f, -128));
}

TEST(Mxfp4, RejectsNaNScales) {
  std::vector<uint8_t> scales = {0, 127, 254};
  EXPECT_EQ(FindE8M0NaN(scales.data(), scales.size()), -1);
  scales.push_back(0xFF);
  scales.push_back(0xFF);
  EXPECT_EQ(FindE8M0NaN(scales.data(), scales.size()), 3);
}

TEST(Mxfp4, QuantizeUsesFloorExponentAndTiesToEven) {
  // amax 5 -> shared exponent floor(log2 5) - 2 = 0, so values are coded as they are.
  std::vector<float> v(32, 0.0f);
  const float in[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, -0.25f, -2.5f, -3.5f, 0.3f};
  const float want[] = {0.0f, 1.0f, 1.0f, 2.0f, 2.0f, 4.0f, 4.0f, -0.0f, -2.0f, -4.0f, 0.5f};
  for (size_t i = 0; i < std::size(in); ++i) v[i] = in[i];
  uint8_t packed[16], scale;
  QuantizeMxfp4Row(v.data(), 32, packed, &scale);
  EXPECT_EQ(scale, 127);
  float out[32];
  DequantizeMxfp4Row(packed, &scale, 32, out);
  for (size_t i = 0; i < std::size(in); ++i) EXPECT_EQ(out[i], want[i]) << "input " << in[i];
}

TEST(Mxfp4, QuantizeSaturatesAtSixTimesScale) {
  // amax 7.9: exponent floor(log2 7.9) - 2 = 0, and 7.9 saturates to 6 (no overflow to NaN).
  std::vector<float> v(32, 1.0f);
  v[5] = 7.9f;
  v[6] = -7.0f;
  uint8_t packed[16], scale;
  QuantizeMxfp4Row(v.data(), 32, packed, &scale);
  EXPECT_EQ(scale, 127);
  float out[32];
  DequantizeMxfp4Row(packed, &scale, 32, out);
  EXPECT_EQ(out[5], 6.0f);
  EXPECT_EQ(out[6], -6.0f);
  EXPECT_EQ(out[0], 1.0f);
}

TEST(Mxfp4, AllZeroBlockAndScaledBlocks) {
  std::vector<float> v(64, 0.0f);
  for (int i = 32; i < 64; ++i) v[i] = 0.001f * (i - 48);
  uint8_t packed[32], scales[2];
  QuantizeMxfp4Row(v.data(), 64, packed, scales);
  EXPECT_EQ(scales[0], 0);  // documented choice: 2^-127 for an all-zero block
  for (int j = 0; j < 16; ++j) EXPECT_EQ(packed[j], 0);
  // amax 0.016 -> floor(log2 0.016) = -6 -> exponent -8 -> byte 119.
  EXPECT_EQ(scales[1], 119);
}

// Independent oracle: for every element, the nearest of the 8 magnitudes times the scale, ties
// broken toward the even code, clamped to 6.
TEST(Mxfp4, QuantizeMatchesBruteForceNearest) {
  Rng rng(42);
  const int cols = 256;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> v(cols);
    const float spread = std::ldexp(1.0f, static_cast<int>(rng.Next() % 40) - 20);
    for (float& x : v) x = spread * rng.Normal();
    std::vector<uint8_t> packed(cols / 2), scales(cols / 32);
    QuantizeMxfp4Row(v.data(), cols, packed.data(), scales.data());
    std::vector<float> out(cols);
    DequantizeMxfp4Row(packed.data(), scales.data(), cols, out.data());
    for (int g = 0; g < cols / 32; ++g) {
      double amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(double(v[g * 32 + i])));
      const int e = static_cast<int>(std::floor(std::log2(amax))) - 2;
      ASSERT_EQ(scales[g], e + 127);
      for (int i = 0; i < 32; ++i) {
        const double x = std::fabs(double(v[g * 32 + i])) / std::ldexp(1.0, e);
        int best = 0;
        for (int c = 1; c < 8; ++c) {
          const double dc = std::fabs(x - kE2M1Values[c]), db = std::fabs(x - kE2M1Values[best]);
          if (dc < db || (dc == db && c % 2 == 0)) best = c;
        }
        const double want = std::copysign(kE2M1Values[best] * std::ldexp(1.0, e), v[g * 32 + i]);
        ASSERT_EQ(out[g * 32 + i], static_cast<float>(want)) << "trial " << trial << " i " << i;
      }
    }
  }
}

}  // namespace
}  // namespace moe::numerics
