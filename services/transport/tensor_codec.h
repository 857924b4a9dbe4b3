// Tensors on the wire (moe.v1.Tensor: dtype + shape + raw little-endian bytes) to and from the
// project's bf16/fp32 buffers. Decoding validates dtype, rank, every dimension and the byte
// count against the shape, and says which field was wrong.
//
//   v1::Tensor t = EncodeBf16(z, rows, latent);
//   MOE_ASSIGN_OR_RETURN(Bf16Matrix m, DecodeBf16Matrix(t, "activations", latent,
//                                                       /*accept_f32=*/false));
#ifndef MOE_SERVICES_TRANSPORT_TENSOR_CODEC_H_
#define MOE_SERVICES_TRANSPORT_TENSOR_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "moe/v1/tensor.pb.h"
#include "services/tensor/bf16.h"
#include "services/tensor/mxfp8_rows.h"

namespace moe::transport {

v1::Tensor EncodeBf16(absl::Span<const tensor::Bf16> values, int64_t rows, int64_t cols);
v1::Tensor EncodeF32(absl::Span<const float> values, int64_t rows, int64_t cols);
// Moves the bytes into the message without another copy where the message allows it.
void EncodeBf16Into(absl::Span<const tensor::Bf16> values, int64_t rows, int64_t cols,
                    v1::Tensor* out);
// Writes `bytes` (a [rows, cols] tensor of dtype) to `to` when it is not null, leaving the
// message's data empty (the bytes travel beside the message, in a data plane's buffer), else
// into the message; the dtype and shape into the message either way.
void EncodeRawInto(const void* bytes, size_t n, v1::DType dtype, int64_t rows, int64_t cols,
                   uint8_t* to, v1::Tensor* out);
// Where those n bytes are to be written by the caller (so that they are produced in place, not
// copied): `to` when it is not null (the message's data left empty), else the message's own
// data, sized n; the dtype and shape into the message either way.
uint8_t* EncodeRawPlace(size_t n, v1::DType dtype, int64_t rows, int64_t cols, uint8_t* to,
                        v1::Tensor* out);

struct Bf16Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<tensor::Bf16> values;  // [rows, cols]
};

// A rank-2 tensor [rows, cols] as bf16. F32 is accepted when accept_f32 (rounded RNE). cols must
// equal expected_cols when that is >= 0 (the message names `what` and both widths); rows may be
// 0 only when allow_empty.
absl::StatusOr<Bf16Matrix> DecodeBf16Matrix(const v1::Tensor& t, const std::string& what,
                                            int64_t expected_cols, bool accept_f32,
                                            bool allow_empty = false);
// The same with the bytes held elsewhere (an out-of-band payload); t gives dtype and shape.
absl::StatusOr<Bf16Matrix> DecodeBf16Matrix(const v1::Tensor& t, std::string_view data,
                                            const std::string& what, int64_t expected_cols,
                                            bool accept_f32, bool allow_empty = false);
// DecodeBf16Matrix's checks alone (rank, width, rows, DTYPE_BF16, byte count) for bf16 bytes
// that are read where they are: the shape, values empty.
absl::StatusOr<Bf16Matrix> CheckBf16Matrix(const v1::Tensor& t, std::string_view data,
                                           const std::string& what, int64_t expected_cols,
                                           bool allow_empty = false);
// A rank-2 F32 tensor with exactly [rows, cols].
absl::StatusOr<std::vector<float>> DecodeF32Matrix(const v1::Tensor& t, const std::string& what,
                                                   int64_t rows, int64_t cols);

// DTYPE_MXFP8 [rows, cols]: the codes, then the scales (tensor.proto).
void EncodeMxfp8Into(const tensor::Mxfp8Rows& m, v1::Tensor* out);
// Only the header (dtype and shape) when the bytes travel out of band.
void SetMxfp8Header(int64_t rows, int64_t cols, v1::Tensor* out);
// A DTYPE_MXFP8 tensor [rows, expected_cols] with its bytes in `data`: shape and byte count
// checked, NaN codes and scales refused (naming row and column).
absl::StatusOr<tensor::Mxfp8Rows> DecodeMxfp8Matrix(const v1::Tensor& t, std::string_view data,
                                                    const std::string& what, int64_t expected_cols);

}  // namespace moe::transport

#endif  // MOE_SERVICES_TRANSPORT_TENSOR_CODEC_H_
