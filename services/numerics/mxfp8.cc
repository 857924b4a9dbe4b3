#include "services/numerics/mxfp8.h"

#include <cmath>

namespace moe::numerics {

float E4M3ToFloat(uint8_t code) {
  const float sign = (code & 0x80) != 0 ? -1.0f : 1.0f;
  const int e = (code >> 3) & 0xF;
  const int m = code & 0x7;
  if (e == 0xF && m == 0x7) return std::nanf("");
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);  // m/8 x 2^-6
  return sign * std::ldexp(static_cast<float>(8 + m), e - 10);      // (1 + m/8) x 2^(e-7)
}

uint8_t FloatToE4M3(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  if (std::isnan(v)) return static_cast<uint8_t>(sign | kE4M3NaN);
  const float a = std::fabs(v);
  if (a >= kE4M3Max) return static_cast<uint8_t>(sign | 0x7E);
  // The spacing of the codes around a: 2^-9 in the subnormal range and the first binade
  // (a < 2^-5 shares the subnormals' step), 2^(floor(log2 a) - 3) above.
  const int exp = a < std::ldexp(1.0f, -6) ? -6 : std::ilogb(a);
  const float step = std::ldexp(1.0f, exp - 3);
  // a / step is exact (a power of two); rint rounds half to even, and even multiples of the
  // step are the codes with mantissa bit 0 clear.
  const float q = std::rint(a / step);
  const float r = q * step;  // the nearest representable magnitude, <= 448
  if (r == 0.0f) return sign;
  const int re = r < std::ldexp(1.0f, -6) ? 0 : std::ilogb(r) + 7;  // biased exponent
  const int m =
      re == 0 ? static_cast<int>(std::ldexp(r, 9)) : static_cast<int>(std::ldexp(r, 10 - re)) - 8;
  return static_cast<uint8_t>(sign | (re << 3) | m);
}

void QuantizeMxfp8Block(const float* values, uint8_t* codes, uint8_t* scale) {
  float amax = 0.0f;
  for (int i = 0; i < kMxfp8BlockSize; ++i) amax = std::fmax(amax, std::fabs(values[i]));
  int e = -kE8M0Bias;  // all-zero block: the smallest scale, every code 0
  if (amax > 0.0f) {
    // The smallest e with amax <= 448 * 2^e, found exactly with ldexp (no log2 rounding).
    e = std::ilogb(amax) - 8;  // 448 = 1.75 x 2^8
    while (amax > std::ldexp(kE4M3Max, e)) ++e;
    while (amax <= std::ldexp(kE4M3Max, e - 1)) --e;
    if (e < -kE8M0Bias) e = -kE8M0Bias;
    if (e > kE8M0Bias) e = kE8M0Bias;
  }
  *scale = static_cast<uint8_t>(e + kE8M0Bias);
  for (int i = 0; i < kMxfp8BlockSize; ++i) codes[i] = FloatToE4M3(std::ldexp(values[i], -e));
}

void DequantizeMxfp8Block(const uint8_t* codes, uint8_t scale, float* out) {
  const int e = static_cast<int>(scale) - kE8M0Bias;
  for (int i = 0; i < kMxfp8BlockSize; ++i) out[i] = std::ldexp(E4M3ToFloat(codes[i]), e);
}

void RoundTripMxfp8Rows(float* values, int64_t rows, int64_t cols) {
  uint8_t codes[kMxfp8BlockSize], scale;
  for (int64_t b = 0; b < rows * cols; b += kMxfp8BlockSize) {
    QuantizeMxfp8Block(values + b, codes, &scale);
    DequantizeMxfp8Block(codes, scale, values + b);
  }
}

}  // namespace moe::numerics
