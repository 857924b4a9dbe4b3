// Portable kernels (the dispatch floor) and the dispatcher. Same summation orders as the
// reference: the gemm is bit-exact; mxfp4_rows sums each row in column order.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "services/numerics/cpu/kernels.h"
#include "services/numerics/mxfp4.h"
#include "services/numerics/mxfp8.h"
#include "services/numerics/situ.h"
#include "services/tensor/bf16.h"

namespace moe::numerics::cpu {
namespace {

void GemmScalar(const float* x, int64_t tokens, int64_t in, const uint16_t* wt, int64_t o0,
                int64_t o1, float* y, int64_t ld_y) {
  for (int64_t o = o0; o < o1; o += kGemmColumnTile) {
    const uint16_t* tile = wt + (o / kGemmColumnTile) * in * kGemmColumnTile;
    for (int64_t t = 0; t < tokens; ++t) {
      float* yt = y + t * ld_y + o;
      for (int64_t c = 0; c < kGemmColumnTile; ++c) yt[c] = 0.0f;
      for (int64_t k = 0; k < in; ++k) {
        const float xk = x[t * in + k];
        const uint16_t* w = tile + k * kGemmColumnTile;
        for (int64_t c = 0; c < kGemmColumnTile; ++c) yt[c] += xk * tensor::Bf16BitsToFloat(w[c]);
      }
    }
  }
}

void Mxfp4RowsScalar(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0,
                     int64_t r1, const float* xp, int64_t ld_xp, int64_t tokens, float* out,
                     int64_t ld_out) {
  float row[kMxfp4BlockSize];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t t = 0; t < tokens; ++t) out[t * ld_out + (r - r0)] = 0.0f;
    for (int64_t g = 0; g < cols / kMxfp4BlockSize; ++g) {
      DequantizeMxfp4Row(packed + r * (cols / 2) + g * 16, scales + r * (cols / 32) + g,
                         kMxfp4BlockSize, row);
      for (int64_t t = 0; t < tokens; ++t) {
        const float* x = xp + t * ld_xp + g * kMxfp4BlockSize;
        float acc = out[t * ld_out + (r - r0)];
        for (int i = 0; i < kMxfp4BlockSize; ++i) acc += row[i] * x[i];
        out[t * ld_out + (r - r0)] = acc;
      }
    }
  }
}

void SituScalar(const float* g, const float* u, int64_t n, float beta, float linear_beta,
                float* h) {
  for (int64_t i = 0; i < n; ++i) {
    h[i] = tensor::RoundBf16(
        Situ(tensor::RoundBf16(g[i]), tensor::RoundBf16(u[i]), beta, linear_beta));
  }
}

void SituScalarF32(const float* g, const float* u, int64_t n, float beta, float linear_beta,
                   float* h) {
  for (int64_t i = 0; i < n; ++i) {
    h[i] = Situ(tensor::RoundBf16(g[i]), tensor::RoundBf16(u[i]), beta, linear_beta);
  }
}

// Scalar multiply + add (the build does not contract them into FMA) on 8 independent chains.
void RoundTripScalar(float* values, int64_t n) { RoundTripMxfp8Rows(values, 1, n); }

double FmaProbeScalar(int64_t iters) {
  float acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = 0.001f * static_cast<float>(i);
  const float a = 0.999f, b = 1e-4f;
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = acc[i] * a + b;
  }
  float sum = 0;
  for (float v : acc) sum += v;
  volatile float sink = sum;
  (void)sink;
  return 2.0 * 8 * static_cast<double>(iters);
}

}  // namespace

bool PairPanelFits(const uint8_t* scales, int64_t cols, int64_t r0, int64_t r1) {
  if (cols % kMxfp4BlockSize != 0) return false;
  const uint8_t* s = scales + r0 * (cols / kMxfp4BlockSize);
  const int64_t n = (r1 - r0) * (cols / kMxfp4BlockSize);
  uint8_t lo = 255, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    lo = s[i] < lo ? s[i] : lo;
    hi = s[i] > hi ? s[i] : hi;
  }
  return lo >= 64 && hi <= 190;
}

void StoreTokenRows(const float* acc, int64_t ld_t, int64_t rows, int64_t tokens, float* out,
                    int64_t ld_out) {
  for (int64_t t0 = 0; t0 < tokens; t0 += kTokenTile) {
    const int64_t t1 = std::min(tokens, t0 + kTokenTile);
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = acc + r * ld_t;
      for (int64_t t = t0; t < t1; ++t) out[t * ld_out + r] = src[t];
    }
  }
}

void PairPanelExact(const uint8_t* packed, const uint8_t* scales, int64_t cols, int64_t r0,
                    int64_t r1, const float* xt, int64_t ld_t, int64_t tokens, float* out,
                    int64_t ld_out) {
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = r0; r < r1; ++r) {
    DequantizeMxfp4Row(packed + r * (cols / 2), scales + r * (cols / kMxfp4BlockSize), cols,
                       row.data());
    for (int64_t t = 0; t < tokens; ++t) {
      float sum = 0.0f;
      for (int64_t c = 0; c < cols; c += 2) {  // one pair slot: columns c (low half), c + 1
        uint32_t slot;
        std::memcpy(&slot, xt + (c / 2) * ld_t + t, 4);
        sum += row[c] * tensor::Bf16BitsToFloat(static_cast<uint16_t>(slot));
        sum += row[c + 1] * tensor::Bf16BitsToFloat(static_cast<uint16_t>(slot >> 16));
      }
      out[t * ld_out + (r - r0)] = sum;
    }
  }
}

const KernelTable& ScalarKernels() {
  static const KernelTable table = {
      Isa::kScalar, "scalar", MxLayout::kFloat, 8,   GemmScalar,     Mxfp4RowsScalar,
      SituScalar,   nullptr,  MxLayout::kFloat, 128, FmaProbeScalar, RoundTripScalar,
      SituScalarF32};
  return table;
}

const KernelTable& KernelsFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Amx:
      return AmxKernels();
    case Isa::kAvx512Bf16:
      return Avx512Bf16Kernels();
    case Isa::kAvx512:
      return Avx512Kernels();
    case Isa::kAvx2:
      return Avx2Kernels();
    case Isa::kScalar:
      break;
  }
  return ScalarKernels();
}

namespace {

// Slot of column i in a float layout (kFloat with `chunk` columns per chunk, or kByteLut).
int64_t FloatSlot(MxLayout layout, int64_t chunk, int64_t i) {
  if (layout == MxLayout::kByteLut) {
    const int64_t within = i % 64, half = within / 32, r = within % 32;
    const int64_t nibble = r % 2, j = r / 2;
    const int64_t n = 4 * nibble + 2 * (j / 8) + j % 2, q = (j % 8) / 2;
    return i - within + 8 * n + 4 * half + q;
  }
  const int64_t within = i % chunk;
  return i - within + (within % 8) * (chunk / 8) + within / 8;
}

int64_t FloatChunk(MxLayout layout, int64_t chunk) {
  return layout == MxLayout::kByteLut ? 64 : chunk;
}

}  // namespace

int64_t ActivationSlots(const KernelTable& k, int64_t cols) {
  if (k.mx_layout == MxLayout::kBf16Pairs) return (cols + 127) / 128 * 64;
  const int64_t chunk = FloatChunk(k.mx_layout, k.mx_chunk);
  return (cols + chunk - 1) / chunk * chunk;
}

int64_t TokenMajorSlots(const KernelTable& k, int64_t cols) {
  if (k.tm_layout == MxLayout::kBf16PairsTm) return (cols + 31) / 32 * 16;
  const int64_t chunk = FloatChunk(k.tm_layout, k.tm_chunk);
  return (cols + chunk - 1) / chunk * chunk;
}

int64_t ActivationSlot(const KernelTable& k, int64_t i) {
  return FloatSlot(k.mx_layout, k.mx_chunk, i);
}

int64_t TokenMajorSlot(const KernelTable& k, int64_t i) {
  if (k.tm_layout == MxLayout::kBf16PairsTm) return i / 2;
  return FloatSlot(k.tm_layout, k.tm_chunk, i);
}

void StoreTokenMajor(const KernelTable& k, float* xt, int64_t ld_t, int64_t i, int64_t t, float v) {
  float* slot = xt + TokenMajorSlot(k, i) * ld_t + t;
  if (k.tm_layout != MxLayout::kBf16PairsTm) {
    *slot = v;
    return;
  }
  const uint16_t bits = static_cast<uint16_t>(tensor::FloatBits(v) >> 16);
  // Little-endian: the low half of a slot is its first two bytes.
  std::memcpy(reinterpret_cast<char*>(slot) + 2 * (i % 2), &bits, sizeof(bits));
}

void StoreActivation(const KernelTable& k, float* slots, int64_t i, float v) {
  if (k.mx_layout != MxLayout::kBf16Pairs) {
    slots[FloatSlot(k.mx_layout, k.mx_chunk, i)] = v;
    return;
  }
  const int64_t within = i % 128, m = within % 8;
  const int64_t slot = (i / 128) * 64 + (m % 4) * 16 + within / 8;
  const uint16_t bits = static_cast<uint16_t>(tensor::FloatBits(v) >> 16);
  // Little-endian: the low half of a slot is its first two bytes.
  std::memcpy(reinterpret_cast<char*>(slots + slot) + 2 * (m / 4), &bits, sizeof(bits));
}

void PrepareActivations(const KernelTable& k, const float* x, int64_t tokens, int64_t cols,
                        float* slots) {
  const int64_t n = ActivationSlots(k, cols);
  for (int64_t t = 0; t < tokens; ++t) {
    float* dst = slots + t * n;
    std::memset(dst, 0, sizeof(float) * n);
    for (int64_t i = 0; i < cols; ++i) StoreActivation(k, dst, i, x[t * cols + i]);
  }
}

}  // namespace moe::numerics::cpu
