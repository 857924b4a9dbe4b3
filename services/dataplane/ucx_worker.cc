#include "services/dataplane/ucx_worker.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
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

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "services/common/poll_window.h"
#include "services/common/status_macros.h"
#include "services/dataplane/net_interface.h"
#include "services/dataplane/ucx_buffer_pool.h"
#include "services/dataplane/ucx_worker_impl.h"

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

// UCX's shared-memory FIFO (the posix and sysv lanes), sized here where the environment does not
// say: UCX's own 64 elements of 8 KiB move a 2 MiB reply in 256 fragments and stop the sender
// every 64 until the receiver drains them, each stop a sleeping wake-up on both sides (31-39
// context switches per T = 256 round trip of dispatch_bench); 128 elements of 32 KiB keep 4 MiB
// in flight (11-17 switches, p99 3.1-5.0 ms against 8.1-9.3: docs/data-plane.md).
// The MM_ names reach the shared-memory transports only (posix, sysv, xpmem: their common table);
// each is left alone where the user set it for any of them (UCX_POSIX_FIFO_SIZE...).
struct UcxSetting {
  const char* name;  // as ucp_config_modify takes it
  const char* value;
  const char* ucx_default;            // UCX 1.13's own (kUcxDefaultFifo)
  std::vector<const char*> user_env;  // posix's first; any of them set: the user's choice stands
};
const UcxSetting kSharedMemoryFifo[] = {
    {"MM_FIFO_SIZE",
     "128",
     "64",
     {"UCX_POSIX_FIFO_SIZE", "UCX_SYSV_FIFO_SIZE", "UCX_XPMEM_FIFO_SIZE"}},
    {"MM_SEG_SIZE",
     "32832",
     "8256",
     {"UCX_POSIX_SEG_SIZE", "UCX_SYSV_SEG_SIZE", "UCX_XPMEM_SEG_SIZE"}},
};
// UCX 1.13 keeps a fragment's length in 16 bits (uct_mm_fifo_element's `length`): with a larger
// segment, fragments are lost without an error and the message never arrives.
constexpr uint64_t kMaxSharedMemorySegment = 65535;

const char* Env(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && *env != '\0' ? env : nullptr;
}

// Whether UCX_TLS (as UcxWorker reports it: "default" for UCX's choice) may select a
// shared-memory transport; elsewhere the MM_ names would only be warned about.
bool MaySelectSharedMemory(const std::string& tls) {
  if (tls == "default" || tls.empty() || tls[0] == '^') return true;  // UCX's choice, exclusions
  for (const char* t : {"posix", "sysv", "xpmem", "sm", "shm", "mm", "all"}) {
    for (absl::string_view item : absl::StrSplit(tls, ',')) {
      if (absl::StripAsciiWhitespace(item) == t) return true;
    }
  }
  return false;
}

// What posix's FIFO gets for setting `s` under UCX_TLS `tls`, and whether it is ours to ask UCX
// for: the user's UCX_POSIX_* value; UCX's own where the user set only another transport's or
// shared memory cannot be picked; else ours. Both the sizing and the shape a worker reports
// come from here, so the shape is what UCX was asked for.
struct Resolved {
  std::string value;
  bool ours = false;
};
Resolved Resolve(const UcxSetting& s, const std::string& tls) {
  if (const char* posix = Env(s.user_env[0])) return {posix, false};
  for (const char* e : s.user_env) {
    if (Env(e) != nullptr) return {s.ucx_default, false};
  }
  if (!MaySelectSharedMemory(tls)) return {s.ucx_default, false};
  return {s.value, true};
}

absl::Status SizeSharedMemoryFifo(ucp_config_t* config, const std::string& tls) {
  for (const char* seg : {"UCX_POSIX_SEG_SIZE", "UCX_SYSV_SEG_SIZE"}) {
    const char* env = Env(seg);
    if (env == nullptr) continue;
    char* end = nullptr;
    const uint64_t v = std::strtoull(env, &end, 10);
    // UCX also takes suffixes (32k, 1m): counted as their value.
    const uint64_t scale = (*end == 'k' || *end == 'K')   ? uint64_t{1} << 10
                           : (*end == 'm' || *end == 'M') ? uint64_t{1} << 20
                                                          : 1;
    if (v > kMaxSharedMemorySegment / scale) {
      return absl::InvalidArgumentError(absl::StrCat(
          seg, "=", env, ": UCX 1.13 loses shared-memory fragments over ", kMaxSharedMemorySegment,
          " bytes without an error (their length is 16 bits); use at most that"));
    }
  }
  for (const UcxSetting& s : kSharedMemoryFifo) {
    if (!Resolve(s, tls).ours) continue;
    if (ucs_status_t st = ucp_config_modify(config, s.name, s.value); st != UCS_OK) {
      return absl::InternalError(
          absl::StrCat("UCX ", s.name, "=", s.value, ": ", ucs_status_string(st)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string SharedMemoryFifoShape(const std::string& tls) {
  return absl::StrCat(Resolve(kSharedMemoryFifo[0], tls).value, "x",
                      Resolve(kSharedMemoryFifo[1], tls).value);
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

UcxWorkerImpl::~UcxWorkerImpl() {
  Stop();
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

absl::Status UcxWorkerImpl::Init(const UcxOptions& o, std::string* address, std::string* tls) {
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
  if (absl::Status s = SizeSharedMemoryFifo(config, *tls); !s.ok()) {
    ucp_config_release(config);
    return s;
  }
  if (!o.bind_host.empty() && !NamesVerbs(*tls)) {
    absl::StatusOr<std::string> iface = InterfaceOf(o.bind_host);
    if (!iface.ok()) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(absl::StrCat("UCX data plane: ", iface.status().message()));
    }
    if (!iface->empty()) {
      if (ucs_status_t s = ucp_config_modify(config, "NET_DEVICES", iface->c_str()); s != UCS_OK) {
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
  if (s = ucp_worker_get_efd(worker_, &efd_); s != UCS_OK) return FromUcs(s, "ucp_worker_get_efd");
  MOE_RETURN_IF_ERROR(SetAmHandlers());
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

// A handler on every active message id (ucx_worker.h, stray_messages_dropped), highest first so
// that UCX sizes its table once; then the hello, request and reply ids' own.
absl::Status UcxWorkerImpl::SetAmHandlers() {
  ucs_status_t s = UCS_OK;
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
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
  return absl::OkStatus();
}

void UcxWorkerImpl::Post(std::function<void()> f) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(f));
    has_commands_.store(true, std::memory_order_release);
  }
  Wake();
}

void UcxWorkerImpl::Wake() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

bool UcxWorkerImpl::TryProgress() {
  if (t_holder == this || !progress_mu_.try_lock()) return false;
  Hold hold(this, /*locked=*/true);
  bool active = RunCommands(/*drain_fd=*/false);
  while (ucp_worker_progress(worker_) != 0) active = true;
  active |= RunCommands(/*drain_fd=*/false);  // what the callbacks queued (a hello's ack)
  return active;
}

void UcxWorkerImpl::BeginPolling() {
  std::lock_guard<std::mutex> lock(progress_mu_);
  ++pollers_;
}

void UcxWorkerImpl::EndPolling(bool hand_off) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    const bool last = --pollers_ == 0;
    if (last) {
      // Handed back: the grace is over at once.
      last_poll_end_ns_.store(
          hand_off ? 0 : std::chrono::steady_clock::now().time_since_epoch().count(),
          std::memory_order_relaxed);
    }
    wake = last && hand_off && (disarmed_ || !inflight_.empty());
  }
  if (wake) Wake();
}

bool UcxWorkerImpl::PollUntil(std::chrono::steady_clock::time_point until,
                              const std::function<bool()>& stop) {
  if (t_holder == this) return false;
  BeginPolling();
  // Between empty polls a pause, and the CPU to whoever else is runnable every 8th
  // (PollPause), so a poll costs no one a time slice.
  bool stopped = false;
  int empty = 0;
  while (!(stopped = stop()) && std::chrono::steady_clock::now() < until) {
    if (TryProgress()) {
      empty = 0;
    } else {
      PollPause(&empty);
    }
  }
  EndPolling(/*hand_off=*/!stopped);
  return stopped;
}

absl::StatusOr<size_t> UcxWorkerImpl::Await(UcxTransfer& t, absl::Time deadline,
                                            std::chrono::microseconds spin,
                                            const std::function<bool()>& stop_polling) {
  if (spin.count() > 0) {
    PollUntil(std::chrono::steady_clock::now() + spin,
              [&] { return t.done() || (stop_polling && stop_polling()); });
  }
  return t.Wait(deadline);
}

void UcxWorkerImpl::SetMessageHandler(UcxWorker::MessageFn fn) {
  Run<bool>([&] {
    on_message_ = std::move(fn);
    return true;
  });
}

std::shared_ptr<UcxTransfer> UcxWorkerImpl::Expect(uint64_t token,
                                                   std::shared_ptr<UcxBuffer> buffer,
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

void UcxWorkerImpl::Stop() {
  if (!thread_.joinable()) return;
  Post([this] { stopping_ = true; });
  thread_.join();
  Hold hold(this);
  RunCommands();  // buffer releases posted while the loop wound down
}

void UcxWorkerImpl::SetHello(UcxWorker::HelloFn fn) {
  Run<bool>([&] {
    hello_ = std::move(fn);
    return true;
  });
}

void UcxWorkerImpl::SetHelloDropped(UcxWorker::HelloDroppedFn fn) {
  Run<bool>([&] {
    hello_dropped_ = std::move(fn);
    return true;
  });
}

absl::StatusOr<uint64_t> UcxWorkerImpl::Connect(const std::string& peer,
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

absl::StatusOr<UcxLanes> UcxWorkerImpl::Lanes(uint64_t id) {
  return Run<absl::StatusOr<UcxLanes>>([&]() -> absl::StatusOr<UcxLanes> {
    if (eps_.count(id) == 0) return absl::NotFoundError(absl::StrCat("no UCX endpoint ", id));
    return LanesOf(id);
  });
}

void UcxWorkerImpl::Disconnect(uint64_t id) {
  Post([this, id] { CloseEp(id); });
}

absl::StatusOr<std::shared_ptr<UcxBuffer>> UcxWorkerImpl::Buffer(size_t bytes) {
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

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const UcxOptions& options) {
  auto impl = std::make_unique<UcxWorkerImpl>();
  std::string address, tls;
  if (absl::Status s = impl->Init(options, &address, &tls); !s.ok()) return s;
  auto w = std::unique_ptr<UcxWorker>(new UcxWorker(std::move(impl)));
  w->address_ = std::move(address);
  w->shm_fifo_ = SharedMemoryFifoShape(tls);
  w->tls_ = std::move(tls);
  w->chunk_bytes_ = w->impl_->chunk_bytes();
  w->poll_spin_ = options.poll_spin;
  w->poll_spin_max_ = options.poll_spin_max;
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
                                                    absl::Time deadline, Done done, size_t offset) {
  return impl_->Start(
      kind == Message::kRequest ? UcxWorkerImpl::Kind::kRequest : UcxWorkerImpl::Kind::kReply, ep,
      0, std::move(buffer), bytes, deadline, std::move(done), 0, std::move(header), offset);
}
void UcxWorker::OnMessage(MessageFn fn) { impl_->SetMessageHandler(std::move(fn)); }
std::shared_ptr<UcxTransfer> UcxWorker::ExpectMessage(uint64_t token,
                                                      std::shared_ptr<UcxBuffer> buffer,
                                                      absl::Time deadline) {
  return impl_->Expect(token, std::move(buffer), deadline);
}
int64_t UcxWorker::messages_dropped() const { return impl_->messages_dropped(); }
bool UcxWorker::Progress() { return impl_->TryProgress(); }
bool UcxWorker::PollUntil(std::chrono::steady_clock::time_point until,
                          const std::function<bool()>& stop) {
  return impl_->PollUntil(until, stop);
}
absl::StatusOr<size_t> UcxWorker::Await(UcxTransfer& t, absl::Time deadline,
                                        std::chrono::microseconds spin,
                                        const std::function<bool()>& stop_polling) {
  return impl_->Await(t, deadline, spin, stop_polling);
}
absl::StatusOr<size_t> UcxWorker::Await(UcxTransfer& t, absl::Time deadline, PollWindow& window,
                                        std::chrono::steady_clock::time_point started,
                                        const std::function<bool()>& stop_polling) {
  // Until started + the window, at least the floor from now (0 with a floor of 0: no polling),
  // never past the deadline (which may be infinite).
  auto spin = std::max<std::chrono::steady_clock::duration>(
      window.floor(), started + window.Window() - std::chrono::steady_clock::now());
  const absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
  if (absl::FromChrono(spin) > left) spin = absl::ToChronoNanoseconds(left);
  absl::StatusOr<size_t> n = impl_->Await(
      t, deadline, std::chrono::duration_cast<std::chrono::microseconds>(spin), stop_polling);
  const auto waited = std::chrono::steady_clock::now() - started;
  if (t.done() || waited > window.ceiling()) window.Record(waited);
  return n;
}
int64_t UcxWorker::transfers_in_flight() const { return impl_->in_flight(); }
int64_t UcxWorker::buffers_registered() const { return impl_->registered(); }

}  // namespace moe::dataplane
