#include "services/metrics/metric_table.h"

#include <cstdio>
#include <cstdlib>

namespace moe::metrics {
namespace {

// Every moe_ metric, once: the services register them by name (service_metrics.cc,
// process_collector.cc) and take their HELP from here; docs/metrics.md is generated from here
// (`moe-tool metrics`), and tests/metrics/prometheus_test.py checks a live cluster's /metrics
// against that page (names, types, labels). Grouped as the page shows them: every service,
// attention-svc, the budget, the wire, the data plane, expert-svc, router-svc.
constexpr MetricInfo kMetrics[] = {
    {"moe_build_info", "gauge", "service, version, allocator",
     "Always 1; the labels say which build and service this is",
     "always 1; `allocator` is the memory allocator the process runs "
     "(`services/common/allocator.h`)",
     "", ""},
    {"moe_errors_total", "counter", "service, method, code",
     "Requests answered with an error, by service, method and status code",
     "requests answered with an error, by gRPC status code name", "nv_inference_request_failure",
     ""},
    {"moe_requests_succeeded_total", "counter", "service, method",
     "Requests (batches on expert-svc) answered OK, by method",
     "requests answered OK (expert-svc: Dispatch batches)", "nv_inference_request_success", ""},
    {"moe_requests_in_flight", "gauge", "service, method",
     "Requests (batches on expert-svc) being computed now, by method",
     "requests being computed now (expert-svc: the batch on the compute thread)", "",
     "requests running (`service=\"attention-svc\"`)"},
    {"moe_hedges_total", "counter", "shard, winner",
     "Expert messages also sent to another replica because theirs had not answered "
     "after --hedge_share of the time to the deadline, by the slow replica and which "
     "answered first (winner: twin, original)",
     "messages also sent to another replica because theirs had not answered after "
     "`--hedge_share` of the time to the deadline, by the slow replica; `winner` "
     "twin or original",
     "", ""},
    {"moe_degraded_pairs_total", "counter", "layer",
     "Routed token-expert pairs skipped by DEGRADE requests (the expert had no "
     "healthy replica)",
     "routed (token, expert) pairs that DEGRADE requests skipped because the expert "
     "had no healthy replica, or none answered after dispatch",
     "", ""},
    {"moe_failovers_total", "counter", "shard",
     "Expert messages sent again because their replica answered UNAVAILABLE (to "
     "another replica, or once more to the same when none is left), by the replica "
     "that failed",
     "expert messages sent again because this replica answered UNAVAILABLE: to "
     "another replica of the range, or once more to it when none is left "
     "(attention-svc)",
     "", ""},
    {"moe_queue_depth", "gauge", "service", "Requests (batches on expert-svc) waiting for a worker",
     "requests waiting for a worker (attention-svc), batches waiting for the compute "
     "thread (expert-svc)",
     "nv_inference_pending_request_count", "requests queued (`service=\"attention-svc\"`)"},
    {"moe_forward_duration_seconds", "histogram", "layer",
     "Forward latency inside attention-svc (successful batches)",
     "Forward latency inside attention-svc (successful batches)",
     "nv_inference_request_duration_us", "",
     "Triton: a cumulative microsecond counter; here `_sum` in seconds, x 1e6"},
    {"moe_dispatch_duration_seconds", "histogram", "layer",
     "From the first dispatch sent to the last expert reply, per batch",
     "first dispatch sent to last expert reply, per batch", "", ""},
    {"moe_combine_duration_seconds", "histogram", "layer",
     "Gather + weighted combine of the expert outputs, per batch",
     "gather + weighted combine of expert outputs", "", ""},
    {"moe_forward_tokens_total", "counter", "layer",
     "Tokens served by Forward (successful batches)", "tokens served by Forward",
     "nv_inference_count", "",
     "inferences: tokens; `nv_inference_exec_count`, the batches, is "
     "`moe_requests_succeeded_total`"},
    {"moe_expert_tokens_total", "counter", "layer, expert",
     "Routed token-expert pairs per expert (E series per layer; "
     "--per_expert_metrics=false turns them off)",
     "routed (token, expert) pairs per expert; E series per layer, "
     "`--per_expert_metrics=false` turns them off",
     "", ""},
    {"moe_shard_tokens_total", "counter", "layer, shard",
     "Routed token-expert pairs dispatched to each expert shard",
     "routed pairs dispatched to each shard", "", ""},
    {"moe_attention_bias_version", "gauge", "layer",
     "The routing-bias version this attention node routes with",
     "the bias version an attention node routes with", "", ""},
    {"moe_budget_tokens_total", "counter", "layer, kind",
     "Dynamic k: tokens served and (token, expert) pairs computed, by layer (kind "
     "tokens|pairs; pairs / tokens is the mean experts per token, top-k without a "
     "budget)",
     "dynamic k: tokens served (`kind=\"tokens\"`) and (token, expert) pairs "
     "computed (`kind=\"pairs\"`); pairs / tokens is the mean experts per token "
     "([docs/math.md](math.md) 4.1)",
     "", ""},
    {"moe_auto_expert_budget", "gauge", "",
     "Dynamic k: the automatic mode's cap on this node's expert budgets (top-k: not "
     "limiting)",
     "dynamic k: the automatic mode's cap on this node's budgets (top-k: not "
     "limiting)",
     "", ""},
    {"moe_canary_ready", "gauge", "",
     "1 while the last readiness canary through the whole path matched the in-process "
     "reference, else 0",
     "the readiness canary (`--canary_interval_ms`): 1 while the last small fixed batch sent "
     "through the whole path (this node, the shards, back) matched the layer's reference "
     "computed in process within the layer tolerance's hard bound (8 bf16 ulps of each row's "
     "scale); the node is not ready at 0",
     "", ""},
    {"moe_canary_checks_total", "counter", "outcome",
     "Readiness canaries by outcome: match, mismatch, timeout, error, skipped, busy",
     "readiness canaries by outcome: `match`, `mismatch` (a wrong answer: a shard serving other "
     "weights), `timeout` (no answer within `--canary_timeout_ms`), `error` (the batch failed), "
     "`skipped` (the bias version moved during the canary), `busy` (it timed out queued behind "
     "requests the node answered meanwhile, none failing on the path: the readiness stays)",
     "", ""},
    {"moe_twin_audits_total", "counter", "outcome",
     "Twin audits (a sampled message also sent to another replica) by outcome",
     "twin audits (`--audit_share`: one message in that many also goes to another healthy "
     "replica of its range, when it has one, and the two replies are compared) by outcome: "
     "`agree` (bit-identical), `within_bound` (they differ, both within the expert FFN bound of "
     "the reference), `caught` "
     "(one outside it: that shard is quarantined), `unresolved` (neither within it, or no "
     "reference here: the message failed), `skipped` (the twin failed or was too slow)",
     "", ""},
    {"moe_quarantines_total", "counter", "shard",
     "Shards this node caught answering wrong bytes and stopped sending to",
     "shards this node caught answering wrong bytes in a twin audit (it stops sending to them "
     "and asks router-svc to quarantine them)",
     "", ""},
    {"moe_suspect_answers_total", "counter", "shard",
     "Answers of a quarantined shard served since its last passed audit",
     "answers of a shard caught by a twin audit that this node served since that shard's last "
     "passed audit (any of them may have been wrong)",
     "", ""},
    {"moe_budget_steps_total", "counter", "direction",
     "Dynamic k: steps of the automatic mode's cap, by direction",
     "dynamic k: the automatic mode's steps, `down` (overloaded) or `up`", "", ""},
    {"moe_budget_checks_total", "counter", "layer, outcome",
     "Dynamic k: sampled budgeted forwards recomputed at full k, by outcome "
     "(measured, dropped: queue full, skipped: bias changed, failed)",
     "dynamic k: sampled budgeted forwards recomputed at full k "
     "(`--budget_check_every`): `measured`, `dropped` (queue full), `skipped` (bias "
     "changed), `failed`",
     "", ""},
    {"moe_budget_routing_mass_kept", "histogram", "layer",
     "Dynamic k: the share of the full top-k routing weight the kept experts carry, "
     "per sampled budgeted forward (mean over its tokens)",
     "dynamic k: the share of the full top-k routing weight the kept experts carry, "
     "per sampled budgeted forward",
     "", ""},
    {"moe_budget_top1_agreement", "histogram", "layer",
     "Dynamic k: the share of a sampled budgeted forward's tokens whose top-1 under "
     "a fixed random projection (a stand-in LM head) is the full-k output's",
     "dynamic k: the share of a sampled budgeted forward's tokens whose top-1 under "
     "a fixed random projection (a stand-in LM head) matches the full-k output's",
     "", ""},
    {"moe_budget_output_rel_diff", "histogram", "layer",
     "Dynamic k: relative L2 difference of a sampled budgeted forward's output from "
     "the same request recomputed at full k",
     "dynamic k: relative L2 difference of a sampled budgeted output from the same "
     "request at full k: what the budget costs on this traffic",
     "", ""},
    {"moe_wire_bytes_total", "counter", "direction, dtype, peer, transport",
     "Tensor payload bytes crossing this service, by direction, dtype and peer",
     "tensor payload bytes (sent/received; bf16/f32/mxfp8; peer client, expert or "
     "attention; transport `grpc` in band or `ucx` out of band)",
     "", ""},
    {"moe_wire_tokens_total", "counter", "direction, dtype, peer, transport",
     "Tensor rows (tokens or token-expert pairs) crossing this service, by "
     "direction, dtype and peer",
     "tensor rows crossing the service", "", ""},
    {"moe_data_plane_events_total", "counter", "shard, event",
     "Out-of-band data plane events per expert shard: connected, fallback (a batch "
     "sent in band), transfer_failed, integrity_failed (a reply payload whose MAC "
     "did not match)",
     "attention-svc's data plane per shard: `connected` (OpenDataPlane and the "
     "backend's hello done: UCX or shm), `fallback` (a batch sent in band: the shard "
     "offers no data plane this node speaks, or the batch is larger than the shm rings "
     "take and no other backend is there), "
     "`transfer_failed` (a payload did not go out or come back), `integrity_failed` "
     "(a reply payload whose MAC did not match)",
     "", ""},
    {"moe_data_plane_lane_info", "gauge", "shard, kind, lanes, shard_lanes",
     "The lanes UCX selected for the out-of-band data plane to each shard, read from "
     "UCX (value 1): kind shm, tcp, rdma or mixed",
     "the lanes UCX really selected for the data plane to each shard (read from UCX "
     "on both ends; kind `shm`, `tcp`, `rdma`, `mixed`), value 1",
     "", ""},
    {"moe_expert_data_plane_events_total", "counter", "shard, event",
     "Out-of-band data plane events of this expert server: hello_rejected (every "
     "refused UCX hello: a wrong secret, an unknown client, or a malformed one "
     "without a reply endpoint, with data, empty or over 256 bytes), integrity_failed (a "
     "batch message or activation payload whose MAC did not match), message_rejected "
     "(a batch message of no bound client, not a frame, or too long), replayed (a "
     "batch message whose sequence was used): all dropped unanswered; reply_failed "
     "(an answer that did not go out)",
     "expert-svc's data plane: `hello_rejected` (every refused UCX hello: a wrong "
     "secret, an unknown client, or a malformed one without a reply endpoint, with "
     "data, empty or over 256 bytes), `integrity_failed` (a batch message or payload "
     "whose MAC did not match), `message_rejected` (a batch message of no bound "
     "client, not a frame, or too long), `replayed` (a batch message whose sequence "
     "was used), `reply_failed` (an answer that did not go out); all but the last "
     "dropped unanswered",
     "", ""},
    {"moe_ucx_messages_dropped_total", "counter", "kind",
     "Active messages this process's UCX worker dropped: stray (an id nobody "
     "handles; UCX 1.13.1 would read its handler table out of bounds), hello (a "
     "malformed or refused hello), batch (a batch message nobody expects, or one its "
     "handler refused)",
     "both services: active messages the UCX worker dropped, `stray` (an id nobody "
     "handles), `hello` (a malformed or refused hello), `batch` (a batch message "
     "nobody expects, or refused)",
     "", ""},
    {"moe_expert_compute_duration_seconds", "histogram", "layer, shard",
     "Expert FFN time per dispatched batch", "expert FFN time per dispatched batch",
     "nv_inference_compute_infer_duration_us", "", "of an expert shard's batches; `_sum` x 1e6"},
    {"moe_expert_queue_duration_seconds", "histogram", "layer, shard",
     "Time a dispatched batch waited for the compute thread",
     "time a batch waited for the compute thread", "nv_inference_queue_duration_us", "",
     "of an expert shard's batches; `_sum` x 1e6"},
    {"moe_expert_rows_total", "counter", "layer, shard", "Token-expert rows computed by this shard",
     "(token, expert) rows computed", "", ""},
    {"moe_expert_busy_seconds_total", "counter", "shard",
     "Seconds the compute thread spent running expert batches", "compute-thread busy time", "", ""},
    {"moe_expert_busy_ratio", "gauge", "shard",
     "Fraction of the last 10 s the compute thread was busy", "busy fraction of the last 10 s", "",
     ""},
    {"moe_expert_weight_read_bytes_total", "counter", "shard",
     "MXFP4 weight bytes the expert batches streamed (each distinct expert of a "
     "batch once)",
     "MXFP4 weight bytes the batches streamed (each distinct expert of a batch once)", "", ""},
    {"moe_expert_flops_total", "counter", "shard",
     "Floating-point operations of the expert FFNs (2 per multiply-add)",
     "floating-point operations of the expert FFNs (2 per multiply-add)", "", ""},
    {"moe_expert_machine_read_bandwidth_bytes_per_second", "gauge", "shard",
     "Streaming read bandwidth measured at start, all compute threads (0: not "
     "measured)",
     "this machine's streaming read bandwidth, measured at start on the compute "
     "threads (`--measure_limits`)",
     "", ""},
    {"moe_expert_machine_fma_peak_flops_per_second", "gauge", "shard, isa",
     "fp32 multiply-add peak of the kernels' ISA measured at start, all compute "
     "threads",
     "the fp32 FMA peak of the kernels' ISA, measured at start", "", ""},
    {"moe_expert_weight_bandwidth_fraction", "gauge", "shard",
     "Weight bytes/s while computing, last 10 s with compute, over this machine's "
     "measured read bandwidth (absent before the first batch)",
     "weight bytes/s while computing (last 10 s with compute) over the measured read "
     "bandwidth; absent before the first batch",
     "", ""},
    {"moe_expert_fma_peak_fraction", "gauge", "shard",
     "FLOP/s while computing, last 10 s with compute, over this machine's measured "
     "fp32 FMA peak of the kernels' ISA (absent before the first batch)",
     "FLOP/s while computing (last 10 s with compute) over the measured FMA peak; "
     "absent before the first batch",
     "", ""},
    {"moe_expert_machine_limit_probes_total", "counter", "shard",
     "Measurements of the machine's limits: at start, then again while idle (the "
     "best is kept)",
     "measurements of the machine's limits: at start (best of 3 passes), then again "
     "after 10 s idle at most once a minute, the best kept",
     "", ""},
    {"moe_expert_verified_batches_total", "counter", "shard, result",
     "Sampled batches recomputed with the scalar reference, by result (match, "
     "mismatch, skipped, error)",
     "sampled batches recomputed with the scalar reference (`--verify_fraction`): "
     "`match`, `mismatch`, `skipped`, `error`",
     "", ""},
    {"moe_expert_kernel_info", "gauge", "shard, decode, prefill, panel_from, source",
     "The CPU kernel sets chosen by measurement (value 1): decode (row kernels), "
     "prefill (panel kernel) from panel_from tokens per expert, source: measured, "
     "cache or pinned",
     "the CPU kernel sets chosen by measurement (value 1): `decode` runs the row "
     "kernels, `prefill` the panel kernel from `panel_from` tokens per expert "
     "(`never`); `source` `measured`, `cache` or `pinned` (see docs/kernels.md)",
     "", ""},
    {"moe_expert_kernel_probe_flops_per_second", "gauge", "shard, set, kernel, tokens",
     "What each CPU kernel set did in the choice's probe at the served shape, by "
     "set, kernel (rows, panel) and tokens per expert",
     "what each kernel set (`rows` or `panel`) did at each token count in the probe "
     "the choice was made from (from the cache file when read)",
     "", ""},
    {"moe_expert_backend_info", "gauge", "shard, backend, fallback",
     "The backend this server's experts run on (value 1), and why not the one asked "
     "for: auto's fallback to the CPU (empty otherwise)",
     "the backend the experts run on (value 1), and why not the one asked for: "
     "`--backend=auto`'s fallback to the CPU (no usable GPU, one older than Ampere, "
     "or `CudaExperts::Create` refused), empty otherwise",
     "", ""},
    {"moe_imbalance_max_vio", "gauge", "layer",
     "MaxVio (max load / mean load - 1) over the current window",
     "MaxVio over router-svc's current window (NaN while empty)", "", ""},
    {"moe_window_tokens", "gauge", "layer", "Tokens in the current statistics window",
     "tokens in the current window", "", ""},
    {"moe_bias_version", "gauge", "layer", "Current routing-bias version (0: the checkpoint's)",
     "current bias version (0: checkpoint)", "", ""},
    {"moe_rebalances_total", "counter", "layer",
     "Quantile Balancing steps applied (button, RPC or continuous)",
     "QB steps applied (page, RPC or continuous)", "", ""},
    {"moe_balancedness", "gauge", "layer",
     "Mean / max tokens per expert shard over the current window, as vLLM's EPLB "
     "exports it (1: even)",
     "mean / max tokens per expert shard over the current window, as vLLM's EPLB "
     "exports it (1: even; NaN: empty window)",
     "", ""},
    {"moe_expert_budget", "gauge", "layer",
     "The layer's expert budget in its current version: experts per token on average "
     "(top-k: every token keeps its top-k; docs/math.md 4.1)",
     "dynamic k: the layer's expert budget in its current version (top-k: none)", "", ""},
    {"moe_budget_thresholds_stale", "gauge", "layer",
     "1 while the layer's budget thresholds were solved under a bias that has moved "
     "since (not applied; router-svc solves them again)",
     "dynamic k: 1 while the thresholds were solved under a bias that has moved "
     "since by more than `--budget_stale_bias` (not applied; solved again from the "
     "next window)",
     "", ""},
    {"moe_budget_window_floor", "gauge", "layer",
     "The kept-load MaxVio the sampling noise of the thresholds' window alone leaves "
     "at the layer's budget (docs/math.md, The window)",
     "dynamic k: the kept-load MaxVio the thresholds' window's sampling noise alone "
     "leaves at the layer's budget (flagged above `--budget_window_floor`)",
     "", ""},
    {"moe_stats_reports_total", "counter", "window",
     "Statistics reports from attention nodes, by whether they joined the current "
     "window (routed with the current bias) or were stale",
     "attention-node reports that joined the window (`current`) or were `stale`", "", ""},
    {"moe_expert_shards", "gauge", "health", "Registered expert shards, by health",
     "registered shards (`all`, `healthy`, `quarantined`: caught answering wrong bytes by a "
     "twin audit, out of the placement until an admin's ReleaseShard)",
     "", ""},
    {"moe_router_state_info", "gauge", "store, start",
     "Where the router's state lives (store: sqlite, etcd, memory) and how it began "
     "at this start (start: restored, initialized = a new cluster's state by "
     "--initialize, in_memory = lost on restart)",
     "the router's state (value 1): `store` sqlite, etcd or memory; `start` "
     "restored, initialized (a new state made by `--initialize`) or in_memory "
     "([docs/operations.md](operations.md))",
     "", ""},
    {"moe_router_state_initialized_timestamp_seconds", "gauge", "",
     "When the router's durable state was first made (--initialize), Unix seconds",
     "when the durable state was first made", "", ""},
};

}  // namespace

absl::Span<const MetricInfo> AllMetrics() { return kMetrics; }

const MetricInfo& Metric(absl::string_view name) {
  for (const MetricInfo& m : kMetrics) {
    if (m.name == name) return m;
  }
  // A metric registered without a row is a programming error every test that builds the
  // service's metrics finds.
  std::fprintf(stderr, "metric %.*s is not in services/metrics/metric_table.cc\n",
               static_cast<int>(name.size()), name.data());
  std::abort();
}

std::string HelpOf(absl::string_view name) { return std::string(Metric(name).help); }

}  // namespace moe::metrics
