// The attention node's core, apart from its fronts (TF Serving's ServerCore beside its service
// classes; the twin of expert-svc's ExpertCore): the hosted layers' dense weights, the routing
// view (placement, bias, budget as this node sees them), the node's statistics for router-svc,
// the links to the expert shards (the data plane's per-process half and the channels), the
// request workers and dynamic k's automatic mode and full-k checks. A front (gRPC, OIP over
// gRPC or REST) holds a non-owned pointer to it and calls Submit and Serve; the server feeds it
// router-svc's watches and sends its reports. No gRPC server or client here.
//
//   MOE_ASSIGN_OR_RETURN(auto core, AttentionCore::Load(options));
//   MOE_RETURN_IF_ERROR(core->Start(metrics));  // metrics may be null
//   core->ApplyPlacement(placement);  core->ApplyBias(bias);
//   core->Submit([&] { status = core->Serve(req, deadline, &resp, "Forward"); });
//   core->Stop();  // queued requests run (bounded by their deadlines), threads joined
#ifndef MOE_ATTENTION_SVC_ATTENTION_CORE_H_
#define MOE_ATTENTION_SVC_ATTENTION_CORE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention-svc/attention_options.h"
#include "attention-svc/budget_governor.h"
#include "attention-svc/expert_links.h"
#include "attention-svc/forward_pass.h"
#include "attention-svc/node_stats.h"
#include "attention-svc/readiness_canary.h"
#include "attention-svc/replica_picker.h"
#include "attention-svc/routing_view.h"
#include "attention-svc/twin_audit.h"
#include "moe/v1/attention.pb.h"
#include "moe/v1/router.pb.h"
#include "services/common/model_config.h"
#include "services/common/work_queue.h"

namespace prometheus {
class Registry;
}
namespace moe::metrics {
class AttentionMetrics;
}
namespace moe::checkpoint {
class Checkpoint;
}

namespace moe::attention_svc {

class AttentionCore {
 public:
  // Loads the dense part of every hosted layer (the checkpoint's, or synthetic ones).
  static absl::StatusOr<std::unique_ptr<AttentionCore>> Load(const AttentionServerOptions& options);
  ~AttentionCore();

  // Starts the data plane's half, the workers and dynamic k's threads. metrics: where the node
  // counts (null: a registry of the core's own, not exported).
  absl::Status Start(metrics::AttentionMetrics* metrics, const LocalExperts& local = {});
  // Runs what is queued (bounded by deadlines), joins the threads, closes the expert channels.
  // Idempotent.
  void Stop();

  // Queues work on the node's workers; false when the queue is full.
  bool Submit(std::function<void()> work);
  // One Forward with its metrics (latency, errors by code, bytes from and to the client) under
  // `method`, the front's name for moe_errors_total ("Forward", "ModelInfer", "http:infer").
  absl::Status Serve(const v1::ForwardRequest& req, absl::Time deadline, v1::ForwardResponse* resp,
                     const char* method);

  // A call a front refused before Serve (which counts its own): moe_errors_total{method, code}.
  void CountRefusal(const char* method, const absl::Status& s) const;

  // router-svc's watches. ApplyPlacement: whether every hosted layer is ready now.
  bool ApplyPlacement(const v1::Placement& p);
  void ApplyBias(const v1::LayerBias& b);
  // The statistics since the last call, as reports to router-svc.
  std::vector<v1::ReportStatsRequest> TakeReports();

  // GetModelInfo's answer but the OIP model names (the OIP front's: oip_service.h).
  void FillModelInfo(v1::ModelInfo* info) const;
  // The layer placed on healthy shards (the routing view's readiness).
  bool LayerReady(int32_t layer) const { return view_.LayerReady(layer); }
  // The readiness canary's last outcome was a match (always true with the canary off).
  bool CanaryReady() const { return canary_ == nullptr || canary_ok_.load(); }
  // Every hosted layer placed on healthy shards and the last canary matched: what the gRPC
  // health service, the OIP readiness and GetModelInfo say.
  bool Ready() const { return view_.AllReady() && CanaryReady(); }
  // Called (from the canary's thread) whenever Ready() may have changed by a canary's outcome.
  void OnReadinessChange(std::function<void(bool)> f);
  // Called (from a request's worker, once per shard) when a twin audit caught a shard answering
  // wrong bytes: the node has stopped sending to it; the server tells router-svc. Set before
  // traffic.
  void OnQuarantine(std::function<void(const ShardQuarantine&)> f);
  // The twin audits' counts (zero with audits off).
  TwinAuditor::Counts AuditCounts() const;
  // This node's own state for router-svc's page (ReportNode): its canary and twin audits.
  v1::ReportNodeRequest NodeReport() const;
  std::vector<int32_t> layers() const;
  const ModelConfig& config() const { return cfg_; }
  const AttentionServerOptions& options() const { return options_; }
  // The data plane's halves (none: in band); they live as long as the core.
  std::vector<ClientHalf*> data_planes() const {
    std::vector<ClientHalf*> out;
    if (links_ != nullptr) {
      for (const auto& h : links_->data_planes()) out.push_back(h.get());
    }
    return out;
  }
  size_t queued() const { return workers_ != nullptr ? workers_->queued() : 0; }

 private:
  AttentionCore(const AttentionServerOptions& o, const ModelConfig& cfg);
  // ckpt: the checkpoint's dense weights (null: synthetic ones from the options' seed).
  absl::Status LoadLayers(checkpoint::Checkpoint* ckpt);
  // PrepareForward, then RunForward (check: dynamic k's full-k recomputation).
  absl::Status RunOne(const v1::ForwardRequest& req, absl::Time deadline, v1::ForwardResponse* resp,
                      bool check);
  // Dynamic k: the automatic mode's decisions, and the sampled full-k checks.
  void GovernorLoop();
  void CheckLoop();
  void MaybeCheck(const v1::ForwardRequest& req, const v1::ForwardResponse& resp);
  // The readiness canary: one canary through the node now, and the loop that runs them.
  CanaryOutcome RunCanary(std::string* detail);
  // Requests through Serve: in flight, answered, and failed on the path (the shards, the data
  // plane, a deadline; not the caller's bad input).
  struct ServeCounts {
    int64_t answered = 0, failed = 0;
  };
  ServeCounts Served() const { return {answered_.load(), path_failed_.load()}; }
  // After a canary timed out: whether the node answered other requests since `before` and none
  // failed on the path. While requests are in flight and none has ended, it waits for the next
  // one to end (bounded by kBusyWaitMax and Stop).
  bool AnsweredOthersMeanwhile(const ServeCounts& before);
  // A twin audit caught q.shard: picked no more here, counted, logged, the sink told.
  void Quarantine(const ShardQuarantine& q);
  void CanaryLoop();

  const AttentionServerOptions options_;
  const ModelConfig cfg_;
  HostedLayers layers_;
  RoutingView view_;
  NodeStats stats_;
  ReplicaPicker picker_;
  std::unique_ptr<ExpertLinks> links_;
  std::unique_ptr<prometheus::Registry> own_registry_;  // metrics not exported
  std::unique_ptr<metrics::AttentionMetrics> own_metrics_;
  metrics::AttentionMetrics* metrics_ = nullptr;  // never null once started
  std::unique_ptr<WorkQueue> workers_;
  std::unique_ptr<BudgetGovernor> governor_;

  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stopping_ ABSL_GUARDED_BY(stop_mu_) = false;
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

  // Each hosted layer's weights as the in-process references read them (dense part and every
  // expert as a view of the checkpoint), where they are kept: the readiness canary's (the first
  // hosted layer) and the twin audits' (every layer).
  std::map<int32_t, std::unique_ptr<numerics::MoeLayerWeights>> reference_;
  std::unique_ptr<TwinAuditor> audit_;
  std::mutex quarantine_mu_;
  std::function<void(const ShardQuarantine&)> on_quarantine_ ABSL_GUARDED_BY(quarantine_mu_);
  // The last canary's outcome and when it ran (NodeReport).
  mutable std::mutex canary_mu_;
  std::string canary_last_ ABSL_GUARDED_BY(canary_mu_) = "pending";
  std::chrono::steady_clock::time_point canary_at_ ABSL_GUARDED_BY(canary_mu_);
  // The readiness canary (null: off) on the first hosted layer.
  std::unique_ptr<CanaryOracle> canary_;
  int32_t canary_layer_ = 0;
  std::atomic<bool> canary_ok_{false};
  std::atomic<int64_t> serving_{0}, answered_{0}, path_failed_{0};
  // The next canary's timeout: --canary_timeout_ms, doubled after each busy canary (canary
  // thread only).
  int64_t canary_timeout_ms_;
  std::mutex readiness_mu_;
  std::function<void(bool)> on_readiness_ ABSL_GUARDED_BY(readiness_mu_);
  std::thread canary_thread_;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_ATTENTION_CORE_H_
