// attention-svc: flags -> AttentionServerOptions -> start -> wait for SIGTERM/SIGINT.
#include <cstdio>

#include "attention-svc/attention_server.h"
#include "services/common/svc_main.h"

int main(int argc, char** argv) {
  moe::attention_svc::AttentionServerOptions o;
  moe::SvcFlags flags("attention-svc", "MoE layer entry point; routed experts remote.");
  flags.String("checkpoint", &o.checkpoint, "checkpoint directory (empty: synthetic in memory)");
  flags.String("preset", &o.preset, "synthetic preset when no checkpoint: k3|mid|tiny");
  flags.Uint64("seed", &o.seed, "synthetic seed");
  flags.Double("router_skew", &o.router_skew, "synthetic router skew");
  flags.IntList("layers", &o.layers, "MoE layers to host, comma-separated (empty: first)");
  flags.String("host", &o.host, "listen address");
  flags.Int("port", &o.port, "listen port (0: any free port)");
  flags.String("port_file", &o.port_file, "write the bound port here");
  flags.Int("metrics_port", &o.metrics_port, "Prometheus /metrics port (-1: off, 0: any)");
  flags.String("metrics_port_file", &o.metrics_port_file, "write the metrics port here");
  flags.Bool("per_expert_metrics", &o.per_expert_metrics, "export per-expert token counters");
  flags.String("router", &o.router, "router-svc host:port");
  flags.String("node", &o.node, "this node's name in statistics");
  flags.String("reply_mode", &o.reply_mode, "per_pair|partial_sum");
  flags.Int("threads", &o.threads, "dense compute threads (0: all cores)");
  flags.Custom("isa", moe::numerics::cpu::IsaName(o.isa),
               "cap the CPU kernels: scalar|avx2|avx512|avx512bf16", [&](const std::string& s) {
                 auto isa = moe::numerics::cpu::ParseIsa(s);
                 if (isa.ok()) o.isa = *isa;
                 return isa.ok();
               });
  flags.Int("workers", &o.workers, "requests in progress at once");
  flags.Int("max_queued", &o.max_queued, "waiting requests beyond: RESOURCE_EXHAUSTED");
  flags.Int64("max_tokens", &o.max_tokens, "tokens per request");
  flags.Int64("default_timeout_ms", &o.default_timeout_ms, "deadline when the caller has none");
  flags.Int64("report_interval_ms", &o.report_interval_ms, "statistics report period");
  flags.Int("qb_bins", &o.qb_bins, "QB histogram bins");
  flags.Int("max_message_bytes", &o.max_message_bytes, "gRPC message limit");
  flags.Int64("max_dispatch_bytes", &o.max_dispatch_bytes,
              "split a shard's dispatch (at expert boundaries) above this many bytes");
  if (!flags.Parse(argc, argv)) return 2;
  return moe::RunServer("attention-svc",
                        [&]() { return moe::attention_svc::AttentionServer::Start(o); });
}
