// MXFP4 (OCP Microscaling v1.0, E2M1 elements with one E8M0 scale per 32) as the K3 checkpoint
// stores it: docs/math.md section 3. This header is the one declaration of the format; the C++ and
// the CUDA kernels share it (no Abseil here: the standalone GPU check compiles it with nvcc's
// host compiler only).
//
// Layout of a [rows, cols] matrix, blocks along cols (the reduction axis):
//   packed[r, j] (rows x cols/2 bytes): low nibble = column 2j, high nibble = column 2j+1
//   scales[r, g] (rows x cols/32 bytes): E8M0, value 2^(s - 127); 0xFF is NaN and rejected
//   nibble: bit 3 sign, bits 2..1 exponent, bit 0 mantissa; codes 0..7 = {0,.5,1,1.5,2,3,4,6}
//
//   std::vector<uint8_t> packed(cols / 2), scales(cols / 32);
//   QuantizeMxfp4Row(values, cols, packed.data(), scales.data());
//   DequantizeMxfp4Row(packed.data(), scales.data(), cols, restored);
#ifndef MOE_SERVICES_NUMERICS_MXFP4_H_
#define MOE_SERVICES_NUMERICS_MXFP4_H_

#include <cstddef>
#include <cstdint>

namespace moe::numerics {

inline constexpr int kMxfp4BlockSize = 32;
inline constexpr uint8_t kE8M0NaN = 0xFF;
inline constexpr int kE8M0Bias = 127;
// floor(log2(6)) = 2: the largest E2M1 exponent, subtracted from the block's amax exponent.
inline constexpr int kE2M1MaxExponent = 2;
inline constexpr float kE2M1Max = 6.0f;

// Value of each 4-bit E2M1 code.
inline constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Bytes of a packed row and of its scales.
constexpr int64_t Mxfp4PackedBytes(int64_t cols) { return cols / 2; }
constexpr int64_t Mxfp4ScaleBytes(int64_t cols) { return cols / kMxfp4BlockSize; }
static_assert(kMxfp4BlockSize % 2 == 0, "a block must hold whole bytes");
static_assert(Mxfp4PackedBytes(kMxfp4BlockSize) == 16, "one block packs into 16 bytes");

// 2^(s - 127) for s in [0, 254]; 0xFF (NaN) returns NaN. Exact in fp32 (2^-127 is subnormal).
float E8M0ToFloat(uint8_t s);

// The E2M1 code nearest to v (|v| already divided by the block scale), ties to even code,
// saturating at +-6. v must not be NaN.
uint8_t FloatToE2M1(float v);

// A packed matrix, borrowed: the bytes are owned elsewhere (a mapped checkpoint, a buffer).
struct Mxfp4Matrix {
  int64_t rows = 0;
  int64_t cols = 0;                 // logical columns; a multiple of 32
  const uint8_t* packed = nullptr;  // [rows, cols / 2]
  const uint8_t* scales = nullptr;  // [rows, cols / 32]
};

// Quantizes cols (a multiple of 32) finite floats with the OCP rule: shared exponent
// floor(log2(amax)) - 2 per block (an all-zero block gets scale 2^-127), each element rounded to
// the nearest E2M1 value (ties to even), saturated at +-6.
void QuantizeMxfp4Row(const float* values, int64_t cols, uint8_t* packed, uint8_t* scales);

// Dequantizes one row into fp32: e2m1(code) * 2^(s - 127), exact.
void DequantizeMxfp4Row(const uint8_t* packed, const uint8_t* scales, int64_t cols, float* out);

// Unpacks nibbles into one code per column (for tests and tools).
void UnpackMxfp4Row(const uint8_t* packed, int64_t cols, uint8_t* codes);
void PackMxfp4Row(const uint8_t* codes, int64_t cols, uint8_t* packed);

// The index of the first E8M0 NaN (0xFF) scale, or -1 when there is none (loaders reject such
// weights).
int64_t FindE8M0NaN(const uint8_t* scales, size_t count);

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_MXFP4_H_
