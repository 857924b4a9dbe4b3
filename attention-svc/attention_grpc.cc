#include "attention-svc/attention_grpc.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "attention-svc/oip_service.h"
#include "services/transport/status_convert.h"
#include "services/transport/stream_reactor.h"

namespace moe::attention_svc {

namespace {

using ForwardStreamReactor = transport::StreamReactor<v1::ForwardRequest, v1::ForwardResponse>;

// A ForwardStream answer that carries a batch's own failure (the stream goes on).
v1::ForwardResponse StreamError(uint64_t request_id, const absl::Status& s) {
  v1::ForwardResponse resp;
  resp.set_request_id(request_id);
  resp.set_code(static_cast<int>(s.code()));
  resp.set_message(std::string(s.message()));
  return resp;
}

}  // namespace

grpc::ServerUnaryReactor* AttentionGrpcFront::Forward(grpc::CallbackServerContext* ctx,
                                                      const v1::ForwardRequest* req,
                                                      v1::ForwardResponse* resp) {
  const AttentionServerOptions& o = core_->options();
  auto* reactor = ctx->DefaultReactor();
  absl::Time deadline = absl::Now() + absl::Milliseconds(o.default_timeout_ms);
  deadline = std::min(deadline, absl::FromChrono(ctx->deadline()));
  AttentionCore* core = core_;
  const bool queued = core->Submit([core, reactor, req, resp, deadline] {
    reactor->Finish(transport::ToGrpc(core->Serve(*req, deadline, resp, "Forward")));
  });
  if (!queued) {
    const absl::Status s = absl::ResourceExhaustedError(absl::StrCat(
        "attention node ", o.node, ": too many requests waiting (", o.max_queued, ")"));
    core->CountRefusal("Forward", s);
    reactor->Finish(transport::ToGrpc(s));
  }
  return reactor;
}

grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse>* AttentionGrpcFront::ForwardStream(
    grpc::CallbackServerContext* ctx) {
  const absl::Time stream_deadline = absl::FromChrono(ctx->deadline());
  AttentionCore* core = core_;
  const AttentionServerOptions& o = core->options();
  return new ForwardStreamReactor(
      [core, &o, stream_deadline](v1::ForwardRequest&& req, ForwardStreamReactor* stream) {
        const absl::Time deadline =
            std::min(stream_deadline, absl::Now() + absl::Milliseconds(o.default_timeout_ms));
        auto shared_req = std::make_shared<v1::ForwardRequest>(std::move(req));
        if (stream->in_flight() >= o.max_stream_in_flight) {
          const absl::Status s = absl::ResourceExhaustedError(
              absl::StrCat("attention node ", o.node, ": ", o.max_stream_in_flight,
                           " requests already in flight on this stream"));
          core->CountRefusal("ForwardStream", s);
          stream->Reply(StreamError(shared_req->request_id(), s), /*ends_work=*/false);
          return;
        }
        stream->BeginWork();
        auto run = [core, shared_req, stream, deadline] {
          v1::ForwardResponse resp;
          if (stream->cancelled()) {  // nobody reads the answer: the cores go to other clients
            core->CountRefusal("ForwardStream", absl::CancelledError());
            stream->Reply(std::move(resp), /*ends_work=*/true);
            return;
          }
          const absl::Status s = core->Serve(*shared_req, deadline, &resp, "ForwardStream");
          if (!s.ok()) resp = StreamError(shared_req->request_id(), s);
          stream->Reply(std::move(resp), /*ends_work=*/true);
        };
        if (!core->Submit(run)) {
          const absl::Status s = absl::ResourceExhaustedError("too many requests waiting");
          core->CountRefusal("ForwardStream", s);
          stream->Reply(StreamError(shared_req->request_id(), s), /*ends_work=*/true);
        }
      },
      static_cast<size_t>(o.max_stream_outbox_bytes));
}

grpc::ServerUnaryReactor* AttentionGrpcFront::GetModelInfo(grpc::CallbackServerContext* ctx,
                                                           const v1::GetModelInfoRequest*,
                                                           v1::ModelInfo* resp) {
  core_->FillModelInfo(resp);
  for (int32_t l : core_->layers()) resp->add_oip_models(OipModelName(l));
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace moe::attention_svc
