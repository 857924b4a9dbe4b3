#include "expert-svc/batch_endpoint.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "expert-svc/dispatch_batch.h"
#include "services/common/logging.h"
#include "services/dataplane/data_plane.h"
#include "services/transport/status_convert.h"

namespace moe::expert_svc {

namespace {

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

// One message back on the data plane: the reply's header, then its outputs.
class MessageReply final : public BatchReply {
 public:
  MessageReply(ServerHalf* data_plane, const BatchSource& from, int64_t reply_bytes,
               std::string shard, absl::Time deadline)
      : data_plane_(data_plane),
        from_(from),
        reply_bytes_(reply_bytes),
        shard_(std::move(shard)),
        deadline_(deadline) {}

  uint8_t* OutputBuffer(size_t bytes) override {
    if (static_cast<int64_t>(bytes) != reply_bytes_) return nullptr;  // Send says why
    buffer_ = data_plane_->NewReplyBuffer(from_, bytes);
    return buffer_ != nullptr ? buffer_->payload() : nullptr;
  }

  void Send(v1::DispatchReply reply) override {
    if (reply.code() == 0 && buffer_ != nullptr && reply.outputs().data().empty()) {
      // The outputs are in the data plane's buffer already (OutputBuffer).
      reply.set_out_of_band(true);
      reply.set_output_bytes(reply_bytes_);
      Sent(reply, data_plane_->ReplyBatchFrom(from_, Header(reply), std::move(buffer_), deadline_));
      return;
    }
    buffer_.reset();
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
    Sent(reply, data_plane_->ReplyBatch(from_, Header(reply), payload, deadline_));
  }
  const char* transport() const override { return data_plane_->name(); }

 private:
  static std::string Header(v1::DispatchReply& reply) {
    std::string header = reply.SerializeAsString();
    if (header.size() > dataplane::kMaxReplyHeaderBytes) {  // a very long error message
      reply.set_message(reply.message().substr(0, 1024));
      header = reply.SerializeAsString();
    }
    return header;
  }
  void Sent(const v1::DispatchReply& reply, const absl::Status& s) const {
    if (!s.ok()) {
      MOE_LOG_WARN("shard {}, batch {}: the reply could not be sent: {}", shard_, reply.batch_id(),
                   s.ToString());
    }
  }

  ServerHalf* const data_plane_;
  const BatchSource from_;
  const int64_t reply_bytes_;
  const std::string shard_;
  const absl::Time deadline_;
  std::unique_ptr<ReplyBuffer> buffer_;  // OutputBuffer's, until Send
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

std::unique_ptr<BatchReply> MakeMessageReply(ServerHalf* data_plane, const BatchSource& from,
                                             int64_t reply_bytes, std::string shard,
                                             absl::Time deadline) {
  return std::make_unique<MessageReply>(data_plane, from, reply_bytes, std::move(shard), deadline);
}

std::unique_ptr<BatchEndpoint> MakeBatchEndpoint(const v1::DispatchRequest& req,
                                                 const EndpointContext& ctx) {
  if (!req.has_out_of_band()) return std::make_unique<InBandEndpoint>(ctx);
  std::unique_ptr<BatchEndpoint> endpoint;
  if (ctx.data_plane != nullptr && ctx.stream != nullptr) {
    endpoint = ctx.data_plane->StreamEndpoint(ctx);
  }
  if (endpoint == nullptr) {
    return std::make_unique<RefusedEndpoint>(
        ctx, absl::FailedPreconditionError(absl::StrCat(
                 "shard ", ctx.shard, ", batch ", req.batch_id(),
                 ": this server has no out-of-band data plane that takes headers on the Dispatch "
                 "stream (send the batch in band)")));
  }
  return endpoint;
}

}  // namespace moe::expert_svc
