// What every backend's channel does the same way around its wire (client_half.h): the
// OpenDataPlane call on a control connection of its own, the protobuf header of a batch message,
// and the checks of a reply message that authenticated. The backends differ only in how the
// bytes move and how a waiter learns they arrived.
//
//   MOE_ASSIGN_OR_RETURN(OpenedDataPlane o, OpenDataPlane(endpoint, limit, token, node, t));
//   v1::DispatchRequest h = BatchMessageHeader(header, m, o.reply.client_id(), seq, bytes, rb);
//   MOE_ASSIGN_OR_RETURN(ExpertReply r, ReadBatchReply(who, shape, message, n, header_bytes));
#ifndef MOE_ATTENTION_SVC_DATAPLANE_BATCH_MESSAGE_H_
#define MOE_ATTENTION_SVC_DATAPLANE_BATCH_MESSAGE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention-svc/expert_channel.h"
#include "moe/v1/expert.pb.h"
#include "services/numerics/precision.h"

namespace grpc {
class Channel;
}

namespace moe::attention_svc {

struct OpenedDataPlane {
  v1::OpenDataPlaneReply reply;
  // Kept open while the data plane is: its state says whether the shard is alive (a
  // shared-memory lane has no peer failure detection of its own).
  std::shared_ptr<grpc::Channel> control;
  // The opening ends here, the backend's hello included: the caller's deadline or two seconds
  // after the call began, whichever comes first.
  absl::Time open_by;
};

// ExpertService.OpenDataPlane of shard `who` at `endpoint` (never waiting past `deadline` or
// two seconds). The shard's error keeps its code (FAILED_PRECONDITION: it offers no data plane;
// UNIMPLEMENTED: it predates them), prefixed with `who`. A reply for another backend than
// `backend` (an empty transport counts as "ucx") is FAILED_PRECONDITION too.
absl::StatusOr<OpenedDataPlane> OpenDataPlane(const std::string& who, const std::string& endpoint,
                                              int max_message_bytes,
                                              const std::string& cluster_token,
                                              const std::string& node, const std::string& backend,
                                              absl::Time deadline);

// The Dispatch request that heads a batch message: the batch's fields, its OutOfBand (client,
// sizes, sequence; the sequence is also the batch id), no activation bytes.
v1::DispatchRequest BatchMessageHeader(const DispatchHeader& header, const DispatchMessage& m,
                                       uint64_t client_id, uint64_t sequence, size_t bytes,
                                       size_t reply_bytes);

// What a batch's reply must look like.
struct ReplyShape {
  ReplyMode mode = ReplyMode::kPerPair;
  numerics::Precision precision;
  int64_t latent = 0, rows = 0, tokens = 0;
  // [rows, latent] bf16 per pair; [tokens, latent] f32 partial sums.
  int64_t bytes() const;
};
ReplyShape ShapeOf(const DispatchHeader& header, const DispatchMessage& m);

// The answer in a reply message that authenticated (`message` holds n bytes: the reply's
// protobuf header, header_bytes of it, then the rows): the shard's error, or the rows when the
// header and the byte count match `shape`; INTERNAL naming `who` otherwise. Per-pair rows are
// read in place when `buffer` keeps the message alive (the reply holds it), else copied.
absl::StatusOr<ExpertReply> ReadBatchReply(const std::string& who, const ReplyShape& shape,
                                           const char* message, size_t n, uint32_t header_bytes,
                                           std::shared_ptr<const void> buffer = nullptr);

// The same, with the header and the rows apart (the header already copied where the rows are
// read in place from memory a peer may still write: shm's ring).
absl::StatusOr<ExpertReply> ReadBatchReply(const std::string& who, const ReplyShape& shape,
                                           std::string_view header, const char* rows_at,
                                           size_t rows_bytes,
                                           std::shared_ptr<const void> buffer = nullptr);

// A call that failed before anything left (no data plane where one is required, no buffer, a
// wire that refused): its Wait answers `status` at once.
std::unique_ptr<ExpertCall> FailedExpertCall(absl::Status status);

// The rows of a checked payload: [rows, latent] f32 (partial sums, copied) or bf16 (read in
// place when `buffer` keeps the payload alive, else copied).
ExpertReply ReplyRows(const void* payload, int64_t rows, int64_t latent, bool f32,
                      std::shared_ptr<const void> buffer = nullptr);

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_DATAPLANE_BATCH_MESSAGE_H_
