// The routed experts' precision between the wire (moe.v1.Precision) and numerics::Precision.
//
//   MOE_ASSIGN_OR_RETURN(numerics::Precision p,
//                        PrecisionFromProto(req.options().precision(), options_.precision));
//   resp->set_precision(PrecisionToProto(p));
#ifndef MOE_SERVICES_TRANSPORT_PRECISION_CONVERT_H_
#define MOE_SERVICES_TRANSPORT_PRECISION_CONVERT_H_

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "moe/v1/tensor.pb.h"
#include "services/numerics/mxfp8.h"
#include "services/numerics/precision_mode.h"

namespace moe::transport {

inline v1::Precision PrecisionToProto(numerics::Precision p) {
  return p == numerics::Precision::kW4A8 ? v1::PRECISION_W4A8 : v1::PRECISION_W4A16;
}

// UNSPECIFIED is `unspecified` (the server's default); a value outside the enum is
// INVALID_ARGUMENT "unknown precision N".
inline absl::StatusOr<numerics::Precision> PrecisionFromProto(v1::Precision p,
                                                              numerics::Precision unspecified) {
  switch (p) {
    case v1::PRECISION_UNSPECIFIED:
      return unspecified;
    case v1::PRECISION_W4A16:
      return numerics::Precision::kW4A16;
    case v1::PRECISION_W4A8:
      return numerics::Precision::kW4A8;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown precision ", static_cast<int>(p)));
}

}  // namespace moe::transport

#endif  // MOE_SERVICES_TRANSPORT_PRECISION_CONVERT_H_
