// The two cores compile without gRPC's headers (issue 39: a core apart from its gRPC adapters):
// this file includes only them, and fails to build if anything they include reaches gRPC. The
// test itself then checks the guards once more at run time, so that ctest names it.
#include <gtest/gtest.h>

#include "attention-svc/attention_core.h"
#include "expert-svc/expert_core.h"

#if defined(GRPCPP_GRPCPP_H) || defined(GRPC_GRPC_H) || defined(GRPCPP_SERVER_CONTEXT_H) || \
    defined(GRPCPP_SUPPORT_STATUS_H)
#error "a core's headers include gRPC"
#endif

namespace moe {
namespace {

TEST(Cores, CompileWithoutGrpcHeaders) {
#if defined(GRPCPP_GRPCPP_H) || defined(GRPC_GRPC_H)
  FAIL() << "gRPC reached";
#endif
  SUCCEED();
}

}  // namespace
}  // namespace moe
