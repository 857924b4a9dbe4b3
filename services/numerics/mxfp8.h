// MXFP8 (OCP Microscaling v1.0): E4M3 elements with one E8M0 scale per 32 values, the format of
// W4A8's latent activations (docs/math.md section 6). This header is the one declaration of the
// format, next to MXFP4 (mxfp4.h; the scale byte and its NaN are the same).
//
// E4M3 ("fn": no infinities): bit 7 sign, bits 6..3 exponent (bias 7), bits 2..0 mantissa.
// Exponent 0 is subnormal (m/8 x 2^-6); S.1111.111 (0x7F, 0xFF) is NaN; the largest finite
// magnitude is S.1111.110 = 448.
//
//   uint8_t codes[32], scale;
//   QuantizeMxfp8Block(values, codes, &scale);     // scale = 2^ceil(log2(amax / 448))
//   DequantizeMxfp8Block(codes, scale, restored);  // e4m3(code) * 2^(scale - 127), exact
#ifndef MOE_SERVICES_NUMERICS_MXFP8_H_
#define MOE_SERVICES_NUMERICS_MXFP8_H_

#include <cstdint>
#include <vector>

#include "services/numerics/mxfp4.h"  // the E8M0 scale (kE8M0Bias, kE8M0NaN, E8M0ToFloat)
#include "services/tensor/bf16.h"
#include "services/tensor/mxfp8_rows.h"

namespace moe::numerics {

inline constexpr int kMxfp8BlockSize = 32;
inline constexpr float kE4M3Max = 448.0f;
inline constexpr uint8_t kE4M3NaN = 0x7F;  // and 0xFF
static_assert(kMxfp8BlockSize == kMxfp4BlockSize, "one scale per 32 values in both formats");

// The value of an E4M3 code (NaN for 0x7F and 0xFF). Exact in fp32.
float E4M3ToFloat(uint8_t code);
// The 256 values of E4M3ToFloat, by code (for decoders).
const float* E4M3Table();

// The E4M3 code nearest to v, ties to the even code (mantissa bit 0 clear), magnitudes above
// 448 saturating to +-448; NaN gives 0x7F with v's sign bit. -0 keeps its sign (0x80).
uint8_t FloatToE4M3(float v);

// One block of 32 finite floats: the E8M0 scale 2^e with e the smallest integer for which
// amax <= 448 * 2^e (i.e. ceil(log2(amax / 448))), clamped to [-127, 127]; an all-zero block
// gets 2^-127 and codes 0 (a -0 keeps its sign); each element FloatToE4M3(v / 2^e).
void QuantizeMxfp8Block(const float* values, uint8_t* codes, uint8_t* scale);

// e4m3(code) * 2^(scale - 127) for the 32 values of a block.
void DequantizeMxfp8Block(const uint8_t* codes, uint8_t scale, float* out);

// Rows of MXFP8 values (services/tensor/mxfp8_rows.h), the wire form of W4A8 activations.
using tensor::Mxfp8Rows;

// x [rows, cols] bf16 (cols a multiple of 32, values finite) quantized row by row.
Mxfp8Rows QuantizeMxfp8Rows(const tensor::Bf16* x, int64_t rows, int64_t cols);
// Row `row` of q as fp32 [q.cols] (exact).
void DequantizeMxfp8Row(const Mxfp8Rows& q, int64_t row, float* out);

// values [rows, cols] (cols a multiple of 32), each row's blocks quantized to MXFP8 and back,
// in place: what a W4A8 FC reads.
void RoundTripMxfp8Rows(float* values, int64_t rows, int64_t cols);

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_MXFP8_H_
