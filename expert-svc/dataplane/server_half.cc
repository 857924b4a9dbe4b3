#include "expert-svc/dataplane/server_half.h"

#include "absl/strings/str_cat.h"
#include "expert-svc/batch_endpoint.h"

namespace moe::expert_svc {

std::unique_ptr<BatchEndpoint> ServerHalf::StreamEndpoint(const EndpointContext&) {
  return nullptr;
}

absl::Status ServerHalf::ReplyBatchFrom(const BatchSource&, std::string_view,
                                        std::unique_ptr<ReplyBuffer>, absl::Time) {
  return absl::InternalError(
      absl::StrCat("the ", name(), " data plane has no reply buffers of its own"));
}

}  // namespace moe::expert_svc
