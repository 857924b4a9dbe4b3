// The precision modes of the routed experts (docs/math.md section 6): W4A16, latent activations
// in bf16; W4A8, the expert inputs z and h quantized to MXFP8 (services/numerics/mxfp8.h; per
// token, blocks of 32 along the row) before the FC that reads them.
//
//   MOE_ASSIGN_OR_RETURN(Precision p, ParsePrecision(flag));  // "w4a16" | "w4a8"
#ifndef MOE_SERVICES_NUMERICS_PRECISION_H_
#define MOE_SERVICES_NUMERICS_PRECISION_H_

#include <string_view>

#include "absl/status/statusor.h"

namespace moe::numerics {

enum class Precision { kW4A16, kW4A8 };

const char* PrecisionName(Precision p);  // "w4a16", "w4a8"
// INVALID_ARGUMENT naming the value and the two modes otherwise.
absl::StatusOr<Precision> ParsePrecision(std::string_view s);

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_PRECISION_H_
