#include "services/numerics/precision.h"

#include "absl/strings/str_cat.h"

namespace moe::numerics {

absl::StatusOr<Precision> ParsePrecision(std::string_view s) {
  if (s == "w4a16") return Precision::kW4A16;
  if (s == "w4a8") return Precision::kW4A8;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown precision \"", absl::string_view(s.data(), s.size()), "\"; use w4a16 or w4a8"));
}

}  // namespace moe::numerics
