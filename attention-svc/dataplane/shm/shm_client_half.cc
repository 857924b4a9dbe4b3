#include "attention-svc/dataplane/shm/shm_client_half.h"

#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/batch_message.h"
#include "attention-svc/dataplane/reply_liveness.h"
#include "attention-svc/expert_channel_grpc.h"
#include "services/common/logging.h"
#include "services/common/poll_window.h"
#include "services/common/status_macros.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/shm_lane.h"

namespace moe::attention_svc {

namespace {

using Clock = std::chrono::steady_clock;
using dataplane::OwnedFd;

// How long past the shard's budget a reply may still come, and how often a waiter checks that
// the shard is alive.
constexpr absl::Duration kReplyGrace = absl::Seconds(1);
constexpr auto kLivenessSlice = std::chrono::milliseconds(20);
// A shard this node cannot use shm with (it does not offer it, or its socket is not in this
// network namespace, or not of this user) is asked again this often; its batches go to the next
// backend meanwhile (ChannelOptions::next). One OpenDataPlane call each time.
constexpr absl::Duration kRetryUnreachable = absl::Seconds(30);

bool SocketClosed(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// One opened data plane to a shard: the region, its rings, and the replies read from it for
// the calls that wait.
struct Conn : std::enable_shared_from_this<Conn> {
  std::string who, shard;
  uint64_t client_id = 0;
  dataplane::ShmRegion region;
  OwnedFd socket, shard_doorbell, node_doorbell;
  dataplane::ShmRing requests, replies;
  std::shared_ptr<grpc::Channel> control;
  ReplyLiveness liveness;
  DataPlaneEventFn on_event;
  std::shared_ptr<PollWindow> window;  // the channel's: its callers' recent waits

  std::mutex tx_mu;  // the request ring's writer, and the sequence
  uint64_t sequence = 1;

  struct Reply {
    bool arrived = false, recorded = false;
    uint64_t sequence = 0;
    std::string header;          // copied out of the ring
    const char* rows = nullptr;  // in the ring (held) or in a buffer of its own
    size_t rows_bytes = 0;
    std::shared_ptr<void> buffer;  // keeps `rows`: frees the ring's record, or the copy
  };
  // The reply ring's reader state: Drain (one waiter at a time) and the replies' buffers, freed
  // from any thread. Taken after `mu`, never before it.
  std::mutex ring_mu;
  std::mutex mu;  // below
  std::condition_variable cv;
  std::map<uint64_t, Reply> inbox;  // by token; an entry per batch in flight
  bool leading = false;             // a waiter reads the reply ring
  bool broken = false;

  enum class Got { kArrived, kDeadline, kGone };

  // Waits for the reply of `token` (its entry in the inbox), sent at `sent`, until `deadline`:
  // polls the ring for the channel's learned window (services/common/poll_window.h), then
  // sleeps on the doorbell.
  Got Await(uint64_t token, Clock::time_point sent, absl::Time deadline) {
    const auto spin_until = std::max(Clock::now() + window->floor(), sent + window->Window());
    std::unique_lock<std::mutex> l(mu);
    for (;;) {
      if (inbox[token].arrived) {
        if (!inbox[token].recorded) {
          inbox[token].recorded = true;
          window->Record(Clock::now() - sent);
        }
        return Got::kArrived;
      }
      if (broken) return Got::kGone;
      const absl::Time now = absl::Now();
      if (now >= deadline) return Got::kDeadline;
      if (!leading) {
        leading = true;
        l.unlock();
        const bool gone = Lead(spin_until, absl::ToChronoTime(deadline));
        l.lock();
        leading = false;
        if (gone) broken = true;
        cv.notify_all();
        continue;
      }
      cv.wait_until(l,
                    absl::ToChronoTime(std::min(deadline, now + absl::FromChrono(kLivenessSlice))));
    }
  }

  // One round of the waiter that reads the ring: spin while `spin_until`, else sleep on the
  // doorbell one slice; read what came. True when the shard is gone.
  bool Lead(Clock::time_point spin_until, std::chrono::system_clock::time_point deadline) {
    if (Drain()) return false;
    for (int empty = 0; Clock::now() < spin_until;) {
      if (replies.MaybeReady()) {
        Drain();
        return false;
      }
      PollPause(&empty);
    }
    replies.SetSleeping(true);
    if (!replies.MaybeReady()) {
      const auto left = deadline - std::chrono::system_clock::now();
      dataplane::WaitReadable(
          node_doorbell.get(), socket.get(),
          Clock::now() + std::min<Clock::duration>(
                             kLivenessSlice, std::chrono::duration_cast<Clock::duration>(left)));
      dataplane::Drain(node_doorbell.get());
    }
    replies.SetSleeping(false);
    if (Drain()) return false;
    if (SocketClosed(socket.get()) || control->GetState(false) != GRPC_CHANNEL_READY) {
      if (on_event) on_event(shard, "transfer_failed");
      return true;
    }
    return false;
  }

  // Copies each reply out of the ring into memory of its own (rows 64-byte aligned) for its
  // call; true when any came. A broken ring marks the connection broken.
  bool Drain() {
    bool any = false;
    for (int i = 0; i < 64; ++i) {
      Reply got;
      uint64_t token = 0;
      {
        std::lock_guard<std::mutex> ring(ring_mu);
        absl::StatusOr<std::optional<dataplane::ShmRecord>> r = replies.Peek();
        if (!r.ok()) {
          if (on_event) on_event(shard, "integrity_failed");
          std::lock_guard<std::mutex> l(mu);
          broken = true;
          return true;
        }
        if (!r->has_value()) break;
        any = true;
        const dataplane::ShmRecord rec = **r;
        token = rec.token;
        if (rec.header_bytes <= dataplane::kMaxReplyHeaderBytes) {
          got.arrived = true;
          got.sequence = rec.sequence;
          got.header.assign(reinterpret_cast<const char*>(rec.header), rec.header_bytes);
          got.rows_bytes = rec.payload_bytes;
          // Read in place while the replies held leave the shard half the ring; else copied.
          if (replies.held() <= replies.capacity() / 2) {
            got.rows = reinterpret_cast<const char*>(rec.payload);
            got.buffer = std::shared_ptr<void>(const_cast<uint8_t*>(rec.payload),
                                               [self = shared_from_this(), rec](void*) {
                                                 std::lock_guard<std::mutex> ring(self->ring_mu);
                                                 self->replies.Release(rec);
                                               });
          } else {
            got.buffer = dataplane::CopyAligned(rec.payload, rec.payload_bytes);
            got.rows = static_cast<const char*>(got.buffer.get());
            got.arrived = got.buffer != nullptr;
            replies.Release(rec);
          }
        } else {
          replies.Release(rec);
        }
      }
      std::lock_guard<std::mutex> l(mu);
      auto it = inbox.find(token);
      if (got.arrived && it != inbox.end() && !it->second.arrived) it->second = std::move(got);
    }
    if (any) {
      std::lock_guard<std::mutex> l(mu);
      cv.notify_all();
    }
    return any;
  }
};

class ShmCall final : public ExpertCall {
 public:
  ShmCall(std::shared_ptr<Conn> conn, uint64_t token, uint64_t sequence, uint64_t ticket,
          ReplyShape shape, absl::Time budget_end)
      : sent_(Clock::now()),
        c_(std::move(conn)),
        token_(token),
        sequence_(sequence),
        ticket_(ticket),
        shape_(shape),
        budget_end_(budget_end) {}
  ~ShmCall() override {
    c_->liveness.Finished(ticket_);
    std::lock_guard<std::mutex> lock(c_->mu);
    c_->inbox.erase(token_);
  }

  const char* transport() const override { return "shm"; }

  bool Answered(absl::Time until) override {
    return c_->Await(token_, sent_, std::min(until, budget_end_ + kReplyGrace)) !=
               Conn::Got::kDeadline ||
           absl::Now() >= budget_end_ + kReplyGrace;
  }

  absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
    switch (c_->Await(token_, sent_, std::min(deadline, budget_end_ + kReplyGrace))) {
      case Conn::Got::kArrived:
        break;
      case Conn::Got::kDeadline:
        // The shard may have dropped it unread: open again, unless it is only busy.
        if (c_->liveness.TimedOutMeansGone(ticket_)) {
          std::lock_guard<std::mutex> l(c_->mu);
          c_->broken = true;
        }
        return absl::DeadlineExceededError(
            absl::StrCat(c_->who, " did not answer the batch before the deadline"));
      case Conn::Got::kGone:
        return absl::UnavailableError(absl::StrCat(c_->who, " is gone (its connection closed)"));
    }
    Conn::Reply r;
    {
      std::lock_guard<std::mutex> l(c_->mu);
      r = std::move(c_->inbox[token_]);
    }
    c_->liveness.Replied();
    if (r.sequence != sequence_) {
      if (c_->on_event) c_->on_event(c_->shard, "integrity_failed");
      return absl::DataLossError(
          absl::StrCat(c_->who, ": a reply for batch ", r.sequence, " came for batch ", sequence_));
    }
    return ReadBatchReply(c_->who, shape_, r.header, r.rows, r.rows_bytes, r.buffer);
  }

 private:
  const Clock::time_point sent_;
  std::shared_ptr<Conn> c_;
  const uint64_t token_, sequence_, ticket_;
  const ReplyShape shape_;
  const absl::Time budget_end_;
};

class ShmExpertChannel final : public ExpertChannel {
 public:
  ShmExpertChannel(ChannelOptions o, const ClientHalfOptions& half)
      : o_(std::move(o)),
        who_(absl::StrCat("expert shard ", o_.shard, " (", o_.endpoint, ")")),
        window_(std::make_shared<PollWindow>(half.poll_spin, half.poll_spin_max)),
        inband_(std::make_unique<GrpcExpertChannel>(o_.shard, o_.endpoint, o_.max_message_bytes,
                                                    o_.cluster_token)) {}

  const std::string& shard() const override { return o_.shard; }
  const char* transport() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return conn_ != nullptr ? "shm" : o_.next != nullptr ? o_.next->transport() : "grpc";
  }

  std::unique_ptr<ExpertCall> Send(const DispatchHeader& header,
                                   const DispatchMessage& m) override {
    const absl::Time deadline =
        absl::Now() + absl::Milliseconds(header.timeout_ms > 0 ? header.timeout_ms : 30000);
    const ReplyShape shape = ShapeOf(header, m);
    const size_t bytes = static_cast<size_t>(m.activation_bytes());
    const uint64_t half_ring = kShmClientRing / 2;
    const bool fits =
        dataplane::ShmRing::RecordBytes(dataplane::kMaxReplyHeaderBytes, bytes) <= half_ring &&
        dataplane::ShmRing::RecordBytes(dataplane::kMaxReplyHeaderBytes, shape.bytes()) <=
            half_ring;
    if (!fits) {
      // Larger than the rings take (a long prefill): the next backend's, or in band over the
      // same authenticated channel, whatever --data_plane says (the lane exists; this batch
      // does not fit it).
      if (o_.next != nullptr) return o_.next->Send(header, m);
      if (o_.on_event) o_.on_event(o_.shard, "fallback");
      return inband_->Send(header, m);
    }
    absl::StatusOr<std::shared_ptr<Conn>> conn = EnsureOpen(deadline);
    if (!conn.ok()) {
      if (!absl::IsFailedPrecondition(conn.status())) SayOnce(conn.status());  // else Unreachable
      if (o_.next != nullptr) return o_.next->Send(header, m);
      if (o_.fallback_in_band) {
        if (o_.on_event) o_.on_event(o_.shard, "fallback");
        return inband_->Send(header, m);
      }
      return FailedExpertCall(absl::UnavailableError(conn.status().message()));
    }
    Conn& c = **conn;
    std::lock_guard<std::mutex> lock(c.tx_mu);
    const uint64_t seq = c.sequence++;
    const std::string h =
        BatchMessageHeader(header, m, c.client_id, seq, bytes, shape.bytes()).SerializeAsString();
    {
      std::lock_guard<std::mutex> l(c.mu);
      c.inbox[seq];  // expected before the request leaves
    }
    auto call = std::make_unique<ShmCall>(*conn, seq, seq, c.liveness.Sent(), shape, deadline);
    absl::StatusOr<dataplane::ShmRing::Slot> s =
        dataplane::ReserveWithin(c.requests, h.size(), bytes, deadline);
    if (!s.ok()) {
      std::lock_guard<std::mutex> l(c.mu);
      c.broken = absl::IsDataLoss(s.status());
      return FailedExpertCall(
          absl::UnavailableError(absl::StrCat(who_, ": ", s.status().message())));
    }
    std::memcpy(s->header, h.data(), h.size());
    m.z.CopyTo(s->payload);
    c.requests.Publish(*s, {seq, seq});
    return call;
  }

 private:
  absl::StatusOr<std::shared_ptr<Conn>> EnsureOpen(absl::Time deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    if (conn_ != nullptr) {
      bool broken;
      {
        std::lock_guard<std::mutex> l(conn_->mu);
        broken = conn_->broken;
      }
      if (!broken && conn_->control->GetState(false) == GRPC_CHANNEL_READY) return conn_;
    }
    conn_.reset();
    if (absl::Now() < retry_after_) return absl::FailedPreconditionError(unreachable_);
    absl::StatusOr<OpenedDataPlane> open = OpenDataPlane(
        who_, o_.endpoint, o_.max_message_bytes, o_.cluster_token, o_.node, "shm", deadline);
    if (!open.ok()) {
      return absl::IsFailedPrecondition(open.status()) || absl::IsUnimplemented(open.status())
                 ? Unreachable(open.status().message())
                 : open.status();
    }
    const OpenedDataPlane& opened = *open;
    const v1::OpenDataPlaneReply& reply = opened.reply;
    if (reply.hello_secret().size() != dataplane::kHelloSecretBytes ||
        reply.worker_address().empty()) {
      return absl::UnavailableError(
          absl::StrCat(who_, ": OpenDataPlane answered without a hello secret or address"));
    }
    // Only a shard in this network namespace (one host: a pod's containers, a local cluster)
    // has its socket here; only one of this user gets the hello's secret and the memory. Both
    // are known before any memory is made for the rings.
    absl::StatusOr<OwnedFd> socket = dataplane::ConnectAbstract(reply.worker_address());
    if (!socket.ok()) {
      return Unreachable(absl::StrCat(who_, ": its shm socket is not in this network namespace (",
                                      socket.status().message(), ")"));
    }
    if (absl::StatusOr<uint32_t> uid = dataplane::PeerUid(socket->get());
        !uid.ok() || *uid != ::geteuid()) {
      return Unreachable(absl::StrCat(who_, ": its shm socket is not this user's"));
    }
    auto c = std::make_shared<Conn>();
    c->who = who_;
    c->shard = o_.shard;
    c->client_id = reply.client_id();
    c->control = opened.control;
    c->on_event = o_.on_event;
    c->window = window_;
    c->socket = std::move(*socket);
    MOE_ASSIGN_OR_RETURN(c->region, dataplane::ShmRegion::Create(kShmClientRing));
    MOE_ASSIGN_OR_RETURN(c->shard_doorbell, dataplane::NewEventFd());
    MOE_ASSIGN_OR_RETURN(c->node_doorbell, dataplane::NewEventFd());
    c->requests = c->region.Ring(dataplane::ShmDirection::kToShard, c->shard_doorbell.get());
    c->replies = c->region.Ring(dataplane::ShmDirection::kToNode, -1);
    std::string hello = dataplane::EncodeHello({reply.client_id(), reply.hello_secret()});
    const uint64_t ring = kShmClientRing;
    hello.append(reinterpret_cast<const char*>(&ring), sizeof ring);
    MOE_RETURN_IF_ERROR(dataplane::SendWithFds(
        c->socket.get(), hello, {c->region.fd(), c->shard_doorbell.get(), c->node_doorbell.get()}));
    std::string peer_lanes;
    for (;;) {
      absl::StatusOr<dataplane::Datagram> ack = dataplane::ReceiveWithFds(c->socket.get(), 64, 0);
      if (ack.ok() && absl::StartsWith(ack->bytes, "MOEA")) {
        peer_lanes = ack->bytes.substr(4);
        break;
      }
      if ((!ack.ok() && !absl::IsUnavailable(ack.status())) || absl::Now() >= opened.open_by) {
        return absl::UnavailableError(absl::StrCat(who_, ": the shm hello was not acknowledged"));
      }
      dataplane::WaitReadable(
          c->socket.get(), -1,
          Clock::now() + absl::ToChronoNanoseconds(opened.open_by - absl::Now()));
    }
    c->replies.SetSleeping(false);
    conn_ = c;
    if (o_.on_event) o_.on_event(o_.shard, "connected");
    if (o_.on_lanes) o_.on_lanes(o_.shard, dataplane::Lanes{{"shm"}, "shm"}, peer_lanes);
    return conn_;
  }

  // Remembers that the shard cannot be reached over shm (see kRetryUnreachable); said once per
  // reason in the log.
  absl::Status Unreachable(absl::string_view why) {
    retry_after_ = absl::Now() + kRetryUnreachable;
    if (why != unreachable_) {
      unreachable_ = std::string(why);
      MOE_LOG_INFO("data plane to {}: no shm ({}){}", o_.shard, unreachable_,
                   o_.next != nullptr ? ": the node's next data plane instead" : "");
    }
    return absl::FailedPreconditionError(unreachable_);
  }

  // A connection that did not open this time (the shard busy or restarting; the next batch
  // tries again): said in the log once per reason, where this batch went with it.
  void SayOnce(const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (s.message() == failed_) return;
    failed_ = std::string(s.message());
    MOE_LOG_INFO("data plane to {}: shm did not open ({}); this batch {}", o_.shard, failed_,
                 o_.next != nullptr ? "on the node's next data plane" : "in band or failed");
  }

  const ChannelOptions o_;
  const std::string who_;
  const std::shared_ptr<PollWindow> window_;
  std::unique_ptr<GrpcExpertChannel> inband_;
  mutable std::mutex mu_;  // the connection below, and when to try again without one
  std::shared_ptr<Conn> conn_;
  absl::Time retry_after_ = absl::InfinitePast();
  std::string unreachable_;
  std::string failed_;  // SayOnce's last
};

class ShmClientHalf final : public ClientHalf {
 public:
  explicit ShmClientHalf(ClientHalfOptions o) : o_(std::move(o)) {}
  const char* name() const override { return "shm"; }
  std::string Describe() const override {
    return absl::StrCat("memfd rings of ", kShmClientRing >> 20, " MiB each way per shard");
  }
  std::shared_ptr<ExpertChannel> MakeChannel(ChannelOptions options) override {
    return std::make_shared<ShmExpertChannel>(std::move(options), o_);
  }

 private:
  const ClientHalfOptions o_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ClientHalf>> StartShmClientHalf(ClientHalfOptions options) {
  return std::make_unique<ShmClientHalf>(std::move(options));
}

}  // namespace moe::attention_svc
