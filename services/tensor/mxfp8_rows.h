// Rows of MXFP8 values as plain bytes: the container of W4A8's latent activations on the wire
// (proto/moe/v1/tensor.proto DTYPE_MXFP8) and in the kernels. The format itself (E4M3 codes,
// E8M0 scales, encode and decode) is declared once, in services/numerics/mxfp8.h.
#ifndef MOE_SERVICES_TENSOR_MXFP8_ROWS_H_
#define MOE_SERVICES_TENSOR_MXFP8_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <vector>

namespace moe::tensor {

// codes [rows, cols] E4M3 and scales [rows, cols / 32] E8M0: block b of row r covers columns
// [32 b, 32 b + 32) of that row. cols is a multiple of 32.
struct Mxfp8Rows {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;
  // Wire bytes: the codes, then the scales.
  int64_t bytes() const { return static_cast<int64_t>(codes.size() + scales.size()); }
  // Rows src[0..n) of this (each in [0, rows); the caller checks), in that order.
  Mxfp8Rows Gather(const int32_t* src, int64_t n) const {
    Mxfp8Rows out;
    out.rows = n;
    out.cols = cols;
    const int64_t blocks = cols / 32;
    out.codes.resize(static_cast<size_t>(n * cols));
    out.scales.resize(static_cast<size_t>(n * blocks));
    for (int64_t r = 0; r < n; ++r) {
      std::copy_n(codes.data() + src[r] * cols, cols, out.codes.data() + r * cols);
      std::copy_n(scales.data() + src[r] * blocks, blocks, out.scales.data() + r * blocks);
    }
    return out;
  }
};

}  // namespace moe::tensor

#endif  // MOE_SERVICES_TENSOR_MXFP8_ROWS_H_
