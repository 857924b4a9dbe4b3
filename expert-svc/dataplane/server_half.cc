#include "expert-svc/dataplane/server_half.h"

#include "expert-svc/batch_endpoint.h"

namespace moe::expert_svc {

std::unique_ptr<BatchEndpoint> ServerHalf::StreamEndpoint(const EndpointContext&) {
  return nullptr;
}

}  // namespace moe::expert_svc
