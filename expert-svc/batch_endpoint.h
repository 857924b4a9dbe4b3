// The expert side of the seam between the wire and the experts, the twin of attention-svc's
// ExpertChannel: a BatchEndpoint delivers one Dispatch request with its activation bytes, and
// the BatchReply it hands over takes the batch's answer back. The core (expert_core.h) computes
// between the two and knows nothing of how the bytes moved; the domain Batch carries no
// transport fields.
//
// Implementations, chosen by one factory (MakeBatchEndpoint) per request:
//   in band (gRPC)  the bytes inside the request; the answer on the same Dispatch stream
//   UCX             the bytes out of band (ucx_data_plane.h), MAC-checked; the answer's payload
//                   out of band with its MAC, its header on the stream once UCX is done
//   local           the bytes inside the request; the answer to a callback (tests, in process)
//
//   auto endpoint = MakeBatchEndpoint(req, ctx);  // ctx: the stream, the UCX plane or null
//   endpoint->Receive(std::move(req), [&](v1::DispatchRequest& r, std::string_view bytes,
//                                         std::unique_ptr<BatchReply> reply) {
//     core.Admit(r, bytes, std::move(reply));  // the answer goes to reply->Send(...) later
//   });
#ifndef MOE_EXPERT_SVC_BATCH_ENDPOINT_H_
#define MOE_EXPERT_SVC_BATCH_ENDPOINT_H_

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "moe/v1/expert.pb.h"
#include "services/transport/stream_reactor.h"

namespace moe::expert_svc {

class UcxDataPlane;
struct UcxBatchSource;

using DispatchReactor = transport::StreamReactor<v1::DispatchRequest, v1::DispatchReply>;

// Where one batch's answer goes. Send runs exactly once, never blocks on the network, and may
// run on any thread.
class BatchReply {
 public:
  virtual ~BatchReply() = default;
  // The answer: code 0 with the outputs, or an error (ErrorReply).
  virtual void Send(v1::DispatchReply reply) = 0;
  // "grpc", "ucx" or "local": the transport label of the wire metrics.
  virtual const char* transport() const = 0;
  // Seconds the activations took to arrive after the header (out of band; 0 in band).
  double receive_seconds = 0;
};

class BatchEndpoint {
 public:
  using Admit = std::function<void(v1::DispatchRequest& req, std::string_view activations,
                                   std::unique_ptr<BatchReply> reply)>;
  virtual ~BatchEndpoint() = default;
  // Fetches the request's activation bytes and calls `admit` once with them (the view valid
  // during the call), maybe later and on another thread; or answers the request's error on its
  // own. Nothing of the endpoint is used after Receive returns (it may be destroyed).
  virtual void Receive(v1::DispatchRequest req, Admit admit) = 0;
};

// An error answer to batch `batch_id`, naming this server's shard when the message does not.
v1::DispatchReply ErrorReply(uint64_t batch_id, const std::string& shard, const absl::Status& s);

struct EndpointContext {
  std::string shard;
  DispatchReactor* stream = nullptr;  // the Dispatch stream of the request (grpc, ucx)
  UcxDataPlane* ucx = nullptr;        // null: this server offers no UCX data plane
  // The local endpoint's answers (no stream).
  std::function<void(v1::DispatchReply)> local_reply;
  // Every error a transport answers on its own (metrics).
  std::function<void(const absl::Status&)> on_error;
};

// The answer to a batch that came as one UCX message (ucx_data_plane.h): one message back, with
// the reply's header and, for an answer, its outputs (which must have the reply_capacity_bytes
// the caller announced in the request's OutOfBand; INTERNAL otherwise). `ucx` outlives it (the
// server answers every batch before it stops the data plane).
std::unique_ptr<BatchReply> MakeUcxBatchReply(UcxDataPlane* ucx, const UcxBatchSource& from,
                                              int64_t reply_bytes, std::string shard,
                                              absl::Time deadline);

// The request's endpoint: UCX when it has an out_of_band header (FAILED_PRECONDITION answered
// when this server has no UCX), in band otherwise; local when the context has no stream.
std::unique_ptr<BatchEndpoint> MakeBatchEndpoint(const v1::DispatchRequest& req,
                                                 const EndpointContext& ctx);

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_BATCH_ENDPOINT_H_
