// The options of an expert server (expert_server.h): weights, range, ports, membership,
// backend, precision modes, bounds, data plane, production check. Plain data: the flags in
// main.cc fill it; ExpertCore and ExpertServer read it.
#ifndef MOE_EXPERT_SVC_EXPERT_OPTIONS_H_
#define MOE_EXPERT_SVC_EXPERT_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "expert-svc/expert_backend.h"
#include "services/dataplane/data_plane.h"
#include "services/numerics/cpu/cpu_isa.h"
#include "services/numerics/cpu/kernel_choice.h"
#include "services/numerics/precision_mode.h"

namespace moe::expert_svc {

struct ExpertServerOptions {
  // Weights: a checkpoint directory, or (when empty) a synthetic layer made in memory from
  // preset/seed/router_skew exactly as `moe-tool synth` writes it.
  std::string checkpoint;
  std::string preset = "mid";
  uint64_t seed = 1;
  double router_skew = 0.0;
  std::vector<int64_t> layers;  // empty: the first MoE layer
  int64_t expert_lo = 0;
  int64_t expert_hi = -1;  // -1: all experts
  // Or the range from a placement table (the Helm chart's ConfigMap) by this pod's ordinal
  // (services/placement: ordinal o serves ranges[o / replicas_per_range]). ordinal -1: the
  // trailing number of $HOSTNAME (StatefulSet).
  std::string ranges_file;
  int64_t ordinal = -1;

  std::string shard = "shard-0";
  std::string host = "127.0.0.1";
  int port = 0;
  std::string port_file;  // written once the port is known (after the metrics port file)
  int metrics_port = -1;  // Prometheus /metrics: -1 off, 0 any free port
  std::string metrics_port_file;
  // router-svc host:port; empty: do not register. advertise is the endpoint registered
  // (default host:port).
  std::string router;
  std::string advertise;
  // This shard's member token for router-svc (its own, naming it:
  // transport::ExpertMemberToken of the cluster secret and `shard`); the file wins.
  std::string cluster_token;
  std::string cluster_token_file;
  // Dispatch, OpenDataPlane and the UCX address are the attention nodes': the caller's token
  // must hash (SHA-256, hex) to this, so that this shard never holds a token that would let it
  // act as an attention node. The file wins. Neither this nor a cluster token: open
  // (development); a cluster token without it: Dispatch is closed.
  std::string attention_token_sha256;
  std::string attention_token_sha256_file;

  int threads = 0;  // compute threads (0: one per hardware thread)
  // Where the experts run: auto (CUDA when a GPU is usable, else CPU), cpu or cuda
  // (expert_backend.h).
  Backend backend = Backend::kAuto;
  // The CPU kernel sets: auto (measured, kernel_choice.h) or one (MOE_CPU_ISA's default).
  numerics::cpu::KernelSets isa = numerics::cpu::DefaultKernelSets();
  // The precision modes served, the first the default of batches that name none (empty:
  // every mode of the backend, W4A16 first). A mode the backend cannot compute fails the start.
  std::vector<numerics::Precision> precisions;
  // W4A8's h quantized to MXFP8 from the fp32 SiTU output (as deployed K3 stacks do), or via a
  // bf16 rounding first (--w4a8_h_via_bf16: this project's order before; docs/math.md 6).
  numerics::W4A8H w4a8_h = numerics::W4A8H::kFromFp32;
  int max_queued_batches = 256;       // beyond: RESOURCE_EXHAUSTED
  int max_message_bytes = 256 << 20;  // also the largest out-of-band payload
  // The out-of-band data plane (docs/data-plane.md): auto offers UCX when this build has it
  // (UCX_TLS picks the transports), grpc never, a backend's name (dataplane/registry.h: "ucx",
  // "fake") that one or fail at start. In-band batches are served in every mode.
  dataplane::DataPlane data_plane;
  std::string ucx_tls;    // empty: UCX_TLS from the environment
  int ucx_poll_us = 100;  // UcxOptions::poll_spin: the compute thread between batches
  // The compute thread's window's ceiling (services/common/poll_window.h).
  int ucx_poll_max_us = dataplane::kPollMaxUs;
  int ucx_progress_spin_us = 0;      // UcxOptions::spin: the progress thread after activity
  int max_data_plane_clients = 256;  // OpenDataPlane beyond: RESOURCE_EXHAUSTED
  // Take each batch as one data-plane message (OpenDataPlaneReply.batch_messages). False answers
  // like a UCX server of the previous release (the header on the Dispatch stream): the tests' way
  // to keep that protocol, which attention nodes still speak to such servers, checked. Not a flag.
  bool ucx_batch_messages = true;
  // The production check (batch_verifier.h): this fraction of the batches is recomputed off the
  // hot path with the scalar reference on independent weights (0: off).
  double verify_fraction = 1e-3;
  // Measure this machine's read bandwidth and FMA peak at start (about 0.4 s, CPU backend) and
  // export what the kernels achieve as fractions of them.
  bool measure_limits = true;
  // And again while idle (no batch for limits_idle_ms, at most every limits_every_ms), keeping
  // the best: a start-up probe that shared the machine with a busy neighbour is corrected.
  int64_t limits_idle_ms = 10000;
  int64_t limits_every_ms = 60000;
};

}  // namespace moe::expert_svc

#endif  // MOE_EXPERT_SVC_EXPERT_OPTIONS_H_
