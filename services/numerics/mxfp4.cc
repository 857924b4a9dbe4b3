#include "services/numerics/mxfp4.h"

#include <cmath>
#include <cstring>

namespace moe::numerics {

float E8M0ToFloat(uint8_t s) {
  if (s == kE8M0NaN) return std::nanf("");
  return std::ldexp(1.0f, static_cast<int>(s) - kE8M0Bias);
}

uint8_t FloatToE2M1(float v) {
  const uint8_t sign = std::signbit(v) ? 0x8 : 0x0;
  const float a = std::fabs(v);
  // Count the midpoints between neighbouring E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} that
  // a lies above. At a tie the even code (mantissa bit 0) wins, so the comparison is strict
  // where the lower neighbour is even and inclusive where it is odd. Branch-free: the
  // generator quantizes 29.6 G random values for one K3 layer.
  const int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                   (a >= 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>(sign | code);
}

void QuantizeMxfp4Row(const float* values, int64_t cols, uint8_t* packed, uint8_t* scales) {
  for (int64_t g = 0; g < cols / kMxfp4BlockSize; ++g) {
    const float* block = values + g * kMxfp4BlockSize;
    float amax = 0.0f;
    for (int i = 0; i < kMxfp4BlockSize; ++i) amax = std::fmax(amax, std::fabs(block[i]));
    int exponent = -kE8M0Bias;  // all-zero block: smallest scale, every code 0
    if (amax > 0.0f) {
      exponent = std::ilogb(amax) - kE2M1MaxExponent;  // ilogb = floor(log2) for finite > 0
      if (exponent < -kE8M0Bias) exponent = -kE8M0Bias;
      if (exponent > kE8M0Bias) exponent = kE8M0Bias;
    }
    scales[g] = static_cast<uint8_t>(exponent + kE8M0Bias);
    // Multiplying by 2^-exponent is exact wherever it matters (a value that would turn
    // subnormal is far below the 0.25 midpoint and codes to 0 either way).
    const float inv_scale = std::ldexp(1.0f, -exponent);
    uint8_t codes[kMxfp4BlockSize];
    for (int i = 0; i < kMxfp4BlockSize; ++i) codes[i] = FloatToE2M1(block[i] * inv_scale);
    PackMxfp4Row(codes, kMxfp4BlockSize, packed + g * (kMxfp4BlockSize / 2));
  }
}

void DequantizeMxfp4Row(const uint8_t* packed, const uint8_t* scales, int64_t cols, float* out) {
  for (int64_t g = 0; g < cols / kMxfp4BlockSize; ++g) {
    const float scale = E8M0ToFloat(scales[g]);
    const uint8_t* p = packed + g * (kMxfp4BlockSize / 2);
    float* o = out + g * kMxfp4BlockSize;
    for (int j = 0; j < kMxfp4BlockSize / 2; ++j) {
      o[2 * j] = kE2M1Values[p[j] & 0xF] * scale;
      o[2 * j + 1] = kE2M1Values[p[j] >> 4] * scale;
    }
  }
}

void UnpackMxfp4Row(const uint8_t* packed, int64_t cols, uint8_t* codes) {
  for (int64_t j = 0; j < cols / 2; ++j) {
    codes[2 * j] = packed[j] & 0xF;
    codes[2 * j + 1] = packed[j] >> 4;
  }
}

void PackMxfp4Row(const uint8_t* codes, int64_t cols, uint8_t* packed) {
  for (int64_t j = 0; j < cols / 2; ++j) {
    packed[j] = static_cast<uint8_t>((codes[2 * j] & 0xF) | ((codes[2 * j + 1] & 0xF) << 4));
  }
}

int64_t FindE8M0NaN(const uint8_t* scales, size_t count) {
  const void* nan = std::memchr(scales, kE8M0NaN, count);
  return nan == nullptr ? -1 : static_cast<const uint8_t*>(nan) - scales;
}

}  // namespace moe::numerics
