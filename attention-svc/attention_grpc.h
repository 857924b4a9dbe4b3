// moe.v1.AttentionService (Forward, ForwardStream, GetModelInfo) over an AttentionCore: a thin
// gRPC adapter, as oip_service.h is for the Open Inference Protocol and oip_rest.h for its
// REST form. It holds a non-owned pointer to the core, which must outlive it.
//
//   AttentionGrpcFront front(core.get());
//   server_options.services = {&front, ...};
#ifndef MOE_ATTENTION_SVC_ATTENTION_GRPC_H_
#define MOE_ATTENTION_SVC_ATTENTION_GRPC_H_

#include <grpcpp/grpcpp.h>

#include "attention-svc/attention_core.h"
#include "moe/v1/attention.grpc.pb.h"

namespace moe::attention_svc {

class AttentionGrpcFront final : public v1::AttentionService::CallbackService {
 public:
  explicit AttentionGrpcFront(AttentionCore* core) : core_(core) {}

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const v1::ForwardRequest* req,
                                    v1::ForwardResponse* resp) override;
  // Each request of the stream on the node's workers, at most max_stream_in_flight at once; a
  // request's failure is its own answer (code and message) and the stream goes on.
  grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse>* ForwardStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx,
                                         const v1::GetModelInfoRequest* req,
                                         v1::ModelInfo* resp) override;

 private:
  AttentionCore* const core_;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_ATTENTION_GRPC_H_
