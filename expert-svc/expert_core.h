// The expert server's core, apart from its gRPC adapter (TF Serving's ServerCore beside its
// stateless service classes): the hosted layers and their backends, the compute queue and its
// thread, the production check and the machine limits. A batch comes in through Admit with its
// activation bytes and a BatchReply (batch_reply.h; made by batch_endpoint.h: in band, UCX or
// local), and its answer goes to that reply; the core never sees how the bytes moved, and
// compiles without gRPC's headers.
//
//   MOE_ASSIGN_OR_RETURN(auto core, ExpertCore::Load(options));
//   core->Start(metrics);  // may be null
//   core->Admit(request, activation_bytes, std::move(reply));
//   core->Stop();  // queued batches answered UNAVAILABLE
#ifndef MOE_EXPERT_SVC_EXPERT_CORE_H_
#define MOE_EXPERT_SVC_EXPERT_CORE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "expert-svc/batch_reply.h"
#include "expert-svc/batch_verifier.h"
#include "expert-svc/dispatch_batch.h"
#include "expert-svc/expert_backend.h"
#include "expert-svc/expert_options.h"
#include "services/checkpoint/checkpoint.h"
#include "services/common/poll_window.h"
#include "services/common/thread_pool.h"
#include "services/numerics/cpu/machine_limits.h"
#include "services/numerics/layer_weights.h"

namespace prometheus {
class Registry;
}
namespace moe::metrics {
class ExpertMetrics;
}

namespace moe::expert_svc {

class ExpertCore {
 public:
  // Loads the weights of every hosted layer (options.expert_lo/hi resolved from a ranges file),
  // makes the backends and measures the machine's limits (options.measure_limits).
  static absl::StatusOr<std::unique_ptr<ExpertCore>> Load(const ExpertServerOptions& options);
  ~ExpertCore();

  // Starts the production check and the compute thread; metrics may be null. idle_poll (may be
  // null): after each batch the compute thread calls it with the end of its idle window
  // (idle_spin after the batch) and a predicate that turns true once a batch is queued, before
  // it sleeps: the UCX worker's PollUntil, so the next batch message lands and is admitted on
  // this thread, with no wake-up in between.
  using IdlePoll = std::function<void(std::chrono::steady_clock::time_point until,
                                      const std::function<bool()>& work_queued)>;
  // The window grows from idle_spin up to idle_spin_max where the recent batches came that soon
  // after the one before (services/common/poll_window.h).
  void Start(metrics::ExpertMetrics* metrics, IdlePoll idle_poll = nullptr,
             std::chrono::microseconds idle_spin = std::chrono::microseconds(0),
             std::chrono::microseconds idle_spin_max = std::chrono::microseconds(0));
  // Validates a batch and queues it; every outcome, error or answer, goes to `reply`.
  // activations_owner: keeps out-of-band bf16 activations alive past the call, and then the
  // batch computes from them in place (ValidateDispatch); null: they are copied.
  void Admit(const v1::DispatchRequest& req, std::string_view activations,
             std::unique_ptr<BatchReply> reply,
             std::shared_ptr<const void> activations_owner = nullptr);
  // Answers what is queued UNAVAILABLE, stops the compute thread and the production check.
  void Stop();

  const ExpertServerOptions& options() const { return options_; }
  const ModelConfig& config() const { return cfg_; }
  const std::map<int64_t, numerics::MoeLayerWeights>& layers() const { return layers_; }
  const std::vector<numerics::Precision>& precisions() const { return precisions_; }
  std::string backend_name() const { return backends_.begin()->second->name(); }
  const numerics::cpu::MachineLimits& limits() const { return limits_; }
  int64_t queued() const;

 private:
  explicit ExpertCore(const ExpertServerOptions& o);
  absl::Status LoadWeights();
  // options.expert_lo/hi from the deployment's ranges file (the pod's ordinal), when given.
  absl::Status ResolveRangeFile();
  // One layer's experts [lo, hi): the checkpoint's or synthetic ones, shapes checked.
  absl::StatusOr<numerics::MoeLayerWeights> LoadRange(int64_t layer, int64_t lo, int64_t hi);
  // The thread pool, the kernels chosen for this CPU, a backend per layer; the precisions
  // asked checked against what the backend computes.
  absl::Status MakeBackends();
  void MeasureLimits();
  // Runs one batch and fills the reply (outputs, timings).
  void Compute(const Batch& b, BatchReply& out, v1::DispatchReply* reply);
  // Queues a batch for the compute thread: RESOURCE_EXHAUSTED when the queue is full,
  // UNAVAILABLE when stopping.
  absl::Status Enqueue(std::unique_ptr<Batch> b, std::unique_ptr<BatchReply>& reply);
  void ComputeLoop();

  ExpertServerOptions options_;
  ModelConfig cfg_;
  std::unique_ptr<checkpoint::Checkpoint> ckpt_;
  std::map<int64_t, numerics::MoeLayerWeights> layers_;
  std::map<int64_t, std::unique_ptr<ExpertBackend>> backends_;  // per hosted layer
  std::vector<numerics::Precision> precisions_;                 // served, the default first
  const numerics::cpu::KernelTable* kernels_ = nullptr;
  const numerics::cpu::KernelChoice* kernel_choice_ = nullptr;  // null: echo backend
  std::unique_ptr<ThreadPool> pool_;
  numerics::cpu::MachineLimits limits_;  // zero when not measured
  // The limits again while idle (the start-up probe may have shared the machine with a busy
  // neighbour): the best of every measurement is kept. Compute thread only.
  void RemeasureLimitsWhenIdle();
  std::chrono::steady_clock::time_point last_batch_end_ = std::chrono::steady_clock::now();
  IdlePoll idle_poll_;                       // set by Start, read by the compute thread
  std::atomic<bool> has_work_{false};        // queue_ is not empty or stopping_ (set under mu_)
  std::unique_ptr<PollWindow> idle_window_;  // set by Start (with idle_poll_)
  std::chrono::steady_clock::time_point limits_measured_ = std::chrono::steady_clock::now();
  std::unique_ptr<BatchVerifier> verifier_;
  std::unique_ptr<prometheus::Registry> own_registry_;  // metrics not exported
  std::unique_ptr<metrics::ExpertMetrics> own_metrics_;
  metrics::ExpertMetrics* metrics_ = nullptr;  // never null once started

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::unique_ptr<Batch>, std::unique_ptr<BatchReply>>> queue_
      ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread compute_thread_;
};

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_EXPERT_CORE_H_
