#include "expert-svc/dataplane/shm/shm_server_half.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "expert-svc/data_plane_clients.h"
#include "services/common/logging.h"
#include "services/common/poll_window.h"
#include "services/common/status_macros.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/shm_lane.h"

namespace moe::expert_svc {

namespace {

using Clock = std::chrono::steady_clock;
using dataplane::OwnedFd;

// A connection that has not said hello within this is closed; at most this many wait at once.
constexpr auto kHelloWithin = std::chrono::seconds(2);
constexpr size_t kMaxPending = 64;
// How long a reply waits for room in a node's full ring before it is dropped ("reply_failed").
constexpr absl::Duration kFullRingWait = absl::Milliseconds(50);
// A wake-up reads at most this many requests of one client before it looks at the others.
constexpr int kMaxPerDrain = 64;
// epoll keys: a connection's number times two, plus one for its doorbell; 0 for the listener.
constexpr uint64_t kListenerKey = 0, kStopKey = 1;

struct Client {
  uint64_t id = 0, conn = 0;
  std::string node;
  OwnedFd socket, doorbell /* ours: the node rings it */, node_doorbell;
  dataplane::ShmRegion region;
  dataplane::ShmRing requests, replies;
  std::mutex rx_mu;                  // the request ring's reader
  std::mutex tx_mu;                  // the reply ring's writer
  std::atomic<bool> dropped{false};  // its rings are read no more
};

// A reply's slot in its client's ring, reserved before the outputs are computed into it:
// published by ReplyBatchFrom, or given up (a filler) if it is dropped unsent.
class ShmReplyBuffer final : public ReplyBuffer {
 public:
  ShmReplyBuffer(std::shared_ptr<Client> c, dataplane::ShmRing::Slot slot)
      : client(std::move(c)), slot(slot) {}
  ~ShmReplyBuffer() override {
    if (sent) return;
    std::lock_guard<std::mutex> lock(client->tx_mu);
    client->replies.Abandon(slot);
  }
  uint8_t* payload() override { return slot.payload; }

  const std::shared_ptr<Client> client;
  const dataplane::ShmRing::Slot slot;
  bool sent = false;
};

class ShmServerHalf final : public ServerHalf {
 public:
  explicit ShmServerHalf(ServerHalfOptions o)
      : options_(std::move(o)),
        clients_(options_.max_clients),
        max_ring_(std::min<uint64_t>(
            dataplane::kShmMaxRing,
            (2 * static_cast<uint64_t>(options_.max_message_bytes) + (4 << 20)) / 4096 * 4096)) {}
  ~ShmServerHalf() override {
    stop_.store(true);
    dataplane::Ring(stop_fd_.get());
    if (thread_.joinable()) thread_.join();
  }

  absl::Status Start() {
    MOE_ASSIGN_OR_RETURN(listener_, dataplane::ListenAbstract("moe-shm"));
    MOE_ASSIGN_OR_RETURN(stop_fd_, dataplane::NewEventFd());
    epoll_ = OwnedFd(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_.valid()) return absl::InternalError("epoll_create1 failed");
    Watch(listener_.fd.get(), kListenerKey);
    Watch(stop_fd_.get(), kStopKey);
    thread_ = std::thread([this] { Loop(); });
    return absl::OkStatus();
  }

  const char* name() const override { return "shm"; }
  std::string Describe() const override {
    return absl::StrCat("memfd rings, hello on the Unix socket ", listener_.address);
  }
  std::string tls() const override { return ""; }
  const std::string& address() const override { return listener_.address; }

  absl::Status Open(const std::string& node, v1::OpenDataPlaneReply* reply) override {
    uint64_t replaced = 0;
    absl::StatusOr<DataPlaneClient> c = clients_.Open(node, &replaced);
    if (!c.ok()) return c.status();
    if (replaced != 0) DropConn(replaced, "replaced by a new one of its node");
    reply->set_transport(name());
    reply->set_client_id(c->id);
    reply->set_worker_address(listener_.address);
    reply->set_hello_secret(c->hello_secret);
    reply->set_batch_messages(true);
    return absl::OkStatus();
  }

  absl::Status ReplyBatch(const BatchSource& to, std::string_view header, std::string_view payload,
                          absl::Time deadline) override {
    if (header.size() > dataplane::kMaxReplyHeaderBytes) {
      return absl::InternalError(absl::StrCat("a reply header of ", header.size(), " bytes"));
    }
    std::shared_ptr<Client> c = ById(to.client_id);
    if (c == nullptr) {
      return absl::UnavailableError(absl::StrCat("unknown data-plane client ", to.client_id));
    }
    std::lock_guard<std::mutex> lock(c->tx_mu);
    // A node that does not read its replies costs this thread at most kFullRingWait a batch.
    deadline = std::min(deadline, absl::Now() + kFullRingWait);
    absl::StatusOr<dataplane::ShmRing::Slot> s =
        dataplane::ReserveWithin(c->replies, header.size(), payload.size(), deadline);
    if (!s.ok()) {
      if (absl::IsDataLoss(s.status())) DropConn(c->conn, s.status().message());
      Count("reply_failed");
      return absl::Status(s.status().code(), absl::StrCat("reply to client ", to.client_id, ": ",
                                                          s.status().message()));
    }
    std::memcpy(s->header, header.data(), header.size());
    std::memcpy(s->payload, payload.data(), payload.size());
    c->replies.Publish(*s, {to.token, to.sequence});
    return absl::OkStatus();
  }

  std::unique_ptr<ReplyBuffer> NewReplyBuffer(const BatchSource& to, size_t bytes) override {
    std::shared_ptr<Client> c = ById(to.client_id);
    if (c == nullptr) return nullptr;
    std::lock_guard<std::mutex> lock(c->tx_mu);
    // Room for the largest header: the one sent may be shorter (a filler takes the rest).
    absl::StatusOr<dataplane::ShmRing::Slot> s =
        c->replies.Reserve(dataplane::kMaxReplyHeaderBytes, bytes);
    if (!s.ok()) return nullptr;  // full now: ReplyBatch waits for room, and copies
    return std::make_unique<ShmReplyBuffer>(std::move(c), *s);
  }

  absl::Status ReplyBatchFrom(const BatchSource& to, std::string_view header,
                              std::unique_ptr<ReplyBuffer> filled, absl::Time deadline) override {
    auto* mine = dynamic_cast<ShmReplyBuffer*>(filled.get());
    if (mine == nullptr || mine->client->id != to.client_id) {
      return ServerHalf::ReplyBatchFrom(to, header, nullptr, deadline);
    }
    if (header.size() > dataplane::kMaxReplyHeaderBytes) {
      return absl::InternalError(absl::StrCat("a reply header of ", header.size(), " bytes"));
    }
    std::lock_guard<std::mutex> lock(mine->client->tx_mu);
    std::memcpy(dataplane::ShmRing::HeaderAt(mine->slot, header.size()), header.data(),
                header.size());
    mine->client->replies.Publish(mine->slot, {to.token, to.sequence}, header.size());
    mine->sent = true;
    return absl::OkStatus();
  }

  std::string lanes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return by_id_.empty() ? "" : "shm";
  }

  // The compute thread between batches: reads every ring itself, while the doorbells stay
  // quiet (nobody sleeps), then says it sleeps again and looks once more.
  void PollUntil(Clock::time_point until, const std::function<bool()>& stop) override {
    polling_.fetch_add(1);
    std::vector<std::shared_ptr<Client>> all = All();
    for (auto& c : all) c->requests.SetSleeping(false);
    uint64_t seen = generation_.load();
    for (int empty = 0; Clock::now() < until && !stop();) {
      bool any = false;
      for (auto& c : all) {
        if (c->requests.MaybeReady()) any |= DrainIfFree(c);
      }
      if (!any) PollPause(&empty);
      if (generation_.load() != seen) {  // a client said hello or left meanwhile
        seen = generation_.load();
        all = All();
        for (auto& c : all) c->requests.SetSleeping(false);
      }
    }
    polling_.fetch_sub(1);
    for (auto& c : all) c->requests.SetSleeping(true);
    for (auto& c : all) DrainIfFree(c);
  }
  std::chrono::microseconds poll_spin() const override { return options_.poll_spin; }

 private:
  void Watch(int fd, uint64_t key) {
    epoll_event e{};
    e.events = EPOLLIN | EPOLLRDHUP;
    e.data.u64 = key;
    (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &e);
  }

  void Loop() {
    epoll_event events[64];
    while (!stop_.load()) {
      for (auto& c : All()) {
        if (polling_.load() == 0) c->requests.SetSleeping(true);
        DrainIfFree(c);  // what came before it said so
      }
      const int n = ::epoll_wait(epoll_.get(), events, 64, 100);
      for (int i = 0; i < n; ++i) {
        const uint64_t key = events[i].data.u64;
        if (key == kStopKey) return;
        if (key == kListenerKey) {
          Accept();
        } else if (key % 2 == 1) {
          if (std::shared_ptr<Client> c = ByConn(key / 2)) {
            dataplane::Drain(c->doorbell.get());
            Drain(c);
          }
        } else {
          OnSocket(key / 2);
        }
      }
      ExpirePending();
    }
  }

  void Accept() {
    for (;;) {
      OwnedFd s(::accept4(listener_.fd.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!s.valid()) return;
      absl::StatusOr<uint32_t> uid = dataplane::PeerUid(s.get());
      if (!uid.ok() || *uid != ::geteuid() || pending_.size() >= kMaxPending) {
        Count("hello_rejected");
        continue;
      }
      const uint64_t conn = next_conn_++;
      Watch(s.get(), conn * 2);
      pending_[conn] = {std::move(s), Clock::now()};
    }
  }

  void ExpirePending() {
    const auto now = Clock::now();
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (now - it->second.since > kHelloWithin) {
        Count("hello_rejected");
        it = pending_.erase(it);  // closing it takes it out of the epoll set
      } else {
        ++it;
      }
    }
  }

  // A pending connection's hello, or anything at all from a bound one (it sends nothing after
  // its hello: the connection ends).
  void OnSocket(uint64_t conn) {
    auto p = pending_.find(conn);
    if (p == pending_.end()) {
      DropConn(conn, "its socket closed or spoke after its hello");
      return;
    }
    absl::StatusOr<dataplane::Datagram> d =
        dataplane::ReceiveWithFds(p->second.socket.get(), dataplane::kHelloBytes + 8, 3);
    if (!d.ok() && absl::IsUnavailable(d.status())) return;
    OwnedFd socket = std::move(p->second.socket);
    pending_.erase(p);
    if (!d.ok()) return Count("hello_rejected");
    absl::Status bound = Bind(conn, std::move(socket), std::move(*d));
    if (!bound.ok()) {
      MOE_LOG_WARN("shard {}: shm hello refused: {}", options_.shard, bound.ToString());
      Count("hello_rejected");
    }
  }

  absl::Status Bind(uint64_t conn, OwnedFd socket, dataplane::Datagram d) {
    if (d.bytes.size() != dataplane::kHelloBytes + 8 || d.fds.size() != 3) {
      return absl::InvalidArgumentError(
          absl::StrCat("a hello of ", d.bytes.size(), " bytes and ", d.fds.size(), " descriptors"));
    }
    uint64_t ring = 0;
    std::memcpy(&ring, d.bytes.data() + dataplane::kHelloBytes, sizeof ring);
    if (ring > max_ring_) {
      return absl::InvalidArgumentError(
          absl::StrCat("rings of ", ring, " bytes (at most ", max_ring_, ")"));
    }
    // The secret first: nothing of a stranger's descriptors is looked at.
    absl::StatusOr<DataPlaneClient> bound =
        clients_.Bind(std::string_view(d.bytes).substr(0, dataplane::kHelloBytes), conn);
    if (!bound.ok()) return bound.status();
    if (!dataplane::IsEventFd(d.fds[1].get()) || !dataplane::IsEventFd(d.fds[2].get())) {
      return absl::InvalidArgumentError("a doorbell that is not an eventfd");
    }
    MOE_ASSIGN_OR_RETURN(dataplane::ShmRegion region,
                         dataplane::ShmRegion::Map(std::move(d.fds[0]), ring));
    auto c = std::make_shared<Client>();
    c->id = bound->id;
    c->conn = conn;
    c->node = bound->node;
    c->socket = std::move(socket);
    c->doorbell = std::move(d.fds[1]);
    c->node_doorbell = std::move(d.fds[2]);
    c->region = std::move(region);
    c->requests = c->region.Ring(dataplane::ShmDirection::kToShard, -1);
    c->replies = c->region.Ring(dataplane::ShmDirection::kToNode, c->node_doorbell.get());
    c->requests.SetSleeping(true);
    Watch(c->doorbell.get(), conn * 2 + 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      by_conn_[conn] = c;
      by_id_[c->id] = c;
    }
    generation_.fetch_add(1);
    MOE_RETURN_IF_ERROR(dataplane::SendWithFds(c->socket.get(), "MOEAshm", {}));
    MOE_LOG_INFO("shard {}: data-plane client {} ({}) said hello over shm (rings of {} bytes)",
                 options_.shard, c->id, c->node, ring);
    return absl::OkStatus();
  }

  // False when it was dropped already (by another thread that saw the same).
  bool DropConn(uint64_t conn, absl::string_view why) {
    std::shared_ptr<Client> c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = by_conn_.find(conn);
      if (it == by_conn_.end()) return false;
      c = it->second;
      by_conn_.erase(it);
      auto id = by_id_.find(c->id);
      if (id != by_id_.end() && id->second == c) by_id_.erase(id);
    }
    generation_.fetch_add(1);
    (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c->socket.get(), nullptr);
    (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c->doorbell.get(), nullptr);
    c->dropped.store(true);
    MOE_LOG_INFO("shard {}: shm data-plane client {} ({}) gone: {}", options_.shard, c->id, c->node,
                 std::string(why));
    return true;
  }

  bool DrainIfFree(const std::shared_ptr<Client>& c) {
    std::unique_lock<std::mutex> lock(c->rx_mu, std::try_to_lock);
    return lock.owns_lock() && DrainLocked(*c);
  }
  void Drain(const std::shared_ptr<Client>& c) {
    std::lock_guard<std::mutex> lock(c->rx_mu);
    DrainLocked(*c);
  }

  // Copies each request out of the ring, frees its place, and hands the copy to the core.
  bool DrainLocked(Client& c) {
    bool any = false;
    for (int n = 0; n < kMaxPerDrain && !c.dropped.load(); ++n) {
      absl::StatusOr<std::optional<dataplane::ShmRecord>> r = c.requests.Peek();
      if (!r.ok()) {
        if (DropConn(c.conn, r.status().message())) Count("message_rejected");
        return any;
      }
      if (!r->has_value()) return any;
      any = true;
      const dataplane::ShmRecord rec = **r;
      if (rec.payload_bytes > static_cast<uint64_t>(options_.max_message_bytes)) {
        c.requests.Release(rec);
        Count("message_rejected");
        continue;
      }
      if (!clients_.ClaimSequence(c.id, rec.sequence)) {
        c.requests.Release(rec);
        Count("replayed");
        continue;
      }
      std::string header(reinterpret_cast<const char*>(rec.header), rec.header_bytes);
      std::shared_ptr<void> owner = dataplane::CopyAligned(rec.payload, rec.payload_bytes);
      c.requests.Release(rec);
      if (owner == nullptr) {
        Count("message_rejected");
        continue;
      }
      options_.on_batch(BatchSource{c.id, rec.token, rec.sequence, false, owner}, header,
                        std::string_view(static_cast<const char*>(owner.get()), rec.payload_bytes));
    }
    return any;
  }

  std::shared_ptr<Client> ById(uint64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second;
  }
  std::shared_ptr<Client> ByConn(uint64_t conn) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_conn_.find(conn);
    return it == by_conn_.end() ? nullptr : it->second;
  }
  std::vector<std::shared_ptr<Client>> All() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<Client>> all;
    for (const auto& [conn, c] : by_conn_) all.push_back(c);
    return all;
  }

  void Count(const char* event) {
    if (options_.on_event) options_.on_event(event);
  }

  const ServerHalfOptions options_;
  DataPlaneClients clients_;
  const uint64_t max_ring_;
  dataplane::UnixListener listener_;
  OwnedFd epoll_, stop_fd_;
  std::atomic<bool> stop_{false};
  std::atomic<int> polling_{0};
  std::atomic<uint64_t> generation_{0};  // changes when a client comes or goes  // compute threads
                                         // in PollUntil (they read the rings)
  std::thread thread_;
  // The loop's thread only: connections that have not said hello yet.
  struct Pending {
    OwnedFd socket;
    Clock::time_point since;
  };
  std::map<uint64_t, Pending> pending_;
  uint64_t next_conn_ = 1;
  mutable std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Client>> by_conn_, by_id_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ServerHalf>> StartShmServerHalf(ServerHalfOptions options) {
  if (!options.on_batch) {
    return absl::FailedPreconditionError("the shm data plane speaks batch messages only");
  }
  auto half = std::make_unique<ShmServerHalf>(std::move(options));
  MOE_RETURN_IF_ERROR(half->Start());
  return half;
}

}  // namespace moe::expert_svc
