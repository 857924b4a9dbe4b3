#include "services/dataplane/ucx_worker.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
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

namespace moe::dataplane {

bool UcxBuilt() { return true; }

std::string UcxVersion() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return absl::StrCat(major, ".", minor, ".", release);
}

absl::Status CheckUcxVersion() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (major == 1 && minor == 13) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("UCX ", UcxVersion(),
                   " is not the version this project tested (1.13): how it treats "
                   "hostile active messages is unchecked (docs/security.md)"));
}

namespace {

// RDMA verbs transports in UCX_TLS syntax: their devices are not IP interfaces.
bool NamesVerbs(const std::string& tls) {
  for (const char* v : {"rc", "ud", "dc", "ib", "all"}) {
    if (tls.find(v) != std::string::npos) return true;
  }
  return tls.empty() || tls == "default";
}

constexpr size_t kMinBufferClass = 4096;
// A transfer cancelled at its deadline that UCX has not given back by this much later (a send
// that cannot be cancelled) has its endpoint closed, which fails it.
constexpr absl::Duration kCancelGrace = absl::Seconds(1);
// How long shutdown waits for cancelled transfers and closing endpoints.
constexpr absl::Duration kShutdownGrace = absl::Seconds(2);
// A request message's rendezvous payload not received by then fails (its handler is told).
constexpr absl::Duration kMessageReceiveTimeout = absl::Seconds(30);

size_t SizeClass(size_t bytes) {
  size_t c = kMinBufferClass;
  while (c < bytes) c <<= 1;
  return c;
}

absl::Status FromUcs(ucs_status_t s, const std::string& what) {
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

}  // namespace

absl::StatusOr<size_t> UcxTransfer::Wait(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!done_) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(what_, " did not complete by its deadline"));
    }
    cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Seconds(1))));
  }
  if (!status_.ok()) return status_;
  return length_;
}

bool UcxTransfer::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::string UcxTransfer::header() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ ? header_ : std::string();
}

void UcxTransfer::Complete(absl::Status status, size_t length, bool release_buffer) {
  if (on_done_) on_done_(status, length);
  on_done_ = nullptr;
  std::shared_ptr<UcxBuffer> release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    status_ = std::move(status);
    length_ = length;
    if (release_buffer) release = std::move(buffer_);  // UCX is done with the memory
  }
  cv_.notify_all();
}

class UcxWorkerImpl;
// The worker this thread holds (its lock), if any: a callback that runs while a thread
// progresses the worker must not take the lock again.
thread_local UcxWorkerImpl* t_holder = nullptr;

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

  ~UcxWorkerImpl() {
    Stop();
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  absl::Status Init(const UcxOptions& o, std::string* address, std::string* tls) {
    options_ = o;
    if (options_.chunk_bytes < kMinBufferClass) options_.chunk_bytes = kMinBufferClass;
    if (options_.max_bytes_in_flight < options_.chunk_bytes) {
      options_.max_bytes_in_flight = options_.chunk_bytes;
    }
    ucp_config_t* config = nullptr;
    if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
      return FromUcs(s, "ucp_config_read");
    }
    *tls = o.tls;
    if (!o.tls.empty()) {
      if (ucs_status_t s = ucp_config_modify(config, "TLS", o.tls.c_str()); s != UCS_OK) {
        ucp_config_release(config);
        return FromUcs(s, absl::StrCat("UCX_TLS=", o.tls));
      }
    } else if (const char* env = std::getenv("UCX_TLS"); env != nullptr && *env != '\0') {
      *tls = env;
    } else {
      *tls = "default";
    }
    if (!o.bind_host.empty() && !NamesVerbs(*tls)) {
      absl::StatusOr<std::string> iface = InterfaceOf(o.bind_host);
      if (!iface.ok()) {
        ucp_config_release(config);
        return absl::InvalidArgumentError(
            absl::StrCat("UCX data plane: ", iface.status().message()));
      }
      if (!iface->empty()) {
        if (ucs_status_t s = ucp_config_modify(config, "NET_DEVICES", iface->c_str());
            s != UCS_OK) {
          ucp_config_release(config);
          return FromUcs(s, absl::StrCat("UCX_NET_DEVICES=", *iface));
        }
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.name = o.name.c_str();
    ucs_status_t s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK) return FromUcs(s, absl::StrCat("ucp_init (UCX_TLS ", *tls, ")"));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    // One thread at a time, behind progress_mu_ (the progress thread or a polling waiter).
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    if (s = ucp_worker_create(context_, &wp, &worker_); s != UCS_OK) {
      return FromUcs(s, "ucp_worker_create");
    }
    if (s = ucp_worker_get_efd(worker_, &efd_); s != UCS_OK)
      return FromUcs(s, "ucp_worker_get_efd");
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    // Every id gets a handler (ucx_worker.h, stray_messages_dropped): highest first, so UCX
    // sizes its table once.
    hp.cb = &UcxWorkerImpl::OnStrayAm;
    hp.arg = this;
    for (int id = kAmIds - 1; id >= 0; --id) {
      hp.id = static_cast<unsigned>(id);
      if (s = ucp_worker_set_am_recv_handler(worker_, &hp); s != UCS_OK) {
        return FromUcs(s, absl::StrCat("ucp_worker_set_am_recv_handler (id ", id, ")"));
      }
    }
    hp.id = kHelloAmId;
    hp.cb = &UcxWorkerImpl::OnAm;
    hp.arg = this;
    if (s = ucp_worker_set_am_recv_handler(worker_, &hp); s != UCS_OK) {
      return FromUcs(s, "ucp_worker_set_am_recv_handler");
    }
    hp.id = kRequestAmId;
    hp.cb = &UcxWorkerImpl::OnRequestAm;
    if (s = ucp_worker_set_am_recv_handler(worker_, &hp); s != UCS_OK) {
      return FromUcs(s, "ucp_worker_set_am_recv_handler");
    }
    hp.id = kReplyAmId;
    hp.cb = &UcxWorkerImpl::OnReplyAm;
    if (s = ucp_worker_set_am_recv_handler(worker_, &hp); s != UCS_OK) {
      return FromUcs(s, "ucp_worker_set_am_recv_handler");
    }
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    if (s = ucp_worker_get_address(worker_, &addr, &len); s != UCS_OK) {
      return FromUcs(s, "ucp_worker_get_address");
    }
    address->assign(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(worker_, addr);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return absl::InternalError("eventfd failed");
    pool_ = std::make_shared<UcxBufferPool>(o.pooled_buffers_per_class);
    pool_->SetPost([this](std::function<void()> f) { Post(std::move(f)); }, context_);
    thread_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "ucx-progress");  // for top -H and profilers
      Loop();
    });
    // Written before any other thread can see this worker (Create has not returned); the loop
    // thread never reads it (it never takes a Hold).
    loop_thread_ = thread_.get_id();
    return absl::OkStatus();
  }

  size_t chunk_bytes() const { return options_.chunk_bytes; }

  void Post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      commands_.push_back(std::move(f));
      has_commands_.store(true, std::memory_order_release);
    }
    Wake();
  }

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

  void Wake() {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  // Progresses the worker from this thread if nobody holds it; whether anything happened.
  bool TryProgress() {
    if (t_holder == this || !progress_mu_.try_lock()) return false;
    Hold hold(this, /*locked=*/true);
    bool active = RunCommands(/*drain_fd=*/false);
    while (ucp_worker_progress(worker_) != 0) active = true;
    active |= RunCommands(/*drain_fd=*/false);  // what the callbacks queued (a hello's ack)
    return active;
  }

  // A thread polls the worker from Begin to End: meanwhile nobody wakes the progress thread for
  // requests in flight (the poller progresses them); the last poller to leave hands them back.
  void BeginPolling() {
    std::lock_guard<std::mutex> lock(progress_mu_);
    ++pollers_;
  }
  void EndPolling() {
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(progress_mu_);
      wake = --pollers_ == 0 && (disarmed_ || !inflight_.empty());
    }
    if (wake) Wake();
  }

  void PollUntil(std::chrono::steady_clock::time_point until, const std::function<bool()>& stop) {
    if (t_holder == this) return;
    BeginPolling();
    // Between empty polls the CPU goes to whoever else is runnable on it (the peer's threads
    // where processes share cores): a poll costs no one a time slice.
    while (!stop() && std::chrono::steady_clock::now() < until) {
      if (!TryProgress()) std::this_thread::yield();
    }
    EndPolling();
  }

  absl::StatusOr<size_t> Await(UcxTransfer& t, absl::Time deadline, std::chrono::microseconds spin,
                               const std::function<bool()>& stop_polling) {
    if (spin.count() > 0) {
      PollUntil(std::chrono::steady_clock::now() + spin,
                [&] { return t.done() || (stop_polling && stop_polling()); });
    }
    return t.Wait(deadline);
  }

  void SetMessageHandler(UcxWorker::MessageFn fn) {
    Run<bool>([&] {
      on_message_ = std::move(fn);
      return true;
    });
  }

  std::shared_ptr<UcxTransfer> Expect(uint64_t token, std::shared_ptr<UcxBuffer> buffer,
                                      absl::Time deadline) {
    auto t = std::make_shared<UcxTransfer>();
    t->buffer_ = std::move(buffer);
    t->deadline_ = deadline;
    t->tag_ = token;
    t->what_ = "UCX reply message";
    in_flight_.fetch_add(1);
    Run<bool>([&] {
      if (stopping_) {
        Finish(t, absl::UnavailableError("UCX reply message: the worker is stopping"), 0);
      } else if (t->buffer_ == nullptr || !expected_.emplace(token, t).second) {
        Finish(t, absl::InvalidArgumentError("UCX reply message: no buffer, or a token in use"), 0);
      }
      return true;
    });
    return t;
  }

  int64_t messages_dropped() const { return messages_dropped_.load(); }

  void Stop() {
    if (!thread_.joinable()) return;
    Post([this] { stopping_ = true; });
    thread_.join();
    Hold hold(this);
    RunCommands();  // buffer releases posted while the loop wound down
  }

  void SetHello(UcxWorker::HelloFn fn) {
    Run<bool>([&] {
      hello_ = std::move(fn);
      return true;
    });
  }
  void SetHelloDropped(UcxWorker::HelloDroppedFn fn) {
    Run<bool>([&] {
      hello_dropped_ = std::move(fn);
      return true;
    });
  }

  absl::StatusOr<uint64_t> Connect(const std::string& peer,
                                   std::function<void(const absl::Status&)> on_error) {
    return Run<absl::StatusOr<uint64_t>>([&]() -> absl::StatusOr<uint64_t> {
      if (stopping_) return absl::UnavailableError("UCX worker is stopping");
      if (peer.empty()) return absl::InvalidArgumentError("empty UCX worker address");
      // Shared memory first: UCX 1.13 offers posix/sysv/cma lanes only without peer error
      // handling. Anything else (a remote peer: TCP, verbs) gets peer error handling.
      absl::StatusOr<uint64_t> id = Create(peer, /*peer_mode=*/false, on_error);
      if (id.ok()) {
        if (LanesOf(*id).kind == "shm") return id;
        // Nothing was sent on it yet: a flush close returns at once.
        CloseEp(*id);
      }
      return Create(peer, /*peer_mode=*/true, on_error);
    });
  }

  absl::StatusOr<UcxLanes> Lanes(uint64_t id) {
    return Run<absl::StatusOr<UcxLanes>>([&]() -> absl::StatusOr<UcxLanes> {
      if (eps_.count(id) == 0) return absl::NotFoundError(absl::StrCat("no UCX endpoint ", id));
      return LanesOf(id);
    });
  }

  void Disconnect(uint64_t id) {
    Post([this, id] { CloseEp(id); });
  }

  absl::StatusOr<std::shared_ptr<UcxBuffer>> Buffer(size_t bytes) {
    const size_t cls = SizeClass(bytes);
    UcxBuffer* b = pool_->Take(cls);
    if (b == nullptr) {
      auto made = Run<absl::StatusOr<UcxBuffer*>>([&]() -> absl::StatusOr<UcxBuffer*> {
        if (stopping_) return absl::UnavailableError("UCX worker is stopping");
        auto nb = std::unique_ptr<UcxBuffer>(new UcxBuffer());
        nb->data_ = static_cast<uint8_t*>(std::aligned_alloc(kMinBufferClass, cls));
        if (nb->data_ == nullptr) {
          return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", cls, " bytes"));
        }
        nb->capacity_ = cls;
        ucp_mem_map_params_t mp{};
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        mp.address = nb->data_;
        mp.length = cls;
        ucp_mem_h memh = nullptr;
        if (ucs_status_t s = ucp_mem_map(context_, &mp, &memh); s != UCS_OK) {
          return FromUcs(s, absl::StrCat("ucp_mem_map of ", cls, " bytes"));
        }
        nb->memh_ = memh;
        nb->pool_ = pool_;
        pool_->registered.fetch_add(1);
        pool_->Track(nb.get());
        return nb.release();
      });
      if (!made.ok()) return made.status();
      b = *made;
    }
    std::shared_ptr<UcxBufferPool> pool = pool_;
    return std::shared_ptr<UcxBuffer>(b, [pool](UcxBuffer* x) { pool->Release(x); });
  }

  enum class Kind { kSend, kRecv, kRecvAny, kHello, kRequest, kReply };

  std::shared_ptr<UcxTransfer> Start(Kind kind, uint64_t ep, uint64_t tag,
                                     std::shared_ptr<UcxBuffer> buffer, size_t bytes,
                                     absl::Time deadline, UcxWorker::Done done, size_t chunk,
                                     std::string hello = {}) {
    auto t = std::make_shared<UcxTransfer>();
    t->buffer_ = std::move(buffer);
    t->on_done_ = std::move(done);
    t->deadline_ = deadline;
    t->ep_ = ep;
    t->tag_ = tag;
    t->what_ =
        kind == Kind::kHello     ? std::string("UCX hello")
        : kind == Kind::kRequest ? std::string("UCX request message")
        : kind == Kind::kReply
            ? std::string("UCX reply message")
            : absl::StrCat("UCX ", kind == Kind::kSend ? "send" : "receive", " of tag ", tag);
    if (chunk == 0) chunk = options_.chunk_bytes;
    if ((kind == Kind::kRequest || kind == Kind::kReply) &&
        hello.size() > UcxWorker::kMaxMessageHeader) {
      t->finished_ = true;
      t->Complete(absl::InvalidArgumentError(absl::StrCat(t->what_, ": a header of ", hello.size(),
                                                          " bytes (at most ",
                                                          UcxWorker::kMaxMessageHeader, ")")),
                  0);
      return t;
    }
    if (kind != Kind::kHello && (t->buffer_ == nullptr || bytes > t->buffer_->capacity())) {
      t->finished_ = true;
      t->Complete(absl::InvalidArgumentError(
                      absl::StrCat(t->what_, ": ", bytes, " bytes do not fit the buffer")),
                  0);
      return t;
    }
    in_flight_.fetch_add(1);
    auto op = [this, t, kind, bytes, chunk, hello = std::move(hello)] {
      switch (kind) {
        case Kind::kSend:
          StartSend(t, bytes, chunk);
          break;
        case Kind::kRecv:
          StartRecv(t, bytes, chunk);
          break;
        case Kind::kRecvAny:
          StartRecvAny(t, bytes);
          break;
        case Kind::kHello:
          StartHello(t, hello);
          break;
        case Kind::kRequest:
        case Kind::kReply:
          StartMessage(t, kind == Kind::kRequest ? kRequestAmId : kReplyAmId, hello, bytes);
          break;
      }
    };
    // On this thread when nobody holds the worker (no wake-up of the progress thread), after
    // what was posted before; else queued for the holder.
    if (t_holder != this && progress_mu_.try_lock()) {
      Hold hold(this, /*locked=*/true);
      hold.wake_if_pending = kind != Kind::kRequest && kind != Kind::kReply;
      RunCommands(/*drain_fd=*/false);
      op();
    } else {
      Post(std::move(op));
    }
    return t;
  }

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
                                  const std::function<void(const absl::Status&)>& on_error) {
    auto e = std::make_unique<Endpoint>();
    e->id = next_ep_++;
    e->on_error = on_error;
    e->owner = this;
    e->peer_mode = peer_mode;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(peer.data());
    ep.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (peer_mode) {
      ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.err_handler.cb = &UcxWorkerImpl::OnEpError;
      ep.err_handler.arg = e.get();
    }
    if (ucs_status_t s = ucp_ep_create(worker_, &ep, &e->ep); s != UCS_OK) {
      return FromUcs(s, "ucp_ep_create");
    }
    const uint64_t id = e->id;
    by_handle_[e->ep] = id;
    eps_[id] = std::move(e);
    return id;
  }

  UcxLanes LanesOf(uint64_t id) {
    auto it = eps_.find(id);
    if (it == eps_.end()) return UcxLanes{};
    char* text = nullptr;
    size_t size = 0;
    FILE* f = open_memstream(&text, &size);
    if (f == nullptr) return UcxLanes{};
    ucp_ep_print_info(it->second->ep, f);
    std::fclose(f);
    UcxLanes lanes = ParseUcxLanes(std::string_view(text, size));
    std::free(text);
    return lanes;
  }

  // The id of an endpoint UCX made for a peer (a hello's reply endpoint). Every hello gets an
  // id of its own: UCX releases the endpoint it made for a peer that went away and may make the
  // next peer's at the same address, so a handle already known here belongs to a peer that is
  // gone. Its id is retired (transfers waiting on it fail; sends to it find no endpoint) rather
  // than handed to the new peer, whose endpoint would otherwise be forgotten when the old
  // peer's client is replaced (ucx_data_plane.cc, Open), its acknowledgement never sent.
  uint64_t Adopt(ucp_ep_h h) {
    auto it = by_handle_.find(h);
    if (it != by_handle_.end()) {
      if (eps_.at(it->second)->owned) return it->second;  // one of ours, answered on
      reply_endpoints_reused_.fetch_add(1);
      CloseEp(it->second);
    }
    auto e = std::make_unique<Endpoint>();
    e->id = next_ep_++;
    e->ep = h;
    e->owned = false;
    e->owner = this;
    const uint64_t id = e->id;
    by_handle_[h] = id;
    eps_[id] = std::move(e);
    return id;
  }

  // Any id but the hello's: dropped (data, eager or rendezvous, is released by UCX when we
  // return UCS_OK), counted, never adopted as an endpoint.
  static ucs_status_t OnStrayAm(void* arg, const void*, size_t, void*, size_t,
                                const ucp_am_recv_param_t*) {
    static_cast<UcxWorkerImpl*>(arg)->stray_dropped_.fetch_add(1);
    return UCS_OK;
  }

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* /*data*/,
                           size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxWorkerImpl*>(arg);
    // A hello has a header and no data; a reply endpoint is what it is for. Anything else is
    // dropped (data, eager or rendezvous, is released by UCX when we return UCS_OK).
    const bool has_reply =
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 && param->reply_ep != nullptr;
    if (length != 0 || !has_reply || header_length == 0 || header_length > kMaxHelloBytes ||
        !self->hello_ || self->stopping_) {
      self->hellos_dropped_.fetch_add(1);
      if (self->hello_dropped_ && !self->stopping_) {
        self->hello_dropped_(
            length != 0          ? absl::StrCat("a UCX hello carrying ", length, " bytes of data")
            : !has_reply         ? std::string("a UCX hello without a reply endpoint")
            : header_length == 0 ? std::string("an empty UCX hello")
                                 : absl::StrCat("a UCX hello of ", header_length,
                                                " bytes (at most ", kMaxHelloBytes, ")"));
      }
      return UCS_OK;
    }
    const uint64_t ep = self->Adopt(param->reply_ep);
    self->hello_(std::string_view(static_cast<const char*>(header), header_length), ep,
                 self->LanesOf(ep));
    return UCS_OK;
  }

  // A request (batch message): where the handler says it lands, or dropped.
  static ucs_status_t OnRequestAm(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxWorkerImpl*>(arg);
    if (!self->on_message_ || self->stopping_ || header_length > UcxWorker::kMaxMessageHeader) {
      self->messages_dropped_.fetch_add(1);
      return UCS_OK;
    }
    UcxWorker::MessageSink sink = self->on_message_(
        std::string_view(static_cast<const char*>(header), header_length), length);
    if (sink.buffer == nullptr) {
      self->messages_dropped_.fetch_add(1);
      return UCS_OK;
    }
    auto t = std::make_shared<UcxTransfer>();
    t->buffer_ = std::move(sink.buffer);
    t->on_done_ = std::move(sink.done);
    t->deadline_ = absl::Now() + kMessageReceiveTimeout;
    t->what_ = "UCX request message";
    self->in_flight_.fetch_add(1);
    self->Land(t, data, length, param);
    return UCS_OK;
  }

  // A reply: into the buffer of the ExpectMessage its token names, or dropped.
  static ucs_status_t OnReplyAm(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxWorkerImpl*>(arg);
    uint64_t token = 0;
    if (header_length >= 8 && header_length <= UcxWorker::kMaxMessageHeader) {
      for (int i = 0; i < 8; ++i) {
        token |= static_cast<uint64_t>(static_cast<const uint8_t*>(header)[i]) << (8 * i);
      }
    }
    auto it = header_length >= 8 && header_length <= UcxWorker::kMaxMessageHeader
                  ? self->expected_.find(token)
                  : self->expected_.end();
    if (it == self->expected_.end() || self->stopping_) {
      self->messages_dropped_.fetch_add(1);
      return UCS_OK;
    }
    std::shared_ptr<UcxTransfer> t = std::move(it->second);
    self->expected_.erase(it);
    t->header_.assign(static_cast<const char*>(header), header_length);
    self->Land(t, data, length, param);
    return UCS_OK;
  }

  // A message's payload into its transfer's buffer: copied from an eager message, received
  // straight into the registered buffer for a rendezvous one.
  void Land(const std::shared_ptr<UcxTransfer>& t, void* data, size_t length,
            const ucp_am_recv_param_t* param) {
    if (length > t->buffer_->capacity()) {
      Finish(t,
             absl::InternalError(absl::StrCat(t->what_, ": ", length, " bytes do not fit the ",
                                              t->buffer_->capacity(), "-byte buffer")),
             0);
      return;  // UCX releases the data (a rendezvous one unread)
    }
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
      if (length > 0) std::memcpy(t->buffer_->data(), data, length);
      Finish(t, absl::OkStatus(), length);
      return;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv_am = &UcxWorkerImpl::OnAmData;
    p.user_data = this;
    p.memh = static_cast<ucp_mem_h>(t->buffer_->memh_);
    t->parts_left_ = 1;
    const Part part{t, length, 0};
    starting_ = true;
    starting_part_ = part;
    AdoptRequest(part, ucp_am_recv_data_nbx(worker_, data, t->buffer_->data(), length, &p));
  }

  static void OnAmData(void* request, ucs_status_t status, size_t length, void* user_data) {
    static_cast<UcxWorkerImpl*>(user_data)->Completed(request, status,
                                                      status == UCS_OK ? length : 0);
  }

  void StartMessage(const std::shared_ptr<UcxTransfer>& t, uint16_t id, const std::string& header,
                    size_t bytes) {
    auto it = eps_.find(t->ep_);
    if (stopping_ || it == eps_.end() || it->second->failed) {
      Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the endpoint is closed")), 0);
      return;
    }
    t->header_ = header;  // UCX reads it until the send completes
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    p.cb.send = &UcxWorkerImpl::OnSend;
    p.user_data = this;
    p.memh = static_cast<ucp_mem_h>(t->buffer_->memh_);
    t->parts_left_ = 1;
    it->second->bytes_in_flight += bytes;
    const Part part{t, bytes, it->second->id};
    starting_ = true;
    starting_part_ = part;
    AdoptRequest(part, ucp_am_send_nbx(it->second->ep, id, t->header_.data(), t->header_.size(),
                                       t->buffer_->data(), bytes, &p));
  }

  void Finish(const std::shared_ptr<UcxTransfer>& t, absl::Status s, size_t length) {
    if (t->finished_) return;
    t->finished_ = true;
    if (!s.ok() && t->cancelled_for_deadline_ &&
        (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kCancelled)) {
      s = absl::DeadlineExceededError(absl::StrCat(t->what_, " did not complete by its deadline"));
    }
    in_flight_.fetch_sub(1);
    t->Complete(std::move(s), length, /*release_buffer=*/t->parts_left_ == 0);
  }

  // `n` parts of a transfer that already finished will never complete (never started, or
  // done): once none is left, UCX holds none of its buffer.
  static void PartsGone(UcxTransfer& t, int n) {
    t.parts_left_ -= n;
    if (t.parts_left_ == 0) {
      std::lock_guard<std::mutex> lock(t.mu_);
      t.buffer_.reset();
    }
  }

  // One chunk finished (status s, length n); the transfer finishes with its last chunk.
  void PartDone(const Part& p, absl::Status s, size_t n) {
    UcxTransfer& t = *p.t;
    if (p.ep != 0) {
      auto it = eps_.find(p.ep);
      if (it != eps_.end()) {
        it->second->bytes_in_flight -= std::min(it->second->bytes_in_flight, p.length);
        Pump(*it->second);
      }
    }
    --t.parts_left_;
    if (s.ok() && p.exact && n != p.length) {
      s = absl::InvalidArgumentError(
          absl::StrCat(t.what_, ": a chunk of ", n, " bytes where ", p.length, " were due"));
    }
    if (!s.ok() && t.first_error_.ok()) t.first_error_ = s;
    t.bytes_done_ += n;
    if (!t.first_error_.ok() && !t.finished_) {
      // Fail at once; the buffer stays held until UCX is done with every chunk.
      CancelParts(p.t);
      Finish(p.t, t.first_error_, 0);
    }
    if (t.parts_left_ == 0) {
      if (!t.finished_) {
        Finish(p.t, absl::OkStatus(), t.bytes_done_);
      } else {
        std::lock_guard<std::mutex> lock(t.mu_);
        t.buffer_.reset();  // UCX is done with the memory now
      }
    }
  }

  // After a *_nbx call: r is NULL (done at once), an error, or a request whose callback comes
  // later, or already came inside the call (UCP_OP_ATTR_FLAG_NO_IMM_CMPL: starting_ got it).
  void AdoptRequest(const Part& p, ucs_status_ptr_t r) {
    const bool already = !starting_;
    starting_ = false;
    if (already) return;
    if (r == nullptr) {
      PartDone(p, absl::OkStatus(), p.length);
    } else if (UCS_PTR_IS_ERR(r)) {
      PartDone(p, FromUcs(UCS_PTR_STATUS(r), p.t->what_), 0);
    } else {
      inflight_[r] = p;
    }
  }

  static std::vector<std::pair<size_t, size_t>> Chunks(size_t bytes, size_t chunk) {
    std::vector<std::pair<size_t, size_t>> out;
    for (size_t off = 0; off < bytes || out.empty(); off += chunk) {
      out.emplace_back(off, std::min(chunk, bytes - off));
      if (bytes == 0) break;
    }
    return out;
  }

  void StartSend(const std::shared_ptr<UcxTransfer>& t, size_t bytes, size_t chunk) {
    auto it = eps_.find(t->ep_);
    if (stopping_ || it == eps_.end() || it->second->failed) {
      Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the endpoint is closed")), 0);
      return;
    }
    const auto chunks = Chunks(bytes, chunk);
    t->parts_left_ = static_cast<int>(chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      it->second->waiting.push_back(
          Chunk{t, chunks[i].first, chunks[i].second, t->tag_ + static_cast<uint64_t>(i)});
    }
    Pump(*it->second);
  }

  // Starts waiting chunks while the endpoint's window has room (one always goes).
  void Pump(Endpoint& e) {
    while (!e.waiting.empty() && !stopping_) {
      Chunk c = e.waiting.front();
      if (c.t->finished_) {  // failed or abandoned meanwhile: never started
        e.waiting.pop_front();
        PartsGone(*c.t, 1);
        continue;
      }
      if (e.bytes_in_flight > 0 && e.bytes_in_flight + c.length > options_.max_bytes_in_flight) {
        return;
      }
      e.waiting.pop_front();
      e.bytes_in_flight += c.length;
      ucp_request_param_t p{};
      p.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
      p.cb.send = &UcxWorkerImpl::OnSend;
      p.user_data = this;
      p.memh = static_cast<ucp_mem_h>(c.t->buffer_->memh_);
      const Part part{c.t, c.length, e.id};
      starting_ = true;
      starting_part_ = part;
      AdoptRequest(part,
                   ucp_tag_send_nbx(e.ep, c.t->buffer_->data() + c.offset, c.length, c.tag, &p));
    }
  }

  // Posts one tagged receive of a transfer's part into buffer[offset, offset + room).
  void PostRecv(const Part& part, size_t offset, size_t room, uint64_t tag) {
    ucp_request_param_t p{};
    // Always through the callback, which carries the received length (UCX 1.13 leaves
    // recv_info unset on immediate completion).
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = &UcxWorkerImpl::OnRecv;
    p.user_data = this;
    p.memh = static_cast<ucp_mem_h>(part.t->buffer_->memh_);
    starting_ = true;
    starting_part_ = part;
    AdoptRequest(part, ucp_tag_recv_nbx(worker_, part.t->buffer_->data() + offset, room, tag,
                                        ~ucp_tag_t{0}, &p));
  }

  void StartRecv(const std::shared_ptr<UcxTransfer>& t, size_t bytes, size_t chunk) {
    if (stopping_) {
      Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the worker is stopping")), 0);
      return;
    }
    const auto chunks = Chunks(bytes, chunk);
    t->parts_left_ = static_cast<int>(chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      // The last chunk may take one byte more than due, so a longer message shows as a
      // length error instead of being cut to fit.
      const size_t room = std::min(chunks[i].second + (i + 1 == chunks.size() ? 1 : 0),
                                   t->buffer_->capacity() - chunks[i].first);
      PostRecv(Part{t, chunks[i].second, 0}, chunks[i].first, room,
               t->tag_ + static_cast<uint64_t>(i));
      if (t->finished_) {  // failed at once: the rest are never posted, nor awaited
        PartsGone(*t, static_cast<int>(chunks.size() - i - 1));
        return;
      }
    }
  }

  void StartRecvAny(const std::shared_ptr<UcxTransfer>& t, size_t capacity) {
    if (stopping_) {
      Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the worker is stopping")), 0);
      return;
    }
    t->parts_left_ = 1;
    PostRecv(Part{t, capacity, 0, /*exact=*/false}, 0, capacity, t->tag_);
  }

  void StartHello(const std::shared_ptr<UcxTransfer>& t, const std::string& hello) {
    auto it = eps_.find(t->ep_);
    if (stopping_ || it == eps_.end() || it->second->failed) {
      Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the endpoint is closed")), 0);
      return;
    }
    // UCX reads the header until the send completes: the transfer (held by its request) keeps it.
    t->header_ = hello;
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    p.cb.send = &UcxWorkerImpl::OnSend;
    p.user_data = this;
    t->parts_left_ = 1;
    const Part part{t, 0, 0};
    starting_ = true;
    starting_part_ = part;
    AdoptRequest(part, ucp_am_send_nbx(it->second->ep, kHelloAmId, t->header_.data(),
                                       t->header_.size(), nullptr, 0, &p));
  }

  void Completed(void* request, ucs_status_t status, size_t length) {
    Part p;
    auto it = inflight_.find(request);
    if (it != inflight_.end()) {
      p = std::move(it->second);
      inflight_.erase(it);
    } else if (starting_) {  // inside the nbx call
      p = starting_part_;
      starting_ = false;
    }
    ucp_request_free(request);
    if (p.t == nullptr) return;
    PartDone(p, status == UCS_OK ? absl::OkStatus() : FromUcs(status, p.t->what_), length);
  }

  static void OnSend(void* request, ucs_status_t status, void* user_data) {
    auto* self = static_cast<UcxWorkerImpl*>(user_data);
    // A send's length is its chunk's (sends complete whole or fail).
    size_t n = 0;
    auto it = self->inflight_.find(request);
    if (it != self->inflight_.end()) {
      n = it->second.length;
    } else if (self->starting_) {
      n = self->starting_part_.length;
    }
    self->Completed(request, status, status == UCS_OK ? n : 0);
  }
  static void OnRecv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                     void* user_data) {
    static_cast<UcxWorkerImpl*>(user_data)->Completed(request, status,
                                                      status == UCS_OK ? info->length : 0);
  }

  static void OnEpError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    auto* e = static_cast<Endpoint*>(arg);
    if (e->failed) return;
    e->failed = true;
    if (e->on_error) {
      e->on_error(absl::UnavailableError(
          absl::StrCat("UCX endpoint to the peer failed: ", ucs_status_string(status))));
    }
    e->owner->Post([owner = e->owner, id = e->id] { owner->CloseEp(id); });
  }

  // Cancels the UCX requests of a transfer that failed (its other chunks).
  void CancelParts(const std::shared_ptr<UcxTransfer>& t) {
    std::vector<void*> mine;
    for (auto& [r, p] : inflight_) {
      if (p.t == t) mine.push_back(r);
    }
    for (void* r : mine) {
      if (inflight_.count(r) != 0) ucp_request_cancel(worker_, r);
    }
  }

  void CloseEp(uint64_t id) {
    auto it = eps_.find(id);
    if (it == eps_.end()) return;
    Endpoint& e = *it->second;
    // Chunks never started fail with the endpoint.
    std::deque<Chunk> waiting;
    waiting.swap(e.waiting);
    for (Chunk& c : waiting) {
      if (!c.t->finished_) {
        CancelParts(c.t);
        Finish(c.t, absl::UnavailableError(absl::StrCat(c.t->what_, ": the endpoint is closed")),
               0);
      }
      PartsGone(*c.t, 1);
    }
    // An endpoint UCX made for a peer's hello is UCX's: forgotten here, released with the worker.
    if (e.owned) {
      ucp_request_param_t p{};
      // Forcibly only where both sides have peer error handling (UCX's rule); a flush otherwise.
      if (e.peer_mode) {
        p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      }
      ucs_status_ptr_t r = ucp_ep_close_nbx(e.ep, &p);
      if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing_.push_back(r);
    }
    by_handle_.erase(e.ep);
    closed_.push_back(std::move(it->second));  // the error handler's arg stays valid
    eps_.erase(it);
  }

  void ReapClosing() {
    for (auto it = closing_.begin(); it != closing_.end();) {
      if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
        ucp_request_free(*it);
        it = closing_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Cancels what is past its deadline; returns the time to the next deadline. A transfer UCX
  // has not given back kCancelGrace after its cancel (a send to a dead shared-memory peer) is
  // failed for its caller (abandoned) while its buffer stays held until UCX lets go; an
  // endpoint with peer error handling is closed instead, which fails it.
  absl::Duration CheckDeadlines() {
    const absl::Time now = absl::Now();
    absl::Duration next = absl::Milliseconds(200);
    std::vector<uint64_t> to_close;
    std::vector<void*> to_cancel;
    std::vector<std::shared_ptr<UcxTransfer>> to_abandon;
    for (auto& [key, p] : inflight_) {
      UcxTransfer& t = *p.t;
      if (!t.cancelled_for_deadline_ && now >= t.deadline_) {
        t.cancelled_for_deadline_ = true;
        to_cancel.push_back(key);
      } else if (t.cancelled_for_deadline_ && now >= t.deadline_ + kCancelGrace) {
        auto ep = eps_.find(p.ep);
        if (ep != eps_.end() && ep->second->peer_mode) {
          to_close.push_back(p.ep);
        } else if (!t.finished_) {
          to_abandon.push_back(p.t);
        }
      } else if (!t.cancelled_for_deadline_) {
        next = std::min(next, t.deadline_ - now);
      }
    }
    // Replies expected past their deadline.
    for (auto it = expected_.begin(); it != expected_.end();) {
      if (now >= it->second->deadline_) {
        to_abandon.push_back(std::move(it->second));
        it = expected_.erase(it);
      } else {
        next = std::min(next, it->second->deadline_ - now);
        ++it;
      }
    }
    // Chunks still waiting for their window past the deadline.
    for (auto& [id, e] : eps_) {
      for (Chunk& c : e->waiting) {
        if (!c.t->finished_ && now >= c.t->deadline_) to_abandon.push_back(c.t);
      }
    }
    // ucp_request_cancel may complete the request at once (its callback edits inflight_).
    for (void* r : to_cancel) {
      if (inflight_.count(r) != 0) ucp_request_cancel(worker_, r);
    }
    for (uint64_t ep : to_close) CloseEp(ep);
    for (auto& t : to_abandon) {
      if (t->finished_) continue;
      t->cancelled_for_deadline_ = true;
      Finish(
          t,
          absl::DeadlineExceededError(absl::StrCat(t->what_, " did not complete by its deadline")),
          0);
    }
    for (auto& [id, e] : eps_) Pump(*e);
    return std::max(next, absl::Milliseconds(1));
  }

  // Runs the posted commands; whether there were any.
  // Runs the posted commands; whether there were any. The progress thread also drains the
  // wake-up counter (drain_fd); a poller only looks at the flag (no system call per poll).
  bool RunCommands(bool drain_fd = true) {
    if (drain_fd) {
      uint64_t n;
      (void)!read(wake_fd_, &n, sizeof(n));
    }
    if (!has_commands_.load(std::memory_order_acquire)) return false;
    std::deque<std::function<void()>> todo;
    {
      std::lock_guard<std::mutex> lock(mu_);
      todo.swap(commands_);
      has_commands_.store(false, std::memory_order_relaxed);
    }
    for (auto& f : todo) f();
    return !todo.empty();
  }

  void Loop() {
    absl::Time stop_by = absl::InfiniteFuture();
    // After any activity the thread may keep polling for options_.spin before it sleeps: a round
    // trip is a chain of small steps (rendezvous handshakes, a reply right after a request), and
    // waking from poll() costs tens of microseconds per step in a VM. Off by default: on a
    // machine whose cores the experts need (2 here) spinning measured slower
    // (tests/bench/dispatch_bench.cc); bounded, so an idle data plane costs no CPU.
    auto last_activity = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(progress_mu_, std::defer_lock);
    for (;;) {
      if (!lock.owns_lock()) lock.lock();
      t_holder = this;
      bool active = RunCommands();
      while (ucp_worker_progress(worker_) != 0) active = true;
      const auto now = std::chrono::steady_clock::now();
      if (active) last_activity = now;
      const absl::Duration next = CheckDeadlines();
      ReapClosing();
      if (stopping_) {
        if (stop_by == absl::InfiniteFuture()) {
          stop_by = absl::Now() + kShutdownGrace;
          // A cancel may complete its request at once (the callback edits inflight_).
          std::vector<void*> requests;
          for (auto& [request, p] : inflight_) {
            p.t->cancelled_for_deadline_ = false;
            requests.push_back(request);
          }
          for (void* r : requests) {
            if (inflight_.count(r) != 0) ucp_request_cancel(worker_, r);
          }
          std::vector<uint64_t> ids;
          for (auto& [id, e] : eps_) ids.push_back(id);
          for (uint64_t id : ids) CloseEp(id);
          for (auto& [token, t] : expected_) {
            Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the worker stopped")), 0);
          }
          expected_.clear();
          pool_->Drain();
          continue;
        }
        if ((inflight_.empty() && closing_.empty()) || absl::Now() > stop_by) break;
      }
      if (now - last_activity < options_.spin) continue;
      if (pollers_ > 0) {
        // A waiter polls the worker: the progress thread sleeps unarmed (no peer signals this
        // worker per message) until the last poller leaves (EndPolling wakes it).
        disarmed_ = true;
        t_holder = nullptr;
        lock.unlock();
        pollfd fd = {wake_fd_, POLLIN, 0};
        (void)poll(&fd, 1, static_cast<int>(absl::ToInt64Milliseconds(next)) + 1);
        continue;
      }
      disarmed_ = false;
      if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
      // Asleep without the worker: a waiter may poll it meanwhile.
      t_holder = nullptr;
      lock.unlock();
      // Requests in flight (a send whose caller did not poll on): back within a millisecond.
      const int timeout_ms =
          inflight_.empty() ? static_cast<int>(absl::ToInt64Milliseconds(next)) + 1 : 1;
      pollfd fds[2] = {{efd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      (void)poll(fds, 2, timeout_ms);
    }
    t_holder = nullptr;
    // Whatever UCX did not give back in time: failed here, never left waiting.
    for (auto& [key, p] : inflight_) {
      if (!p.t->finished_) {
        p.t->finished_ = true;
        in_flight_.fetch_sub(1);
        p.t->Complete(absl::UnavailableError(absl::StrCat(p.t->what_, ": the worker stopped")), 0);
      }
    }
    inflight_.clear();
  }

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
  int pollers_ = 0;                        // threads between BeginPolling and EndPolling
  bool disarmed_ = false;                  // the progress thread sleeps without arming
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

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const UcxOptions& options) {
  auto impl = std::make_unique<UcxWorkerImpl>();
  std::string address, tls;
  if (absl::Status s = impl->Init(options, &address, &tls); !s.ok()) return s;
  auto w = std::unique_ptr<UcxWorker>(new UcxWorker(std::move(impl)));
  w->address_ = std::move(address);
  w->tls_ = std::move(tls);
  w->chunk_bytes_ = w->impl_->chunk_bytes();
  w->poll_spin_ = options.poll_spin;
  return w;
}

UcxWorker::UcxWorker(std::unique_ptr<UcxWorkerImpl> impl) : impl_(std::move(impl)) {}
UcxWorker::~UcxWorker() = default;

absl::StatusOr<uint64_t> UcxWorker::Connect(const std::string& peer_address,
                                            std::function<void(const absl::Status&)> on_error) {
  return impl_->Connect(peer_address, std::move(on_error));
}
absl::StatusOr<UcxLanes> UcxWorker::Lanes(uint64_t ep) { return impl_->Lanes(ep); }
void UcxWorker::Disconnect(uint64_t ep) { impl_->Disconnect(ep); }
void UcxWorker::OnHello(HelloFn fn) { impl_->SetHello(std::move(fn)); }
void UcxWorker::OnHelloDropped(HelloDroppedFn fn) { impl_->SetHelloDropped(std::move(fn)); }
std::shared_ptr<UcxTransfer> UcxWorker::SendHello(uint64_t ep, std::string hello,
                                                  absl::Time deadline) {
  return impl_->Start(UcxWorkerImpl::Kind::kHello, ep, 0, nullptr, 0, deadline, nullptr, 0,
                      std::move(hello));
}
int64_t UcxWorker::hellos_dropped() const { return impl_->hellos_dropped(); }
int64_t UcxWorker::stray_messages_dropped() const { return impl_->stray_messages_dropped(); }
int64_t UcxWorker::reply_endpoints_reused() const { return impl_->reply_endpoints_reused(); }
absl::StatusOr<std::shared_ptr<UcxBuffer>> UcxWorker::Buffer(size_t bytes) {
  return impl_->Buffer(bytes);
}
std::shared_ptr<UcxTransfer> UcxWorker::Send(uint64_t ep, uint64_t tag,
                                             std::shared_ptr<UcxBuffer> buffer, size_t bytes,
                                             absl::Time deadline, Done done, size_t chunk_bytes) {
  return impl_->Start(UcxWorkerImpl::Kind::kSend, ep, tag, std::move(buffer), bytes, deadline,
                      std::move(done), chunk_bytes);
}
std::shared_ptr<UcxTransfer> UcxWorker::Recv(uint64_t tag, std::shared_ptr<UcxBuffer> buffer,
                                             size_t bytes, absl::Time deadline, Done done,
                                             size_t chunk_bytes) {
  return impl_->Start(UcxWorkerImpl::Kind::kRecv, 0, tag, std::move(buffer), bytes, deadline,
                      std::move(done), chunk_bytes);
}
std::shared_ptr<UcxTransfer> UcxWorker::RecvAny(uint64_t tag, std::shared_ptr<UcxBuffer> buffer,
                                                absl::Time deadline, Done done) {
  const size_t bytes = buffer != nullptr ? buffer->capacity() : 0;
  return impl_->Start(UcxWorkerImpl::Kind::kRecvAny, 0, tag, std::move(buffer), bytes, deadline,
                      std::move(done), 0);
}
std::shared_ptr<UcxTransfer> UcxWorker::SendMessage(uint64_t ep, Message kind, std::string header,
                                                    std::shared_ptr<UcxBuffer> buffer, size_t bytes,
                                                    absl::Time deadline, Done done) {
  return impl_->Start(
      kind == Message::kRequest ? UcxWorkerImpl::Kind::kRequest : UcxWorkerImpl::Kind::kReply, ep,
      0, std::move(buffer), bytes, deadline, std::move(done), 0, std::move(header));
}
void UcxWorker::OnMessage(MessageFn fn) { impl_->SetMessageHandler(std::move(fn)); }
std::shared_ptr<UcxTransfer> UcxWorker::ExpectMessage(uint64_t token,
                                                      std::shared_ptr<UcxBuffer> buffer,
                                                      absl::Time deadline) {
  return impl_->Expect(token, std::move(buffer), deadline);
}
int64_t UcxWorker::messages_dropped() const { return impl_->messages_dropped(); }
bool UcxWorker::Progress() { return impl_->TryProgress(); }
void UcxWorker::PollUntil(std::chrono::steady_clock::time_point until,
                          const std::function<bool()>& stop) {
  impl_->PollUntil(until, stop);
}
absl::StatusOr<size_t> UcxWorker::Await(UcxTransfer& t, absl::Time deadline,
                                        std::chrono::microseconds spin,
                                        const std::function<bool()>& stop_polling) {
  return impl_->Await(t, deadline, spin, stop_polling);
}
int64_t UcxWorker::transfers_in_flight() const { return impl_->in_flight(); }
int64_t UcxWorker::buffers_registered() const { return impl_->registered(); }

}  // namespace moe::dataplane
