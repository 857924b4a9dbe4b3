// The precision modes by name (the --precision flags): "w4a16" | "w4a8". The modes themselves
// are declared in precision_mode.h (docs/math.md section 6).
//
//   MOE_ASSIGN_OR_RETURN(Precision p, ParsePrecision(flag));
#ifndef MOE_SERVICES_NUMERICS_PRECISION_H_
#define MOE_SERVICES_NUMERICS_PRECISION_H_

#include <string_view>

#include "absl/status/statusor.h"
#include "services/numerics/precision_mode.h"

namespace moe::numerics {

// INVALID_ARGUMENT naming the value and the two modes otherwise.
absl::StatusOr<Precision> ParsePrecision(std::string_view s);

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_PRECISION_H_
