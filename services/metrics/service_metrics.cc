#include "services/metrics/service_metrics.h"

#include <cmath>
#include <string>

#include "services/common/allocator.h"
#include "services/common/version.h"
#include "services/metrics/metric_table.h"

namespace moe::metrics {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

namespace {

std::string L(int64_t layer) { return std::to_string(layer); }

}  // namespace

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 0.0005; v < 20; v *= 2) b.push_back(v);
  return b;
}

CommonMetrics::CommonMetrics(prometheus::Registry& registry, const std::string& service)
    : registry_(registry),
      service_(service),
      errors_(BuildCounter()
                  .Name("moe_errors_total")
                  .Help(HelpOf("moe_errors_total"))
                  .Register(registry)),
      in_flight_(BuildGauge()
                     .Name("moe_requests_in_flight")
                     .Help(HelpOf("moe_requests_in_flight"))
                     .Register(registry)),
      succeeded_(BuildCounter()
                     .Name("moe_requests_succeeded_total")
                     .Help(HelpOf("moe_requests_succeeded_total"))
                     .Register(registry)),
      queue_depth_(BuildGauge()
                       .Name("moe_queue_depth")
                       .Help(HelpOf("moe_queue_depth"))
                       .Register(registry)
                       .Add({{"service", service}})) {
  BuildGauge()
      .Name("moe_build_info")
      .Help(HelpOf("moe_build_info"))
      .Register(registry)
      .Add({{"service", service}, {"version", moe::BuildVersion()}, {"allocator", AllocatorName()}})
      .Set(1);
}

CommonMetrics::PerMethod& CommonMetrics::For(const std::string& method) {
  PerMethod& m = methods_[method];
  if (m.in_flight == nullptr) {
    m.in_flight = &in_flight_.Add({{"service", service_}, {"method", method}});
    m.succeeded = &succeeded_.Add({{"service", service_}, {"method", method}});
  }
  return m;
}

void CommonMetrics::Started(const std::string& method) {
  std::lock_guard<std::mutex> lock(mu_);
  For(method).in_flight->Increment();
}

void CommonMetrics::Finished(const std::string& method, bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  PerMethod& m = For(method);
  m.in_flight->Decrement();
  if (ok) m.succeeded->Increment();
}

void CommonMetrics::QueueDepth(int64_t waiting) { queue_depth_.Set(static_cast<double>(waiting)); }

void CommonMetrics::Error(const std::string& method, const std::string& code) {
  std::lock_guard<std::mutex> lock(mu_);
  prometheus::Counter*& c = error_counters_[{method, code}];
  if (c == nullptr) {
    c = &errors_.Add({{"service", service_}, {"method", method}, {"code", code}});
  }
  c->Increment();
}

WireMetrics::WireMetrics(prometheus::Registry& registry)
    : bytes_(BuildCounter()
                 .Name("moe_wire_bytes_total")
                 .Help(HelpOf("moe_wire_bytes_total"))
                 .Register(registry)),
      rows_(BuildCounter()
                .Name("moe_wire_tokens_total")
                .Help(HelpOf("moe_wire_tokens_total"))
                .Register(registry)) {}

void WireMetrics::Add(const std::string& direction, const std::string& dtype,
                      const std::string& peer, int64_t bytes, int64_t rows,
                      const std::string& transport) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& entry = cache_[direction + "/" + dtype + "/" + peer + "/" + transport];
  if (entry.first == nullptr) {
    const prometheus::Labels labels = {
        {"direction", direction}, {"dtype", dtype}, {"peer", peer}, {"transport", transport}};
    entry.first = &bytes_.Add(labels);
    entry.second = &rows_.Add(labels);
  }
  entry.first->Increment(static_cast<double>(bytes));
  entry.second->Increment(static_cast<double>(rows));
}

AttentionMetrics::AttentionMetrics(prometheus::Registry& registry,
                                   const std::vector<int64_t>& layers, int64_t num_experts,
                                   bool per_expert)
    : common(registry, "attention-svc"),
      wire(registry),
      shard_tokens_(BuildCounter()
                        .Name("moe_shard_tokens_total")
                        .Help(HelpOf("moe_shard_tokens_total"))
                        .Register(registry)),
      data_plane_events_(BuildCounter()
                             .Name("moe_data_plane_events_total")
                             .Help(HelpOf("moe_data_plane_events_total"))
                             .Register(registry)),
      failovers_(BuildCounter()
                     .Name("moe_failovers_total")
                     .Help(HelpOf("moe_failovers_total"))
                     .Register(registry)),
      data_plane_lanes_(BuildGauge()
                            .Name("moe_data_plane_lane_info")
                            .Help(HelpOf("moe_data_plane_lane_info"))
                            .Register(registry)),
      registry_(registry) {
  auto& forward = BuildHistogram()
                      .Name("moe_forward_duration_seconds")
                      .Help(HelpOf("moe_forward_duration_seconds"))
                      .Register(registry);
  auto& dispatch = BuildHistogram()
                       .Name("moe_dispatch_duration_seconds")
                       .Help(HelpOf("moe_dispatch_duration_seconds"))
                       .Register(registry);
  auto& combine = BuildHistogram()
                      .Name("moe_combine_duration_seconds")
                      .Help(HelpOf("moe_combine_duration_seconds"))
                      .Register(registry);
  auto& tokens = BuildCounter()
                     .Name("moe_forward_tokens_total")
                     .Help(HelpOf("moe_forward_tokens_total"))
                     .Register(registry);
  auto& degraded = BuildCounter()
                       .Name("moe_degraded_pairs_total")
                       .Help(HelpOf("moe_degraded_pairs_total"))
                       .Register(registry);
  auto& version = BuildGauge()
                      .Name("moe_attention_bias_version")
                      .Help(HelpOf("moe_attention_bias_version"))
                      .Register(registry);
  auto& experts = BuildCounter()
                      .Name("moe_expert_tokens_total")
                      .Help(HelpOf("moe_expert_tokens_total"))
                      .Register(registry);
  auto& budgeted = BuildCounter()
                       .Name("moe_budget_tokens_total")
                       .Help(HelpOf("moe_budget_tokens_total"))
                       .Register(registry);
  auto& diff = BuildHistogram()
                   .Name("moe_budget_output_rel_diff")
                   .Help(HelpOf("moe_budget_output_rel_diff"))
                   .Register(registry);
  auto& mass = BuildHistogram()
                   .Name("moe_budget_routing_mass_kept")
                   .Help(HelpOf("moe_budget_routing_mass_kept"))
                   .Register(registry);
  auto& top1 = BuildHistogram()
                   .Name("moe_budget_top1_agreement")
                   .Help(HelpOf("moe_budget_top1_agreement"))
                   .Register(registry);
  auto& checks = BuildCounter()
                     .Name("moe_budget_checks_total")
                     .Help(HelpOf("moe_budget_checks_total"))
                     .Register(registry);
  auto_budget_ = &BuildGauge()
                      .Name("moe_auto_expert_budget")
                      .Help(HelpOf("moe_auto_expert_budget"))
                      .Register(registry)
                      .Add({});
  auto& steps = BuildCounter()
                    .Name("moe_budget_steps_total")
                    .Help(HelpOf("moe_budget_steps_total"))
                    .Register(registry);
  steps_down_ = &steps.Add({{"direction", "down"}});
  steps_up_ = &steps.Add({{"direction", "up"}});
  canary_ready_ = &BuildGauge()
                       .Name("moe_canary_ready")
                       .Help(HelpOf("moe_canary_ready"))
                       .Register(registry)
                       .Add({});
  auto& canary = BuildCounter()
                     .Name("moe_canary_checks_total")
                     .Help(HelpOf("moe_canary_checks_total"))
                     .Register(registry);
  for (const char* outcome : {"match", "mismatch", "timeout", "error", "skipped", "busy"}) {
    canary_checks_[outcome] = &canary.Add({{"outcome", outcome}});
  }
  AddTwinAudits(registry);
  for (int64_t layer : layers) {
    Layer& l = layers_[layer];
    l.budgeted_tokens = &budgeted.Add({{"layer", L(layer)}, {"kind", "tokens"}});
    l.budgeted_pairs = &budgeted.Add({{"layer", L(layer)}, {"kind", "pairs"}});
    l.budget_diff = &diff.Add(
        {{"layer", L(layer)}},
        prometheus::Histogram::BucketBoundaries{1e-3, 3e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0});
    const prometheus::Histogram::BucketBoundaries shares{0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0};
    l.budget_mass = &mass.Add({{"layer", L(layer)}}, shares);
    l.budget_top1 = &top1.Add({{"layer", L(layer)}}, shares);
    for (const char* outcome : {"measured", "dropped", "skipped", "failed"}) {
      l.budget_checks[outcome] = &checks.Add({{"layer", L(layer)}, {"outcome", outcome}});
    }
    l.forward = &forward.Add({{"layer", L(layer)}}, LatencyBuckets());
    l.dispatch = &dispatch.Add({{"layer", L(layer)}}, LatencyBuckets());
    l.combine = &combine.Add({{"layer", L(layer)}}, LatencyBuckets());
    l.tokens = &tokens.Add({{"layer", L(layer)}});
    l.degraded = &degraded.Add({{"layer", L(layer)}});
    l.bias_version = &version.Add({{"layer", L(layer)}});
    if (per_expert) {
      for (int64_t e = 0; e < num_experts; ++e) {
        l.experts.push_back(&experts.Add({{"layer", L(layer)}, {"expert", std::to_string(e)}}));
      }
    }
  }
}

void AttentionMetrics::Budgeted(int64_t layer, int64_t tokens, int64_t pairs) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  it->second.budgeted_tokens->Increment(static_cast<double>(tokens));
  it->second.budgeted_pairs->Increment(static_cast<double>(pairs));
}

void AttentionMetrics::AutoBudget(int64_t cap) { auto_budget_->Set(static_cast<double>(cap)); }

void AttentionMetrics::BudgetStep(bool down) { (down ? steps_down_ : steps_up_)->Increment(); }

void AttentionMetrics::Canary(const std::string& outcome, bool ready) {
  auto it = canary_checks_.find(outcome);
  if (it != canary_checks_.end()) it->second->Increment();
  canary_ready_->Set(ready ? 1.0 : 0.0);
}

void AttentionMetrics::AddTwinAudits(prometheus::Registry& registry) {
  auto& audits = BuildCounter()
                     .Name("moe_twin_audits_total")
                     .Help(HelpOf("moe_twin_audits_total"))
                     .Register(registry);
  for (const char* outcome : {"agree", "within_bound", "caught", "unresolved", "skipped"}) {
    twin_audits_[outcome] = &audits.Add({{"outcome", outcome}});
  }
}

void AttentionMetrics::TwinAudit(const std::string& outcome) {
  auto it = twin_audits_.find(outcome);
  if (it != twin_audits_.end()) it->second->Increment();
}

void AttentionMetrics::Quarantined(const std::string& shard, int64_t suspect_answers, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (quarantines_ == nullptr) {
    quarantines_ = &BuildCounter()
                        .Name("moe_quarantines_total")
                        .Help(HelpOf("moe_quarantines_total"))
                        .Register(registry_);
    suspect_answers_ = &BuildCounter()
                            .Name("moe_suspect_answers_total")
                            .Help(HelpOf("moe_suspect_answers_total"))
                            .Register(registry_);
  }
  quarantines_->Add({{"shard", shard}}).Increment(static_cast<double>(n));
  suspect_answers_->Add({{"shard", shard}}).Increment(static_cast<double>(suspect_answers));
}

void AttentionMetrics::BudgetCheck(int64_t layer, const std::string& outcome, double rel_diff) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  auto c = it->second.budget_checks.find(outcome);
  if (c != it->second.budget_checks.end()) c->second->Increment();
  if (outcome == "measured") it->second.budget_diff->Observe(rel_diff);
}

void AttentionMetrics::BudgetQuality(int64_t layer, double mass_kept, double top1_agreement) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  it->second.budget_mass->Observe(mass_kept);
  it->second.budget_top1->Observe(top1_agreement);
}

void AttentionMetrics::Degraded(int64_t layer, int64_t pairs) {
  auto it = layers_.find(layer);
  if (it != layers_.end()) it->second.degraded->Increment(static_cast<double>(pairs));
}

void AttentionMetrics::ForwardDone(int64_t layer, double seconds, double dispatch_seconds,
                                   double combine_seconds, int64_t tokens) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  it->second.forward->Observe(seconds);
  it->second.dispatch->Observe(dispatch_seconds);
  it->second.combine->Observe(combine_seconds);
  it->second.tokens->Increment(static_cast<double>(tokens));
}

void AttentionMetrics::Routed(int64_t layer, const std::vector<int64_t>& counts,
                              const std::vector<std::pair<std::string, int64_t>>& shard_pairs) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  for (size_t e = 0; e < it->second.experts.size() && e < counts.size(); ++e) {
    if (counts[e] > 0) it->second.experts[e]->Increment(static_cast<double>(counts[e]));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [shard, n] : shard_pairs) {
    prometheus::Counter*& c = shard_counters_[{layer, shard}];
    if (c == nullptr) c = &shard_tokens_.Add({{"layer", L(layer)}, {"shard", shard}});
    c->Increment(static_cast<double>(n));
  }
}

void AttentionMetrics::BiasVersion(int64_t layer, uint64_t version) {
  auto it = layers_.find(layer);
  if (it != layers_.end()) it->second.bias_version->Set(static_cast<double>(version));
}

void AttentionMetrics::DataPlaneEvent(const std::string& shard, const std::string& event) {
  std::lock_guard<std::mutex> lock(mu_);
  prometheus::Counter*& c = data_plane_counters_[{shard, event}];
  if (c == nullptr) c = &data_plane_events_.Add({{"shard", shard}, {"event", event}});
  c->Increment();
}

void AttentionMetrics::DataPlaneLanes(const std::string& shard, const std::string& kind,
                                      const std::string& lanes, const std::string& shard_lanes) {
  std::lock_guard<std::mutex> lock(mu_);
  prometheus::Gauge*& g = lane_gauges_[shard];
  if (g != nullptr) data_plane_lanes_.Remove(g);
  g = &data_plane_lanes_.Add(
      {{"shard", shard}, {"kind", kind}, {"lanes", lanes}, {"shard_lanes", shard_lanes}});
  g->Set(1);
}

void AttentionMetrics::Hedge(const std::string& shard, bool twin_won, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (hedges_ == nullptr) {  // exported from the first hedge on
    hedges_ = &BuildCounter()
                   .Name("moe_hedges_total")
                   .Help(HelpOf("moe_hedges_total"))
                   .Register(registry_);
  }
  prometheus::Counter*& c = hedge_counters_[{shard, twin_won}];
  if (c == nullptr)
    c = &hedges_->Add({{"shard", shard}, {"winner", twin_won ? "twin" : "original"}});
  c->Increment(static_cast<double>(n));
}

void AttentionMetrics::Failover(const std::string& shard, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  prometheus::Counter*& c = failover_counters_[shard];
  if (c == nullptr) c = &failovers_.Add({{"shard", shard}});
  c->Increment(static_cast<double>(n));
}

ExpertMetrics::ExpertMetrics(prometheus::Registry& registry, const std::vector<int64_t>& layers,
                             const std::string& shard)
    : common(registry, "expert-svc"),
      wire(registry),
      shard_(shard),
      busy_seconds_(BuildCounter()
                        .Name("moe_expert_busy_seconds_total")
                        .Help(HelpOf("moe_expert_busy_seconds_total"))
                        .Register(registry)
                        .Add({{"shard", shard}})),
      busy_ratio_(BuildGauge()
                      .Name("moe_expert_busy_ratio")
                      .Help(HelpOf("moe_expert_busy_ratio"))
                      .Register(registry)
                      .Add({{"shard", shard}})),
      weight_bytes_(BuildCounter()
                        .Name("moe_expert_weight_read_bytes_total")
                        .Help(HelpOf("moe_expert_weight_read_bytes_total"))
                        .Register(registry)
                        .Add({{"shard", shard}})),
      flops_(BuildCounter()
                 .Name("moe_expert_flops_total")
                 .Help(HelpOf("moe_expert_flops_total"))
                 .Register(registry)
                 .Add({{"shard", shard}})),
      bandwidth_fraction_family_(BuildGauge()
                                     .Name("moe_expert_weight_bandwidth_fraction")
                                     .Help(HelpOf("moe_expert_weight_bandwidth_fraction"))
                                     .Register(registry)),
      fma_fraction_family_(BuildGauge()
                               .Name("moe_expert_fma_peak_fraction")
                               .Help(HelpOf("moe_expert_fma_peak_fraction"))
                               .Register(registry)),
      read_bandwidth_(BuildGauge()
                          .Name("moe_expert_machine_read_bandwidth_bytes_per_second")
                          .Help(HelpOf("moe_expert_machine_read_bandwidth_bytes_per_second"))
                          .Register(registry)
                          .Add({{"shard", shard}})),
      limit_probes_(BuildCounter()
                        .Name("moe_expert_machine_limit_probes_total")
                        .Help(HelpOf("moe_expert_machine_limit_probes_total"))
                        .Register(registry)
                        .Add({{"shard", shard}})),
      fma_peak_(BuildGauge()
                    .Name("moe_expert_machine_fma_peak_flops_per_second")
                    .Help(HelpOf("moe_expert_machine_fma_peak_flops_per_second"))
                    .Register(registry)),
      verified_(BuildCounter()
                    .Name("moe_expert_verified_batches_total")
                    .Help(HelpOf("moe_expert_verified_batches_total"))
                    .Register(registry)),
      data_plane_events_(BuildCounter()
                             .Name("moe_expert_data_plane_events_total")
                             .Help(HelpOf("moe_expert_data_plane_events_total"))
                             .Register(registry)),
      backend_info_(BuildGauge()
                        .Name("moe_expert_backend_info")
                        .Help(HelpOf("moe_expert_backend_info"))
                        .Register(registry)),
      kernel_info_(BuildGauge()
                       .Name("moe_expert_kernel_info")
                       .Help(HelpOf("moe_expert_kernel_info"))
                       .Register(registry)),
      kernel_probe_(BuildGauge()
                        .Name("moe_expert_kernel_probe_flops_per_second")
                        .Help(HelpOf("moe_expert_kernel_probe_flops_per_second"))
                        .Register(registry)) {
  auto& compute = BuildHistogram()
                      .Name("moe_expert_compute_duration_seconds")
                      .Help(HelpOf("moe_expert_compute_duration_seconds"))
                      .Register(registry);
  auto& queue = BuildHistogram()
                    .Name("moe_expert_queue_duration_seconds")
                    .Help(HelpOf("moe_expert_queue_duration_seconds"))
                    .Register(registry);
  auto& rows = BuildCounter()
                   .Name("moe_expert_rows_total")
                   .Help(HelpOf("moe_expert_rows_total"))
                   .Register(registry);
  for (int64_t layer : layers) {
    Layer& l = layers_[layer];
    l.compute = &compute.Add({{"layer", L(layer)}, {"shard", shard}}, LatencyBuckets());
    l.queue = &queue.Add({{"layer", L(layer)}, {"shard", shard}}, LatencyBuckets());
    l.rows = &rows.Add({{"layer", L(layer)}, {"shard", shard}});
  }
  for (const char* result : {"match", "mismatch", "skipped", "error"}) {
    verified_.Add({{"shard", shard}, {"result", result}});  // all four series from the start
  }
  // Every kind of refused data-plane message from the start, at 0 (rate() sees the first one).
  for (const char* event :
       {"hello_rejected", "integrity_failed", "message_rejected", "replayed", "reply_failed"}) {
    data_plane_events_.Add({{"shard", shard}, {"event", event}});
  }
}

void ExpertMetrics::BatchDone(int64_t layer, double queue_seconds, double compute_seconds,
                              int64_t rows, double weight_bytes, double flops,
                              std::chrono::steady_clock::time_point now) {
  auto it = layers_.find(layer);
  if (it != layers_.end()) {
    it->second.compute->Observe(compute_seconds);
    it->second.queue->Observe(queue_seconds);
    it->second.rows->Increment(static_cast<double>(rows));
  }
  busy_seconds_.Increment(compute_seconds);
  weight_bytes_.Increment(weight_bytes);
  flops_.Increment(flops);
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t slot = now.time_since_epoch() / kSlot;
  if (recent_.empty() || recent_.back().slot != slot) recent_.push_back({slot, 0, 0, 0});
  const int64_t ns = std::llround(compute_seconds * 1e9), b = std::llround(weight_bytes),
                f = std::llround(flops);
  recent_.back().ns += ns;
  recent_.back().weight_bytes += b;
  recent_.back().flops += f;
  window_ns_ += ns;
  window_bytes_ += b;
  window_flops_ += f;
  UpdateWindowLocked(now);
}

void ExpertMetrics::SetMachineLimits(double read_bytes_per_second, double fma_flops_per_second,
                                     const std::string& isa) {
  read_bandwidth_.Set(read_bytes_per_second);
  fma_peak_.Add({{"shard", shard_}, {"isa", isa}}).Set(fma_flops_per_second);
  std::lock_guard<std::mutex> lock(mu_);
  limit_bandwidth_ = read_bytes_per_second;
  limit_flops_ = fma_flops_per_second;
  UpdateWindowLocked(std::chrono::steady_clock::now());
}

void ExpertMetrics::Verified(const std::string& result) {
  verified_.Add({{"shard", shard_}, {"result", result}}).Increment();
}

void ExpertMetrics::Backend(const std::string& backend, const std::string& fallback) {
  backend_info_.Add({{"shard", shard_}, {"backend", backend}, {"fallback", fallback}}).Set(1);
}

void ExpertMetrics::KernelChoice(const std::string& decode, const std::string& prefill,
                                 const std::string& panel_from, const std::string& source,
                                 const std::vector<KernelProbe>& probes) {
  kernel_info_
      .Add({{"shard", shard_},
            {"decode", decode},
            {"prefill", prefill},
            {"panel_from", panel_from},
            {"source", source}})
      .Set(1);
  for (const KernelProbe& p : probes) {
    kernel_probe_
        .Add({{"shard", shard_},
              {"set", p.set},
              {"kernel", p.kernel},
              {"tokens", std::to_string(p.tokens)}})
        .Set(p.flops_per_second);
  }
}

void ExpertMetrics::DataPlaneEvent(const std::string& event) {
  data_plane_events_.Add({{"shard", shard_}, {"event", event}}).Increment();
}

void ExpertMetrics::Tick(std::chrono::steady_clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  UpdateWindowLocked(now);
}

void ExpertMetrics::UpdateWindowLocked(std::chrono::steady_clock::time_point now) {
  // Slots that ended more than the window (10 s) ago leave it.
  const int64_t oldest = (now - std::chrono::seconds(10)).time_since_epoch() / kSlot;
  while (!recent_.empty() && recent_.front().slot < oldest) {
    window_ns_ -= recent_.front().ns;
    window_bytes_ -= recent_.front().weight_bytes;
    window_flops_ -= recent_.front().flops;
    recent_.pop_front();
  }
  const double busy = static_cast<double>(window_ns_) * 1e-9,
               bytes = static_cast<double>(window_bytes_),
               flops = static_cast<double>(window_flops_);
  busy_ratio_.Set(std::min(1.0, busy / 10.0));
  // Only a window with compute and measured limits has fractions: none before (the series are
  // absent, not NaN), the latest after (an idle window keeps them).
  if (busy > 0 && limit_bandwidth_ > 0 && limit_flops_ > 0) {
    if (bandwidth_fraction_ == nullptr) {
      bandwidth_fraction_ = &bandwidth_fraction_family_.Add({{"shard", shard_}});
      fma_fraction_ = &fma_fraction_family_.Add({{"shard", shard_}});
    }
    bandwidth_fraction_->Set(bytes / busy / limit_bandwidth_);
    fma_fraction_->Set(flops / busy / limit_flops_);
  }
}

RouterMetrics::RouterMetrics(prometheus::Registry& registry, const std::vector<int64_t>& layers)
    : common(registry, "router-svc"), registry_(registry) {
  auto& reports = BuildCounter()
                      .Name("moe_stats_reports_total")
                      .Help(HelpOf("moe_stats_reports_total"))
                      .Register(registry);
  reports_accepted_ = &reports.Add({{"window", "current"}});
  reports_stale_ = &reports.Add({{"window", "stale"}});
  auto& shards =
      BuildGauge().Name("moe_expert_shards").Help(HelpOf("moe_expert_shards")).Register(registry);
  shards_ = &shards.Add({{"health", "all"}});
  shards_healthy_ = &shards.Add({{"health", "healthy"}});
  shards_quarantined_ = &shards.Add({{"health", "quarantined"}});
  auto& max_vio = BuildGauge()
                      .Name("moe_imbalance_max_vio")
                      .Help(HelpOf("moe_imbalance_max_vio"))
                      .Register(registry);
  auto& balancedness =
      BuildGauge().Name("moe_balancedness").Help(HelpOf("moe_balancedness")).Register(registry);
  auto& window =
      BuildGauge().Name("moe_window_tokens").Help(HelpOf("moe_window_tokens")).Register(registry);
  auto& version =
      BuildGauge().Name("moe_bias_version").Help(HelpOf("moe_bias_version")).Register(registry);
  auto& budget =
      BuildGauge().Name("moe_expert_budget").Help(HelpOf("moe_expert_budget")).Register(registry);
  auto& stale = BuildGauge()
                    .Name("moe_budget_thresholds_stale")
                    .Help(HelpOf("moe_budget_thresholds_stale"))
                    .Register(registry);
  auto& floor = BuildGauge()
                    .Name("moe_budget_window_floor")
                    .Help(HelpOf("moe_budget_window_floor"))
                    .Register(registry);
  auto& rebalances = BuildCounter()
                         .Name("moe_rebalances_total")
                         .Help(HelpOf("moe_rebalances_total"))
                         .Register(registry);
  for (int64_t layer : layers) {
    Layer& l = layers_[layer];
    l.max_vio = &max_vio.Add({{"layer", L(layer)}});
    l.window_tokens = &window.Add({{"layer", L(layer)}});
    l.balancedness = &balancedness.Add({{"layer", L(layer)}});
    l.bias_version = &version.Add({{"layer", L(layer)}});
    l.expert_budget = &budget.Add({{"layer", L(layer)}});
    l.budget_stale = &stale.Add({{"layer", L(layer)}});
    l.window_floor = &floor.Add({{"layer", L(layer)}});
    l.rebalances = &rebalances.Add({{"layer", L(layer)}});
  }
}

void RouterMetrics::Window(int64_t layer, double max_vio, int64_t window_tokens) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  it->second.max_vio->Set(max_vio);
  it->second.window_tokens->Set(static_cast<double>(window_tokens));
}

void RouterMetrics::Balancedness(int64_t layer, double balancedness) {
  auto it = layers_.find(layer);
  if (it != layers_.end()) it->second.balancedness->Set(balancedness);
}

void RouterMetrics::BiasVersion(int64_t layer, uint64_t version) {
  auto it = layers_.find(layer);
  if (it != layers_.end()) it->second.bias_version->Set(static_cast<double>(version));
}

void RouterMetrics::ExpertBudget(int64_t layer, int64_t k_avg) {
  auto it = layers_.find(layer);
  if (it != layers_.end()) it->second.expert_budget->Set(static_cast<double>(k_avg));
}

void RouterMetrics::BudgetThresholds(int64_t layer, bool stale, double window_floor) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return;
  it->second.budget_stale->Set(stale ? 1.0 : 0.0);
  it->second.window_floor->Set(window_floor);
}

void RouterMetrics::Rebalanced(int64_t layer) {
  auto it = layers_.find(layer);
  if (it != layers_.end()) it->second.rebalances->Increment();
}

void RouterMetrics::Report(bool accepted) {
  (accepted ? reports_accepted_ : reports_stale_)->Increment();
}

void RouterMetrics::Shards(int64_t total, int64_t healthy, int64_t quarantined) {
  shards_->Set(static_cast<double>(total));
  shards_healthy_->Set(static_cast<double>(healthy));
  shards_quarantined_->Set(static_cast<double>(quarantined));
}

void RouterMetrics::State(const std::string& store, const std::string& start,
                          int64_t initialized_unix_ms) {
  BuildGauge()
      .Name("moe_router_state_info")
      .Help(HelpOf("moe_router_state_info"))
      .Register(registry_)
      .Add({{"store", store}, {"start", start}})
      .Set(1);
  if (initialized_unix_ms > 0) {
    BuildGauge()
        .Name("moe_router_state_initialized_timestamp_seconds")
        .Help(HelpOf("moe_router_state_initialized_timestamp_seconds"))
        .Register(registry_)
        .Add({})
        .Set(static_cast<double>(initialized_unix_ms) / 1000.0);
  }
}

}  // namespace moe::metrics
