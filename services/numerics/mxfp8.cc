#include "services/numerics/mxfp8.h"

#include <algorithm>
#include <cmath>

namespace moe::numerics {

namespace {

using tensor::BitsToFloat;
using tensor::FloatBits;

// 2^k as a float for k in [-149, 127] (subnormal below -126): multiplying by it rounds exactly
// as ldexp does, without the call.
float Pow2(int k) {
  return k >= -126 ? BitsToFloat(static_cast<uint32_t>(k + 127) << 23)
                   : BitsToFloat(uint32_t{1} << (k + 149));
}

struct E4M3Values {
  float v[256];
};

E4M3Values MakeE4M3Values() {
  E4M3Values t{};
  for (int c = 0; c < 256; ++c) {
    const float sign = (c & 0x80) != 0 ? -1.0f : 1.0f;
    const int e = (c >> 3) & 0xF, m = c & 0x7;
    if (e == 0xF && m == 0x7) {
      t.v[c] = std::copysign(std::nanf(""), sign);
    } else if (e == 0) {
      t.v[c] = sign * std::ldexp(static_cast<float>(m), -9);  // m/8 x 2^-6
    } else {
      t.v[c] = sign * std::ldexp(static_cast<float>(8 + m), e - 10);  // (1 + m/8) x 2^(e-7)
    }
  }
  return t;
}

const E4M3Values& Values() {
  static const E4M3Values t = MakeE4M3Values();
  return t;
}

// The block exponent e of QuantizeMxfp8Block (amax > 0).
int BlockExponent(float amax) {
  int e = std::clamp(std::ilogb(amax) - 8, -kE8M0Bias, kE8M0Bias);  // 448 = 1.75 x 2^8
  while (e < kE8M0Bias && amax > kE4M3Max * Pow2(e)) ++e;
  while (e > -kE8M0Bias && amax <= kE4M3Max * Pow2(e - 1)) --e;
  return e;
}

}  // namespace

const float* E4M3Table() { return Values().v; }

float E4M3ToFloat(uint8_t code) { return Values().v[code]; }

uint8_t FloatToE4M3(float v) {
  uint32_t u = FloatBits(v);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80);
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return static_cast<uint8_t>(sign | kE4M3NaN);
  if (u >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7E);  // >= 448 (and Inf)
  if (u < 0x3C800000u) {
    // Below 2^-6 the codes are the multiples of 2^-9 (the subnormals, then 2^-6 itself as code
    // 8): a * 2^9 < 8 is exact, and adding and removing 2^23 rounds it half to even.
    const float q = (BitsToFloat(u) * 512.0f + 8388608.0f) - 8388608.0f;
    return static_cast<uint8_t>(sign | static_cast<int>(q));
  }
  // A normal: the fp32 mantissa rounded to 3 bits, half to even (a carry into the exponent is
  // the next binade's code); the result is at most 448, so no saturation is needed here.
  u += 0x7FFFFu + ((u >> 20) & 1u);
  const uint32_t e = (u >> 23) - 120, m = (u >> 20) & 7u;  // E4M3 bias 7 vs fp32 127
  return static_cast<uint8_t>(sign | (e << 3) | m);
}

void QuantizeMxfp8Block(const float* values, uint8_t* codes, uint8_t* scale) {
  float amax = 0.0f;
  for (int i = 0; i < kMxfp8BlockSize; ++i) amax = std::fmax(amax, std::fabs(values[i]));
  // All-zero block: the smallest scale, every code 0 (a -0 keeps its sign).
  const int e = amax > 0.0f ? BlockExponent(amax) : -kE8M0Bias;
  *scale = static_cast<uint8_t>(e + kE8M0Bias);
  const float inv = Pow2(-e);
  for (int i = 0; i < kMxfp8BlockSize; ++i) codes[i] = FloatToE4M3(values[i] * inv);
}

void DequantizeMxfp8Block(const uint8_t* codes, uint8_t scale, float* out) {
  const float s = Pow2(static_cast<int>(scale) - kE8M0Bias);
  const float* table = E4M3Table();
  for (int i = 0; i < kMxfp8BlockSize; ++i) out[i] = table[codes[i]] * s;
}

void RoundTripMxfp8Rows(float* values, int64_t rows, int64_t cols) {
  uint8_t codes[kMxfp8BlockSize], scale;
  for (int64_t b = 0; b < rows * cols; b += kMxfp8BlockSize) {
    QuantizeMxfp8Block(values + b, codes, &scale);
    DequantizeMxfp8Block(codes, scale, values + b);
  }
}

Mxfp8Rows QuantizeMxfp8Rows(const tensor::Bf16* x, int64_t rows, int64_t cols) {
  Mxfp8Rows q;
  q.rows = rows;
  q.cols = cols;
  q.codes.resize(static_cast<size_t>(rows * cols));
  q.scales.resize(static_cast<size_t>(rows * cols / kMxfp8BlockSize));
  float block[kMxfp8BlockSize];
  for (int64_t b = 0; b < rows * cols / kMxfp8BlockSize; ++b) {
    for (int i = 0; i < kMxfp8BlockSize; ++i) block[i] = x[b * kMxfp8BlockSize + i].ToFloat();
    QuantizeMxfp8Block(block, q.codes.data() + b * kMxfp8BlockSize, &q.scales[b]);
  }
  return q;
}

void DequantizeMxfp8Row(const Mxfp8Rows& q, int64_t row, float* out) {
  const int64_t blocks = q.cols / kMxfp8BlockSize;
  for (int64_t b = 0; b < blocks; ++b) {
    DequantizeMxfp8Block(q.codes.data() + row * q.cols + b * kMxfp8BlockSize,
                         q.scales[row * blocks + b], out + b * kMxfp8BlockSize);
  }
}

}  // namespace moe::numerics
