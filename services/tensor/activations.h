// Latent activation rows with their format: the value type a dispatch message, an expert batch
// and an expert backend pass around instead of parallel bf16 / MXFP8 fields. The format travels
// with the data (bf16 rows for W4A16; MXFP8 rows, tensor/mxfp8_rows.h, for W4A8); a new format
// is a new ActivationFormat and a case in the few switches over it.
//
//   Activations z = Activations::FromBf16(std::move(values), rows, latent);
//   Activations v = Activations::ViewBf16(received, rows, latent, buffer);  // read in place
//   if (z.format() == ActivationFormat::kMxfp8) use(z.mxfp8());
//   z.CopyTo(wire_buffer);  // z.bytes() bytes: bf16 row-major, or MXFP8 codes then scales
#ifndef MOE_SERVICES_TENSOR_ACTIVATIONS_H_
#define MOE_SERVICES_TENSOR_ACTIVATIONS_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "services/tensor/bf16.h"
#include "services/tensor/mxfp8_rows.h"

namespace moe::tensor {

enum class ActivationFormat { kBf16, kMxfp8 };

// "bf16", "mxfp8": the dtype label of the wire metrics.
inline const char* ActivationFormatName(ActivationFormat f) {
  return f == ActivationFormat::kMxfp8 ? "mxfp8" : "bf16";
}

class Activations {
 public:
  Activations() = default;  // no rows, bf16

  // values: [rows, cols] bf16.
  static Activations FromBf16(std::vector<Bf16> values, int64_t rows, int64_t cols) {
    Activations a;
    a.format_ = ActivationFormat::kBf16;
    a.rows_ = rows;
    a.cols_ = cols;
    a.bf16_ = std::move(values);
    return a;
  }
  // Bf16 rows [rows, cols] at `data`, read where they are (a data plane's receive buffer): no
  // copy. `owner` keeps them alive as long as this value or a copy of it.
  static Activations ViewBf16(const Bf16* data, int64_t rows, int64_t cols,
                              std::shared_ptr<const void> owner) {
    Activations a;
    a.format_ = ActivationFormat::kBf16;
    a.rows_ = rows;
    a.cols_ = cols;
    a.view_ = data;
    a.owner_ = std::move(owner);
    return a;
  }
  static Activations FromMxfp8(Mxfp8Rows q) {
    Activations a;
    a.format_ = ActivationFormat::kMxfp8;
    a.rows_ = q.rows;
    a.cols_ = q.cols;
    a.mxfp8_ = std::move(q);
    return a;
  }

  ActivationFormat format() const { return format_; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  bool empty() const { return rows_ == 0; }
  // The rows in their format (the other accessor is empty).
  absl::Span<const Bf16> bf16() const {
    return view_ != nullptr ? absl::Span<const Bf16>(view_, static_cast<size_t>(rows_ * cols_))
                            : absl::Span<const Bf16>(bf16_);
  }
  // Whether the bf16 rows are a view of another buffer (ViewBf16).
  bool viewed() const { return view_ != nullptr; }
  const Mxfp8Rows& mxfp8() const { return mxfp8_; }

  // The wire payload's size, and the payload itself into dst.
  int64_t bytes() const {
    return format_ == ActivationFormat::kMxfp8 ? mxfp8_.bytes()
                                               : static_cast<int64_t>(bf16().size() * sizeof(Bf16));
  }
  void CopyTo(uint8_t* dst) const {
    if (format_ == ActivationFormat::kMxfp8) {
      std::memcpy(dst, mxfp8_.codes.data(), mxfp8_.codes.size());
      std::memcpy(dst + mxfp8_.codes.size(), mxfp8_.scales.data(), mxfp8_.scales.size());
    } else {
      std::memcpy(dst, bf16().data(), bf16().size() * sizeof(Bf16));
    }
  }

  // Rows src[0..n) (each in [0, rows); the caller checks), in that order, in this format.
  Activations Gather(const int32_t* src, int64_t n) const {
    if (format_ == ActivationFormat::kMxfp8) return FromMxfp8(mxfp8_.Gather(src, n));
    std::vector<Bf16> out(static_cast<size_t>(n * cols_));
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(out.data() + r * cols_, bf16().data() + src[r] * cols_, cols_ * sizeof(Bf16));
    }
    return FromBf16(std::move(out), n, cols_);
  }

 private:
  ActivationFormat format_ = ActivationFormat::kBf16;
  int64_t rows_ = 0, cols_ = 0;
  std::vector<Bf16> bf16_;
  const Bf16* view_ = nullptr;  // ViewBf16: the rows, kept alive by owner_
  std::shared_ptr<const void> owner_;
  Mxfp8Rows mxfp8_;
};

}  // namespace moe::tensor

#endif  // MOE_SERVICES_TENSOR_ACTIVATIONS_H_
