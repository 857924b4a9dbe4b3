#include "expert-svc/dataplane/ucx/ucx_data_plane.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "services/common/logging.h"
#include "services/common/status_macros.h"
#include "services/dataplane/payload_mac.h"
#include "services/dataplane/ucx_worker.h"

namespace moe::expert_svc {

namespace {
constexpr absl::Duration kAckTimeout = absl::Seconds(5);
constexpr absl::Duration kLogEvery = absl::Minutes(1);
}  // namespace

UcxDataPlane::UcxDataPlane(UcxDataPlaneOptions options)
    : options_(std::move(options)), clients_(options_.max_clients) {}

UcxDataPlane::~UcxDataPlane() { worker_.reset(); }

absl::StatusOr<std::unique_ptr<UcxDataPlane>> UcxDataPlane::Start(UcxDataPlaneOptions options) {
  auto dp = std::unique_ptr<UcxDataPlane>(new UcxDataPlane(std::move(options)));
  dataplane::UcxOptions uo;
  uo.name = dp->options_.shard;
  uo.tls = dp->options_.tls;
  uo.bind_host = dp->options_.bind_host;
  uo.poll_spin = dp->options_.poll_spin;
  uo.spin = dp->options_.progress_spin;
  auto w = dataplane::UcxWorker::Create(uo);
  if (!w.ok()) return w.status();
  dp->worker_ = std::move(*w);
  UcxDataPlane* self = dp.get();
  dp->worker_->OnHello([self](std::string_view hello, uint64_t ep, const dataplane::UcxLanes& l) {
    self->OnHello(hello, ep, l.Describe());
  });
  // Malformed hellos the worker drops before they reach OnHello are refused hellos too.
  dp->worker_->OnHelloDropped([self](const std::string& why) {
    self->Rejected("hello_rejected", "a malformed hello", "a UCX hello was refused: " + why);
  });
  dp->worker_->OnMessage(
      [self](std::string_view frame, size_t length) { return self->OnRequest(frame, length); });
  return dp;
}

const std::string& UcxDataPlane::address() const { return worker_->address(); }
const std::string& UcxDataPlane::tls() const { return worker_->tls(); }
size_t UcxDataPlane::chunk_bytes() const { return worker_->chunk_bytes(); }

absl::StatusOr<DataPlaneClient> UcxDataPlane::Open(const std::string& node) {
  auto ack = worker_->Buffer(256);
  if (!ack.ok()) return ack.status();
  uint64_t replaced = 0;
  absl::StatusOr<DataPlaneClient> c = clients_.Open(node, &replaced);
  if (!c.ok()) return c.status();
  {
    std::lock_guard<std::mutex> lock(mu_);
    ack_buffers_[c->id] = *ack;
    // Buffers of clients that are gone (replaced or never said hello) are dropped lazily.
    for (auto it = ack_buffers_.begin(); it != ack_buffers_.end();) {
      it = clients_.Get(it->first).status().code() == absl::StatusCode::kNotFound
               ? ack_buffers_.erase(it)
               : std::next(it);
    }
  }
  // The replaced client's endpoint is UCX's (made for its hello): forgotten, not closed.
  if (replaced != 0) worker_->Disconnect(replaced);
  return c;
}

void UcxDataPlane::Rejected(const std::string& event, const std::string& peer,
                            const std::string& detail) {
  if (options_.on_event) options_.on_event(event);
  std::lock_guard<std::mutex> lock(mu_);
  // Bounded: at most one entry per client (capped) and one for hellos of unknown peers.
  if (last_logged_.size() > static_cast<size_t>(options_.max_clients) + 8) last_logged_.clear();
  absl::Time& last = last_logged_[absl::StrCat(event, "/", peer)];
  const absl::Time now = absl::Now();
  if (now - last < kLogEvery) return;
  last = now;
  MOE_LOG_WARN("shard {}: data plane: {} (logged once a minute per peer)", options_.shard, detail);
}

void UcxDataPlane::OnHello(std::string_view hello, uint64_t ep, const std::string& lanes) {
  absl::StatusOr<DataPlaneClient> c = clients_.Bind(hello, ep);
  if (!c.ok()) {
    Rejected("hello_rejected", "an unbound endpoint",
             absl::StrCat("a UCX hello was refused: ", c.status().ToString()));
    return;
  }
  std::shared_ptr<dataplane::UcxBuffer> ack;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ack_buffers_.find(c->id);
    if (it == ack_buffers_.end()) return;  // said hello twice: acknowledged already
    ack = std::move(it->second);
    ack_buffers_.erase(it);
    lanes_ = lanes;
  }
  // The acknowledgement carries the lanes UCX selected on this side.
  const size_t n = std::min(lanes.size(), ack->capacity());
  std::memcpy(ack->data(), lanes.data(), n);
  (void)worker_->Send(ep, c->ack_tag, ack, n, absl::Now() + kAckTimeout);
  MOE_LOG_INFO("shard {}: data-plane client {} ({}) said hello over UCX, lanes {}", options_.shard,
               c->id, c->node, lanes);
}

std::string UcxDataPlane::lanes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lanes_;
}

void UcxDataPlane::Receive(const OutOfBandHeader& h, absl::Time deadline, Received done) {
  const std::string where = absl::StrCat("shard ", options_.shard, ", batch ", h.batch_id);
  absl::StatusOr<DataPlaneClient> c = clients_.Get(h.client_id);
  if (!c.ok()) {
    return done(absl::FailedPreconditionError(absl::StrCat(where, ": ", c.status().message())), {});
  }
  if (absl::Status s = ValidateOutOfBand(h, options_.max_message_bytes, where); !s.ok()) {
    return done(s, {});
  }
  auto buffer = worker_->Buffer(static_cast<size_t>(h.activation_bytes));
  if (!buffer.ok()) {
    return done(absl::ResourceExhaustedError(
                    absl::StrCat(where, ": no receive buffer: ", buffer.status().message())),
                {});
  }
  std::shared_ptr<dataplane::UcxBuffer> buf = *buffer;
  const size_t want = static_cast<size_t>(h.activation_bytes);
  // Runs on the UCX progress thread once the payload is in (or the receive failed).
  worker_->Recv(
      h.tag, buf, want, deadline,
      [this, buf, want, where, mac = c->mac, seq = h.sequence, tag = h.activation_mac,
       peer = absl::StrCat("client ", c->id, " (", c->node, ")"),
       done = std::move(done)](const absl::Status& s, size_t n) {
        if (!s.ok()) {
          const absl::StatusCode code = s.code() == absl::StatusCode::kInvalidArgument ||
                                                s.code() == absl::StatusCode::kInternal
                                            ? absl::StatusCode::kInvalidArgument
                                            : s.code();
          return done(absl::Status(code, absl::StrCat(where, ": activations: ", s.message())), {});
        }
        if (n != want || !mac->Verify(dataplane::Direction::kToExpert, seq, buf->data(), n, tag)) {
          Rejected("integrity_failed", peer,
                   absl::StrCat(where, ": an activation payload of ", peer,
                                " failed its integrity check"));
          return done(absl::DataLossError(
                          absl::StrCat(where,
                                       ": the activation payload failed its integrity check "
                                       "(AES-GMAC of the connection); refused before compute")),
                      {});
        }
        done(absl::OkStatus(), std::string_view(reinterpret_cast<const char*>(buf->data()), n));
      });
}

dataplane::UcxWorker::MessageSink UcxDataPlane::OnRequest(std::string_view frame_bytes,
                                                          size_t length) {
  dataplane::UcxWorker::MessageSink sink;
  absl::StatusOr<dataplane::BatchFrame> frame =
      dataplane::ParseBatchFrame(frame_bytes, dataplane::BatchKind::kRequest, length);
  absl::StatusOr<DataPlaneClient> c =
      frame.ok() ? clients_.Get(frame->client_id) : absl::StatusOr<DataPlaneClient>(frame.status());
  if (!c.ok() || !options_.on_batch ||
      static_cast<int64_t>(length) > options_.max_message_bytes + (int64_t{1} << 20)) {
    Rejected("message_rejected", "an unbound peer",
             absl::StrCat("a UCX batch message of ", length, " bytes was dropped: ",
                          !c.ok() ? c.status().ToString() : "too long, or no batch handler"));
    return sink;
  }
  // The activations (after the header) land 64-byte aligned: the batch is computed from them
  // where they are.
  const size_t offset =
      (kActivationAlignment - frame->header_bytes % kActivationAlignment) % kActivationAlignment;
  auto buffer = worker_->Buffer(std::max<size_t>(offset + length, 1));
  if (!buffer.ok()) {
    Rejected("message_rejected", "buffers",
             absl::StrCat("no buffer for a UCX batch message: ", buffer.status().ToString()));
    return sink;
  }
  sink.buffer = *buffer;
  sink.offset = offset;
  sink.done = [this, buf = *buffer, offset, f = *frame,
               prefix = std::string(dataplane::MacPrefix(frame_bytes)), mac = c->mac,
               peer = absl::StrCat("client ", c->id, " (", c->node, ")")](const absl::Status& s,
                                                                          size_t n) {
    if (!s.ok()) {
      Rejected("message_rejected", peer,
               absl::StrCat("a UCX batch message of ", peer, " did not arrive: ", s.ToString()));
      return;
    }
    // Nothing of it is read before it authenticated under the client's key.
    const uint8_t* message = buf->data() + offset;
    if (!mac->Verify(dataplane::Direction::kToExpert, f.sequence, message, n, f.mac, prefix)) {
      Rejected("integrity_failed", peer,
               absl::StrCat("shard ", options_.shard, ": a batch message of ", peer,
                            " failed its integrity check (dropped)"));
      return;
    }
    if (!clients_.ClaimSequence(f.client_id, f.sequence)) {
      Rejected("replayed", peer,
               absl::StrCat("shard ", options_.shard, ": a batch message of ", peer,
                            " repeated sequence ", f.sequence, " (dropped)"));
      return;
    }
    const auto* d = reinterpret_cast<const char*>(message);
    options_.on_batch(
        BatchSource{f.client_id, f.token, f.sequence, (f.flags & dataplane::kDetachTag) != 0, buf},
        std::string_view(d, f.header_bytes),
        std::string_view(d + f.header_bytes, n - f.header_bytes));
  };
  return sink;
}

absl::StatusOr<std::shared_ptr<dataplane::UcxBuffer>> UcxDataPlane::ReplyBuffer(size_t bytes) {
  auto buffer = worker_->Buffer(kReplyPayloadOffset + bytes);
  if (!buffer.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no reply buffer: ", buffer.status().message()));
  }
  return buffer;
}

absl::Status UcxDataPlane::ReplyBatch(const BatchSource& to, std::string_view header,
                                      std::string_view payload, absl::Time deadline, Sent sent) {
  MOE_ASSIGN_OR_RETURN(std::shared_ptr<dataplane::UcxBuffer> buffer, ReplyBuffer(payload.size()));
  if (!payload.empty()) {
    std::memcpy(buffer->data() + kReplyPayloadOffset, payload.data(), payload.size());
  }
  return ReplyBatchFrom(to, header, std::move(buffer), payload.size(), deadline, std::move(sent));
}

absl::Status UcxDataPlane::ReplyBatchFrom(const BatchSource& to, std::string_view header,
                                          std::shared_ptr<dataplane::UcxBuffer> buffer,
                                          size_t bytes, absl::Time deadline, Sent sent) {
  if (header.size() > dataplane::kMaxReplyHeaderBytes) {
    return absl::InternalError(absl::StrCat("a reply header of ", header.size(), " bytes"));
  }
  if (buffer == nullptr || buffer->capacity() < kReplyPayloadOffset + bytes) {
    return absl::InternalError(absl::StrCat("a reply of ", bytes, " bytes outside its buffer"));
  }
  absl::StatusOr<DataPlaneClient> c = clients_.Get(to.client_id);
  if (!c.ok()) return absl::UnavailableError(c.status().message());
  // The header goes right before the payload: one message from there.
  const size_t offset = kReplyPayloadOffset - header.size();
  const size_t total = header.size() + bytes;
  uint8_t* d = buffer->data() + offset;
  if (!header.empty()) std::memcpy(d, header.data(), header.size());
  dataplane::BatchFrame f{to.token,    dataplane::BatchKind::kReply,         to.client_id,
                          to.sequence, static_cast<uint32_t>(header.size()), {}};
  // A reply that does not go out is counted and logged (its batch then fails at the caller's
  // deadline).
  auto on_sent =
      [this, peer = absl::StrCat("client ", c->id, " (", c->node, ")")](const absl::Status& s) {
        if (!s.ok()) {
          Rejected("reply_failed", peer,
                   absl::StrCat("shard ", options_.shard, ": a reply to ", peer,
                                " did not go out: ", s.ToString()));
        }
      };
  dataplane::UcxWorker::Done done = [on_sent, sent = std::move(sent)](const absl::Status& s,
                                                                      size_t) {
    on_sent(s);
    if (sent) sent(s);
  };
  if (!to.detach_tag) {
    worker_->SendMessage(
        c->endpoint, dataplane::UcxWorker::Message::kReply,
        dataplane::SealBatchFrame(*c->mac, dataplane::Direction::kToAttention, f, d, total),
        std::move(buffer), total, deadline, std::move(done), offset);
    return absl::OkStatus();
  }
  // The reply leaves now; its MAC follows once computed (the attention node hashes its copy
  // meanwhile). The buffer stays held here until the hash is done.
  f.flags = dataplane::kDetachTag;
  auto tag_buffer = worker_->Buffer(1);
  if (!tag_buffer.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no buffer for a reply's tag: ", tag_buffer.status().message()));
  }
  const std::shared_ptr<dataplane::UcxBuffer> held = buffer;
  worker_->SendMessage(c->endpoint, dataplane::UcxWorker::Message::kReply,
                       dataplane::EncodeBatchFrame(f), std::move(buffer), total, deadline,
                       std::move(done), offset);
  worker_->SendMessage(c->endpoint, dataplane::UcxWorker::Message::kReply,
                       dataplane::ReplyTagFrame(*c->mac, f, held->data() + offset, total,
                                                [this] { (void)worker_->Progress(); }),
                       std::move(*tag_buffer), 0, deadline,
                       [on_sent](const absl::Status& s, size_t) { on_sent(s); });
  return absl::OkStatus();
}

absl::Status UcxDataPlane::Reply(const OutOfBandHeader& h, std::string_view payload,
                                 absl::Time deadline,
                                 const std::function<void(const std::string& mac)>& seal,
                                 Sent sent) {
  const std::string where = absl::StrCat("shard ", options_.shard, ", batch ", h.batch_id);
  if (static_cast<int64_t>(payload.size()) != h.reply_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the reply has ", payload.size(),
                                                   " bytes, the caller expects ", h.reply_bytes));
  }
  absl::StatusOr<DataPlaneClient> c = clients_.Get(h.client_id);
  if (!c.ok()) {
    return absl::UnavailableError(absl::StrCat(where, ": ", c.status().message()));
  }
  auto buffer = worker_->Buffer(payload.size());
  if (!buffer.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat(where, ": no reply buffer: ", buffer.status().message()));
  }
  std::memcpy((*buffer)->data(), payload.data(), payload.size());
  seal(c->mac->Compute(dataplane::Direction::kToAttention, h.sequence, (*buffer)->data(),
                       payload.size()));
  worker_->Send(c->endpoint, h.reply_tag, *buffer, payload.size(), deadline,
                [sent = std::move(sent)](const absl::Status& s, size_t) { sent(s); });
  return absl::OkStatus();
}

}  // namespace moe::expert_svc
