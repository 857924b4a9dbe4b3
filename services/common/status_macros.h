// Small Status helpers: Debian's Abseil (20220623) ships no ABSL_RETURN_IF_ERROR.
//
//   MOE_RETURN_IF_ERROR(Validate(cfg));
//   MOE_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
#ifndef MOE_SERVICES_COMMON_STATUS_MACROS_H_
#define MOE_SERVICES_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MOE_RETURN_IF_ERROR(expr)              \
  do {                                         \
    const ::absl::Status moe_status_ = (expr); \
    if (!moe_status_.ok()) return moe_status_; \
  } while (0)

#define MOE_STATUS_CONCAT_INNER_(a, b) a##b
#define MOE_STATUS_CONCAT_(a, b) MOE_STATUS_CONCAT_INNER_(a, b)

#define MOE_ASSIGN_OR_RETURN(lhs, expr) \
  MOE_ASSIGN_OR_RETURN_IMPL_(MOE_STATUS_CONCAT_(moe_statusor_, __LINE__), lhs, expr)

#define MOE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(*tmp)

#endif  // MOE_SERVICES_COMMON_STATUS_MACROS_H_
