#include "expert-svc/batch_endpoint.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "expert-svc/dispatch_batch.h"
#include "expert-svc/ucx_data_plane.h"
#include "services/common/logging.h"
#include "services/dataplane/data_plane.h"
#include "services/transport/status_convert.h"

namespace moe::expert_svc {

namespace {

// How long past a batch's budget its reply payload may take to be taken by the caller.
constexpr absl::Duration kReplySendGrace = absl::Seconds(5);

class StreamReply final : public BatchReply {
 public:
  explicit StreamReply(DispatchReactor* stream) : stream_(stream) {}
  void Send(v1::DispatchReply reply) override { stream_->Reply(std::move(reply), true); }
  const char* transport() const override { return "grpc"; }

 private:
  DispatchReactor* stream_;
};

class LocalReply final : public BatchReply {
 public:
  explicit LocalReply(std::function<void(v1::DispatchReply)> fn) : fn_(std::move(fn)) {}
  void Send(v1::DispatchReply reply) override { fn_(std::move(reply)); }
  const char* transport() const override { return "local"; }

 private:
  std::function<void(v1::DispatchReply)> fn_;
};

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

// One UCX message back: the reply's header, then its outputs.
class UcxBatchReply final : public BatchReply {
 public:
  UcxBatchReply(UcxDataPlane* ucx, const UcxBatchSource& from, int64_t reply_bytes,
                std::string shard, absl::Time deadline)
      : ucx_(ucx),
        from_(from),
        reply_bytes_(reply_bytes),
        shard_(std::move(shard)),
        deadline_(deadline) {}

  void Send(v1::DispatchReply reply) override {
    std::string payload;
    if (reply.code() == 0) {
      payload = std::move(*reply.mutable_outputs()->mutable_data());
      reply.mutable_outputs()->clear_data();
      if (static_cast<int64_t>(payload.size()) != reply_bytes_) {
        const uint64_t id = reply.batch_id();
        reply = ErrorReply(id, shard_,
                           absl::InternalError(absl::StrCat(
                               "shard ", shard_, ", batch ", id, ": the reply has ", payload.size(),
                               " bytes, the caller expects ", reply_bytes_)));
        payload.clear();
      } else {
        reply.set_out_of_band(true);
        reply.set_output_bytes(static_cast<int64_t>(payload.size()));
      }
    }
    std::string header = reply.SerializeAsString();
    if (header.size() > dataplane::kMaxReplyHeaderBytes) {  // a very long error message
      reply.set_message(reply.message().substr(0, 1024));
      header = reply.SerializeAsString();
    }
    const absl::Status s = ucx_->ReplyBatch(from_, header, payload, deadline_, nullptr);
    if (!s.ok()) {
      MOE_LOG_WARN("shard {}, batch {}: the reply could not be sent: {}", shard_, reply.batch_id(),
                   s.ToString());
    }
  }
  const char* transport() const override { return "ucx"; }

 private:
  UcxDataPlane* const ucx_;
  const UcxBatchSource from_;
  const int64_t reply_bytes_;
  const std::string shard_;
  const absl::Time deadline_;
};

class InBandEndpoint final : public BatchEndpoint {
 public:
  explicit InBandEndpoint(const EndpointContext& ctx) : ctx_(ctx) {}
  void Receive(v1::DispatchRequest req, Admit admit) override {
    std::unique_ptr<BatchReply> reply;
    if (ctx_.stream != nullptr) {
      reply = std::make_unique<StreamReply>(ctx_.stream);
    } else {
      reply = std::make_unique<LocalReply>(ctx_.local_reply);
    }
    const std::string bytes = std::move(*req.mutable_activations()->mutable_data());
    admit(req, bytes, std::move(reply));
  }

 private:
  const EndpointContext ctx_;
};

class UcxEndpoint final : public BatchEndpoint {
 public:
  explicit UcxEndpoint(const EndpointContext& ctx) : ctx_(ctx) {}
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
    auto reply = std::make_shared<std::unique_ptr<UcxReply>>(std::make_unique<UcxReply>(
        ctx_.stream, ctx_.ucx, h, ctx_.shard, deadline + kReplySendGrace));
    auto shared_req = std::make_shared<v1::DispatchRequest>(std::move(req));
    // Runs on the UCX progress thread once the payload is in and its MAC matched (or not).
    ctx_.ucx->Receive(
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
};

// A request that asks for a data plane this server does not offer.
class RefusedEndpoint final : public BatchEndpoint {
 public:
  RefusedEndpoint(const EndpointContext& ctx, absl::Status why) : ctx_(ctx), why_(std::move(why)) {}
  void Receive(v1::DispatchRequest req, Admit) override {
    if (ctx_.on_error) ctx_.on_error(why_);
    const v1::DispatchReply reply = ErrorReply(req.batch_id(), ctx_.shard, why_);
    if (ctx_.stream != nullptr) {
      ctx_.stream->Reply(reply, true);
    } else if (ctx_.local_reply) {
      ctx_.local_reply(reply);
    }
  }

 private:
  const EndpointContext ctx_;
  const absl::Status why_;
};

}  // namespace

v1::DispatchReply ErrorReply(uint64_t batch_id, const std::string& shard, const absl::Status& s) {
  v1::DispatchReply reply;
  reply.set_batch_id(batch_id);
  transport::SetBatchStatus(s, &reply);
  reply.set_shard(shard);
  return reply;
}

std::unique_ptr<BatchReply> MakeUcxBatchReply(UcxDataPlane* ucx, const UcxBatchSource& from,
                                              int64_t reply_bytes, std::string shard,
                                              absl::Time deadline) {
  return std::make_unique<UcxBatchReply>(ucx, from, reply_bytes, std::move(shard), deadline);
}

std::unique_ptr<BatchEndpoint> MakeBatchEndpoint(const v1::DispatchRequest& req,
                                                 const EndpointContext& ctx) {
  if (!req.has_out_of_band()) return std::make_unique<InBandEndpoint>(ctx);
  if (ctx.ucx == nullptr || ctx.stream == nullptr) {
    return std::make_unique<RefusedEndpoint>(
        ctx, absl::FailedPreconditionError(
                 absl::StrCat("shard ", ctx.shard, ", batch ", req.batch_id(),
                              ": this server has no UCX data plane (send the batch in band)")));
  }
  return std::make_unique<UcxEndpoint>(ctx);
}

}  // namespace moe::expert_svc
