#include "attention-svc/dataplane/ucx/expert_channel_ucx.h"

#include <grpcpp/grpcpp.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/batch_message.h"
#include "attention-svc/expert_channel_grpc.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/dataplane/data_plane.h"
#include "services/dataplane/payload_mac.h"
#include "services/dataplane/ucx_worker.h"
#include "services/transport/channel.h"
#include "services/transport/expert_stream.h"
#include "services/transport/grpc_server.h"
#include "services/transport/status_convert.h"

namespace moe::attention_svc {

using tensor::Bf16;

namespace {

// A shard without UCX is asked again after this long (it may be restarted with it).
constexpr absl::Duration kRetryWithoutUcx = absl::Seconds(10);
// A reply's receive stays posted this long past the batch's deadline, so that a late payload
// lands in our buffer (then dropped) instead of staying unexpected in the worker.
constexpr absl::Duration kLateReplyGrace = absl::Seconds(5);

// Over shared memory each end writes into the other's FIFO with its own shape, and UCX checks
// nothing: with different ones the lane would stop after its first wrap or overrun the shard's
// segments. FAILED_PRECONDITION naming both shapes when the lanes are such and the shard's
// (OpenDataPlane's shm_fifo; empty from earlier servers: UCX's own) is not ours.
absl::Status SameFifoShape(const std::string& who, const std::string& shard_fifo,
                           const std::string& ours,
                           const absl::StatusOr<dataplane::UcxLanes>& lanes) {
  const std::string theirs = shard_fifo.empty() ? dataplane::kUcxDefaultFifo : shard_fifo;
  if (!lanes.ok() || !dataplane::UsesSharedMemoryFifo(*lanes) || theirs == ours) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      who, ": its UCX shared-memory FIFO is ", theirs, ", this node's ", ours,
      " (elements x segment bytes): UCX would lose messages on the lane (", lanes->Describe(),
      "); set UCX_POSIX_FIFO_SIZE and UCX_POSIX_SEG_SIZE alike on both, or neither"));
}

class UcxCall final : public ExpertCall {
 public:
  UcxCall(std::shared_ptr<std::atomic<bool>> broken, std::function<void()> on_transfer_failed,
          std::shared_ptr<transport::ExpertStream> stream,
          std::shared_ptr<transport::PendingReply> pending,
          std::shared_ptr<dataplane::UcxTransfer> sent,
          std::shared_ptr<dataplane::UcxTransfer> received,
          std::shared_ptr<dataplane::UcxBuffer> reply_buffer, ReplyMode mode,
          numerics::Precision precision, int64_t latent, int64_t rows, int64_t tokens,
          std::shared_ptr<const dataplane::PayloadMac> mac, uint64_t sequence,
          std::function<void()> on_integrity_failed)
      : mac_(std::move(mac)),
        sequence_(sequence),
        on_integrity_failed_(std::move(on_integrity_failed)),
        broken_(std::move(broken)),
        on_transfer_failed_(std::move(on_transfer_failed)),
        stream_(std::move(stream)),
        pending_(std::move(pending)),
        sent_(std::move(sent)),
        received_(std::move(received)),
        reply_buffer_(std::move(reply_buffer)),
        mode_(mode),
        precision_(precision),
        latent_(latent),
        rows_(rows),
        tokens_(tokens) {}

  const char* transport() const override { return "ucx"; }

  // The header answers first (the payload follows it, or the shard failed the batch).
  bool Answered(absl::Time until) override {
    return transport::ExpertStream::WaitAnswered(*pending_, until);
  }
  absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
    const std::string& shard = stream_->shard();
    // The header first: a shard that died (found by its gRPC stream, not by UCX: shared-memory
    // lanes have no peer failure detection) or refused the batch answers here; no shard answers
    // OK before the payload arrived whole.
    absl::StatusOr<v1::DispatchReply> reply = stream_->Wait(*pending_, deadline);
    if (!reply.ok()) {
      if (reply.status().code() == absl::StatusCode::kFailedPrecondition ||
          reply.status().code() == absl::StatusCode::kUnavailable) {
        broken_->store(true);
      }
      return reply.status();
    }
    if (absl::StatusOr<size_t> s = sent_->Wait(deadline); !s.ok()) {
      if (s.status().code() != absl::StatusCode::kDeadlineExceeded) broken_->store(true);
      if (on_transfer_failed_) on_transfer_failed_();
      return absl::Status(s.status().code(), absl::StrCat("expert shard ", shard,
                                                          ": activations: ", s.status().message()));
    }
    MOE_RETURN_IF_ERROR(CheckReplyPrecision(*reply, precision_, shard));
    const bool f32 = mode_ == ReplyMode::kPartialSum;
    const int64_t rows = f32 ? tokens_ : rows_;
    const int64_t want = rows * latent_ * (f32 ? 4 : 2);
    const v1::Tensor& t = reply->outputs();
    if (!reply->out_of_band() || t.dtype() != (f32 ? v1::DTYPE_F32 : v1::DTYPE_BF16) ||
        t.shape_size() != 2 || t.shape(0) != rows || t.shape(1) != latent_ ||
        reply->output_bytes() != want) {
      return absl::InternalError(absl::StrCat(
          "expert shard ", shard, " answered an out-of-band batch with ",
          reply->out_of_band() ? "" : "an in-band ", "reply of ", reply->output_bytes(),
          " bytes, shape [", t.shape_size() > 0 ? t.shape(0) : -1, ", ",
          t.shape_size() > 1 ? t.shape(1) : -1, "] (expected [", rows, ", ", latent_, "])"));
    }
    absl::StatusOr<size_t> n = received_->Wait(deadline);
    if (!n.ok()) {
      if (on_transfer_failed_) on_transfer_failed_();
      return absl::Status(n.status().code(),
                          absl::StrCat("expert shard ", shard, ": reply: ", n.status().message()));
    }
    if (static_cast<int64_t>(*n) != want) {
      return absl::InternalError(absl::StrCat("expert shard ", shard, " sent ", *n,
                                              " reply bytes out of band, the header said ", want));
    }
    // Nothing is combined from bytes the shard did not seal under this connection's key.
    if (!mac_->Verify(dataplane::Direction::kToAttention, sequence_, reply_buffer_->data(), *n,
                      reply->output_mac())) {
      if (on_integrity_failed_) on_integrity_failed_();
      return absl::DataLossError(absl::StrCat(
          "expert shard ", shard,
          ": the reply payload failed its integrity check (AES-GMAC of the connection)"));
    }
    return ReplyRows(reply_buffer_->data(), rows, latent_, f32, reply_buffer_);
  }

 private:
  std::shared_ptr<const dataplane::PayloadMac> mac_;
  const uint64_t sequence_;
  std::function<void()> on_integrity_failed_;
  std::shared_ptr<std::atomic<bool>> broken_;
  std::function<void()> on_transfer_failed_;
  std::shared_ptr<transport::ExpertStream> stream_;
  std::shared_ptr<transport::PendingReply> pending_;
  std::shared_ptr<dataplane::UcxTransfer> sent_, received_;
  std::shared_ptr<dataplane::UcxBuffer> reply_buffer_;
  const ReplyMode mode_;
  const numerics::Precision precision_;
  const int64_t latent_, rows_, tokens_;
};

// A batch as one UCX message each way (shards that answer OpenDataPlane with batch_messages):
// the waiting thread polls the worker for the reply (UcxWorker::Await), then sleeps in slices
// that check the send, the endpoint and the shard's control connection (a shared-memory lane
// has no peer failure detection: a dead shard shows as that connection closing).
class MessageCall final : public ExpertCall {
 public:
  struct Batch {
    uint64_t client_id = 0, sequence = 0, token = 0;
    ReplyShape shape;
    // The shard's budget for the batch ends here (it answers DEADLINE_EXCEEDED by then): a
    // reply that has not come a grace later is not coming.
    absl::Time budget_end = absl::InfiniteFuture();
    // When the request left, and the channel's poll window (learned from its round trips).
    std::chrono::steady_clock::time_point sent_at;
    std::shared_ptr<PollWindow> window;
    // The reply's tag message, when the request asked for it (dataplane::kDetachTag).
    std::shared_ptr<dataplane::UcxTransfer> tag;
    // What the connection's other batches say when this one times out, and its ticket there.
    std::shared_ptr<ReplyLiveness> liveness;
    uint64_t ticket = 0;
  };
  MessageCall(std::string who, dataplane::UcxWorker* worker, std::shared_ptr<grpc::Channel> control,
              std::shared_ptr<std::atomic<bool>> broken, std::function<void()> on_transfer_failed,
              std::function<void()> on_integrity_failed,
              std::shared_ptr<const dataplane::PayloadMac> mac,
              std::shared_ptr<dataplane::UcxTransfer> sent,
              std::shared_ptr<dataplane::UcxTransfer> received,
              std::shared_ptr<dataplane::UcxBuffer> reply_buffer, Batch batch)
      : who_(std::move(who)),
        worker_(worker),
        control_(std::move(control)),
        broken_(std::move(broken)),
        on_transfer_failed_(std::move(on_transfer_failed)),
        on_integrity_failed_(std::move(on_integrity_failed)),
        mac_(std::move(mac)),
        sent_(std::move(sent)),
        received_(std::move(received)),
        reply_buffer_(std::move(reply_buffer)),
        b_(batch) {}
  ~MessageCall() override { b_.liveness->Finished(b_.ticket); }

  const char* transport() const override { return "ucx"; }

  bool Answered(absl::Time until) override {
    (void)worker_->Await(*received_, until, *b_.window, b_.sent_at,
                         [this] { return SendFailed(); });
    return received_->done() || SendFailed() || broken_->load();
  }

  absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
    MOE_RETURN_IF_ERROR(AwaitReply(std::min(deadline, b_.budget_end + kReplyGrace)));
    absl::StatusOr<size_t> n = received_->Wait(absl::InfinitePast());
    if (!n.ok()) {
      if (on_transfer_failed_) on_transfer_failed_();
      return absl::Status(n.status().code(), absl::StrCat(who_, ": reply: ", n.status().message()));
    }
    b_.liveness->Replied();
    // Nothing is read from bytes the shard did not seal under this connection's key for this
    // batch (its sequence is the nonce).
    absl::StatusOr<dataplane::BatchFrame> frame = Authenticate(*n, deadline);
    if (!frame.ok()) {
      if (frame.status().code() == absl::StatusCode::kDataLoss && on_integrity_failed_) {
        on_integrity_failed_();
      }
      return absl::Status(frame.status().code(),
                          absl::StrCat(who_, ": ", frame.status().message()));
    }
    // The rows stay in the registered buffer they landed in; the reply holds it.
    return ReadBatchReply(who_, b_.shape, reinterpret_cast<const char*>(reply_buffer_->data()), *n,
                          frame->header_bytes, reply_buffer_);
  }

 private:
  // How often a waiter that no longer polls checks the send, the endpoint and the shard.
  static constexpr absl::Duration kLivenessSlice = absl::Milliseconds(20);
  // How long past the shard's budget a reply may still come (its answer and the wire).
  static constexpr absl::Duration kReplyGrace = absl::Seconds(1);

  bool SendFailed() const { return sent_->done() && !sent_->Wait(absl::InfinitePast()).ok(); }

  // The reply's frame once its MAC matched: the frame's own, or (a detached tag) the one its
  // tag message brings, hashed here while that message is on its way. DATA_LOSS when it does
  // not match; the tag message's failure or absence by the deadline otherwise.
  absl::StatusOr<dataplane::BatchFrame> Authenticate(size_t n, absl::Time deadline) {
    if (b_.tag == nullptr) {
      return dataplane::OpenReplyFrame(*mac_, received_->header(), reply_buffer_->data(), n,
                                       b_.client_id, b_.sequence);
    }
    absl::StatusOr<dataplane::DetachedReply> reply = dataplane::HashDetachedReply(
        *mac_, received_->header(), reply_buffer_->data(), n, b_.client_id, b_.sequence);
    if (!reply.ok()) return reply.status();
    const absl::Time by = std::min(deadline, b_.budget_end + kReplyGrace);
    // Polled (it follows the shard's hash of the same bytes), not learned from: the window is
    // the round trip's.
    (void)worker_->Await(*b_.tag, by, worker_->poll_spin_max(), [] { return false; });
    absl::StatusOr<size_t> got = b_.tag->Wait(by);
    if (!got.ok()) {
      return absl::Status(got.status().code(),
                          absl::StrCat("the reply's tag message: ", got.status().message()));
    }
    MOE_RETURN_IF_ERROR(dataplane::CheckReplyTag(*reply, b_.tag->header()));
    return reply->frame;
  }

  // OK once the reply message arrived (or its transfer failed); else why not, naming the shard.
  absl::Status AwaitReply(absl::Time deadline) {
    // Most replies land while this thread polls: nothing else is looked at first.
    (void)worker_->Await(*received_, std::min(deadline, absl::Now() + kLivenessSlice), *b_.window,
                         b_.sent_at, [this] { return SendFailed(); });
    while (!received_->done()) {
      if (SendFailed()) {
        const absl::Status s = sent_->Wait(absl::InfinitePast()).status();
        if (s.code() != absl::StatusCode::kDeadlineExceeded) broken_->store(true);
        if (on_transfer_failed_) on_transfer_failed_();
        return absl::Status(s.code(), absl::StrCat(who_, ": activations: ", s.message()));
      }
      if (broken_->load() || control_->GetState(false) != GRPC_CHANNEL_READY) {
        broken_->store(true);
        if (on_transfer_failed_) on_transfer_failed_();
        return absl::UnavailableError(
            absl::StrCat(who_, " is gone (its UCX endpoint or its connection closed)"));
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        // The shard may have dropped the batch unread (it no longer knows this client: evicted
        // as idle, or another process opened under this node name): then the next batch opens
        // the data plane again instead of waiting out its deadline too. Unless the shard is
        // only busy: it answered since, or an older batch is still waiting (ReplyLiveness).
        if (b_.liveness->TimedOutMeansGone(b_.ticket)) broken_->store(true);
        return absl::DeadlineExceededError(
            absl::StrCat(who_, " did not answer the batch before the deadline"));
      }
      (void)received_->Wait(std::min(deadline, now + kLivenessSlice));
    }
    return absl::OkStatus();
  }

  const std::string who_;
  dataplane::UcxWorker* const worker_;
  std::shared_ptr<grpc::Channel> control_;
  std::shared_ptr<std::atomic<bool>> broken_;
  std::function<void()> on_transfer_failed_, on_integrity_failed_;
  std::shared_ptr<const dataplane::PayloadMac> mac_;
  std::shared_ptr<dataplane::UcxTransfer> sent_, received_;
  std::shared_ptr<dataplane::UcxBuffer> reply_buffer_;
  const Batch b_;
};

}  // namespace

UcxExpertChannel::UcxExpertChannel(ChannelOptions o, dataplane::UcxWorker* worker)
    : shard_(o.shard),
      endpoint_(o.endpoint),
      node_(std::move(o.node)),
      cluster_token_(std::move(o.cluster_token)),
      max_message_bytes_(o.max_message_bytes),
      worker_(worker),
      fallback_in_band_(o.fallback_in_band),
      next_(std::move(o.next)),
      detach_reply_tag_from_(o.detach_reply_tag_from),
      on_event_(std::move(o.on_event)),
      on_lanes_(std::move(o.on_lanes)),
      stream_(std::make_shared<transport::ExpertStream>(shard_, endpoint_, max_message_bytes_,
                                                        cluster_token_)),
      inband_(std::make_unique<GrpcExpertChannel>(shard_, stream_)),
      reply_window_(std::make_shared<PollWindow>(worker->poll_spin(), worker->poll_spin_max())) {}

UcxExpertChannel::~UcxExpertChannel() {
  if (ep_ != 0) worker_->Disconnect(ep_);
}

absl::StatusOr<UcxExpertChannel::Connection> UcxExpertChannel::EnsureOpen(absl::Time deadline) {
  std::lock_guard<std::mutex> lock(open_mu_);
  // A shard whose control connection dropped (it restarted, or died) is opened again before
  // anything is sent to its old worker.
  if (client_id_.load() != 0 && !broken_->load() &&
      (control_ == nullptr || control_->GetState(false) == GRPC_CHANNEL_READY)) {
    return Connection{ep_,          client_id_.load(), mac_,
                      chunk_bytes_, batch_messages_,   detached_tags_,
                      control_,     liveness_};
  }
  if (absl::Now() < retry_after_) {
    return absl::FailedPreconditionError(absl::StrCat(without_ucx_, " (asked again every ",
                                                      absl::FormatDuration(kRetryWithoutUcx), ")"));
  }
  if (ep_ != 0) worker_->Disconnect(ep_);
  ep_ = 0;
  client_id_.store(0);
  broken_->store(false);
  const std::string who = absl::StrCat("expert shard ", shard_, " (", endpoint_, ")");
  absl::StatusOr<OpenedDataPlane> opened =
      OpenDataPlane(who, endpoint_, max_message_bytes_, cluster_token_, node_, "ucx", deadline);
  if (!opened.ok()) {
    if (opened.status().code() == absl::StatusCode::kFailedPrecondition ||
        opened.status().code() == absl::StatusCode::kUnimplemented) {
      retry_after_ = absl::Now() + kRetryWithoutUcx;
      without_ucx_ = std::string(opened.status().message());
    }
    return opened.status();
  }
  const absl::Time open_by = opened->open_by;
  const v1::OpenDataPlaneReply& reply = opened->reply;
  auto mac = dataplane::PayloadMac::Create(reply.mac_key());
  if (!mac.ok() || reply.hello_secret().size() != dataplane::kHelloSecretBytes ||
      reply.chunk_bytes() < 4096 || reply.worker_address().empty()) {
    return absl::UnavailableError(absl::StrCat(
        who, ": OpenDataPlane answered without a MAC key, hello secret, chunk size or address"));
  }
  // The address came from the shard we dialled over the authenticated channel.
  auto ep = worker_->Connect(reply.worker_address(),
                             [broken = broken_](const absl::Status&) { broken->store(true); });
  if (!ep.ok()) {
    return absl::UnavailableError(absl::StrCat(who, ": UCX endpoint: ", ep.status().message()));
  }
  // The hello binds our client id to this endpoint on the shard; its acknowledgement (the
  // shard's view of the lanes) proves the way back works before any batch relies on it.
  auto ack_buffer = worker_->Buffer(256);
  if (!ack_buffer.ok()) {
    worker_->Disconnect(*ep);
    return absl::ResourceExhaustedError(absl::StrCat(who, ": ", ack_buffer.status().message()));
  }
  // The acknowledgement is shorter than the buffer: a receive of up to 255 bytes.
  auto ack = worker_->RecvAny(reply.ack_tag(), *ack_buffer, open_by);
  auto hello = worker_->SendHello(
      *ep, dataplane::EncodeHello({reply.client_id(), reply.hello_secret()}), open_by);
  absl::StatusOr<size_t> acked = ack->Wait(open_by + absl::Milliseconds(100));
  if (!acked.ok()) {
    worker_->Disconnect(*ep);
    return absl::UnavailableError(
        absl::StrCat(who, ": the UCX hello was not acknowledged: ", acked.status().message()));
  }
  absl::StatusOr<dataplane::UcxLanes> lanes = worker_->Lanes(*ep);
  // A shard with another shared-memory FIFO is not used over UCX (in band where allowed).
  if (absl::Status same =
          SameFifoShape(who, reply.shm_fifo(), worker_->shared_memory_fifo(), lanes);
      !same.ok()) {
    worker_->Disconnect(*ep);
    retry_after_ = absl::Now() + kRetryWithoutUcx;
    without_ucx_ = std::string(same.message());
    return same;
  }
  {
    std::lock_guard<std::mutex> l(lanes_mu_);
    lanes_ = lanes.ok() ? *lanes : dataplane::UcxLanes{};
    peer_lanes_.assign(reinterpret_cast<const char*>((*ack_buffer)->data()), *acked);
  }
  ep_ = *ep;
  mac_ = std::make_shared<const dataplane::PayloadMac>(std::move(*mac));
  chunk_bytes_ = static_cast<size_t>(reply.chunk_bytes());
  batch_messages_ = reply.batch_messages();
  detached_tags_ = reply.batch_messages() && reply.detached_reply_tags();
  control_ = std::move(opened->control);
  liveness_ = std::make_shared<ReplyLiveness>();
  client_id_.store(reply.client_id());
  if (on_event_) on_event_(shard_, "connected");
  if (on_lanes_) on_lanes_(shard_, lanes_, peer_lanes_);
  return Connection{ep_,          client_id_.load(), mac_,
                    chunk_bytes_, batch_messages_,   detached_tags_,
                    control_,     liveness_};
}

dataplane::UcxLanes UcxExpertChannel::lanes() const {
  std::lock_guard<std::mutex> l(lanes_mu_);
  return lanes_;
}

int64_t UcxExpertChannel::dispatch_streams_opened() const { return stream_->streams_opened(); }

std::string UcxExpertChannel::peer_lanes() const {
  std::lock_guard<std::mutex> l(lanes_mu_);
  return peer_lanes_;
}

std::unique_ptr<ExpertCall> UcxExpertChannel::Send(const DispatchHeader& header,
                                                   const DispatchMessage& m) {
  const absl::Time deadline =
      absl::Now() +
      absl::Milliseconds(std::max<int64_t>(1, header.timeout_ms > 0 ? header.timeout_ms : 30000));
  const absl::StatusOr<Connection> open = EnsureOpen(deadline);
  if (!open.ok()) {
    if (next_ != nullptr) return next_->Send(header, m);
    if (fallback_in_band_) {
      if (on_event_) on_event_(shard_, "fallback");
      return inband_->Send(header, m);
    }
    return FailedExpertCall(absl::UnavailableError(open.status().message()));
  }
  const Connection& c = *open;
  const int64_t u = static_cast<int64_t>(m.tokens.size());
  const size_t bytes = static_cast<size_t>(m.activation_bytes());
  const bool f32 = header.mode == ReplyMode::kPartialSum;
  const int64_t reply_rows = f32 ? u : m.rows();
  const size_t reply_bytes = static_cast<size_t>(reply_rows * header.latent) * (f32 ? 4 : 2);
  if (c.batch_messages) return SendMessage(c, header, m, bytes, reply_bytes, deadline);
  auto send_buffer = worker_->Buffer(bytes);
  auto reply_buffer = worker_->Buffer(reply_bytes);
  if (!send_buffer.ok() || !reply_buffer.ok()) {
    return FailedExpertCall(absl::ResourceExhaustedError(absl::StrCat(
        "expert shard ", shard_, ": no UCX buffer: ",
        (!send_buffer.ok() ? send_buffer.status() : reply_buffer.status()).message())));
  }
  // z: [U, latent] bf16 (or MXFP8 codes, then scales), copied once into registered memory
  // that the transfer owns.
  m.z.CopyTo((*send_buffer)->data());
  // Tags nobody outside this connection can predict (a CSPRNG per batch), and the MAC nonce.
  const uint64_t seq = sequence_.fetch_add(1);
  const uint64_t tag = dataplane::RandomU64();
  const uint64_t reply_tag = dataplane::RandomU64();
  const std::string activation_mac =
      c.mac->Compute(dataplane::Direction::kToExpert, seq, (*send_buffer)->data(), bytes);
  // The reply's receive is posted before the header leaves, so the payload always finds it.
  auto received = worker_->Recv(reply_tag, *reply_buffer, reply_bytes, deadline + kLateReplyGrace,
                                nullptr, c.chunk_bytes);
  auto sent = worker_->Send(c.ep, tag, *send_buffer, bytes, deadline, nullptr, c.chunk_bytes);
  v1::DispatchRequest dr = DispatchRequestFor(header, m, /*with_activation_bytes=*/false);
  v1::OutOfBand* oob = dr.mutable_out_of_band();
  oob->set_client_id(c.client_id);
  oob->set_tag(tag);
  oob->set_activation_bytes(static_cast<int64_t>(bytes));
  oob->set_reply_tag(reply_tag);
  oob->set_reply_capacity_bytes(static_cast<int64_t>(reply_bytes));
  oob->set_sequence(seq);
  oob->set_activation_mac(activation_mac);
  auto pending = stream_->Send(std::move(dr));
  return std::make_unique<UcxCall>(broken_, TransferFailed(), stream_, std::move(pending),
                                   std::move(sent), std::move(received), *reply_buffer, header.mode,
                                   m.precision(), header.latent, m.rows(), u, c.mac, seq,
                                   IntegrityFailed());
}

std::function<void()> UcxExpertChannel::TransferFailed() const {
  if (!on_event_) return nullptr;
  return [on_event = on_event_, shard = shard_] { on_event(shard, "transfer_failed"); };
}

std::function<void()> UcxExpertChannel::IntegrityFailed() const {
  // Counted every time, logged once a minute for this shard (the peer).
  return [on_event = on_event_, shard = shard_, last = last_integrity_log_] {
    if (on_event) on_event(shard, "integrity_failed");
    const int64_t now = absl::ToUnixSeconds(absl::Now());
    int64_t seen = last->load();
    if (now - seen >= 60 && last->compare_exchange_strong(seen, now)) {
      MOE_LOG_WARN(
          "data plane to {}: a reply payload failed its integrity check (DATA_LOSS; "
          "logged once a minute per shard)",
          shard);
    }
  };
}

std::unique_ptr<ExpertCall> UcxExpertChannel::SendMessage(const Connection& c,
                                                          const DispatchHeader& header,
                                                          const DispatchMessage& m, size_t bytes,
                                                          size_t reply_bytes, absl::Time deadline) {
  const uint64_t seq = sequence_.fetch_add(1);
  v1::DispatchRequest dr = BatchMessageHeader(header, m, c.client_id, seq, bytes, reply_bytes);
  const size_t header_bytes = dr.ByteSizeLong();
  const size_t total = header_bytes + bytes;
  auto send_buffer = worker_->Buffer(std::max<size_t>(total, 1));
  auto reply_buffer = worker_->Buffer(reply_bytes + dataplane::kMaxReplyHeaderBytes);
  if (!send_buffer.ok() || !reply_buffer.ok()) {
    return FailedExpertCall(absl::ResourceExhaustedError(absl::StrCat(
        "expert shard ", shard_, ": no UCX buffer: ",
        (!send_buffer.ok() ? send_buffer.status() : reply_buffer.status()).message())));
  }
  // One buffer: the request's header, then z ([U, latent] bf16, or MXFP8 codes then scales).
  uint8_t* d = (*send_buffer)->data();
  dr.SerializeWithCachedSizesToArray(d);
  m.z.CopyTo(d + header_bytes);
  // The reply's token: unpredictable outside this connection, and even (its tag message, if
  // any, carries the odd one next to it).
  dataplane::BatchFrame f{dataplane::RandomU64() & ~uint64_t{1},
                          dataplane::BatchKind::kRequest,
                          c.client_id,
                          seq,
                          static_cast<uint32_t>(header_bytes),
                          {}};
  std::shared_ptr<dataplane::UcxTransfer> tag;
  if (c.detached_tags && detach_reply_tag_from_ > 0 && reply_bytes >= detach_reply_tag_from_) {
    auto tag_buffer = worker_->Buffer(1);
    if (tag_buffer.ok()) {
      f.flags = dataplane::kDetachTag;
      tag = worker_->ExpectMessage(dataplane::ReplyTagToken(f.token), *tag_buffer,
                                   deadline + kLateReplyGrace);
      detached_tag_batches_.fetch_add(1);
    }
  }
  const std::string frame =
      dataplane::SealBatchFrame(*c.mac, dataplane::Direction::kToExpert, f, d, total);
  // Expected before the request leaves, so the reply always finds its buffer.
  const uint64_t ticket = c.liveness->Sent();
  auto received = worker_->ExpectMessage(f.token, *reply_buffer, deadline + kLateReplyGrace);
  auto sent = worker_->SendMessage(c.ep, dataplane::UcxWorker::Message::kRequest, frame,
                                   *send_buffer, total, deadline);
  MessageCall::Batch b;
  b.client_id = c.client_id;
  b.sequence = seq;
  b.token = f.token;
  b.shape = ShapeOf(header, m);
  b.budget_end = deadline;
  b.sent_at = std::chrono::steady_clock::now();
  b.window = reply_window_;
  b.tag = std::move(tag);
  b.liveness = c.liveness;
  b.ticket = ticket;
  return std::make_unique<MessageCall>(absl::StrCat("expert shard ", shard_, " (", endpoint_, ")"),
                                       worker_, c.control, broken_, TransferFailed(),
                                       IntegrityFailed(), c.mac, std::move(sent),
                                       std::move(received), *reply_buffer, b);
}

}  // namespace moe::attention_svc
