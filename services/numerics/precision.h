// The precision modes by name (the --precision flags): "w4a16" | "w4a8", one EnumNames table
// over the names precision_mode.h spells. The modes themselves are declared there (docs/math.md
// section 6).
//
//   MOE_ASSIGN_OR_RETURN(Precision p, ParsePrecision(flag));
//   flags.Enum("precision", &o.precision, kPrecisions, "...");
#ifndef MOE_SERVICES_NUMERICS_PRECISION_H_
#define MOE_SERVICES_NUMERICS_PRECISION_H_

#include <string_view>

#include "absl/status/statusor.h"
#include "services/common/enum_names.h"
#include "services/numerics/precision_mode.h"

namespace moe::numerics {

inline constexpr EnumNames<Precision, 2> kPrecisions{
    "precision",
    {{{Precision::kW4A16, kPrecisionNames[0]}, {Precision::kW4A8, kPrecisionNames[1]}}}};

// INVALID_ARGUMENT naming the value and the two modes otherwise.
absl::StatusOr<Precision> ParsePrecision(std::string_view s);

}  // namespace moe::numerics

#endif  // MOE_SERVICES_NUMERICS_PRECISION_H_
