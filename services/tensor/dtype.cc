#include "services/tensor/dtype.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe::tensor {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kBool, "BOOL", 1}, {DType::kU8, "U8", 1},          {DType::kI8, "I8", 1},
    {DType::kU16, "U16", 2},   {DType::kI16, "I16", 2},        {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kU32, "U32", 4},        {DType::kI32, "I32", 4},
    {DType::kF32, "F32", 4},   {DType::kU64, "U64", 8},        {DType::kI64, "I64", 8},
    {DType::kF64, "F64", 8},   {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
};

const DTypeInfo& Info(DType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info;
  }
  return kDTypes[0];  // unreachable: every enumerator is in the table
}

}  // namespace

size_t DTypeSize(DType dtype) { return Info(dtype).size; }

const char* DTypeName(DType dtype) { return Info(dtype).name; }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (name == info.name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", name, "\""));
}

}  // namespace moe::tensor
