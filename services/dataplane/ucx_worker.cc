#include "services/dataplane/ucx_worker.h"

#include <poll.h>
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

namespace moe::dataplane {

bool UcxBuilt() { return true; }

namespace {

constexpr size_t kMinBufferClass = 4096;
// A transfer cancelled at its deadline that UCX has not given back by this much later (a send
// that cannot be cancelled) has its endpoint closed, which fails it.
constexpr absl::Duration kCancelGrace = absl::Seconds(1);
// How long shutdown waits for cancelled transfers and closing endpoints.
constexpr absl::Duration kShutdownGrace = absl::Seconds(2);

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

// Free registered buffers by size class. Mapping and unmapping run on the progress thread
// (post_), which owns every UCX call; once the worker is gone, buffers are only freed.
class UcxBufferPool {
 public:
  explicit UcxBufferPool(int per_class) : per_class_(per_class) {}

  UcxBuffer* Take(size_t cls) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& list = free_[cls];
    if (list.empty()) return nullptr;
    UcxBuffer* b = list.back();
    list.pop_back();
    return b;
  }

  void Release(UcxBuffer* b) {
    std::unique_lock<std::mutex> lock(mu_);
    auto& list = free_[b->capacity_];
    if (post_ && static_cast<int>(list.size()) < per_class_) {
      list.push_back(b);
      return;
    }
    if (post_) {
      auto post = post_;
      lock.unlock();
      post([b] { delete b; });  // unmapped by ~UcxBuffer on the progress thread
      return;
    }
    lock.unlock();
    b->memh_ = nullptr;  // the context is gone, and with it every registration
    delete b;
  }

  void SetPost(std::function<void(std::function<void()>)> post, ucp_context_h context) {
    std::lock_guard<std::mutex> lock(mu_);
    post_ = std::move(post);
    context_ = context;
  }

  void Track(UcxBuffer* b) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert(b);
  }
  void Untrack(UcxBuffer* b) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(b);
  }

  // Progress thread, at shutdown: unmaps every buffer (UCX must not be cleaned up with a
  // registration left; a buffer still held elsewhere stays readable memory) and frees the free
  // ones; pooling stops.
  void Drain() {
    std::map<size_t, std::vector<UcxBuffer*>> free;
    std::set<UcxBuffer*> live;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free.swap(free_);
      live.swap(live_);
      post_ = nullptr;
    }
    for (UcxBuffer* b : live) {
      if (b->memh_ != nullptr) ucp_mem_unmap(context_, static_cast<ucp_mem_h>(b->memh_));
      b->memh_ = nullptr;
      registered.fetch_sub(1);
    }
    for (auto& [cls, list] : free) {
      for (UcxBuffer* b : list) delete b;
    }
  }

  ucp_context_h context() const { return context_; }
  std::atomic<int64_t> registered{0};

 private:
  const int per_class_;
  std::mutex mu_;
  std::map<size_t, std::vector<UcxBuffer*>> free_;
  std::set<UcxBuffer*> live_;  // every registered buffer, pooled or in use
  std::function<void(std::function<void()>)> post_;
  ucp_context_h context_ = nullptr;
};

UcxBuffer::~UcxBuffer() {
  if (pool_ != nullptr) pool_->Untrack(this);
  if (memh_ != nullptr && pool_ != nullptr) {
    ucp_mem_unmap(pool_->context(), static_cast<ucp_mem_h>(memh_));
    pool_->registered.fetch_sub(1);
  }
  std::free(data_);
}

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

void UcxTransfer::Complete(absl::Status status, size_t length) {
  if (on_done_) on_done_(status, length);
  on_done_ = nullptr;
  std::shared_ptr<UcxBuffer> release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    status_ = std::move(status);
    length_ = length;
    release = std::move(buffer_);  // UCX is done with the memory
  }
  cv_.notify_all();
}

class UcxWorkerImpl {
 public:
  struct Endpoint {
    ucp_ep_h ep = nullptr;
    uint64_t id = 0;
    bool failed = false;
    std::function<void(const absl::Status&)> on_error;
    UcxWorkerImpl* owner = nullptr;
  };

  ~UcxWorkerImpl() {
    Stop();
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  absl::Status Init(const UcxOptions& o, std::string* address, std::string* tls) {
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
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    params.name = o.name.c_str();
    ucs_status_t s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK) return FromUcs(s, absl::StrCat("ucp_init (UCX_TLS ", *tls, ")"));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it
    if (s = ucp_worker_create(context_, &wp, &worker_); s != UCS_OK) {
      return FromUcs(s, "ucp_worker_create");
    }
    if (s = ucp_worker_get_efd(worker_, &efd_); s != UCS_OK)
      return FromUcs(s, "ucp_worker_get_efd");
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
    thread_ = std::thread([this] { Loop(); });
    return absl::OkStatus();
  }

  void Post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      commands_.push_back(std::move(f));
    }
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  template <typename T>
  T Run(std::function<T()> f) {
    std::promise<T> p;
    auto fut = p.get_future();
    Post([&] { p.set_value(f()); });
    return fut.get();
  }

  void Stop() {
    if (!thread_.joinable()) return;
    Post([this] { stopping_ = true; });
    thread_.join();
    RunCommands();  // buffer releases posted while the loop wound down
  }

  absl::StatusOr<uint64_t> Connect(const std::string& peer,
                                   std::function<void(const absl::Status&)> on_error) {
    return Run<absl::StatusOr<uint64_t>>([&]() -> absl::StatusOr<uint64_t> {
      if (stopping_) return absl::UnavailableError("UCX worker is stopping");
      auto e = std::make_unique<Endpoint>();
      e->id = next_ep_++;
      e->on_error = std::move(on_error);
      e->owner = this;
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(peer.data());
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &UcxWorkerImpl::OnEpError;
      ep.err_handler.arg = e.get();
      if (ucs_status_t s = ucp_ep_create(worker_, &ep, &e->ep); s != UCS_OK) {
        return FromUcs(s, "ucp_ep_create");
      }
      const uint64_t id = e->id;
      eps_[id] = std::move(e);
      return id;
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

  std::shared_ptr<UcxTransfer> Start(bool send, uint64_t ep, uint64_t tag,
                                     std::shared_ptr<UcxBuffer> buffer, size_t bytes,
                                     absl::Time deadline, UcxWorker::Done done) {
    auto t = std::make_shared<UcxTransfer>();
    t->buffer_ = std::move(buffer);
    t->on_done_ = std::move(done);
    t->deadline_ = deadline;
    t->ep_ = ep;
    t->tag_ = tag;
    t->what_ = absl::StrCat("UCX ", send ? "send" : "receive", " of tag ", tag);
    if (t->buffer_ == nullptr || bytes > t->buffer_->capacity()) {
      t->Complete(absl::InvalidArgumentError(
                      absl::StrCat(t->what_, ": ", bytes, " bytes do not fit the buffer")),
                  0);
      return t;
    }
    in_flight_.fetch_add(1);
    Post([this, t, send, bytes] { send ? StartSend(t, bytes) : StartRecv(t, bytes); });
    return t;
  }

  int64_t in_flight() const { return in_flight_.load(); }
  int64_t registered() const { return pool_ != nullptr ? pool_->registered.load() : 0; }

 private:
  // Progress thread from here on.
  void Finish(const std::shared_ptr<UcxTransfer>& t, absl::Status s, size_t length) {
    if (!s.ok() && t->cancelled_for_deadline_ &&
        (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kCancelled)) {
      s = absl::DeadlineExceededError(absl::StrCat(t->what_, " did not complete by its deadline"));
    }
    in_flight_.fetch_sub(1);
    t->Complete(std::move(s), length);
  }

  // After a *_nbx call: r is NULL (done at once), an error, or a request whose callback comes
  // later, or already came inside the call (UCP_OP_ATTR_FLAG_NO_IMM_CMPL: starting_ got it).
  void Adopt(const std::shared_ptr<UcxTransfer>& t, ucs_status_ptr_t r, size_t bytes) {
    const bool already = starting_ == nullptr;
    starting_ = nullptr;
    if (already) return;
    if (r == nullptr) {
      Finish(t, absl::OkStatus(), bytes);
    } else if (UCS_PTR_IS_ERR(r)) {
      Finish(t, FromUcs(UCS_PTR_STATUS(r), t->what_), 0);
    } else {
      t->request_ = r;
      inflight_[r] = t;
    }
  }

  void StartSend(const std::shared_ptr<UcxTransfer>& t, size_t bytes) {
    auto it = eps_.find(t->ep_);
    if (stopping_ || it == eps_.end() || it->second->failed) {
      Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the endpoint is closed")), 0);
      return;
    }
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    p.cb.send = &UcxWorkerImpl::OnSend;
    p.user_data = this;
    p.memh = static_cast<ucp_mem_h>(t->buffer_->memh_);
    starting_ = t;
    Adopt(t, ucp_tag_send_nbx(it->second->ep, t->buffer_->data(), bytes, t->tag_, &p), bytes);
  }

  void StartRecv(const std::shared_ptr<UcxTransfer>& t, size_t bytes) {
    if (stopping_) {
      Finish(t, absl::UnavailableError(absl::StrCat(t->what_, ": the worker is stopping")), 0);
      return;
    }
    ucp_request_param_t p{};
    // Always through the callback, which carries the received length (UCX 1.13 leaves
    // recv_info unset on immediate completion).
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = &UcxWorkerImpl::OnRecv;
    p.user_data = this;
    p.memh = static_cast<ucp_mem_h>(t->buffer_->memh_);
    starting_ = t;
    Adopt(t, ucp_tag_recv_nbx(worker_, t->buffer_->data(), bytes, t->tag_, ~ucp_tag_t{0}, &p), 0);
  }

  // The transfer of a request (user_data is the worker; the request is the key of inflight_).
  std::shared_ptr<UcxTransfer> Take(void* request) {
    auto it = inflight_.find(request);
    if (it == inflight_.end()) return nullptr;
    std::shared_ptr<UcxTransfer> t = std::move(it->second);
    inflight_.erase(it);
    return t;
  }

  void Completed(void* request, ucs_status_t status, size_t length) {
    std::shared_ptr<UcxTransfer> t = Take(request);
    if (t == nullptr && starting_ != nullptr) t = std::move(starting_);  // inside the nbx call
    ucp_request_free(request);
    if (t == nullptr) return;
    t->request_ = nullptr;
    Finish(t, status == UCS_OK ? absl::OkStatus() : FromUcs(status, t->what_), length);
  }

  static void OnSend(void* request, ucs_status_t status, void* user_data) {
    static_cast<UcxWorkerImpl*>(user_data)->Completed(request, status, 0);
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

  void CloseEp(uint64_t id) {
    auto it = eps_.find(id);
    if (it == eps_.end()) return;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(it->second->ep, &p);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing_.push_back(r);
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

  // Cancels what is past its deadline; returns the time to the next deadline.
  absl::Duration CheckDeadlines() {
    const absl::Time now = absl::Now();
    absl::Duration next = absl::Milliseconds(200);
    std::vector<uint64_t> to_close;
    std::vector<void*> to_cancel;
    for (auto& [key, t] : inflight_) {
      if (!t->cancelled_for_deadline_ && now >= t->deadline_) {
        t->cancelled_for_deadline_ = true;
        to_cancel.push_back(t->request_);
      } else if (t->cancelled_for_deadline_ && now >= t->deadline_ + kCancelGrace && t->ep_ != 0) {
        to_close.push_back(t->ep_);
      } else if (!t->cancelled_for_deadline_) {
        next = std::min(next, t->deadline_ - now);
      }
    }
    // ucp_request_cancel may complete the request at once (its callback edits inflight_).
    for (void* r : to_cancel) {
      if (inflight_.count(r) != 0) ucp_request_cancel(worker_, r);
    }
    for (uint64_t ep : to_close) CloseEp(ep);
    return std::max(next, absl::Milliseconds(1));
  }

  void RunCommands() {
    uint64_t n;
    (void)!read(wake_fd_, &n, sizeof(n));
    std::deque<std::function<void()>> todo;
    {
      std::lock_guard<std::mutex> lock(mu_);
      todo.swap(commands_);
    }
    for (auto& f : todo) f();
  }

  void Loop() {
    absl::Time stop_by = absl::InfiniteFuture();
    for (;;) {
      RunCommands();
      while (ucp_worker_progress(worker_) != 0) {
      }
      const absl::Duration next = CheckDeadlines();
      ReapClosing();
      if (stopping_) {
        if (stop_by == absl::InfiniteFuture()) {
          stop_by = absl::Now() + kShutdownGrace;
          // A cancel may complete its request at once (the callback edits inflight_).
          std::vector<void*> requests;
          for (auto& [request, t] : inflight_) {
            t->cancelled_for_deadline_ = false;
            requests.push_back(request);
          }
          for (void* r : requests) {
            if (inflight_.count(r) != 0) ucp_request_cancel(worker_, r);
          }
          std::vector<uint64_t> ids;
          for (auto& [id, e] : eps_) ids.push_back(id);
          for (uint64_t id : ids) CloseEp(id);
          pool_->Drain();
          continue;
        }
        if ((inflight_.empty() && closing_.empty()) || absl::Now() > stop_by) break;
      }
      if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
      pollfd fds[2] = {{efd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      (void)poll(fds, 2, static_cast<int>(absl::ToInt64Milliseconds(next)) + 1);
    }
    // Whatever UCX did not give back in time: failed here, never left waiting.
    for (auto& [key, t] : inflight_) {
      in_flight_.fetch_sub(1);
      t->Complete(absl::UnavailableError(absl::StrCat(t->what_, ": the worker stopped")), 0);
    }
    inflight_.clear();
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::mutex mu_;
  std::deque<std::function<void()>> commands_;
  std::shared_ptr<UcxBufferPool> pool_;
  std::atomic<int64_t> in_flight_{0};
  // Progress thread only.
  bool stopping_ = false;
  uint64_t next_ep_ = 1;
  std::map<uint64_t, std::unique_ptr<Endpoint>> eps_;
  std::vector<std::unique_ptr<Endpoint>> closed_;
  std::vector<void*> closing_;
  std::unordered_map<void*, std::shared_ptr<UcxTransfer>> inflight_;  // by request
  std::shared_ptr<UcxTransfer> starting_;  // the transfer whose *_nbx call is running
};

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const UcxOptions& options) {
  auto impl = std::make_unique<UcxWorkerImpl>();
  std::string address, tls;
  if (absl::Status s = impl->Init(options, &address, &tls); !s.ok()) return s;
  auto w = std::unique_ptr<UcxWorker>(new UcxWorker(std::move(impl)));
  w->address_ = std::move(address);
  w->tls_ = std::move(tls);
  return w;
}

UcxWorker::UcxWorker(std::unique_ptr<UcxWorkerImpl> impl) : impl_(std::move(impl)) {}
UcxWorker::~UcxWorker() = default;

absl::StatusOr<uint64_t> UcxWorker::Connect(const std::string& peer_address,
                                            std::function<void(const absl::Status&)> on_error) {
  return impl_->Connect(peer_address, std::move(on_error));
}
void UcxWorker::Disconnect(uint64_t ep) { impl_->Disconnect(ep); }
absl::StatusOr<std::shared_ptr<UcxBuffer>> UcxWorker::Buffer(size_t bytes) {
  return impl_->Buffer(bytes);
}
std::shared_ptr<UcxTransfer> UcxWorker::Send(uint64_t ep, uint64_t tag,
                                             std::shared_ptr<UcxBuffer> buffer, size_t bytes,
                                             absl::Time deadline, Done done) {
  return impl_->Start(true, ep, tag, std::move(buffer), bytes, deadline, std::move(done));
}
std::shared_ptr<UcxTransfer> UcxWorker::Recv(uint64_t tag, std::shared_ptr<UcxBuffer> buffer,
                                             absl::Time deadline, Done done) {
  const size_t bytes = buffer != nullptr ? buffer->capacity() : 0;
  return impl_->Start(false, 0, tag, std::move(buffer), bytes, deadline, std::move(done));
}
int64_t UcxWorker::transfers_in_flight() const { return impl_->in_flight(); }
int64_t UcxWorker::buffers_registered() const { return impl_->registered(); }

}  // namespace moe::dataplane
