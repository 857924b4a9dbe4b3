// ExpertChannel over in-band gRPC: each message becomes one ExpertService.Dispatch batch on the
// shard's long-lived stream (transport::ExpertStream), activations and replies as tensor bytes.
//
//   GrpcExpertChannel ch("shard-0", "127.0.0.1:5001", 256 << 20);
#ifndef MOE_ATTENTION_SVC_EXPERT_CHANNEL_GRPC_H_
#define MOE_ATTENTION_SVC_EXPERT_CHANNEL_GRPC_H_

#include <memory>
#include <string>

#include "attention-svc/expert_channel.h"

namespace moe::transport {
class ExpertStream;
}

namespace moe::v1 {
class DispatchRequest;
class DispatchReply;
}  // namespace moe::v1

namespace moe::attention_svc {

// The Dispatch message of one plan message: groups, row_source, the partial-sum fields, and the
// activations' bytes when with_activation_bytes (their dtype and shape always).
v1::DispatchRequest DispatchRequestFor(const DispatchHeader& header, const DispatchMessage& m,
                                       bool with_activation_bytes);

// OK when the reply's precision is the one the batch was sent in, else INTERNAL naming the
// shard and both.
absl::Status CheckReplyPrecision(const v1::DispatchReply& reply, numerics::Precision precision,
                                 const std::string& shard);

class GrpcExpertChannel final : public ExpertChannel {
 public:
  GrpcExpertChannel(std::string shard, std::string endpoint, int max_message_bytes,
                    std::string cluster_token);
  // On an existing stream (the UCX channel's in-band path shares its header stream).
  GrpcExpertChannel(std::string shard, std::shared_ptr<transport::ExpertStream> stream);
  ~GrpcExpertChannel() override;

  std::unique_ptr<ExpertCall> Send(const DispatchHeader& header,
                                   const DispatchMessage& message) override;
  const std::string& shard() const override { return shard_; }
  const char* transport() const override { return "grpc"; }

 private:
  const std::string shard_;
  std::shared_ptr<transport::ExpertStream> stream_;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_EXPERT_CHANNEL_GRPC_H_
