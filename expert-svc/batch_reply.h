// Where one batch's answer goes: what the core (expert_core.h) hands each answer to, with no
// transport in sight (the endpoints that make them: batch_endpoint.h). No gRPC here.
#ifndef MOE_EXPERT_SVC_BATCH_REPLY_H_
#define MOE_EXPERT_SVC_BATCH_REPLY_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "moe/v1/expert.pb.h"

namespace moe::expert_svc {

// Where one batch's answer goes. Send runs exactly once, never blocks on the network, and may
// run on any thread.
class BatchReply {
 public:
  virtual ~BatchReply() = default;
  // The answer: code 0 with the outputs, or an error (ErrorReply).
  virtual void Send(v1::DispatchReply reply) = 0;
  // "grpc", "local" or the data plane's name ("ucx"): the transport label of the wire metrics.
  virtual const char* transport() const = 0;
  // Where the answer's outputs of `bytes` may be written instead of into the reply's
  // outputs.data: the memory the data plane sends from (one copy less), valid until Send. Null
  // where there is none. An answer whose outputs were written there goes to Send with their
  // shape and no data.
  virtual uint8_t* OutputBuffer(size_t bytes) { return nullptr; }
  // Seconds the activations took to arrive after the header (out of band; 0 in band).
  double receive_seconds = 0;
};

// An error answer to batch `batch_id`, naming this server's shard when the message does not.
v1::DispatchReply ErrorReply(uint64_t batch_id, const std::string& shard, const absl::Status& s);

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_BATCH_REPLY_H_
