#include "expert-svc/dataplane/ucx/ucx_server_half.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "expert-svc/batch_endpoint.h"
#include "expert-svc/dataplane/ucx/ucx_data_plane.h"
#include "expert-svc/dispatch_batch.h"
#include "services/common/logging.h"
#include "services/dataplane/ucx_worker.h"

namespace moe::expert_svc {

namespace {

// How long past a batch's budget its reply payload may take to be taken by the caller.
constexpr absl::Duration kReplySendGrace = absl::Seconds(5);

// The answer's payload out of band (sealed with the connection's MAC), its header on the stream
// once UCX is done with the payload; errors on the stream at once.
class UcxReply final : public BatchReply {
 public:
  UcxReply(DispatchReactor* stream, UcxDataPlane* ucx, OutOfBandHeader header, std::string shard,
           absl::Time deadline)
      : stream_(stream),
        ucx_(ucx),
        header_(std::move(header)),
        shard_(std::move(shard)),
        deadline_(deadline) {}

  void Send(v1::DispatchReply reply) override {
    if (reply.code() != 0) {
      stream_->Reply(std::move(reply), true);
      return;
    }
    reply.set_receive_seconds(receive_seconds);
    auto out = std::make_shared<v1::DispatchReply>();
    const std::string& data = reply.outputs().data();
    const int64_t n = static_cast<int64_t>(data.size());
    const absl::Status sent = ucx_->Reply(
        header_, data, deadline_,
        [&](const std::string& mac) {
          v1::DispatchReply r = reply;  // the outputs' bytes travel out of band
          r.mutable_outputs()->clear_data();
          r.set_out_of_band(true);
          r.set_output_bytes(n);
          r.set_output_mac(mac);
          *out = std::move(r);
        },
        [stream = stream_, out, shard = shard_](const absl::Status& s) {
          if (!s.ok()) {
            const uint64_t batch_id = out->batch_id();
            *out = ErrorReply(batch_id, shard,
                              absl::UnavailableError(absl::StrCat(
                                  "shard ", shard, ", batch ", batch_id,
                                  ": the reply payload did not go out: ", s.message())));
          }
          stream->Reply(std::move(*out), true);
        });
    if (!sent.ok()) stream_->Reply(ErrorReply(reply.batch_id(), shard_, sent), true);
  }
  const char* transport() const override { return "ucx"; }

 private:
  DispatchReactor* stream_;
  UcxDataPlane* ucx_;
  const OutOfBandHeader header_;
  const std::string shard_;
  const absl::Time deadline_;
};

class UcxEndpoint final : public BatchEndpoint {
 public:
  UcxEndpoint(const EndpointContext& ctx, UcxDataPlane* ucx) : ctx_(ctx), ucx_(ucx) {}
  void Receive(v1::DispatchRequest req, Admit admit) override {
    const v1::OutOfBand& o = req.out_of_band();
    OutOfBandHeader h;
    h.batch_id = req.batch_id();
    h.client_id = o.client_id();
    h.tag = o.tag();
    h.activation_bytes = o.activation_bytes();
    h.reply_tag = o.reply_tag();
    h.reply_bytes = o.reply_capacity_bytes();
    h.sequence = o.sequence();
    h.activation_mac = o.activation_mac();
    const auto arrived = std::chrono::steady_clock::now();
    const auto budget = BatchBudget(req.timeout_ms());
    const absl::Time deadline = absl::Now() + absl::FromChrono(budget);
    auto reply = std::make_shared<std::unique_ptr<UcxReply>>(
        std::make_unique<UcxReply>(ctx_.stream, ucx_, h, ctx_.shard, deadline + kReplySendGrace));
    auto shared_req = std::make_shared<v1::DispatchRequest>(std::move(req));
    // Runs on the UCX progress thread once the payload is in and its MAC matched (or not).
    ucx_->Receive(
        h, deadline,
        [ctx = ctx_, shared_req, reply, arrived, admit = std::move(admit)](const absl::Status& s,
                                                                           std::string_view bytes) {
          if (!s.ok()) {
            if (ctx.on_error) ctx.on_error(s);
            ctx.stream->Reply(ErrorReply(shared_req->batch_id(), ctx.shard, s), true);
            return;
          }
          (*reply)->receive_seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - arrived).count();
          admit(*shared_req, bytes, std::move(*reply));
        });
  }

 private:
  const EndpointContext ctx_;
  UcxDataPlane* const ucx_;
};

// A reply's registered buffer, its payload after the header's room.
class UcxReplyBuffer final : public ReplyBuffer {
 public:
  UcxReplyBuffer(std::shared_ptr<dataplane::UcxBuffer> buffer, size_t bytes)
      : buffer(std::move(buffer)), bytes(bytes) {}
  uint8_t* payload() override { return buffer->data() + UcxDataPlane::kReplyPayloadOffset; }

  std::shared_ptr<dataplane::UcxBuffer> buffer;
  const size_t bytes;
};

class UcxServerHalf final : public ServerHalf {
 public:
  UcxServerHalf(std::unique_ptr<UcxDataPlane> ucx, bool batch_messages)
      : ucx_(std::move(ucx)), batch_messages_(batch_messages) {}

  const char* name() const override { return "ucx"; }
  std::string Describe() const override {
    return absl::StrCat("UCX ", dataplane::UcxVersion(), ", UCX_TLS ", ucx_->tls(),
                        ", shared-memory FIFO ", ucx_->worker().shared_memory_fifo());
  }
  std::string tls() const override { return ucx_->tls(); }
  const std::string& address() const override { return ucx_->address(); }

  absl::Status Open(const std::string& node, v1::OpenDataPlaneReply* reply) override {
    absl::StatusOr<DataPlaneClient> client = ucx_->Open(node);
    if (!client.ok()) return client.status();
    reply->set_transport(name());
    reply->set_client_id(client->id);
    reply->set_worker_address(ucx_->address());
    reply->set_tls(ucx_->tls());
    reply->set_hello_secret(client->hello_secret);
    reply->set_ack_tag(client->ack_tag);
    reply->set_mac_key(client->mac_key);
    reply->set_chunk_bytes(static_cast<int64_t>(ucx_->chunk_bytes()));
    reply->set_batch_messages(batch_messages_);
    reply->set_shm_fifo(ucx_->worker().shared_memory_fifo());
    reply->set_detached_reply_tags(batch_messages_);
    return absl::OkStatus();
  }
  absl::Status ReplyBatch(const BatchSource& to, std::string_view header, std::string_view payload,
                          absl::Time deadline) override {
    return ucx_->ReplyBatch(to, header, payload, deadline, nullptr);
  }
  std::unique_ptr<ReplyBuffer> NewReplyBuffer(const BatchSource&, size_t bytes) override {
    absl::StatusOr<std::shared_ptr<dataplane::UcxBuffer>> b = ucx_->ReplyBuffer(bytes);
    if (!b.ok()) return nullptr;  // ReplyBatch then finds none either and says so
    return std::make_unique<UcxReplyBuffer>(std::move(*b), bytes);
  }
  absl::Status ReplyBatchFrom(const BatchSource& to, std::string_view header,
                              std::unique_ptr<ReplyBuffer> filled, absl::Time deadline) override {
    auto* mine = dynamic_cast<UcxReplyBuffer*>(filled.get());
    if (mine == nullptr) return ServerHalf::ReplyBatchFrom(to, header, nullptr, deadline);
    return ucx_->ReplyBatchFrom(to, header, std::move(mine->buffer), mine->bytes, deadline,
                                nullptr);
  }

  void PollUntil(std::chrono::steady_clock::time_point until,
                 const std::function<bool()>& stop) override {
    ucx_->PollUntil(until, stop);
  }
  std::chrono::microseconds poll_spin() const override {
    return batch_messages_ ? ucx_->poll_spin() : std::chrono::microseconds(0);
  }
  std::vector<std::pair<std::string, double>> DroppedByKind() const override {
    return ucx_->worker().DroppedByKind();
  }
  std::string lanes() const override { return ucx_->lanes(); }
  std::unique_ptr<BatchEndpoint> StreamEndpoint(const EndpointContext& ctx) override {
    return std::make_unique<UcxEndpoint>(ctx, ucx_.get());
  }

 private:
  const std::unique_ptr<UcxDataPlane> ucx_;
  const bool batch_messages_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ServerHalf>> StartUcxServerHalf(ServerHalfOptions o) {
  const bool batch_messages = static_cast<bool>(o.on_batch);
  const std::string shard = o.shard;
  auto ucx = UcxDataPlane::Start(std::move(o));
  if (!ucx.ok()) return absl::FailedPreconditionError(ucx.status().message());
  if (absl::Status v = dataplane::CheckUcxVersion(); !v.ok()) {
    MOE_LOG_WARN("shard {}: {}", shard, std::string(v.message()));
  }
  return std::make_unique<UcxServerHalf>(std::move(*ucx), batch_messages);
}

}  // namespace moe::expert_svc
