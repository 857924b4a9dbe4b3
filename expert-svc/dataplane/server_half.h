// The expert server's half of an out-of-band data plane (docs/data-plane.md, "Adding a
// transport"): what one backend (UCX, the in-process fake) does in this process. The server
// starts the half its --data_plane names through the registry (registry.h), hands OpenDataPlane
// to it, takes each batch message it authenticated (on_batch) to the core, and answers through
// ReplyBatch. Everything about the wire (addresses, keys, lanes, buffers) stays in the
// backend's folder; the server and the core know only this interface.
//
//   MOE_ASSIGN_OR_RETURN(auto half, StartServerHalf("ucx", {.shard = "shard-0", ...}));
//   MOE_RETURN_IF_ERROR(half->Open("attention-0", &open_data_plane_reply));
//   // ... on_batch(from, header, activations) -> core -> half->ReplyBatch(from, h, outputs, t);
#ifndef MOE_EXPERT_SVC_DATAPLANE_SERVER_HALF_H_
#define MOE_EXPERT_SVC_DATAPLANE_SERVER_HALF_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "moe/v1/expert.pb.h"

namespace moe::expert_svc {

class BatchEndpoint;
struct EndpointContext;

// Who sent a batch message (services/dataplane/data_plane.h, BatchFrame), to answer it.
struct BatchSource {
  uint64_t client_id = 0, token = 0, sequence = 0;
  // The request asked for its reply's MAC in a message of its own, after the reply (UCX:
  // dataplane::kDetachTag; backends that never say detached_reply_tags never see it set).
  bool detach_tag = false;
  // Keeps the activations' bytes alive and unchanged past on_batch (the buffer they landed in:
  // the batch is computed from them in place); null: valid during the call only. Their start
  // is 64-byte aligned where this is set.
  std::shared_ptr<const void> activations_owner;
};

struct ServerHalfOptions {
  std::string shard;      // for messages
  std::string bind_host;  // the server's --host: the only interface the backend listens on
  std::string tls;        // the backend's transports (UCX: UCX_TLS syntax); empty: its default
  // A thread that waits anyway (the compute thread between batches) polls this long.
  std::chrono::microseconds poll_spin{100};
  // The backend's own progress thread keeps polling this long after its last activity before
  // it sleeps (UcxOptions::spin; 0: at once).
  std::chrono::microseconds progress_spin{0};
  int max_clients = 256;                  // OpenDataPlane beyond: RESOURCE_EXHAUSTED
  int64_t max_message_bytes = 256 << 20;  // the largest payload either way
  // Runs once per request message that authenticated (a bound client, its MAC right, its
  // sequence new), on a thread of the backend (it must not block for long), with the request's
  // protobuf header and its activations, valid during the call. Anything else is dropped and
  // counted ("message_rejected", "integrity_failed", "replayed"), never answered. Null: batch
  // messages are not offered (a backend with a previous protocol speaks only that one).
  std::function<void(const BatchSource& from, std::string_view header,
                     std::string_view activations)>
      on_batch;
  // Counted events (metrics): "hello_rejected", "integrity_failed", "message_rejected",
  // "replayed", "reply_failed".
  std::function<void(const std::string& event)> on_event;
};

// A reply payload's place in a backend's own memory (UCX: registered), from
// ServerHalf::NewReplyBuffer: the outputs are written at payload() and sent from there.
class ReplyBuffer {
 public:
  virtual ~ReplyBuffer() = default;
  virtual uint8_t* payload() = 0;
};

class ServerHalf {
 public:
  virtual ~ServerHalf() = default;
  // The registry's name of the backend ("ucx", "fake"): GetInfo's and the router's data_plane.
  virtual const char* name() const = 0;
  // One line for the start-up log ("UCX 1.13.1, UCX_TLS posix").
  virtual std::string Describe() const = 0;
  // The transports it was started with (GetInfo.ucx_tls for UCX; "" where there is no choice).
  virtual std::string tls() const = 0;
  // Where members reach it (GetInfo, to members only: the backend may authenticate nobody).
  virtual const std::string& address() const = 0;

  // OpenDataPlane: a new client of `node`, its keys and the backend's connection fields written
  // into `reply` (transport = name()). RESOURCE_EXHAUSTED past max_clients.
  virtual absl::Status Open(const std::string& node, v1::OpenDataPlaneReply* reply) = 0;
  // Answers a batch with one message: its reply's protobuf header (at most
  // dataplane::kMaxReplyHeaderBytes) then `payload`, sealed under the client's key. Failures to
  // send later are counted ("reply_failed"); an error here (unknown client, no buffer) sent
  // nothing.
  virtual absl::Status ReplyBatch(const BatchSource& to, std::string_view header,
                                  std::string_view payload, absl::Time deadline) = 0;
  // Where the payload of `bytes` of a reply to `to` can be written so that ReplyBatchFrom sends
  // it without a copy (UCX: a registered buffer; shm: its slot in the client's reply ring);
  // null where the backend has no such place now (ReplyBatch copies the payload).
  virtual std::unique_ptr<ReplyBuffer> NewReplyBuffer(const BatchSource& to, size_t bytes) {
    return nullptr;
  }
  // ReplyBatch of a payload already written into `filled` (this half's NewReplyBuffer).
  virtual absl::Status ReplyBatchFrom(const BatchSource& to, std::string_view header,
                                      std::unique_ptr<ReplyBuffer> filled, absl::Time deadline);

  // Polls the backend from the calling thread until `until` or `stop()`, and how long a thread
  // that waits anyway should (0: this backend delivers on its own threads; nobody polls).
  virtual void PollUntil(std::chrono::steady_clock::time_point until,
                         const std::function<bool()>& stop) {}
  virtual std::chrono::microseconds poll_spin() const { return std::chrono::microseconds(0); }

  // Messages the backend's library dropped before any handler saw them, by kind
  // (moe_ucx_messages_dropped_total for UCX); empty: none are.
  virtual std::vector<std::pair<std::string, double>> DroppedByKind() const { return {}; }
  // The lanes of the latest client's connection ("shm (posix)"), "" before any.
  virtual std::string lanes() const { return ""; }
  // A request whose header came on the Dispatch stream with an OutOfBand (a previous protocol
  // of this backend): its endpoint; null when the backend has none (the request is refused).
  virtual std::unique_ptr<BatchEndpoint> StreamEndpoint(const EndpointContext& ctx);
};

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_DATAPLANE_SERVER_HALF_H_
