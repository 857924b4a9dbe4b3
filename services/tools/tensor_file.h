// Reads a [T, H] activation matrix from a .npy file (float32 '<f4', or bf16 bit patterns stored
// as '<u2') or from a .safetensors file (a BF16 or F32 tensor, by name or the only one), and
// writes float32 .npy files. For `moe-cli forward` and `moe-tool forward --input`.
//
//   MOE_ASSIGN_OR_RETURN(Matrix x, ReadMatrix("x.npy", ""));
//   MOE_RETURN_IF_ERROR(WriteNpyF32("y.npy", y, rows, cols));
#ifndef MOE_SERVICES_TOOLS_TENSOR_FILE_H_
#define MOE_SERVICES_TOOLS_TENSOR_FILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/tensor/bf16.h"

namespace moe::tools {

struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<tensor::Bf16> values;  // bf16 (fp32 input rounded RNE)
};

absl::StatusOr<Matrix> ReadMatrix(const std::string& path, const std::string& tensor_name);
// Parses .npy bytes (exposed for tests).
absl::StatusOr<Matrix> ParseNpy(absl::string_view bytes, const std::string& label);
absl::Status WriteNpyF32(const std::string& path, const std::vector<float>& values, int64_t rows,
                         int64_t cols);

}  // namespace moe::tools

#endif  // MOE_SERVICES_TOOLS_TENSOR_FILE_H_
