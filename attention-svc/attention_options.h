// attention-svc's options: what the flags (main.cc) and the tests set, read by the core
// (attention_core.h) and the server that serves it (attention_server.h).
#ifndef MOE_ATTENTION_SVC_ATTENTION_OPTIONS_H_
#define MOE_ATTENTION_SVC_ATTENTION_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "attention-svc/dispatch_plan.h"
#include "services/dataplane/data_plane.h"
#include "services/numerics/cpu/cpu_isa.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/precision_mode.h"

namespace moe::attention_svc {

struct AttentionServerOptions {
  std::string checkpoint;  // dense weights and config; empty: synthetic (preset, seed, skew)
  std::string preset = "mid";
  uint64_t seed = 1;
  double router_skew = 0.0;
  std::vector<int64_t> layers;  // empty: the first MoE layer

  std::string host = "127.0.0.1";
  int port = 0;
  std::string port_file;  // written after the metrics port file
  int metrics_port = -1;  // Prometheus /metrics: -1 off, 0 any free port
  std::string metrics_port_file;
  // The Open Inference Protocol's REST/JSON front (oip_rest.h): -1 off, 0 any free port.
  int http_port = -1;
  std::string http_port_file;
  int64_t max_http_body_bytes = int64_t{256} << 20;
  bool per_expert_metrics = true;  // E series per layer of moe_expert_tokens_total
  std::string router;              // router-svc host:port (required)
  // The cluster token router-svc asks of members (router_server.h); the file wins.
  std::string cluster_token;
  std::string cluster_token_file;
  std::string node = "attention-0";

  // The reply mode of requests that do not name one (dispatch_plan.h).
  ReplyMode reply_mode = ReplyMode::kPerPair;
  // The routed experts' precision of requests that do not name one (W4A8: z goes out in MXFP8).
  numerics::Precision precision = numerics::Precision::kW4A16;
  int threads = 0;  // dense compute threads (0: the CPUs this process may use)
  numerics::cpu::KernelSets isa = numerics::cpu::DefaultKernelSets();
  int workers = 4;       // requests in progress at once (dense compute is serialized)
  int max_queued = 256;  // waiting requests beyond: RESOURCE_EXHAUSTED
  // Requests of one ForwardStream in progress or waiting at once; beyond: RESOURCE_EXHAUSTED for
  // that request (one client cannot fill the queue for everyone). Work of a stream the client
  // cancelled is skipped.
  int max_stream_in_flight = 16;
  // Replies of one ForwardStream waiting for a client that does not read; past this the client
  // is treated as gone (replies dropped, its queued work skipped).
  int64_t max_stream_outbox_bytes = int64_t{256} << 20;
  int64_t max_tokens = 16384;  // per request
  int64_t default_timeout_ms = 30000;
  int64_t report_interval_ms = 500;
  int qb_bins = 1000;
  int budget_bins = 512;  // dynamic k: bins of the score histograms reported for the thresholds
  // Dynamic k's automatic mode (budget_governor.h): while more than budget_auto_queue requests
  // wait for a worker (or the p99 forward latency of an interval passes budget_auto_p99_ms,
  // when > 0) the node's cap on the budget steps down one expert per budget_auto_interval_ms
  // toward budget_auto_floor, and back up after a few clear intervals. floor 0: off.
  int budget_auto_floor = 0;
  int64_t budget_auto_queue = 8;
  double budget_auto_p99_ms = 0;
  int64_t budget_auto_interval_ms = 250;
  // One in this many forwards served below the full top-k (of at most 2048 tokens) is
  // recomputed at full k off the hot path (at most budget_check_queue waiting; more are dropped
  // and counted) and the output's relative difference exported (moe_budget_output_rel_diff).
  // 0: never.
  int64_t budget_check_every = 64;
  int budget_check_queue = 2;
  int max_message_bytes = 256 << 20;
  // A shard's dispatch is split (at expert boundaries) so that no message or reply exceeds
  // about this many payload bytes (K3 batches of thousands of tokens would pass gRPC's limit).
  int64_t max_dispatch_bytes = 64 << 20;
  // A message whose replica has not answered after this share of the time to the expert
  // deadline is also sent to another healthy replica of its range; the first answer wins
  // (moe_hedges_total). 0: never. Without replicas it changes nothing.
  double hedge_share = 0.5;
  // Split each request into this many micro-batches along its tokens, two in flight: one is
  // routed, projected and run through the shared experts here while the shards compute the
  // other (MegaScale-Infer's ping-pong). 1: the whole request at once. Same results either way.
  int micro_batches = 1;
  // The payload path to the expert shards (docs/data-plane.md): auto uses UCX with every shard
  // that offers it and in-band gRPC with the rest; grpc always in band; a backend's name
  // (dataplane/registry.h: "ucx", "fake") that one or fail the batch.
  dataplane::DataPlane data_plane;
  std::string ucx_tls;    // empty: UCX_TLS from the environment
  int ucx_poll_us = 100;  // UcxOptions::poll_spin: a thread waiting for a shard's reply
  int ucx_poll_max_us = dataplane::kPollMaxUs;  // UcxOptions::poll_spin_max: its window's ceiling
  // Replies of at least this many bytes get their MAC after them
  // (ChannelOptions::detach_reply_tag_from); 0: never.
  int64_t ucx_detach_tag_from_bytes = dataplane::kDetachTagFromBytes;
  int ucx_progress_spin_us = 0;  // UcxOptions::spin: the progress thread after its last activity
  // The readiness canary (readiness_canary.h): every canary_interval_ms a 4-token batch through
  // the whole path, answered within canary_timeout_ms and within the layer tolerance's hard
  // bound of its in-process reference, or the node is not ready. 0: off (readiness is the
  // placement alone).
  int64_t canary_interval_ms = 10000;
  int64_t canary_timeout_ms = 3000;
  // Twin audits (twin_audit.h): one message in audit_share also goes to another healthy
  // replica of its range (when it has one), and the replies are compared; a shard whose reply is
  // outside the reference's bound is quarantined. 0: off. The reference needs the layer's
  // experts (views of the checkpoint; synthetic ones only up to 2 GiB).
  int64_t audit_share = 64;
};

}  // namespace moe::attention_svc

#endif  // MOE_ATTENTION_SVC_ATTENTION_OPTIONS_H_
