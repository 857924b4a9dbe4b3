#include "services/numerics/precision.h"

namespace moe::numerics {

absl::StatusOr<Precision> ParsePrecision(std::string_view s) {
  return kPrecisions.Parse(absl::string_view(s.data(), s.size()));
}

}  // namespace moe::numerics
