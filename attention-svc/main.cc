// attention-svc: flags -> AttentionServerOptions -> start -> wait for SIGTERM/SIGINT.
#include <cstdio>

#include "attention-svc/attention_server.h"
#include "attention-svc/dataplane/registry.h"
#include "services/common/status_macros.h"
#include "services/common/svc_main.h"
#include "services/numerics/precision.h"
#include "services/transport/security.h"

namespace {

// Where expert payloads travel (docs/data-plane.md).
void AddDataPlaneFlags(moe::SvcFlags& flags, moe::attention_svc::AttentionServerOptions* o) {
  flags.Typed(
      "data_plane", &o->data_plane, moe::dataplane::DataPlaneName,
      [](const std::string& name) {
        return moe::dataplane::ParseDataPlane(name, moe::attention_svc::ClientBackendNames());
      },
      "auto|grpc|ucx|fake|shm: expert payloads on shm to shards on this host that offer it, "
      "else on UCX where the shard offers it, else in band (auto); never out of band (grpc); or "
      "always on the named backend (shm: memfd rings to shards on this host; fake: shards in "
      "this process only; attention-svc/dataplane/registry.h)");
  flags.Int("micro_batches", &o->micro_batches,
            "split each request into this many micro-batches, two in flight (1: off)");
  flags.String("ucx_tls", &o->ucx_tls, "UCX transports (UCX_TLS syntax; empty: $UCX_TLS)");
  flags.Int("ucx_poll_us", &o->ucx_poll_us,
            "a thread waiting for a shard's UCX reply polls for it this long before it sleeps "
            "(0: it sleeps at once; docs/data-plane.md)");
  flags.Int("ucx_poll_max_us", &o->ucx_poll_max_us,
            "...and up to this long where its recent replies came that soon (3 in 4 of the last "
            "16: the window covers the longest of those; never below --ucx_poll_us; "
            "docs/data-plane.md)");
  flags.Int64("ucx_detach_tag_from_bytes", &o->ucx_detach_tag_from_bytes,
              "a reply of at least this many bytes asks for its MAC in a message after it, so "
              "that the shard and this node hash it at once (shards that offer it; 0: never; "
              "docs/data-plane.md)");
  flags.Int("ucx_progress_spin_us", &o->ucx_progress_spin_us,
            "the UCX progress thread keeps polling this long after its last activity before it "
            "sleeps (0: at once; at most 10000): worth it where the data plane has a core to "
            "itself (docs/data-plane.md)");
}

}  // namespace

int main(int argc, char** argv) {
  moe::attention_svc::AttentionServerOptions o;
  moe::SvcFlags flags("attention-svc", "MoE layer entry point; routed experts remote.");
  moe::AddWeightFlags(flags, &o);
  moe::AddServingFlags(flags, &o);
  flags.Bool("per_expert_metrics", &o.per_expert_metrics, "export per-expert token counters");
  flags.String("router", &o.router, "router-svc host:port");
  flags.String("cluster_token_file", &o.cluster_token_file,
               "file holding the cluster token router-svc asks of its members (chmod 600)");
  flags.String("node", &o.node, "this node's name in statistics");
  flags.Enum("reply_mode", &o.reply_mode, moe::attention_svc::kReplyModes,
             "the default reply mode of the expert shards");
  flags.Enum("precision", &o.precision, moe::numerics::kPrecisions,
             "the routed experts' precision of requests that name none (w4a8 sends z in MXFP8)");
  flags.Int(
      "threads", &o.threads,
      "dense compute threads (0: the CPUs this process may use: its affinity and cgroup quota)");
  flags.Typed("isa", &o.isa, moe::numerics::cpu::KernelSetsName,
              moe::numerics::cpu::ParseKernelSets,
              "CPU kernel sets: auto (the fastest measured on this CPU, cached per CPU model: "
              "MOE_KERNEL_CACHE) or one of scalar|avx2|avx512|avx512bf16|avx512amx");
  flags.Int("workers", &o.workers, "requests in progress at once");
  flags.Int("max_queued", &o.max_queued, "waiting requests beyond: RESOURCE_EXHAUSTED");
  flags.Int("max_stream_in_flight", &o.max_stream_in_flight,
            "requests of one ForwardStream in progress or waiting at once");
  flags.Int64("max_stream_outbox_bytes", &o.max_stream_outbox_bytes,
              "replies waiting for a ForwardStream client that does not read, at most");
  flags.Int64("max_tokens", &o.max_tokens, "tokens per request");
  flags.Int64("default_timeout_ms", &o.default_timeout_ms, "deadline when the caller has none");
  flags.Int64("report_interval_ms", &o.report_interval_ms, "statistics report period");
  flags.Int("qb_bins", &o.qb_bins, "QB histogram bins");
  flags.Int("http_port", &o.http_port,
            "the Open Inference Protocol's REST/JSON front (KServe v2 HTTP): -1 off, 0 any");
  flags.String("http_port_file", &o.http_port_file, "write the REST port here");
  flags.Int64("max_http_body_bytes", &o.max_http_body_bytes, "largest REST request body");
  flags.Int("budget_bins", &o.budget_bins,
            "dynamic k: bins of the per-expert score histograms reported for the thresholds");
  flags.Int("budget_auto_floor", &o.budget_auto_floor,
            "dynamic k: the automatic mode's lowest budget (0: off)");
  flags.Int64("budget_auto_queue", &o.budget_auto_queue,
              "dynamic k: overloaded when more requests than this wait for a worker");
  flags.Double(
      "budget_auto_p99_ms", &o.budget_auto_p99_ms,
      "dynamic k: overloaded when an interval's p99 forward latency passes this (0: unused)");
  flags.Int64("budget_auto_interval_ms", &o.budget_auto_interval_ms,
              "dynamic k: one automatic step decision per this many ms");
  flags.Int64("budget_check_every", &o.budget_check_every,
              "dynamic k: recompute one in this many budgeted forwards at full k (0: never)");
  flags.Int("budget_check_queue", &o.budget_check_queue,
            "dynamic k: sampled checks waiting at most (more are dropped)");
  flags.Int("max_message_bytes", &o.max_message_bytes, "gRPC message limit");
  flags.Int64("max_dispatch_bytes", &o.max_dispatch_bytes,
              "split a shard's dispatch (at expert boundaries) above this many bytes");
  flags.Double("hedge_share", &o.hedge_share,
               "send a message also to another replica when its own has not answered after this "
               "share of the time to the deadline (0: never)");
  AddDataPlaneFlags(flags, &o);
  flags.Int64("canary_interval_ms", &o.canary_interval_ms,
              "readiness canary: a 4-token batch through the whole path this often, compared "
              "with its in-process reference; ready only while it matches (0: off)");
  flags.Int64("canary_timeout_ms", &o.canary_timeout_ms,
              "readiness canary: an answer later than this is a failed canary");
  flags.Int64("audit_share", &o.audit_share,
              "twin audits: one message in this many also goes to another healthy replica "
              "of its range (when it has one); replies that differ are judged against the "
              "in-process reference and a shard outside its bound is quarantined (0: off)");
  moe::transport::TlsOptions tls;
  moe::AddTlsFlags(flags, &tls);
  if (int rc = flags.Parse(argc, argv); rc >= 0) return rc;
  return moe::RunServer(
      "attention-svc",
      [&]() -> absl::StatusOr<std::unique_ptr<moe::attention_svc::AttentionServer>> {
        // The REST front is plain HTTP: on a cluster that asked for TLS it would be the one
        // unencrypted door, so the two are refused together (terminate TLS in front of it).
        if (o.http_port >= 0 && tls.enabled()) {
          return absl::FailedPreconditionError(
              "--http_port (the REST front, plain HTTP) with TLS: the REST front has no TLS of "
              "its own; use the gRPC front, or terminate TLS in front of the REST port and "
              "start without the TLS flags");
        }
        MOE_RETURN_IF_ERROR(moe::transport::ConfigureProcessTls(tls, /*server=*/true));
        return moe::attention_svc::AttentionServer::Start(o);
      });
}
