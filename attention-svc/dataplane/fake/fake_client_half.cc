#include "attention-svc/dataplane/fake/fake_client_half.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/batch_message.h"
#include "attention-svc/dataplane/reply_liveness.h"
#include "attention-svc/expert_channel_grpc.h"
#include "services/common/status_macros.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/fake_wire.h"
#include "services/dataplane/payload_mac.h"

namespace moe::attention_svc {

namespace {

constexpr char kAckFrame[] = "MOEA";
// How long past the shard's budget a reply may still come, and how often a waiter checks that
// the shard is alive.
constexpr absl::Duration kReplyGrace = absl::Seconds(1);
constexpr absl::Duration kLivenessSlice = absl::Milliseconds(20);

// What arrives at this channel's address, shared with its calls (it outlives the channel while
// a call waits).
struct Inbox {
  std::mutex mu;
  std::condition_variable cv;
  bool acked = false;
  std::string peer_lanes;
  struct Reply {
    bool arrived = false;
    std::string frame, message;
  };
  std::map<uint64_t, Reply> replies;  // by token; an entry per batch in flight

  void Deliver(std::string frame, std::string message) {
    std::lock_guard<std::mutex> lock(mu);
    if (frame == kAckFrame) {
      acked = true;
      peer_lanes = message.substr(0, 64);
    } else if (frame.size() == dataplane::kBatchFrameBytes) {
      absl::StatusOr<dataplane::BatchFrame> f =
          dataplane::ParseBatchFrame(frame, dataplane::BatchKind::kReply, message.size());
      if (!f.ok()) return;
      auto it = replies.find(f->token);
      if (it == replies.end() || it->second.arrived) return;  // not ours (dropped)
      it->second = {true, std::move(frame), std::move(message)};
    }
    cv.notify_all();
  }
};

class FakeCall final : public ExpertCall {
 public:
  struct Batch {
    uint64_t client_id = 0, sequence = 0, token = 0;
    ReplyShape shape;
    absl::Time budget_end;
    // What the connection's other batches say when this one times out, and its ticket there.
    std::shared_ptr<ReplyLiveness> liveness;
    uint64_t ticket = 0;
  };
  FakeCall(std::string who, std::shared_ptr<Inbox> inbox,
           std::shared_ptr<const dataplane::PayloadMac> mac, std::shared_ptr<grpc::Channel> control,
           std::shared_ptr<std::atomic<bool>> broken, DataPlaneEventFn on_event, std::string shard,
           Batch b)
      : who_(std::move(who)),
        inbox_(std::move(inbox)),
        mac_(std::move(mac)),
        control_(std::move(control)),
        broken_(std::move(broken)),
        on_event_(std::move(on_event)),
        shard_(std::move(shard)),
        b_(b) {}
  ~FakeCall() override {
    b_.liveness->Finished(b_.ticket);
    std::lock_guard<std::mutex> lock(inbox_->mu);
    inbox_->replies.erase(b_.token);
  }

  const char* transport() const override { return "fake"; }

  bool Answered(absl::Time until) override {
    std::unique_lock<std::mutex> lock(inbox_->mu);
    return inbox_->cv.wait_until(lock, absl::ToChronoTime(until),
                                 [this] { return inbox_->replies[b_.token].arrived; });
  }

  absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
    deadline = std::min(deadline, b_.budget_end + kReplyGrace);
    Inbox::Reply r;
    {
      std::unique_lock<std::mutex> lock(inbox_->mu);
      for (;;) {
        Inbox::Reply& slot = inbox_->replies[b_.token];
        if (slot.arrived) {
          r = std::move(slot);
          b_.liveness->Replied();
          break;
        }
        const absl::Time now = absl::Now();
        if (now >= deadline) {
          // The shard may have dropped it unread: open again, unless it is only busy.
          if (b_.liveness->TimedOutMeansGone(b_.ticket)) broken_->store(true);
          return absl::DeadlineExceededError(
              absl::StrCat(who_, " did not answer the batch before the deadline"));
        }
        if (control_->GetState(false) != GRPC_CHANNEL_READY) {
          broken_->store(true);
          if (on_event_) on_event_(shard_, "transfer_failed");
          return absl::UnavailableError(absl::StrCat(who_, " is gone (its connection closed)"));
        }
        inbox_->cv.wait_until(lock, absl::ToChronoTime(std::min(deadline, now + kLivenessSlice)));
      }
    }
    absl::StatusOr<dataplane::BatchFrame> frame = dataplane::OpenReplyFrame(
        *mac_, r.frame, reinterpret_cast<const uint8_t*>(r.message.data()), r.message.size(),
        b_.client_id, b_.sequence);
    if (!frame.ok()) {
      if (on_event_) on_event_(shard_, "integrity_failed");
      return absl::DataLossError(absl::StrCat(who_, ": ", frame.status().message()));
    }
    return ReadBatchReply(who_, b_.shape, r.message.data(), r.message.size(), frame->header_bytes);
  }

 private:
  const std::string who_;
  std::shared_ptr<Inbox> inbox_;
  std::shared_ptr<const dataplane::PayloadMac> mac_;
  std::shared_ptr<grpc::Channel> control_;
  std::shared_ptr<std::atomic<bool>> broken_;
  DataPlaneEventFn on_event_;
  const std::string shard_;
  const Batch b_;
};

class FakeExpertChannel final : public ExpertChannel {
 public:
  explicit FakeExpertChannel(ChannelOptions o)
      : o_(std::move(o)),
        who_(absl::StrCat("expert shard ", o_.shard, " (", o_.endpoint, ")")),
        inbox_(std::make_shared<Inbox>()),
        inband_(std::make_unique<GrpcExpertChannel>(o_.shard, o_.endpoint, o_.max_message_bytes,
                                                    o_.cluster_token)) {
    me_ = dataplane::FakeWire::Listen([inbox = inbox_](std::string frame, std::string message) {
      inbox->Deliver(std::move(frame), std::move(message));
    });
  }
  ~FakeExpertChannel() override { dataplane::FakeWire::Close(me_); }

  const std::string& shard() const override { return o_.shard; }
  const char* transport() const override {
    return client_id_.load() != 0 ? "fake" : o_.next != nullptr ? o_.next->transport() : "grpc";
  }

  std::unique_ptr<ExpertCall> Send(const DispatchHeader& header,
                                   const DispatchMessage& m) override {
    const absl::Time deadline =
        absl::Now() + absl::Milliseconds(header.timeout_ms > 0 ? header.timeout_ms : 30000);
    absl::Status open = EnsureOpen(deadline);
    if (!open.ok()) {
      if (o_.next != nullptr) return o_.next->Send(header, m);
      if (o_.fallback_in_band) {
        if (o_.on_event) o_.on_event(o_.shard, "fallback");
        return inband_->Send(header, m);
      }
      return FailedExpertCall(absl::UnavailableError(open.message()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t seq = sequence_++;
    const ReplyShape shape = ShapeOf(header, m);
    const size_t bytes = static_cast<size_t>(m.activation_bytes());
    const v1::DispatchRequest dr =
        BatchMessageHeader(header, m, client_id_.load(), seq, bytes, shape.bytes());
    std::string message = dr.SerializeAsString();
    const size_t header_bytes = message.size();
    message.resize(header_bytes + bytes);
    m.z.CopyTo(reinterpret_cast<uint8_t*>(message.data()) + header_bytes);
    const dataplane::BatchFrame f{dataplane::RandomU64(),
                                  dataplane::BatchKind::kRequest,
                                  client_id_.load(),
                                  seq,
                                  static_cast<uint32_t>(header_bytes),
                                  {}};
    std::string frame =
        dataplane::SealBatchFrame(*mac_, dataplane::Direction::kToExpert, f,
                                  reinterpret_cast<const uint8_t*>(message.data()), message.size());
    {
      std::lock_guard<std::mutex> l(inbox_->mu);
      inbox_->replies[f.token];  // expected before the request leaves
    }
    FakeCall::Batch b{f.client_id, seq, f.token, shape, deadline, liveness_, liveness_->Sent()};
    auto call =
        std::make_unique<FakeCall>(who_, inbox_, mac_, control_, broken_, o_.on_event, o_.shard, b);
    if (absl::Status s = dataplane::FakeWire::Send(server_, std::move(frame), std::move(message));
        !s.ok()) {
      broken_->store(true);
      return FailedExpertCall(absl::UnavailableError(absl::StrCat(who_, ": ", s.message())));
    }
    return call;
  }

 private:
  absl::Status EnsureOpen(absl::Time deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    if (client_id_.load() != 0 && !broken_->load() &&
        control_->GetState(false) == GRPC_CHANNEL_READY) {
      return absl::OkStatus();
    }
    client_id_.store(0);
    broken_->store(false);
    absl::StatusOr<OpenedDataPlane> opened = OpenDataPlane(
        who_, o_.endpoint, o_.max_message_bytes, o_.cluster_token, o_.node, "fake", deadline);
    if (!opened.ok()) return opened.status();
    const v1::OpenDataPlaneReply& reply = opened->reply;
    auto mac = dataplane::PayloadMac::Create(reply.mac_key());
    if (!mac.ok() || reply.hello_secret().size() != dataplane::kHelloSecretBytes ||
        reply.worker_address().empty()) {
      return absl::UnavailableError(absl::StrCat(
          who_, ": OpenDataPlane answered without a MAC key, hello secret or address"));
    }
    {
      std::lock_guard<std::mutex> l(inbox_->mu);
      inbox_->acked = false;
    }
    MOE_RETURN_IF_ERROR(dataplane::FakeWire::Send(
        reply.worker_address(), dataplane::EncodeHello({reply.client_id(), reply.hello_secret()}),
        me_));
    std::string peer_lanes;
    {
      std::unique_lock<std::mutex> l(inbox_->mu);
      if (!inbox_->cv.wait_until(l, absl::ToChronoTime(opened->open_by),
                                 [this] { return inbox_->acked; })) {
        return absl::UnavailableError(absl::StrCat(who_, ": the hello was not acknowledged"));
      }
      peer_lanes = inbox_->peer_lanes;
    }
    server_ = reply.worker_address();
    mac_ = std::make_shared<const dataplane::PayloadMac>(std::move(*mac));
    control_ = opened->control;
    liveness_ = std::make_shared<ReplyLiveness>();
    sequence_ = 1;
    client_id_.store(reply.client_id());
    if (o_.on_event) o_.on_event(o_.shard, "connected");
    if (o_.on_lanes) o_.on_lanes(o_.shard, dataplane::Lanes{{"fake"}, "fake"}, peer_lanes);
    return absl::OkStatus();
  }

  const ChannelOptions o_;
  const std::string who_;
  std::shared_ptr<Inbox> inbox_;
  std::unique_ptr<GrpcExpertChannel> inband_;
  std::string me_;  // this channel's address on the wire (replies, acknowledgements)
  std::mutex mu_;   // the connection below, and the sequence
  std::string server_;
  std::shared_ptr<const dataplane::PayloadMac> mac_;
  std::shared_ptr<grpc::Channel> control_;
  std::shared_ptr<ReplyLiveness> liveness_;
  uint64_t sequence_ = 1;
  std::atomic<uint64_t> client_id_{0};
  std::shared_ptr<std::atomic<bool>> broken_ = std::make_shared<std::atomic<bool>>(false);
};

class FakeClientHalf final : public ClientHalf {
 public:
  const char* name() const override { return "fake"; }
  std::string Describe() const override { return "the in-process wire"; }
  std::shared_ptr<ExpertChannel> MakeChannel(ChannelOptions options) override {
    return std::make_shared<FakeExpertChannel>(std::move(options));
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<ClientHalf>> StartFakeClientHalf(ClientHalfOptions) {
  return std::make_unique<FakeClientHalf>();
}

}  // namespace moe::attention_svc
