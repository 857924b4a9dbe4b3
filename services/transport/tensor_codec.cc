#include "services/transport/tensor_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace moe::transport {

using tensor::Bf16;

namespace {

static_assert(sizeof(Bf16) == 2 && sizeof(float) == 4, "wire sizes");
// The wire is little-endian; so is every machine this builds for (x86-64, aarch64 Linux).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "little-endian host expected");

// The dtype's name, or its number for a value outside the enum (whose name is empty).
std::string DTypeLabel(v1::DType dtype) {
  const std::string& name = v1::DType_Name(dtype);
  return name.empty() ? absl::StrCat(static_cast<int>(dtype), " (not a dtype of the contract)")
                      : name;
}

void SetShape(v1::Tensor* t, v1::DType dtype, int64_t rows, int64_t cols) {
  t->set_dtype(dtype);
  t->clear_shape();
  t->add_shape(rows);
  t->add_shape(cols);
}

absl::Status CheckRank2(const v1::Tensor& t, const std::string& what) {
  if (t.shape_size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected a rank-2 tensor [rows, cols], got rank ", t.shape_size()));
  }
  if (t.shape(0) < 0 || t.shape(1) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": negative dimension [", t.shape(0), ", ", t.shape(1), "]"));
  }
  // Keep rows * cols * 4 far from overflow; no real tensor comes near 2^40 elements.
  if (t.shape(0) > (int64_t{1} << 40) || t.shape(1) > (int64_t{1} << 40) ||
      (t.shape(1) > 0 && t.shape(0) > (int64_t{1} << 40) / t.shape(1))) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shape [", t.shape(0), ", ", t.shape(1), "] is too large"));
  }
  return absl::OkStatus();
}

}  // namespace

uint8_t* EncodeRawPlace(size_t n, v1::DType dtype, int64_t rows, int64_t cols, uint8_t* to,
                        v1::Tensor* out) {
  SetShape(out, dtype, rows, cols);
  if (to != nullptr) {
    out->clear_data();
    return to;
  }
  out->mutable_data()->resize(n);
  return reinterpret_cast<uint8_t*>(out->mutable_data()->data());
}

void EncodeRawInto(const void* bytes, size_t n, v1::DType dtype, int64_t rows, int64_t cols,
                   uint8_t* to, v1::Tensor* out) {
  uint8_t* place = EncodeRawPlace(n, dtype, rows, cols, to, out);
  if (n > 0) std::memcpy(place, bytes, n);
}

void EncodeBf16Into(absl::Span<const Bf16> values, int64_t rows, int64_t cols, v1::Tensor* out) {
  EncodeRawInto(values.data(), values.size() * sizeof(Bf16), v1::DTYPE_BF16, rows, cols, nullptr,
                out);
}

v1::Tensor EncodeBf16(absl::Span<const Bf16> values, int64_t rows, int64_t cols) {
  v1::Tensor t;
  EncodeBf16Into(values, rows, cols, &t);
  return t;
}

v1::Tensor EncodeF32(absl::Span<const float> values, int64_t rows, int64_t cols) {
  v1::Tensor t;
  SetShape(&t, v1::DTYPE_F32, rows, cols);
  t.set_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return t;
}

absl::StatusOr<Bf16Matrix> DecodeBf16Matrix(const v1::Tensor& t, const std::string& what,
                                            int64_t expected_cols, bool accept_f32,
                                            bool allow_empty) {
  return DecodeBf16Matrix(t, t.data(), what, expected_cols, accept_f32, allow_empty);
}

namespace {

// DecodeBf16Matrix's checks: rank, width, rows, dtype and byte count; the shape, and in *elem
// the bytes per value of the data (2: bf16, 4: f32).
absl::StatusOr<Bf16Matrix> CheckMatrix(const v1::Tensor& t, std::string_view data,
                                       const std::string& what, int64_t expected_cols,
                                       bool accept_f32, bool allow_empty, size_t* elem) {
  if (absl::Status s = CheckRank2(t, what); !s.ok()) return s;
  Bf16Matrix m;
  m.rows = t.shape(0);
  m.cols = t.shape(1);
  if (expected_cols >= 0 && m.cols != expected_cols) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": width ", m.cols, " but this layer needs ", expected_cols));
  }
  if (m.rows == 0 && !allow_empty) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": no rows (T = 0)"));
  }
  const size_t n = static_cast<size_t>(m.rows * m.cols);
  if (t.dtype() == v1::DTYPE_BF16) {
    *elem = 2;
  } else if (t.dtype() == v1::DTYPE_F32 && accept_f32) {
    *elem = 4;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(what, ": dtype ", DTypeLabel(t.dtype()),
                                                   " not accepted (expected DTYPE_BF16",
                                                   accept_f32 ? " or DTYPE_F32)" : ")"));
  }
  if (data.size() != n * *elem) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", data.size(),
                                                   " bytes of data but shape [", m.rows, ", ",
                                                   m.cols, "] needs ", n * *elem));
  }
  return m;
}

}  // namespace

absl::StatusOr<Bf16Matrix> CheckBf16Matrix(const v1::Tensor& t, std::string_view data,
                                           const std::string& what, int64_t expected_cols,
                                           bool allow_empty) {
  size_t elem = 0;
  return CheckMatrix(t, data, what, expected_cols, /*accept_f32=*/false, allow_empty, &elem);
}

absl::StatusOr<Bf16Matrix> DecodeBf16Matrix(const v1::Tensor& t, std::string_view data,
                                            const std::string& what, int64_t expected_cols,
                                            bool accept_f32, bool allow_empty) {
  size_t elem = 0;
  MOE_ASSIGN_OR_RETURN(Bf16Matrix m,
                       CheckMatrix(t, data, what, expected_cols, accept_f32, allow_empty, &elem));
  const size_t n = static_cast<size_t>(m.rows * m.cols);
  m.values.resize(n);
  if (elem == 2) {
    std::memcpy(m.values.data(), data.data(), n * 2);
  } else {
    const char* p = data.data();
    for (size_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      m.values[i] = Bf16::FromFloat(f);
    }
  }
  return m;
}

absl::StatusOr<std::vector<float>> DecodeF32Matrix(const v1::Tensor& t, const std::string& what,
                                                   int64_t rows, int64_t cols) {
  if (absl::Status s = CheckRank2(t, what); !s.ok()) return s;
  if (t.dtype() != v1::DTYPE_F32 || t.shape(0) != rows || t.shape(1) != cols) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected DTYPE_F32 [", rows, ", ", cols,
                                                   "], got ", DTypeLabel(t.dtype()), " [",
                                                   t.shape(0), ", ", t.shape(1), "]"));
  }
  const size_t n = static_cast<size_t>(rows * cols);
  if (t.data().size() != n * 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", t.data().size(), " bytes of data, shape needs ", n * 4));
  }
  std::vector<float> v(n);
  std::memcpy(v.data(), t.data().data(), n * 4);
  return v;
}

void SetMxfp8Header(int64_t rows, int64_t cols, v1::Tensor* out) {
  SetShape(out, v1::DTYPE_MXFP8, rows, cols);
}

void EncodeMxfp8Into(const tensor::Mxfp8Rows& m, v1::Tensor* out) {
  SetShape(out, v1::DTYPE_MXFP8, m.rows, m.cols);
  std::string* data = out->mutable_data();
  data->resize(m.codes.size() + m.scales.size());
  std::memcpy(data->data(), m.codes.data(), m.codes.size());
  std::memcpy(data->data() + m.codes.size(), m.scales.data(), m.scales.size());
}

absl::StatusOr<tensor::Mxfp8Rows> DecodeMxfp8Matrix(const v1::Tensor& t, std::string_view data,
                                                    const std::string& what,
                                                    int64_t expected_cols) {
  if (absl::Status s = CheckRank2(t, what); !s.ok()) return s;
  if (t.dtype() != v1::DTYPE_MXFP8) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": dtype ", DTypeLabel(t.dtype()),
                                                   " not accepted (expected DTYPE_MXFP8)"));
  }
  tensor::Mxfp8Rows m;
  m.rows = t.shape(0);
  m.cols = t.shape(1);
  if (m.cols != expected_cols || m.cols % 32 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": width ", m.cols, " but this layer needs ", expected_cols, " (a multiple of 32)"));
  }
  if (m.rows == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": no rows (T = 0)"));
  const size_t codes = static_cast<size_t>(m.rows * m.cols), scales = codes / 32;
  if (data.size() != codes + scales) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", data.size(),
                                                   " bytes of data but MXFP8 [", m.rows, ", ",
                                                   m.cols, "] needs ", codes + scales));
  }
  m.codes.assign(data.begin(), data.begin() + static_cast<std::ptrdiff_t>(codes));
  m.scales.assign(data.begin() + static_cast<std::ptrdiff_t>(codes), data.end());
  // NaN policy, as for bf16: non-finite activations are refused. E4M3 NaN is S.1111.111; the
  // E8M0 NaN is 0xFF.
  uint8_t any_nan = 0;
  for (uint8_t c : m.codes) any_nan |= static_cast<uint8_t>((c & 0x7F) == 0x7F);
  for (uint8_t s : m.scales) any_nan |= static_cast<uint8_t>(s == 0xFF);
  for (size_t i = 0; any_nan != 0 && i < codes; ++i) {
    if ((m.codes[i] & 0x7F) == 0x7F || m.scales[i / 32] == 0xFF) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": row ", i / static_cast<size_t>(m.cols), " column ",
                       i % static_cast<size_t>(m.cols), " is not finite (",
                       m.scales[i / 32] == 0xFF ? "NaN scale" : "NaN code", ")"));
    }
  }
  return m;
}

}  // namespace moe::transport
