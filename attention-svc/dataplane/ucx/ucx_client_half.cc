#include "attention-svc/dataplane/ucx/ucx_client_half.h"

#include "absl/strings/str_cat.h"
#include "attention-svc/dataplane/ucx/expert_channel_ucx.h"
#include "services/common/logging.h"
#include "services/dataplane/ucx_worker.h"

namespace moe::attention_svc {

namespace {

class UcxClientHalf final : public ClientHalf {
 public:
  explicit UcxClientHalf(std::unique_ptr<dataplane::UcxWorker> worker)
      : worker_(std::move(worker)) {}

  const char* name() const override { return "ucx"; }
  std::string Describe() const override {
    return absl::StrCat("UCX ", dataplane::UcxVersion(), ", UCX_TLS ", worker_->tls(),
                        ", shared-memory FIFO ", worker_->shared_memory_fifo());
  }
  std::shared_ptr<ExpertChannel> MakeChannel(ChannelOptions options) override {
    return std::make_shared<UcxExpertChannel>(std::move(options), worker_.get());
  }
  std::vector<std::pair<std::string, double>> DroppedByKind() const override {
    return worker_->DroppedByKind();
  }

 private:
  const std::unique_ptr<dataplane::UcxWorker> worker_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ClientHalf>> StartUcxClientHalf(ClientHalfOptions o) {
  dataplane::UcxOptions uo;
  uo.name = o.node;
  uo.tls = o.tls;
  uo.bind_host = o.bind_host;
  uo.poll_spin = o.poll_spin;
  uo.poll_spin_max = o.poll_spin_max;
  uo.spin = o.progress_spin;
  auto w = dataplane::UcxWorker::Create(uo);
  if (!w.ok()) return absl::FailedPreconditionError(w.status().message());
  if (absl::Status v = dataplane::CheckUcxVersion(); !v.ok()) {
    MOE_LOG_WARN("{}", std::string(v.message()));
  }
  return std::make_unique<UcxClientHalf>(std::move(*w));
}

}  // namespace moe::attention_svc
