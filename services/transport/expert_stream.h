// The attention node's side of ExpertService.Dispatch: one long-lived bidirectional stream to
// one expert server, shared by all requests of the node. Batches are tagged with ids; replies
// are matched to their waiters, in any order.
//
// A writer thread opens the stream and writes queued batches; a reader thread delivers replies.
// When the stream breaks (server gone, connection reset), every waiting batch fails with
// UNAVAILABLE naming the shard, and the next Send opens a new stream. A waiter gives up at its
// deadline with DEADLINE_EXCEEDED naming the shard, so nothing ever hangs on a dead or stalled
// server.
//
//   ExpertStream s("shard-0", "127.0.0.1:5001", /*max_message_bytes=*/256 << 20);
//   auto pending = s.Send(std::move(request));          // to every shard first ...
//   MOE_ASSIGN_OR_RETURN(v1::DispatchReply r, s.Wait(*pending, deadline));  // ... then wait
#ifndef MOE_SERVICES_TRANSPORT_EXPERT_STREAM_H_
#define MOE_SERVICES_TRANSPORT_EXPERT_STREAM_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "moe/v1/expert.pb.h"

namespace moe::transport {

struct PendingReply {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::Status status;
  v1::DispatchReply reply;
  uint64_t batch_id = 0;
  int32_t layer = 0;
};

class ExpertStream {
 public:
  // cluster_token: sent on the stream (kClusterTokenMetadata) when not empty.
  ExpertStream(std::string shard, std::string endpoint, int max_message_bytes,
               std::string cluster_token = "");
  ~ExpertStream();
  ExpertStream(const ExpertStream&) = delete;
  ExpertStream& operator=(const ExpertStream&) = delete;

  // Queues one batch; batch_id is assigned here. Never blocks on the network.
  std::shared_ptr<PendingReply> Send(v1::DispatchRequest request);
  // The reply, or UNAVAILABLE (stream broken) / DEADLINE_EXCEEDED, both naming the shard. A reply
  // with a non-zero code is returned as that status, prefixed with the shard name.
  absl::StatusOr<v1::DispatchReply> Wait(PendingReply& pending, absl::Time deadline);
  // Blocks until the batch is answered (or failed) or `until`; true when answered. Consumes
  // nothing and forgets nothing: Wait takes the reply after.
  static bool WaitAnswered(PendingReply& pending, absl::Time until);
  absl::StatusOr<v1::DispatchReply> Call(v1::DispatchRequest request, absl::Time deadline) {
    auto p = Send(std::move(request));
    return Wait(*p, deadline);
  }

  const std::string& shard() const { return shard_; }
  const std::string& endpoint() const { return endpoint_; }
  // Streams opened so far (1 + reconnects).
  int64_t streams_opened() const;

 private:
  class Session;
  std::string Describe() const;

  const std::string shard_, endpoint_;
  const int max_message_bytes_;
  const std::string cluster_token_;
  mutable std::mutex mu_;
  std::shared_ptr<Session> current_;
  std::vector<std::shared_ptr<Session>> retired_;
  uint64_t next_batch_id_ = 1;
  int64_t streams_opened_ = 0;
};

}  // namespace moe::transport

#endif  // MOE_SERVICES_TRANSPORT_EXPERT_STREAM_H_
