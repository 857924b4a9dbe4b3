// Every metric the services export, declared in one place (STYLE.md: Envoy's stats lists).
// Names carry the `moe_` prefix and base units; counters end in `_total`; labels are bounded
// (layer, expert < E, shard, stage-like enums, status code). Each name, type, label list and
// HELP is a row of metric_table.cc (docs/metrics.md is generated from it); tests/metrics
// checks a live /metrics against that page and the Grafana dashboard.
//
//   AttentionMetrics m(registry, layers, num_experts, /*per_expert=*/true);
//   m.ForwardDone(layer, seconds, dispatch_seconds, combine_seconds, tokens);
#ifndef MOE_SERVICES_METRICS_SERVICE_METRICS_H_
#define MOE_SERVICES_METRICS_SERVICE_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace moe::metrics {

// Latency buckets: 0.5 ms .. ~16 s, doubling.
prometheus::Histogram::BucketBoundaries LatencyBuckets();

// What every service exports: build info, errors by method and status code, requests being
// served and succeeded by method, and the depth of its work queue. (Process metrics, CPU, RSS,
// open fds, come from the metrics server itself: process_collector.h.)
class CommonMetrics {
 public:
  CommonMetrics(prometheus::Registry& registry, const std::string& service);
  // code: the absl/grpc status code name, e.g. "INVALID_ARGUMENT".
  void Error(const std::string& method, const std::string& code);
  // A request starts being served / is answered (ok: counted as a success; an error is counted
  // by Error with its code).
  void Started(const std::string& method);
  void Finished(const std::string& method, bool ok);
  // Requests (attention-svc) or batches (expert-svc) waiting for a worker.
  void QueueDepth(int64_t waiting);

 private:
  struct PerMethod {
    prometheus::Gauge* in_flight = nullptr;
    prometheus::Counter* succeeded = nullptr;
  };
  PerMethod& For(const std::string& method);  // mu_ held

  prometheus::Registry& registry_;
  std::string service_;
  prometheus::Family<prometheus::Counter>& errors_;
  prometheus::Family<prometheus::Gauge>& in_flight_;
  prometheus::Family<prometheus::Counter>& succeeded_;
  prometheus::Gauge& queue_depth_;
  std::mutex mu_;
  std::map<std::pair<std::string, std::string>, prometheus::Counter*> error_counters_;
  std::map<std::string, PerMethod> methods_;
};

// Bytes and rows crossing a service's boundary: direction "sent"/"received", dtype "bf16"/"f32",
// peer "client" (callers of this service) or "expert" (expert servers, from an attention node)
// or "attention" (attention nodes, from an expert server); transport "grpc" (in band) or "ucx"
// (out of band, docs/data-plane.md).
class WireMetrics {
 public:
  explicit WireMetrics(prometheus::Registry& registry);
  void Add(const std::string& direction, const std::string& dtype, const std::string& peer,
           int64_t bytes, int64_t rows, const std::string& transport = "grpc");

 private:
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Counter>& rows_;
  std::mutex mu_;
  std::map<std::string, std::pair<prometheus::Counter*, prometheus::Counter*>> cache_;
};

class AttentionMetrics {
 public:
  AttentionMetrics(prometheus::Registry& registry, const std::vector<int64_t>& layers,
                   int64_t num_experts, bool per_expert);

  CommonMetrics common;
  WireMetrics wire;
  // A successful forward of `tokens` tokens; stage durations in seconds.
  void ForwardDone(int64_t layer, double seconds, double dispatch_seconds, double combine_seconds,
                   int64_t tokens);
  // Routed (token, expert) pairs of one batch: counts[e] for e < E; pairs per shard.
  void Routed(int64_t layer, const std::vector<int64_t>& counts,
              const std::vector<std::pair<std::string, int64_t>>& shard_pairs);
  void BiasVersion(int64_t layer, uint64_t version);
  // A DEGRADE request left out `pairs` routed pairs (experts without a healthy replica).
  void Degraded(int64_t layer, int64_t pairs);
  // The out-of-band data plane of one shard: "connected" (OpenDataPlane done), "fallback" (a
  // batch went in band because UCX was not available to that shard), "transfer_failed".
  void DataPlaneEvent(const std::string& shard, const std::string& event);
  // The lanes UCX selected for the data plane to `shard` (one series per shard, value 1):
  // kind "shm", "tcp", "rdma" or "mixed", ours and the shard's view (its hello's answer).
  void DataPlaneLanes(const std::string& shard, const std::string& kind, const std::string& lanes,
                      const std::string& shard_lanes);
  // n messages of `shard` (which was gone) sent to another replica of its range (n = 0: the
  // series exists at 0 from the shard's first use, so a rate() has a start).
  void Failover(const std::string& shard, int64_t n = 1);
  // A message of `shard` (silent past the hedge share) also sent to another replica; which
  // answered first.
  void Hedge(const std::string& shard, bool twin_won, int64_t n = 1);
  // Dynamic k (docs/math.md 4.1). A forward of `tokens` tokens computing `pairs` pairs.
  void Budgeted(int64_t layer, int64_t tokens, int64_t pairs);
  // The automatic mode's cap on this node's budgets (top-k: not limiting) and its steps.
  void AutoBudget(int64_t cap);
  void BudgetStep(bool down);
  // A sampled budgeted forward recomputed at full k: outcome "measured" (with the output's
  // relative difference), "dropped" (the check queue was full), "skipped" (the bias changed in
  // between) or "failed".
  void BudgetCheck(int64_t layer, const std::string& outcome, double rel_diff = 0);
  // What a measured check kept of the full layer: the routing weight mass of the kept experts
  // and the share of tokens whose top-1 direction (numerics::Top1Agreement) stayed.
  void BudgetQuality(int64_t layer, double mass_kept, double top1_agreement);
  // A readiness canary's outcome ("match", "mismatch", "timeout", "error", "skipped", "busy") and
  // the readiness it leaves (readiness_canary.h).
  void Canary(const std::string& outcome, bool ready);
  // A twin audit's outcome ("agree", "within_bound", "caught", "unresolved", "skipped";
  // twin_audit.h).
  void TwinAudit(const std::string& outcome);
  // n times a shard this node caught answering wrong bytes (quarantined here), with the answers
  // of it that served messages since its last passed audit (suspect); n = 0, suspect 0: the
  // series exist at 0 from the shard's first use.
  void Quarantined(const std::string& shard, int64_t suspect_answers, int64_t n = 1);

 private:
  struct Layer {
    prometheus::Histogram* forward = nullptr;
    prometheus::Counter* budgeted_tokens = nullptr;
    prometheus::Counter* budgeted_pairs = nullptr;
    prometheus::Histogram* budget_diff = nullptr;
    prometheus::Histogram* budget_mass = nullptr;
    prometheus::Histogram* budget_top1 = nullptr;
    std::map<std::string, prometheus::Counter*> budget_checks;
    prometheus::Histogram* dispatch = nullptr;
    prometheus::Histogram* combine = nullptr;
    prometheus::Counter* tokens = nullptr;
    prometheus::Counter* degraded = nullptr;
    prometheus::Gauge* bias_version = nullptr;
    std::vector<prometheus::Counter*> experts;  // empty when per-expert series are off
  };
  std::map<int64_t, Layer> layers_;
  prometheus::Gauge* auto_budget_ = nullptr;
  prometheus::Counter* steps_down_ = nullptr;
  prometheus::Counter* steps_up_ = nullptr;
  prometheus::Gauge* canary_ready_ = nullptr;
  std::map<std::string, prometheus::Counter*> canary_checks_;
  void AddTwinAudits(prometheus::Registry& registry);  // moe_twin_audits_total, every outcome at 0
  std::map<std::string, prometheus::Counter*> twin_audits_;
  prometheus::Family<prometheus::Counter>* quarantines_ = nullptr;
  prometheus::Family<prometheus::Counter>* suspect_answers_ = nullptr;
  prometheus::Family<prometheus::Counter>& shard_tokens_;
  prometheus::Family<prometheus::Counter>& data_plane_events_;
  prometheus::Family<prometheus::Counter>& failovers_;
  prometheus::Family<prometheus::Gauge>& data_plane_lanes_;
  std::map<std::string, prometheus::Counter*> failover_counters_;
  prometheus::Family<prometheus::Counter>* hedges_ = nullptr;
  std::map<std::pair<std::string, bool>, prometheus::Counter*> hedge_counters_;
  prometheus::Registry& registry_;
  std::map<std::string, prometheus::Gauge*> lane_gauges_;
  std::mutex mu_;
  std::map<std::pair<int64_t, std::string>, prometheus::Counter*> shard_counters_;
  std::map<std::pair<std::string, std::string>, prometheus::Counter*> data_plane_counters_;
};

class ExpertMetrics {
 public:
  ExpertMetrics(prometheus::Registry& registry, const std::vector<int64_t>& layers,
                const std::string& shard);

  CommonMetrics common;
  WireMetrics wire;
  // weight_bytes: MXFP4 bytes of the batch's distinct experts (each streams once per batch);
  // flops: 2 per multiply-add of the expert FFNs.
  // now: when the batch ended (tests pass their own clock).
  void BatchDone(int64_t layer, double queue_seconds, double compute_seconds, int64_t rows,
                 double weight_bytes, double flops,
                 std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());
  // This machine's limits, measured once at start (numerics/cpu/machine_limits.h); the achieved
  // weight bytes/s and FLOP/s of the last window are exported as fractions of them.
  void SetMachineLimits(double read_bytes_per_second, double fma_flops_per_second,
                        const std::string& isa);
  // One measurement of the limits (at start, or again while idle).
  void LimitsProbed() { limit_probes_.Increment(); }
  // A production check's result: "match", "mismatch", "skipped" or "error" (batch_verifier.h).
  void Verified(const std::string& result);
  // The backend the experts run on, and why not the one asked for ("" when it is).
  void Backend(const std::string& backend, const std::string& fallback);
  // The CPU kernels chosen (numerics/cpu/kernel_choice.h): the decode and prefill sets, the
  // tokens per expert from which the panel kernel runs ("never"), where the choice came from
  // (measured, cache, pinned), and each probe's FLOP/s.
  struct KernelProbe {
    std::string set, kernel;
    int64_t tokens;
    double flops_per_second;
  };
  void KernelChoice(const std::string& decode, const std::string& prefill,
                    const std::string& panel_from, const std::string& source,
                    const std::vector<KernelProbe>& probes);
  // The out-of-band data plane: "hello_rejected" (a UCX hello with a wrong secret, an unknown
  // client or a malformed form), "integrity_failed" (a payload whose MAC did not match).
  void DataPlaneEvent(const std::string& event);
  // Fraction of the last window (10 s) the compute thread was busy; updated on each batch and
  // by Tick() (call it periodically so an idle server decays to 0).
  void Tick(std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());

 private:
  // The window's batches in 100 ms slots (at most ~100 kept whatever the batch rate), and
  // their sums kept as they come and go: a batch costs O(1), not a pass over the window (which
  // at tens of thousands of small batches a second was a fifth of a shard's CPU).
  struct Recent {
    int64_t slot;  // steady clock / 100 ms
    int64_t ns, weight_bytes, flops;
  };
  static constexpr std::chrono::milliseconds kSlot{100};
  void UpdateWindowLocked(std::chrono::steady_clock::time_point now);
  struct Layer {
    prometheus::Histogram* compute = nullptr;
    prometheus::Histogram* queue = nullptr;
    prometheus::Counter* rows = nullptr;
  };
  const std::string shard_;
  std::map<int64_t, Layer> layers_;
  prometheus::Counter& busy_seconds_;
  prometheus::Gauge& busy_ratio_;
  prometheus::Counter& weight_bytes_;
  prometheus::Counter& flops_;
  // Families of the two fractions; their series exist from the first window with compute
  // time and limits on (absent before: no NaN to divide by), then hold the latest window's.
  prometheus::Family<prometheus::Gauge>& bandwidth_fraction_family_;
  prometheus::Family<prometheus::Gauge>& fma_fraction_family_;
  prometheus::Gauge* bandwidth_fraction_ = nullptr;
  prometheus::Gauge* fma_fraction_ = nullptr;
  prometheus::Gauge& read_bandwidth_;
  prometheus::Counter& limit_probes_;
  prometheus::Family<prometheus::Gauge>& fma_peak_;
  prometheus::Family<prometheus::Counter>& verified_;
  prometheus::Family<prometheus::Counter>& data_plane_events_;
  prometheus::Family<prometheus::Gauge>& backend_info_;
  prometheus::Family<prometheus::Gauge>& kernel_info_;
  prometheus::Family<prometheus::Gauge>& kernel_probe_;
  std::mutex mu_;
  std::deque<Recent> recent_;
  int64_t window_ns_ = 0, window_bytes_ = 0, window_flops_ = 0;  // sums over recent_
  double limit_bandwidth_ = 0, limit_flops_ = 0;
};

class RouterMetrics {
 public:
  RouterMetrics(prometheus::Registry& registry, const std::vector<int64_t>& layers);

  CommonMetrics common;
  void Window(int64_t layer, double max_vio, int64_t window_tokens);
  // Mean / max tokens per shard over the window (1: even; NaN: empty window).
  void Balancedness(int64_t layer, double balancedness);
  void BiasVersion(int64_t layer, uint64_t version);
  // Dynamic k: the layer's expert budget (experts per token on average; top-k: none).
  void ExpertBudget(int64_t layer, int64_t k_avg);
  // Its thresholds: stale (not applied until solved again), and their window's noise floor.
  void BudgetThresholds(int64_t layer, bool stale, double window_floor);
  void Rebalanced(int64_t layer);
  void Report(bool accepted);
  // quarantined: caught answering wrong bytes (registry's Quarantine), not healthy.
  void Shards(int64_t total, int64_t healthy, int64_t quarantined = 0);
  // The router's state at this start (router_core.h StateOrigin); set once.
  void State(const std::string& store, const std::string& start, int64_t initialized_unix_ms);

 private:
  prometheus::Registry& registry_;
  struct Layer {
    prometheus::Gauge* max_vio = nullptr;
    prometheus::Gauge* window_tokens = nullptr;
    prometheus::Gauge* balancedness = nullptr;
    prometheus::Gauge* bias_version = nullptr;
    prometheus::Gauge* expert_budget = nullptr;
    prometheus::Gauge* budget_stale = nullptr;
    prometheus::Gauge* window_floor = nullptr;
    prometheus::Counter* rebalances = nullptr;
  };
  std::map<int64_t, Layer> layers_;
  prometheus::Counter* reports_accepted_ = nullptr;
  prometheus::Counter* reports_stale_ = nullptr;
  prometheus::Gauge* shards_ = nullptr;
  prometheus::Gauge* shards_healthy_ = nullptr;
  prometheus::Gauge* shards_quarantined_ = nullptr;
};

}  // namespace moe::metrics

#endif  // MOE_SERVICES_METRICS_SERVICE_METRICS_H_
