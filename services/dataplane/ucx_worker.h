// The out-of-band data plane's one UCX worker per process (docs/data-plane.md): batch messages
// (one active message each way) and tagged messages between processes over whatever UCX_TLS
// selects (shared memory, TCP, RDMA verbs), from buffers registered once with ucp_mem_map and
// reused, driven by a progress thread and by the threads that wait on it (below). No gRPC here:
// the services exchange worker addresses and keys over gRPC themselves.
//
// Every transfer has a deadline: a send or receive not complete by then is cancelled and fails
// with DEADLINE_EXCEEDED; a peer that fails (endpoint error) fails its transfers with
// UNAVAILABLE. A transfer's buffer is held until UCX is done with it, so a caller that gives up
// early can never have its memory written or read after it moved on.
//
// Lanes: Connect first makes the endpoint without peer error handling and keeps it when every
// lane UCX chose is shared memory (posix, sysv, cma: UCX 1.13 offers them only without
// UCP_ERR_HANDLING_MODE_PEER, whose endpoints would silently run over TCP); otherwise it makes
// it again with peer error handling (TCP, RDMA verbs). Lanes() says what UCX really selected.
// A shared-memory peer that dies is found by the caller's gRPC stream and the deadlines.
//
// Flow control: a payload moves in chunks of at most chunk_bytes (tags tag, tag + 1, ...), and
// an endpoint has at most max_bytes_in_flight of sends started; the rest wait their turn.
//
// Active messages: the hello (data_plane.h): OnHello's callback gets its bytes and the endpoint it
// came on (UCX's reply endpoint), so a server never parses a peer's address. Batches: one active
// message each way (SendMessage): a small header and the payload, which lands in a registered
// buffer (copied out of an eager message; a rendezvous one is received straight into it). A
// request goes to OnMessage's handler, which says where it lands; a reply lands in the buffer
// of the ExpectMessage whose 8-byte token opens its header.
//
// Threads: the worker is UCS_THREAD_MODE_SERIALIZED behind one lock. The progress thread holds
// it while it works and sleeps on the worker's event fd without it; a thread that waits for a
// transfer (Await) polls the worker itself for a bounded spin first, and a send or receive
// started while the lock is free runs on the caller's thread: a batch's round trip needs no
// wake-up of the progress thread when the waiter polls.
//
//   MOE_ASSIGN_OR_RETURN(auto w, UcxWorker::Create({.name = "attention-0"}));
//   MOE_ASSIGN_OR_RETURN(uint64_t ep, w->Connect(peer_address, on_peer_error));
//   MOE_ASSIGN_OR_RETURN(UcxLanes lanes, w->Lanes(ep));  // lanes.kind == "shm" on one host
//   auto buf = w->Buffer(bytes);  std::memcpy(buf->data(), src, bytes);
//   auto sent = w->Send(ep, tag, buf, bytes, deadline);
//   auto got = w->Recv(reply_tag, reply_buf, deadline);
//   MOE_ASSIGN_OR_RETURN(size_t n, got->Wait(deadline));
//
// Built without UCX (no libucx-dev), Create answers UNIMPLEMENTED and the services keep to
// in-band gRPC.
#ifndef MOE_SERVICES_DATAPLANE_UCX_WORKER_H_
#define MOE_SERVICES_DATAPLANE_UCX_WORKER_H_

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/dataplane/data_plane.h"

namespace moe {
class PollWindow;
}

namespace moe::dataplane {

// True when this build has UCX (libucx-dev was found).
bool UcxBuilt();
// The UCX library this process loaded ("1.13.1"; empty without UCX), and whether it is a
// version this project has tested (1.13; FAILED_PRECONDITION saying why it matters otherwise,
// OK without UCX): the services log both at start.
std::string UcxVersion();
absl::Status CheckUcxVersion();
// The posix shared-memory FIFO shape a worker with UCX_TLS `tls` ("" or "default": UCX's choice)
// asks for, as UcxWorker::shared_memory_fifo says it ("128x32832"; empty without UCX).
std::string SharedMemoryFifoShape(const std::string& tls);

struct UcxOptions {
  std::string name = "moe";
  // UCX transports (the UCX_TLS syntax: "posix,self", "tcp", "rc,ud", "all"); empty: UCX_TLS from
  // the environment, else UCX's own choice.
  std::string tls;
  // The address the service was given (its --host): UCX's TCP transport then listens only on
  // the interface that holds it (UCX_NET_DEVICES), not on every interface as it does by default.
  // Empty or a wildcard (0.0.0.0, ::): UCX's own choice. Not applied when `tls` names RDMA
  // verbs transports (their devices are not IP interfaces): set UCX_NET_DEVICES there. An
  // address no interface of this machine holds fails Create with INVALID_ARGUMENT.
  std::string bind_host;
  // Free registered buffers kept per size class for reuse (more are unmapped when released).
  int pooled_buffers_per_class = 16;
  // A payload moves in chunks of at most this many bytes (the receiver is told the size).
  size_t chunk_bytes = size_t{4} << 20;
  // Bytes of sends started and not yet complete per endpoint; further chunks wait.
  size_t max_bytes_in_flight = size_t{64} << 20;
  // The progress thread polls this long after its last activity before it sleeps (0: it sleeps
  // at once; worth it only where the data plane has a core to itself). A rendezvous over shared
  // memory moves in FIFO-sized fragments, and without a spin each one that finds the thread
  // asleep wakes it (with UCX's own FIFO 36-56 context switches per 2.3 MB round trip, 11-25
  // with 30 us; on 2 vCPUs shared with the callers it cost latency and goodput as often; the
  // FIFO every worker now asks for leaves 10-17: docs/data-plane.md).
  std::chrono::microseconds spin{0};
  // A thread waiting for a batch's reply polls the worker itself this long before it sleeps
  // (Await; the services' callers): a reply that comes within it costs no wake-up. Measured on
  // 2 vCPUs (tests/bench/dispatch_bench.cc): a bounded poll by a thread that waits anyway beat
  // both sleeping and a spinning progress thread.
  std::chrono::microseconds poll_spin{100};
  // ...and up to this long where its recent waits were that short (services/common/
  // poll_window.h; a channel's callers and a shard's compute thread each learn their own): a
  // T = 64 round trip on shared memory took 164-254 us where a fixed 100 us poll slept and took
  // 335-465 (docs/data-plane.md). A window with a poll_spin of 0 never polls (PollWindow).
  std::chrono::microseconds poll_spin_max{kPollMaxUs};
  // After a poller that got what it waited for leaves, the progress thread stays asleep and
  // unarmed this long for the next poll (PollUntil): a round trip then wakes no thread, where
  // waking it to arm the worker, and the peer's signal on the next message, cost two sleeping
  // wake-ups per side per round trip (tests/bench/hop_bench.cc). While threads poll, the
  // progress thread looks every 10 graces (UcxWorkerImpl::SleepWhilePolled): events nobody
  // polls for after the last poll (a hello, an endpoint error) wait at most 11 graces.
  std::chrono::microseconds handoff_grace{2000};
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
  // A received message's header (ExpectMessage), once done.
  std::string header() const;

 private:
  friend class UcxWorkerImpl;
  // Runs the callback and wakes the waiters; releases the buffer unless UCX may still use it.
  void Complete(absl::Status status, size_t length, bool release_buffer = true);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::Status status_;
  size_t length_ = 0;
  // Progress-thread state.
  int parts_left_ = 0;        // chunks not yet complete
  size_t bytes_done_ = 0;     // of the chunks complete
  absl::Status first_error_;  // of any chunk
  bool finished_ = false;     // Complete ran (abandoned transfers finish before UCX is done)
  std::string header_;        // a hello's or message's header (read by UCX until a send completes)
  std::shared_ptr<UcxBuffer> buffer_;
  size_t offset_ = 0;  // of a message's bytes in buffer_
  std::function<void(const absl::Status&, size_t)> on_done_;
  absl::Time deadline_ = absl::InfiniteFuture();
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

  // This worker's address (opaque bytes a peer passes to Connect). Hand it only to peers
  // that authenticated: UCX itself authenticates nobody.
  const std::string& address() const { return address_; }
  // The transports UCX was asked for ("posix,self", or "default").
  const std::string& tls() const { return tls_; }
  size_t chunk_bytes() const { return chunk_bytes_; }
  // The shape of UCX's posix shared-memory FIFO in this worker, "<elements>x<segment bytes>":
  // what it asked UCX for ("128x32832") or the user's UCX_POSIX_FIFO_SIZE / UCX_POSIX_SEG_SIZE.
  // Two ends of a shared-memory lane must agree: UCX 1.13 writes into a peer's FIFO with its own
  // element count and segment size (with different ones, messages stop at the first wrap of the
  // FIFO, or overrun the peer's segments), and nothing in UCX checks it.
  const std::string& shared_memory_fifo() const { return shm_fifo_; }
  std::chrono::microseconds poll_spin() const { return poll_spin_; }
  std::chrono::microseconds poll_spin_max() const { return poll_spin_max_; }

  // An endpoint to a peer worker whose address came from a trusted source (UCX may abort on a
  // malformed one): shared-memory lanes without peer error handling when UCX can give them,
  // else peer error handling (see above). on_error runs once (progress thread) when a peer
  // with error handling fails; the endpoint's transfers then fail with UNAVAILABLE.
  absl::StatusOr<uint64_t> Connect(const std::string& peer_address,
                                   std::function<void(const absl::Status&)> on_error);
  // The lanes UCX selected for an endpoint (read from UCX, not from the configuration).
  absl::StatusOr<UcxLanes> Lanes(uint64_t ep);
  // Closes an endpoint: forcibly when it has peer error handling (its unfinished transfers
  // fail with UNAVAILABLE), else by a flush that may never end for a dead peer (bounded by the
  // transfers' deadlines; given up at shutdown).
  void Disconnect(uint64_t ep);

  // The hello handler (progress thread; must not block nor call back into this worker but for
  // Send/Recv/Disconnect): the message's bytes (at most 256; longer ones and any with data
  // attached are dropped and counted), the endpoint it came on and that endpoint's lanes. Set
  // it before the address is handed out.
  using HelloFn =
      std::function<void(std::string_view hello, uint64_t reply_ep, const UcxLanes& lanes)>;
  void OnHello(HelloFn fn);
  // Runs (progress thread, same rules) for every hello this worker drops as malformed before
  // the hello handler sees it, saying why (no reply endpoint, data attached, over 256 bytes,
  // empty), so that its owner counts every refused hello as it counts those it refuses itself.
  using HelloDroppedFn = std::function<void(const std::string& why)>;
  void OnHelloDropped(HelloDroppedFn fn);
  // Sends a hello (an active message with a reply endpoint) on `ep`.
  std::shared_ptr<UcxTransfer> SendHello(uint64_t ep, std::string hello, absl::Time deadline);
  // Active messages dropped as malformed (hostile or confused peers).
  int64_t hellos_dropped() const;
  // Hellos that came on an endpoint UCX made at the address of one it had made for an earlier
  // peer (gone): each got a new id, the earlier one retired.
  int64_t reply_endpoints_reused() const;
  // Active messages on any id but the hello's, dropped. UCX 1.13.1 reads its handler table
  // without a bounds check: a message on an id past the table's end (65535, or anything above
  // about 17,000) makes the progress thread read unmapped memory (SIGSEGV) or call whatever the
  // memory past the table holds. So every worker registers a handler on each of the 65,536 ids
  // (1.5 MB, 1.5 ms once): every slot UCX reads is ours, and the message is dropped and counted.
  int64_t stray_messages_dropped() const;

  // Batch messages. SendMessage sends header (at most kMaxMessageHeader bytes) and
  // buffer[offset, offset + bytes) as one active message: kRequest to OnMessage's handler at the
  // peer, kReply to the peer's ExpectMessage of the token that opens the header. UCX picks eager
  // or rendezvous by size; the transfer holds the buffer until UCX is done. (An offset lets a
  // payload be written into the buffer before the bytes that precede it are known.)
  static constexpr size_t kMaxMessageHeader = 256;
  enum class Message { kRequest, kReply };
  std::shared_ptr<UcxTransfer> SendMessage(uint64_t ep, Message kind, std::string header,
                                           std::shared_ptr<UcxBuffer> buffer, size_t bytes,
                                           absl::Time deadline, Done done = nullptr,
                                           size_t offset = 0);
  // Where a request's payload lands and what runs once it did (done: OK with its length, or the
  // failure). A sink without a buffer drops the message (counted in messages_dropped).
  struct MessageSink {
    std::shared_ptr<UcxBuffer> buffer;
    Done done;
    size_t offset = 0;  // where in buffer the message's bytes land
  };
  // The request handler (runs with the worker held, on whichever thread progresses it: must not
  // block nor wait for this worker; Buffer may be called). Set it before the address is handed
  // out; without one every request is dropped.
  using MessageFn = std::function<MessageSink(std::string_view header, size_t length)>;
  void OnMessage(MessageFn fn);
  // The reply whose header opens with `token` (8 bytes, little-endian) lands in `buffer` (a
  // longer one fails the transfer INTERNAL); the transfer's header() is the reply's header.
  // Registered before this returns, so a request sent after it always finds it. Not arrived by
  // `deadline`: DEADLINE_EXCEEDED (a later one is dropped and counted).
  std::shared_ptr<UcxTransfer> ExpectMessage(uint64_t token, std::shared_ptr<UcxBuffer> buffer,
                                             absl::Time deadline);
  // Batch messages dropped: requests the handler refused or with no handler, replies whose
  // token nobody expects, headers over kMaxMessageHeader.
  int64_t messages_dropped() const;
  // The three counts above by kind ("stray", "hello", "batch"): moe_ucx_messages_dropped_total.
  std::vector<std::pair<std::string, double>> DroppedByKind() const {
    return {{"stray", static_cast<double>(stray_messages_dropped())},
            {"hello", static_cast<double>(hellos_dropped())},
            {"batch", static_cast<double>(messages_dropped())}};
  }

  // Progresses the worker once from this thread if nobody holds it; whether it did.
  bool Progress();
  // Polls the worker from this thread until `until` or until stop() (a thread that would
  // otherwise sleep: an expert server's compute thread between batches, so the next batch
  // message lands on it). Meanwhile the progress thread sleeps unarmed: peers do not signal
  // this worker per message, and nobody wakes that thread for requests this one progresses.
  // A poller whose stop() came true (it got what it waited for) is taken to come back soon (the
  // next batch, the next hop): the progress thread is not woken and takes over by itself only
  // when no thread has polled for `UcxOptions::handoff_grace`. One whose time ran out hands the
  // worker back at once (the progress thread arms it and sleeps on its event fd). A batch
  // message's sender is expected to poll (Await, PollUntil) after SendMessage; one that does
  // not is progressed within the grace. Returns whether stop() ended the poll.
  bool PollUntil(std::chrono::steady_clock::time_point until, const std::function<bool()>& stop);

  // Waits for `t` like t.Wait, but first polls the worker from this thread for up to `spin`
  // (or until `stop_polling` says so): the completion runs here without waking the progress
  // thread. A spin of 0 is t.Wait. The progress thread takes over when the spin ends without
  // the completion (at once) or after the hand-off grace (PollUntil).
  absl::StatusOr<size_t> Await(UcxTransfer& t, absl::Time deadline, std::chrono::microseconds spin,
                               const std::function<bool()>& stop_polling = nullptr);
  // The same, polling until `started` (when the request went out) + window.Window(), at least
  // window.floor() from now and never past `deadline`; a wait that ended (t done, or longer than
  // the window's ceiling) is recorded in `window` from `started` on.
  absl::StatusOr<size_t> Await(UcxTransfer& t, absl::Time deadline, PollWindow& window,
                               std::chrono::steady_clock::time_point started,
                               const std::function<bool()>& stop_polling = nullptr);

  // A registered buffer of at least `bytes`, from the pool (registration only when the pool has
  // none of that size class yet).
  absl::StatusOr<std::shared_ptr<UcxBuffer>> Buffer(size_t bytes);

  // Tagged send of buffer[0, bytes) to `ep` in chunks of chunk_bytes (tags tag, tag + 1, ...);
  // the transfer holds `buffer` until UCX is done with every chunk.
  std::shared_ptr<UcxTransfer> Send(uint64_t ep, uint64_t tag, std::shared_ptr<UcxBuffer> buffer,
                                    size_t bytes, absl::Time deadline, Done done = nullptr,
                                    size_t chunk_bytes = 0);
  // Receives exactly `bytes` sent by Send with this tag and chunk size (0: this worker's) into
  // buffer; a chunk of another length fails the transfer (INVALID_ARGUMENT, or INTERNAL for a
  // longer one). Tags match from any peer: payloads are checked (payload_mac.h) by the caller.
  std::shared_ptr<UcxTransfer> Recv(uint64_t tag, std::shared_ptr<UcxBuffer> buffer, size_t bytes,
                                    absl::Time deadline, Done done = nullptr,
                                    size_t chunk_bytes = 0);
  // Receives one message of any length up to the buffer's capacity (small control messages).
  std::shared_ptr<UcxTransfer> RecvAny(uint64_t tag, std::shared_ptr<UcxBuffer> buffer,
                                       absl::Time deadline, Done done = nullptr);

  // Counters (any thread).
  int64_t transfers_in_flight() const;
  int64_t buffers_registered() const;

 private:
  explicit UcxWorker(std::unique_ptr<UcxWorkerImpl> impl);
  std::unique_ptr<UcxWorkerImpl> impl_;
  std::string address_, tls_, shm_fifo_;
  size_t chunk_bytes_ = 0;
  std::chrono::microseconds poll_spin_{0};
  std::chrono::microseconds poll_spin_max_{0};
};

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_UCX_WORKER_H_
