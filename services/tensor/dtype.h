// Element types of checkpoint tensors and wire tensors, named as safetensors names them.
//
//   auto dt = moe::tensor::ParseDType("BF16");   // StatusOr<DType>
//   size_t n = moe::tensor::DTypeSize(*dt);       // 2
#ifndef MOE_SERVICES_TENSOR_DTYPE_H_
#define MOE_SERVICES_TENSOR_DTYPE_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe::tensor {

enum class DType {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kF16,
  kBF16,
  kU32,
  kI32,
  kF32,
  kU64,
  kI64,
  kF64,
  kF8E4M3,
  kF8E5M2,
};

// Bytes per element.
size_t DTypeSize(DType dtype);
// The safetensors spelling ("BF16", "F32", "U8", ...).
const char* DTypeName(DType dtype);
// Parses the safetensors spelling; unknown names are INVALID_ARGUMENT.
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace moe::tensor

#endif  // MOE_SERVICES_TENSOR_DTYPE_H_
