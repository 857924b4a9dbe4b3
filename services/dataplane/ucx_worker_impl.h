// The UCX worker's implementation class, shared by the files that implement it (not part of the
// interface: ucx_worker.h is): ucx_worker.cc (set-up, connections, buffers, the public
// UcxWorker), ucx_worker_progress.cc (the progress loop, posted commands, deadlines),
// ucx_worker_messages.cc (endpoints made for peers; active messages in: the handler on every AM
// id, hellos, batch messages and their payloads) and ucx_worker_transfers.cc (transfers started,
// tagged sends and receives in chunks under a window, completions, cancellation, closing
// endpoints).
#ifndef MOE_SERVICES_DATAPLANE_UCX_WORKER_IMPL_H_
#define MOE_SERVICES_DATAPLANE_UCX_WORKER_IMPL_H_

#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/dataplane/net_interface.h"
#include "services/dataplane/ucx_buffer_pool.h"
#include "services/dataplane/ucx_worker.h"

namespace moe::dataplane {

// RDMA verbs transports in UCX_TLS syntax: their devices are not IP interfaces.
inline bool NamesVerbs(const std::string& tls) {
  for (const char* v : {"rc", "ud", "dc", "ib", "all"}) {
    if (tls.find(v) != std::string::npos) return true;
  }
  return tls.empty() || tls == "default";
}

inline constexpr size_t kMinBufferClass = 4096;
// A transfer cancelled at its deadline that UCX has not given back by this much later (a send
// that cannot be cancelled) has its endpoint closed, which fails it.
inline constexpr absl::Duration kCancelGrace = absl::Seconds(1);
// How long shutdown waits for cancelled transfers and closing endpoints.
inline constexpr absl::Duration kShutdownGrace = absl::Seconds(2);
// A request message's rendezvous payload not received by then fails (its handler is told).
inline constexpr absl::Duration kMessageReceiveTimeout = absl::Seconds(30);

inline size_t SizeClass(size_t bytes) {
  size_t c = kMinBufferClass;
  while (c < bytes) c <<= 1;
  return c;
}

inline absl::Status FromUcs(ucs_status_t s, const std::string& what) {
  if (s == UCS_OK) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", ucs_status_string(s));
  switch (s) {
    case UCS_ERR_MESSAGE_TRUNCATED:
      return absl::InternalError(msg);
    case UCS_ERR_NO_MEMORY:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::UnavailableError(msg);
  }
}

class UcxWorkerImpl;
// The worker this thread holds (its lock), if any: a callback that runs while a thread
// progresses the worker must not take the lock again.
inline thread_local UcxWorkerImpl* t_holder = nullptr;

class UcxWorkerImpl {
 public:
  // One chunk of a transfer waiting for its turn on an endpoint (flow control).
  struct Chunk {
    std::shared_ptr<UcxTransfer> t;
    size_t offset = 0, length = 0;
    uint64_t tag = 0;
  };
  struct Endpoint {
    ucp_ep_h ep = nullptr;
    uint64_t id = 0;
    bool failed = false;
    bool peer_mode = false;  // UCP_ERR_HANDLING_MODE_PEER: can be closed forcibly
    bool owned = true;       // false: UCX made it (a hello's reply endpoint)
    std::function<void(const absl::Status&)> on_error;
    UcxWorkerImpl* owner = nullptr;
    size_t bytes_in_flight = 0;
    std::deque<Chunk> waiting;
  };
  // One UCX request: a chunk of a transfer.
  struct Part {
    std::shared_ptr<UcxTransfer> t;
    size_t length = 0;  // the chunk's expected length
    uint64_t ep = 0;    // sends: the endpoint whose window it holds
    bool exact = true;  // false: any length up to `length` (RecvAny)
  };

  ~UcxWorkerImpl();

  absl::Status Init(const UcxOptions& o, std::string* address, std::string* tls);
  absl::Status SetAmHandlers();

  size_t chunk_bytes() const { return options_.chunk_bytes; }

  void Post(std::function<void()> f);

  // Runs f with the worker held, on this thread (after the commands posted before it).
  template <typename T>
  T Run(std::function<T()> f) {
    if (t_holder == this) return f();
    Hold hold(this);
    RunCommands();
    return f();
  }

  // The worker's lock, held by this thread while in scope; on release, a thread that is not
  // the progress thread wakes it when UCX still has requests to progress (an inline send that
  // did not complete at once): nobody else may be polling.
  class Hold {
   public:
    explicit Hold(UcxWorkerImpl* w, bool locked = false) : w_(w) {
      if (!locked) w_->progress_mu_.lock();
      t_holder = w_;
    }
    // Off for batch messages: their sender polls next (Await, PollUntil); the progress
    // thread's short sleep while requests are in flight covers one that does not.
    bool wake_if_pending = true;
    ~Hold() {
      const bool wake = wake_if_pending && !w_->inflight_.empty() && w_->pollers_ == 0 &&
                        std::this_thread::get_id() != w_->loop_thread_;
      t_holder = nullptr;
      w_->progress_mu_.unlock();
      if (wake) w_->Wake();
    }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    UcxWorkerImpl* w_;
  };

  void Wake();

  // Progresses the worker from this thread if nobody holds it; whether anything happened.
  bool TryProgress();

  // A thread polls the worker from Begin to End: meanwhile nobody wakes the progress thread for
  // requests in flight (the poller progresses them); the last poller to leave hands them back.
  // hand_off: wake the progress thread now (the poller goes to sleep); otherwise it takes over
  // by itself after options_.handoff_grace without a poller (SleepWhilePolled).
  void BeginPolling();
  void EndPolling(bool hand_off);

  bool PollUntil(std::chrono::steady_clock::time_point until, const std::function<bool()>& stop);

  absl::StatusOr<size_t> Await(UcxTransfer& t, absl::Time deadline, std::chrono::microseconds spin,
                               const std::function<bool()>& stop_polling);

  void SetMessageHandler(UcxWorker::MessageFn fn);

  std::shared_ptr<UcxTransfer> Expect(uint64_t token, std::shared_ptr<UcxBuffer> buffer,
                                      absl::Time deadline);

  int64_t messages_dropped() const { return messages_dropped_.load(); }

  void Stop();

  void SetHello(UcxWorker::HelloFn fn);
  void SetHelloDropped(UcxWorker::HelloDroppedFn fn);

  absl::StatusOr<uint64_t> Connect(const std::string& peer,
                                   std::function<void(const absl::Status&)> on_error);

  absl::StatusOr<UcxLanes> Lanes(uint64_t id);

  void Disconnect(uint64_t id);

  absl::StatusOr<std::shared_ptr<UcxBuffer>> Buffer(size_t bytes);

  enum class Kind { kSend, kRecv, kRecvAny, kHello, kRequest, kReply };

  std::shared_ptr<UcxTransfer> Start(Kind kind, uint64_t ep, uint64_t tag,
                                     std::shared_ptr<UcxBuffer> buffer, size_t bytes,
                                     absl::Time deadline, UcxWorker::Done done, size_t chunk,
                                     std::string hello = {}, size_t offset = 0);

  int64_t in_flight() const { return in_flight_.load(); }
  int64_t registered() const { return pool_ != nullptr ? pool_->registered.load() : 0; }
  int64_t hellos_dropped() const { return hellos_dropped_.load(); }
  int64_t stray_messages_dropped() const { return stray_dropped_.load(); }
  int64_t reply_endpoints_reused() const { return reply_endpoints_reused_.load(); }

 private:
  static constexpr uint16_t kHelloAmId = 1;
  static constexpr uint16_t kRequestAmId = 2;  // batch messages (SendMessage)
  static constexpr uint16_t kReplyAmId = 3;
  static constexpr int kAmIds = 65536;  // the wire's AM id is 16 bits
  static constexpr size_t kMaxHelloBytes = 256;

  // Progress thread from here on.
  absl::StatusOr<uint64_t> Create(const std::string& peer, bool peer_mode,
                                  const std::function<void(const absl::Status&)>& on_error);

  UcxLanes LanesOf(uint64_t id);

  // The id of an endpoint UCX made for a peer (a hello's reply endpoint). Every hello gets an
  // id of its own: UCX releases the endpoint it made for a peer that went away and may make the
  // next peer's at the same address, so a handle already known here belongs to a peer that is
  // gone. Its id is retired (transfers waiting on it fail; sends to it find no endpoint) rather
  // than handed to the new peer, whose endpoint would otherwise be forgotten when the old
  // peer's client is replaced (ucx_data_plane.cc, Open), its acknowledgement never sent.
  uint64_t Adopt(ucp_ep_h h);

  // Any id but the hello's: dropped (data, eager or rendezvous, is released by UCX when we
  // return UCS_OK), counted, never adopted as an endpoint.
  static ucs_status_t OnStrayAm(void* arg, const void*, size_t, void*, size_t,
                                const ucp_am_recv_param_t*);

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* /*data*/,
                           size_t length, const ucp_am_recv_param_t* param);

  // A request (batch message): where the handler says it lands, or dropped.
  static ucs_status_t OnRequestAm(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param);

  // A reply: into the buffer of the ExpectMessage its token names, or dropped.
  static ucs_status_t OnReplyAm(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);

  // A message's payload into its transfer's buffer: copied from an eager message, received
  // straight into the registered buffer for a rendezvous one.
  void Land(const std::shared_ptr<UcxTransfer>& t, void* data, size_t length,
            const ucp_am_recv_param_t* param);

  static void OnAmData(void* request, ucs_status_t status, size_t length, void* user_data);

  void StartMessage(const std::shared_ptr<UcxTransfer>& t, uint16_t id, const std::string& header,
                    size_t bytes);

  void Finish(const std::shared_ptr<UcxTransfer>& t, absl::Status s, size_t length);

  // `n` parts of a transfer that already finished will never complete (never started, or
  // done): once none is left, UCX holds none of its buffer.
  static void PartsGone(UcxTransfer& t, int n);

  // One chunk finished (status s, length n); the transfer finishes with its last chunk.
  void PartDone(const Part& p, absl::Status s, size_t n);

  // After a *_nbx call: r is NULL (done at once), an error, or a request whose callback comes
  // later, or already came inside the call (UCP_OP_ATTR_FLAG_NO_IMM_CMPL: starting_ got it).
  void AdoptRequest(const Part& p, ucs_status_ptr_t r);

  static std::vector<std::pair<size_t, size_t>> Chunks(size_t bytes, size_t chunk);

  void StartSend(const std::shared_ptr<UcxTransfer>& t, size_t bytes, size_t chunk);

  // Starts waiting chunks while the endpoint's window has room (one always goes).
  void Pump(Endpoint& e);

  // Posts one tagged receive of a transfer's part into buffer[offset, offset + room).
  void PostRecv(const Part& part, size_t offset, size_t room, uint64_t tag);

  void StartRecv(const std::shared_ptr<UcxTransfer>& t, size_t bytes, size_t chunk);

  void StartRecvAny(const std::shared_ptr<UcxTransfer>& t, size_t capacity);

  void StartHello(const std::shared_ptr<UcxTransfer>& t, const std::string& hello);

  void Completed(void* request, ucs_status_t status, size_t length);

  static void OnSend(void* request, ucs_status_t status, void* user_data);
  static void OnRecv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                     void* user_data);

  static void OnEpError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status);

  // Cancels the UCX requests of a transfer that failed (its other chunks).
  void CancelParts(const std::shared_ptr<UcxTransfer>& t);

  void CloseEp(uint64_t id);

  void ReapClosing();

  // Cancels what is past its deadline; returns the time to the next deadline. A transfer UCX
  // has not given back kCancelGrace after its cancel (a send to a dead shared-memory peer) is
  // failed for its caller (abandoned) while its buffer stays held until UCX lets go; an
  // endpoint with peer error handling is closed instead, which fails it.
  absl::Duration CheckDeadlines();

  // Runs the posted commands; whether there were any.
  // Runs the posted commands; whether there were any. The progress thread also drains the
  // wake-up counter (drain_fd); a poller only looks at the flag (no system call per poll).
  bool RunCommands(bool drain_fd = true);

  void Loop();
  // The progress thread's sleep while threads poll the worker (unarmed, on the wake fd only):
  // returns when woken, when `next` (a deadline) comes, or when no thread has polled for the
  // hand-off grace, which it looks at every kGracesPerPolledLook graces while a thread polls.
  // Each look is a wake-up on a core that pollers spin on (at T = 1 the attention node's and the
  // shard's hold both cores of a 2-vCPU host): one per grace (2 ms) on each worker was in the
  // T = 1 round trip's tail (dispatch_bench p99 62-1,392 us, 51-96 with ten times fewer looks,
  // five alternated pairs on Zen 3; docs/data-plane.md).
  static constexpr int kGracesPerPolledLook = 10;
  void SleepWhilePolled(absl::Duration next);
  std::chrono::steady_clock::time_point LastPollEnd() const;

  UcxOptions options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::thread::id loop_thread_;
  // Held by whoever drives the worker (the progress thread or a polling waiter): every UCX call
  // and every field below "Worker-held" happen under it.
  std::mutex progress_mu_;
  std::mutex mu_;
  std::deque<std::function<void()>> commands_;
  std::shared_ptr<UcxBufferPool> pool_;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> hellos_dropped_{0};
  std::atomic<int64_t> stray_dropped_{0};
  std::atomic<int64_t> reply_endpoints_reused_{0};
  std::atomic<int64_t> messages_dropped_{0};
  std::atomic<bool> has_commands_{false};  // commands_ is not empty (set under mu_)
  std::atomic<int> pollers_{0};            // threads between BeginPolling and EndPolling
  // When the last poller left (steady clock, ns): the hand-off grace counts from it.
  std::atomic<int64_t> last_poll_end_ns_{0};
  bool disarmed_ = false;  // the progress thread sleeps without arming
  // Worker-held (progress_mu_).
  UcxWorker::MessageFn on_message_;
  std::unordered_map<uint64_t, std::shared_ptr<UcxTransfer>> expected_;  // replies, by token
  bool stopping_ = false;
  uint64_t next_ep_ = 1;
  UcxWorker::HelloFn hello_;
  UcxWorker::HelloDroppedFn hello_dropped_;
  std::map<uint64_t, std::unique_ptr<Endpoint>> eps_;
  std::unordered_map<ucp_ep_h, uint64_t> by_handle_;
  std::vector<std::unique_ptr<Endpoint>> closed_;
  std::vector<void*> closing_;
  std::unordered_map<void*, Part> inflight_;  // by request
  bool starting_ = false;                     // a *_nbx call is running for starting_part_
  Part starting_part_;
};

}  // namespace moe::dataplane

#endif  // MOE_SERVICES_DATAPLANE_UCX_WORKER_IMPL_H_
