// attention-svc's implementation, shared by its two files: attention_server.cc (start,
// placement and bias watches, statistics reports, the gRPC fronts) and forward_pass.cc (one
// Forward: route, project, dispatch to the expert replicas through a FailoverChannel, gather,
// finish).
// Private to attention-svc.
#ifndef MOE_ATTENTION_SVC_ATTENTION_IMPL_H_
#define MOE_ATTENTION_SVC_ATTENTION_IMPL_H_

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "attention-svc/attention_server.h"
#include "attention-svc/budget_governor.h"
#include "attention-svc/dataplane/client_half.h"
#include "attention-svc/dispatch_plan.h"
#include "attention-svc/expert_channel.h"
#include "attention-svc/expert_channel_grpc.h"
#include "attention-svc/oip_rest.h"
#include "attention-svc/oip_service.h"
#include "attention-svc/replica_picker.h"
#include "moe/v1/attention.grpc.pb.h"
#include "moe/v1/router.grpc.pb.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/router_link.h"
#include "services/common/logging.h"
#include "services/common/secret_file.h"
#include "services/common/status_macros.h"
#include "services/common/work_queue.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/process_collector.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/combine.h"
#include "services/numerics/cpu/moe_layer.h"
#include "services/numerics/dynamic_k.h"
#include "services/numerics/qb.h"
#include "services/transport/grpc_server.h"
#include "services/transport/precision_convert.h"
#include "services/transport/status_convert.h"
#include "services/transport/stream_reactor.h"
#include "services/transport/tensor_codec.h"

namespace moe::attention_svc {

using numerics::LayerTimings;
using numerics::QbHistogram;
using numerics::cpu::CpuMoeLayer;
using numerics::cpu::RoutedBatch;
using tensor::Bf16;
using Clock = std::chrono::steady_clock;

// The expert calls end this share of the time left before the caller's deadline, within
// [min, max], so that the caller hears which shard was late rather than a bare
// DEADLINE_EXCEEDED from its own clock.
inline constexpr double kExpertDeadlineShare = 0.1;
inline constexpr absl::Duration kExpertDeadlineMarginMin = absl::Milliseconds(10);
inline constexpr absl::Duration kExpertDeadlineMarginMax = absl::Milliseconds(100);
using ForwardStreamReactor = transport::StreamReactor<v1::ForwardRequest, v1::ForwardResponse>;

// A ForwardStream answer that carries a batch's own failure (the stream goes on).
inline v1::ForwardResponse StreamError(uint64_t request_id, const absl::Status& s) {
  v1::ForwardResponse resp;
  resp.set_request_id(request_id);
  resp.set_code(static_cast<int>(s.code()));
  resp.set_message(std::string(s.message()));
  return resp;
}

inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct HostedLayer {
  std::unique_ptr<CpuMoeLayer> layer;
  std::mutex mu;  // CpuMoeLayer is not reentrant
  std::vector<float> checkpoint_bias;
};

struct BiasEntry {
  uint64_t version = 0;
  std::vector<float> bias;
  // Dynamic k (docs/math.md section 4.1) as the version has it: the layer's budget, k_min and
  // the threshold table [k - 1, E] (empty: never solved, only the full top-k is served).
  int32_t k_avg = 0;
  int32_t k_min = 1;
  std::vector<float> thresholds;
  // Solved under a bias that has moved since (ExpertBudget.stale): not applied, the full top-k
  // is served until router-svc publishes them solved again.
  bool stale = false;
  uint64_t solved_from_version = 0;
  bool usable() const { return !thresholds.empty() && !stale; }
};

// One layer's statistics of the current report: QB's histogram and dynamic k's.
struct LayerStats {
  QbHistogram qb;
  std::optional<numerics::BudgetHistogram> budget;
};

class AttentionServer::Impl final : public v1::AttentionService::CallbackService {
 public:
  explicit Impl(const AttentionServerOptions& o) : options_(o) {}
  ~Impl() override;

  absl::Status Load();
  absl::Status StartServing();
  void Shutdown(absl::Duration grace);
  int port() const { return server_ != nullptr ? server_->port() : 0; }
  void Wait() {
    if (server_ != nullptr) server_->Wait();
  }

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const v1::ForwardRequest* req,
                                    v1::ForwardResponse* resp) override;
  grpc::ServerBidiReactor<v1::ForwardRequest, v1::ForwardResponse>* ForwardStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* ctx,
                                         const v1::GetModelInfoRequest* req,
                                         v1::ModelInfo* resp) override;

 private:
  // What a Forward request asks, checked, with the layer's bias and route at its start.
  struct ForwardSpec {
    HostedLayer* hosted = nullptr;
    transport::Bf16Matrix x;  // [T, H]
    ReplyMode mode = ReplyMode::kPerPair;
    numerics::Precision precision = numerics::Precision::kW4A16;
    std::shared_ptr<const BiasEntry> bias;
    // The expert budget served (experts per token on average): k, or lower with bias's
    // thresholds (the layer's budget, the request's cap, the automatic mode).
    int32_t budget = 0;
    // What each token keeps of its top k: the budget's thresholds row, or the request's top-p
    // (ForwardOptions.expert_top_p), or nothing dropped (no thresholds, top_p 0). Its pointer
    // is into bias, which the spec holds.
    numerics::BudgetRule rule;
    bool check = false;  // a full-k check: no statistics, no per-expert counts
    std::shared_ptr<const LayerRoute> route;
    absl::Time expert_deadline;  // the expert calls end here, a little before the caller's
  };
  class ForwardPass;  // forward_pass.cc
  // check: dynamic k's full-k recomputation of a sampled request (the full top-k whatever the
  // budgets; it adds nothing to the load statistics).
  absl::StatusOr<ForwardSpec> PrepareForward(const v1::ForwardRequest& req, absl::Time deadline,
                                             bool check = false);
  // The conductor: PrepareForward, then each micro-batch started and finished by a ForwardPass.
  absl::Status RunForward(const v1::ForwardRequest& req, absl::Time deadline,
                          v1::ForwardResponse* resp, bool check = false);
  // Dynamic k: the automatic mode's decisions, and the sampled full-k checks.
  void GovernorLoop();
  void CheckLoop();
  void MaybeCheck(const v1::ForwardRequest& req, const v1::ForwardResponse& resp);
  // RunForward plus its metrics (latency, errors by code, bytes from and to the client).
  // Queues work for the workers (false: the queue is full); the queue depth gauge follows.
  bool Submit(std::function<void()> work) {
    const bool queued = workers_->Submit(std::move(work));
    if (governor_ != nullptr) governor_->ObserveQueue(static_cast<int64_t>(workers_->queued()));
    if (metrics_ != nullptr) metrics_->common.QueueDepth(static_cast<int64_t>(workers_->queued()));
    return queued;
  }
  absl::Status ServeForward(const v1::ForwardRequest& req, absl::Time deadline,
                            v1::ForwardResponse* resp, const char* method);
  void Accumulate(int32_t layer, const BiasEntry& bias, const RoutedBatch& batch);
  void ApplyPlacement(const v1::Placement& p);
  void ApplyBias(const v1::LayerBias& b);
  // The channel of one shard (made once, kept by shard@endpoint): the data plane or in band.
  std::shared_ptr<ExpertChannel> ChannelFor(const ShardRef& s);
  ReplicaPicker picker_;
  void ReportLoop();
  void ReportNow();
  bool SleepUnlessStopping(std::chrono::milliseconds d);

  AttentionServerOptions options_;
  ModelConfig cfg_;
  std::map<int32_t, std::unique_ptr<HostedLayer>> layers_;
  std::unique_ptr<transport::GrpcServer> server_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::unique_ptr<metrics::AttentionMetrics> metrics_;
  std::unique_ptr<WorkQueue> workers_;
  std::unique_ptr<client::RouterLink> router_;  // placement and bias watches, reports
  // The node's half of the out-of-band data plane (dataplane/client_half.h; null: in band
  // only). Declared before the channels so that it outlives them.
  std::unique_ptr<ClientHalf> data_plane_;
  // moe_ucx_messages_dropped_total, read from data_plane_ at every scrape (stopped before it
  // goes).
  std::shared_ptr<metrics::ScrapedCounter> dp_drops_;
  std::unique_ptr<OipService> oip_;    // the Open Inference Protocol front
  std::unique_ptr<OipRest> oip_rest_;  // its REST/JSON form (--http_port)
  std::unique_ptr<metrics::HttpServer> http_;

  std::mutex mu_;
  std::map<int32_t, std::shared_ptr<const BiasEntry>> bias_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, std::shared_ptr<const LayerRoute>> routes_ ABSL_GUARDED_BY(mu_);
  std::map<int32_t, bool> covered_ ABSL_GUARDED_BY(mu_);  // every expert has a healthy shard
  v1::Placement placement_ ABSL_GUARDED_BY(mu_);          // the last one from router-svc
  // by shard@endpoint
  std::map<std::string, std::shared_ptr<ExpertChannel>> channels_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::condition_variable stop_cv_;

  std::mutex stats_mu_;
  std::map<int32_t, std::optional<LayerStats>> stats_ ABSL_GUARDED_BY(stats_mu_);
  // finished windows of an older bias version
  std::vector<LayerStats> outgoing_ ABSL_GUARDED_BY(stats_mu_);
  // Dynamic k's full-k checks measured since the last report, per layer: count and summed
  // relative difference, mass kept and top-1 agreement (ReportStatsRequest.budget_*).
  struct CheckSums {
    int64_t checks = 0;
    double rel_diff = 0, mass_kept = 0, top1 = 0;
  };
  std::map<int32_t, CheckSums> check_costs_ ABSL_GUARDED_BY(stats_mu_);

  std::thread report_thread_;

  // Dynamic k (docs/math.md 4.1).
  std::unique_ptr<BudgetGovernor> governor_;
  std::thread governor_thread_;
  struct BudgetCheck {
    v1::ForwardRequest req;
    std::string output;  // the budgeted answer's bf16 bytes
    uint64_t bias_version = 0;
    double mass_kept = 1.0;  // its ForwardResponse.routing_mass_kept
  };
  std::mutex check_mu_;
  std::condition_variable check_cv_;
  std::deque<BudgetCheck> checks_ ABSL_GUARDED_BY(check_mu_);
  bool checks_stopping_ ABSL_GUARDED_BY(check_mu_) = false;
  uint64_t budgeted_ ABSL_GUARDED_BY(check_mu_) = 0;
  std::thread check_thread_;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_ATTENTION_IMPL_H_
