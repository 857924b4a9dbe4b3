#include "attention-svc/dataplane/batch_message.h"

#include <grpcpp/grpcpp.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "attention-svc/expert_channel_grpc.h"
#include "moe/v1/expert.grpc.pb.h"
#include "services/common/status_macros.h"
#include "services/transport/channel.h"
#include "services/transport/grpc_server.h"
#include "services/transport/status_convert.h"

namespace moe::attention_svc {

namespace {
// OpenDataPlane is a small unary call; it never waits longer than this.
constexpr absl::Duration kOpenTimeout = absl::Seconds(2);
}  // namespace

absl::StatusOr<OpenedDataPlane> OpenDataPlane(const std::string& who, const std::string& endpoint,
                                              int max_message_bytes,
                                              const std::string& cluster_token,
                                              const std::string& node, const std::string& backend,
                                              absl::Time deadline) {
  OpenedDataPlane out;
  out.open_by = std::min(deadline, absl::Now() + kOpenTimeout);
  out.control = transport::MakeControlChannel(endpoint, max_message_bytes);
  auto stub = v1::ExpertService::NewStub(out.control);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(out.open_by));
  if (!cluster_token.empty()) ctx.AddMetadata(transport::kClusterTokenMetadata, cluster_token);
  v1::OpenDataPlaneRequest req;
  req.set_node(node);
  req.set_transport(backend);
  const absl::Status s = transport::FromGrpc(stub->OpenDataPlane(&ctx, req, &out.reply));
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(who, ": OpenDataPlane: ", s.message()));
  const std::string& offered = out.reply.transport().empty() ? "ucx" : out.reply.transport();
  if (offered != backend) {
    return absl::FailedPreconditionError(absl::StrCat(who, " offers the ", offered.substr(0, 32),
                                                      " data plane, this node speaks ", backend));
  }
  return out;
}

v1::DispatchRequest BatchMessageHeader(const DispatchHeader& header, const DispatchMessage& m,
                                       uint64_t client_id, uint64_t sequence, size_t bytes,
                                       size_t reply_bytes) {
  v1::DispatchRequest dr = DispatchRequestFor(header, m, /*with_activation_bytes=*/false);
  dr.set_batch_id(sequence);
  v1::OutOfBand* oob = dr.mutable_out_of_band();
  oob->set_client_id(client_id);
  oob->set_activation_bytes(static_cast<int64_t>(bytes));
  oob->set_reply_capacity_bytes(static_cast<int64_t>(reply_bytes));
  oob->set_sequence(sequence);
  return dr;
}

namespace {
class FailedCall final : public ExpertCall {
 public:
  explicit FailedCall(absl::Status s) : status_(std::move(s)) {}
  absl::StatusOr<ExpertReply> Wait(absl::Time) override { return status_; }
  const char* transport() const override { return ""; }

 private:
  absl::Status status_;
};
}  // namespace

std::unique_ptr<ExpertCall> FailedExpertCall(absl::Status status) {
  return std::make_unique<FailedCall>(std::move(status));
}

int64_t ReplyShape::bytes() const {
  const bool f32 = mode == ReplyMode::kPartialSum;
  return (f32 ? tokens : rows) * latent * (f32 ? 4 : 2);
}

ReplyShape ShapeOf(const DispatchHeader& header, const DispatchMessage& m) {
  ReplyShape s;
  s.mode = header.mode;
  s.precision = m.precision();
  s.latent = header.latent;
  s.rows = m.rows();
  s.tokens = static_cast<int64_t>(m.tokens.size());
  return s;
}

ExpertReply ReplyRows(const void* payload, int64_t rows, int64_t latent, bool f32,
                      std::shared_ptr<const void> buffer) {
  ExpertReply out;
  out.rows = rows;
  const size_t n = static_cast<size_t>(rows * latent);
  if (f32) {
    out.f32.resize(n);  // a copy: DEGRADE may scale it in place
    std::memcpy(out.f32.data(), payload, n * 4);
  } else if (buffer != nullptr) {
    out.bf16 = absl::MakeConstSpan(static_cast<const tensor::Bf16*>(payload), n);
    out.held = std::move(buffer);
  } else {
    std::vector<tensor::Bf16> v(n);
    std::memcpy(v.data(), payload, n * 2);
    out.Own(std::move(v));
  }
  return out;
}

absl::StatusOr<ExpertReply> ReadBatchReply(const std::string& who, const ReplyShape& b,
                                           const char* d, size_t n, uint32_t header_bytes,
                                           std::shared_ptr<const void> buffer) {
  if (header_bytes > n) {
    return absl::InternalError(absl::StrCat(who, " sent a reply header that does not parse"));
  }
  return ReadBatchReply(who, b, std::string_view(d, header_bytes), d + header_bytes,
                        n - header_bytes, std::move(buffer));
}

absl::StatusOr<ExpertReply> ReadBatchReply(const std::string& who, const ReplyShape& b,
                                           std::string_view header, const char* rows_at,
                                           size_t rows_bytes, std::shared_ptr<const void> buffer) {
  v1::DispatchReply reply;
  if (!reply.ParseFromArray(header.data(), static_cast<int>(header.size()))) {
    return absl::InternalError(absl::StrCat(who, " sent a reply header that does not parse"));
  }
  MOE_RETURN_IF_ERROR(transport::BatchStatus(reply, who));
  MOE_RETURN_IF_ERROR(CheckReplyPrecision(reply, b.precision, who));
  const bool f32 = b.mode == ReplyMode::kPartialSum;
  const int64_t rows = f32 ? b.tokens : b.rows;
  const int64_t want = b.bytes();
  const int64_t got = static_cast<int64_t>(rows_bytes);
  const v1::Tensor& t = reply.outputs();
  if (!reply.out_of_band() || t.dtype() != (f32 ? v1::DTYPE_F32 : v1::DTYPE_BF16) ||
      t.shape_size() != 2 || t.shape(0) != rows || t.shape(1) != b.latent ||
      reply.output_bytes() != want || got != want) {
    return absl::InternalError(absl::StrCat(
        who, " answered with a reply of ", got, " bytes, shape [",
        t.shape_size() > 0 ? t.shape(0) : -1, ", ", t.shape_size() > 1 ? t.shape(1) : -1,
        "] (expected ", want, " bytes, [", rows, ", ", b.latent, "])"));
  }
  return ReplyRows(rows_at, rows, b.latent, f32, std::move(buffer));
}

}  // namespace moe::attention_svc
