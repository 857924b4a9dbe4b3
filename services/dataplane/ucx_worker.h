// The out-of-band data plane's one UCX worker per process (docs/data-plane.md): tagged messages
// between processes over whatever UCX_TLS selects (shared memory, TCP, RDMA verbs), from buffers
// registered once with ucp_mem_map and reused, driven by one progress thread that owns the
// worker. No gRPC here: the services exchange worker addresses and tags over gRPC themselves.
//
// Every transfer has a deadline: a send or receive not complete by then is cancelled and fails
// with DEADLINE_EXCEEDED; a peer that fails (endpoint error) fails its transfers with
// UNAVAILABLE. A transfer's buffer is held by the transfer until UCX is done with it, so a
// caller that gives up early can never have its memory written or read after it moved on.
//
//   MOE_ASSIGN_OR_RETURN(auto w, UcxWorker::Create({.name = "attention-0"}));
//   MOE_ASSIGN_OR_RETURN(uint64_t ep, w->Connect(peer_address, on_peer_error));
//   auto buf = w->Buffer(bytes);  std::memcpy(buf->data(), src, bytes);
//   auto sent = w->Send(ep, tag, buf, bytes, deadline);
//   auto got = w->Recv(reply_tag, reply_buf, deadline);
//   MOE_ASSIGN_OR_RETURN(size_t n, got->Wait(deadline));
//
// Built without UCX (no libucx-dev), Create answers UNIMPLEMENTED and the services keep to
// in-band gRPC.
#ifndef MOE_SERVICES_DATAPLANE_UCX_WORKER_H_
#define MOE_SERVICES_DATAPLANE_UCX_WORKER_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moe::dataplane {

// True when this build has UCX (libucx-dev was found).
bool UcxBuilt();

struct UcxOptions {
  std::string name = "moe";
  // UCX transports (the UCX_TLS syntax: "posix,self", "tcp", "rc,ud", "all"); empty: UCX_TLS from
  // the environment, else UCX's own choice.
  std::string tls;
  // Free registered buffers kept per size class for reuse (more are unmapped when released).
  int pooled_buffers_per_class = 16;
};

class UcxWorkerImpl;
class UcxBufferPool;

// Registered memory, reused through the worker's pool: handed out by UcxWorker::Buffer and
// returned when the last reference (the caller's or an unfinished transfer's) is dropped.
class UcxBuffer {
 public:
  ~UcxBuffer();
  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  friend class UcxWorkerImpl;
  friend class UcxBufferPool;
  UcxBuffer() = default;
  uint8_t* data_ = nullptr;
  size_t capacity_ = 0;
  void* memh_ = nullptr;  // ucp_mem_h
  std::shared_ptr<UcxBufferPool> pool_;
};

// One send or receive. Completes exactly once: OK with the bytes moved, DEADLINE_EXCEEDED,
// UNAVAILABLE (the peer failed, the worker stopped), or INTERNAL (a message longer than the
// receive buffer).
class UcxTransfer {
 public:
  // The bytes moved, or the failure; DEADLINE_EXCEEDED if not complete by `deadline` (the
  // transfer itself runs on until its own deadline).
  absl::StatusOr<size_t> Wait(absl::Time deadline);
  bool done() const;

 private:
  friend class UcxWorkerImpl;
  void Complete(absl::Status status, size_t length);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
  size_t length_ = 0;
  // Progress-thread state.
  std::shared_ptr<UcxBuffer> buffer_;
  std::function<void(const absl::Status&, size_t)> on_done_;
  absl::Time deadline_ = absl::InfiniteFuture();
  void* request_ = nullptr;
  bool cancelled_for_deadline_ = false;
  uint64_t ep_ = 0;
  uint64_t tag_ = 0;
  std::string what_;
};

class UcxWorker {
 public:
  using Done = std::function<void(const absl::Status&, size_t)>;  // runs on the progress thread

  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(const UcxOptions& options);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  // This worker's address (opaque bytes a peer passes to Connect).
  const std::string& address() const { return address_; }
  // The transports UCX was asked for ("posix,self", or "default").
  const std::string& tls() const { return tls_; }

  // An endpoint to a peer worker with peer error handling. on_error runs once (progress thread)
  // when the peer fails; the endpoint's transfers then fail with UNAVAILABLE.
  absl::StatusOr<uint64_t> Connect(const std::string& peer_address,
                                   std::function<void(const absl::Status&)> on_error);
  // Closes an endpoint (forcibly: its unfinished transfers fail with UNAVAILABLE).
  void Disconnect(uint64_t ep);

  // A registered buffer of at least `bytes`, from the pool (registration only when the pool has
  // none of that size class yet).
  absl::StatusOr<std::shared_ptr<UcxBuffer>> Buffer(size_t bytes);

  // Tagged send of buffer[0, bytes) to `ep`; the transfer holds `buffer` until it completes.
  std::shared_ptr<UcxTransfer> Send(uint64_t ep, uint64_t tag, std::shared_ptr<UcxBuffer> buffer,
                                    size_t bytes, absl::Time deadline, Done done = nullptr);
  // Receives the message with exactly this tag (from any peer) into buffer.
  std::shared_ptr<UcxTransfer> Recv(uint64_t tag, std::shared_ptr<UcxBuffer> buffer,
                                    absl::Time deadline, Done done = nullptr);

  // Counters (any thread).
  int64_t transfers_in_flight() const;
  int64_t buffers_registered() const;

 private:
  explicit UcxWorker(std::unique_ptr<UcxWorkerImpl> impl);
  std::unique_ptr<UcxWorkerImpl> impl_;
  std::string address_, tls_;
};

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_UCX_WORKER_H_
