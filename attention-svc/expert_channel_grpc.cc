#include "attention-svc/expert_channel_grpc.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/transport/expert_stream.h"
#include "services/transport/precision_convert.h"
#include "services/transport/tensor_codec.h"

namespace moe::attention_svc {

namespace {

class GrpcCall final : public ExpertCall {
 public:
  GrpcCall(std::shared_ptr<transport::ExpertStream> stream,
           std::shared_ptr<transport::PendingReply> pending, ReplyMode mode,
           numerics::Precision precision, int64_t latent, int64_t rows, int64_t tokens)
      : stream_(std::move(stream)),
        pending_(std::move(pending)),
        mode_(mode),
        precision_(precision),
        latent_(latent),
        rows_(rows),
        tokens_(tokens) {}

  const char* transport() const override { return "grpc"; }
  bool Answered(absl::Time until) override {
    return transport::ExpertStream::WaitAnswered(*pending_, until);
  }

  absl::StatusOr<ExpertReply> Wait(absl::Time deadline) override {
    MOE_ASSIGN_OR_RETURN(v1::DispatchReply reply, stream_->Wait(*pending_, deadline));
    const std::string what = absl::StrCat("reply of shard ", stream_->shard());
    MOE_RETURN_IF_ERROR(CheckReplyPrecision(reply, precision_, stream_->shard()));
    ExpertReply out;
    if (mode_ == ReplyMode::kPerPair) {
      MOE_ASSIGN_OR_RETURN(transport::Bf16Matrix m,
                           transport::DecodeBf16Matrix(reply.outputs(), what, latent_,
                                                       /*accept_f32=*/false));
      if (m.rows != rows_) {
        return absl::InternalError(
            absl::StrCat("shard ", stream_->shard(), " returned ", m.rows, " rows for ", rows_));
      }
      out.rows = m.rows;
      out.Own(std::move(m.values));
      return out;
    }
    MOE_ASSIGN_OR_RETURN(out.f32,
                         transport::DecodeF32Matrix(reply.outputs(), what, tokens_, latent_));
    out.rows = tokens_;
    return out;
  }

 private:
  std::shared_ptr<transport::ExpertStream> stream_;
  std::shared_ptr<transport::PendingReply> pending_;
  const ReplyMode mode_;
  const numerics::Precision precision_;
  const int64_t latent_, rows_, tokens_;
};

}  // namespace

GrpcExpertChannel::GrpcExpertChannel(std::string shard, std::string endpoint, int max_message_bytes,
                                     std::string cluster_token)
    : shard_(shard),
      stream_(std::make_shared<transport::ExpertStream>(
          std::move(shard), std::move(endpoint), max_message_bytes, std::move(cluster_token))) {}

GrpcExpertChannel::GrpcExpertChannel(std::string shard,
                                     std::shared_ptr<transport::ExpertStream> stream)
    : shard_(std::move(shard)), stream_(std::move(stream)) {}

GrpcExpertChannel::~GrpcExpertChannel() = default;

absl::Status CheckReplyPrecision(const v1::DispatchReply& reply, numerics::Precision precision,
                                 const std::string& shard) {
  const v1::Precision want = transport::PrecisionToProto(precision);
  // A server older than the precision field answers UNSPECIFIED, and serves W4A16 only.
  const v1::Precision got =
      reply.precision() == v1::PRECISION_UNSPECIFIED ? v1::PRECISION_W4A16 : reply.precision();
  if (got == want) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("shard ", shard, " answered in ", v1::Precision_Name(got),
                                          " for a batch sent in ", v1::Precision_Name(want)));
}

v1::DispatchRequest DispatchRequestFor(const DispatchHeader& header, const DispatchMessage& m,
                                       bool with_activation_bytes) {
  v1::DispatchRequest dr;
  dr.set_layer(header.layer);
  dr.set_reply_mode(header.mode == ReplyMode::kPerPair ? v1::REPLY_MODE_PER_PAIR
                                                       : v1::REPLY_MODE_PARTIAL_SUM);
  dr.set_timeout_ms(header.timeout_ms);
  // The precision follows the activations' format: MXFP8 rows are W4A8.
  dr.set_precision(transport::PrecisionToProto(m.precision()));
  for (const auto& [expert, rows] : m.groups) {
    v1::ExpertGroup* g = dr.add_groups();
    g->set_expert_id(expert);
    g->set_token_count(rows);
  }
  *dr.mutable_row_source() = {m.row_source.begin(), m.row_source.end()};
  if (header.mode == ReplyMode::kPartialSum) {
    *dr.mutable_token_index() = {m.token_index.begin(), m.token_index.end()};
    *dr.mutable_weights() = {m.weights.begin(), m.weights.end()};
    dr.set_num_tokens(static_cast<int32_t>(header.num_tokens));
  }
  switch (m.z.format()) {
    case tensor::ActivationFormat::kMxfp8:
      if (with_activation_bytes) {
        transport::EncodeMxfp8Into(m.z.mxfp8(), dr.mutable_activations());
      } else {
        transport::SetMxfp8Header(m.z.rows(), m.z.cols(), dr.mutable_activations());
      }
      break;
    case tensor::ActivationFormat::kBf16:
      if (with_activation_bytes) {
        transport::EncodeBf16Into(m.z.bf16(), m.z.rows(), m.z.cols(), dr.mutable_activations());
      } else {
        v1::Tensor* a = dr.mutable_activations();
        a->set_dtype(v1::DTYPE_BF16);
        a->add_shape(m.z.rows());
        a->add_shape(m.z.cols());
      }
      break;
  }
  return dr;
}

std::unique_ptr<ExpertCall> GrpcExpertChannel::Send(const DispatchHeader& header,
                                                    const DispatchMessage& m) {
  auto pending = stream_->Send(DispatchRequestFor(header, m, /*with_activation_bytes=*/true));
  return std::make_unique<GrpcCall>(stream_, std::move(pending), header.mode, m.precision(),
                                    header.latent, m.rows(), static_cast<int64_t>(m.tokens.size()));
}

}  // namespace moe::attention_svc
