// expert-svc: flags -> ExpertServerOptions -> start -> wait for SIGTERM/SIGINT.
#include <cstdio>

#include "expert-svc/dataplane/registry.h"
#include "expert-svc/dispatch_batch.h"
#include "expert-svc/expert_server.h"
#include "services/common/status_macros.h"
#include "services/common/svc_main.h"
#include "services/transport/security.h"

int main(int argc, char** argv) {
  moe::expert_svc::ExpertServerOptions o;
  moe::SvcFlags flags("expert-svc", "Serves the routed experts of an expert range over gRPC.");
  moe::AddWeightFlags(flags, &o);
  flags.Int64("expert_lo", &o.expert_lo, "first hosted expert");
  flags.Int64("expert_hi", &o.expert_hi, "one past the last hosted expert (-1: all)");
  flags.String("ranges_file", &o.ranges_file,
               "placement table (JSON); the range comes from this pod's ordinal");
  flags.Int64("ordinal", &o.ordinal, "with --ranges_file: -1 reads it from $HOSTNAME");
  flags.String("shard", &o.shard, "shard name (unique in the cluster)");
  moe::AddServingFlags(flags, &o);
  flags.String("router", &o.router, "router-svc host:port to register with (empty: none)");
  flags.String("cluster_token_file", &o.cluster_token_file,
               "file holding this shard's member token for router-svc (chmod 600)");
  flags.String("attention_token_sha256_file", &o.attention_token_sha256_file,
               "file holding the SHA-256 (hex) of the attention nodes' token: Dispatch needs it");
  flags.String("advertise", &o.advertise, "endpoint to register (default: host:port)");
  flags.Int("threads", &o.threads,
            "compute threads (0: the CPUs this process may use: its affinity and cgroup quota)");
  flags.Enum("backend", &o.backend, moe::expert_svc::kBackends,
             "where the experts run (echo: no compute, each row answered with its activations, "
             "to measure the data plane alone)");
  flags.Typed("isa", &o.isa, moe::numerics::cpu::KernelSetsName,
              moe::numerics::cpu::ParseKernelSets,
              "CPU kernel sets: auto (the fastest measured on this CPU, cached per CPU model: "
              "MOE_KERNEL_CACHE) or one of scalar|avx2|avx512|avx512bf16|avx512amx");
  flags.Typed("precision", &o.precisions, moe::expert_svc::PrecisionList,
              moe::expert_svc::ParsePrecisionList,
              "precision modes served, comma-separated, the first the default of batches that "
              "name none: w4a16, w4a8, w4a16,w4a8 (default: every mode of the backend)");
  bool w4a8_h_via_bf16 = false;
  flags.Bool("w4a8_h_via_bf16", &w4a8_h_via_bf16,
             "W4A8: round h to bf16 before MXFP8 (this project's order before; the default "
             "quantizes the fp32 SiTU output as deployed K3 stacks do, docs/math.md section 6)");
  flags.Int("max_queued_batches", &o.max_queued_batches, "queue bound");
  flags.Int("max_message_bytes", &o.max_message_bytes,
            "gRPC message limit, and the largest out-of-band payload");
  flags.Typed(
      "data_plane", &o.data_plane, moe::dataplane::DataPlaneName,
      [](const std::string& name) {
        return moe::dataplane::ParseDataPlane(name, moe::expert_svc::ServerBackendNames());
      },
      "auto|grpc|ucx|fake|shm: offer an out-of-band data plane (auto: UCX when built with it, "
      "and shm; shm: memfd rings for attention nodes on this host; fake: an in-process wire, "
      "for tests; expert-svc/dataplane/registry.h)");
  flags.String("ucx_tls", &o.ucx_tls, "UCX transports (UCX_TLS syntax; empty: $UCX_TLS)");
  flags.Int("ucx_poll_us", &o.ucx_poll_us,
            "after a batch the compute thread polls the UCX data plane this long for the next one "
            "(0: it sleeps at once; docs/data-plane.md)");
  flags.Int("ucx_poll_max_us", &o.ucx_poll_max_us,
            "...and up to this long where the recent batches came that soon after the last (3 in "
            "4 of the last 16: the window covers the longest of those; never below "
            "--ucx_poll_us; docs/data-plane.md)");
  flags.Int("ucx_progress_spin_us", &o.ucx_progress_spin_us,
            "the UCX progress thread keeps polling this long after its last activity before it "
            "sleeps (0: at once; at most 10000): worth it where the data plane has a core to "
            "itself (docs/data-plane.md)");
  flags.Int("max_data_plane_clients", &o.max_data_plane_clients,
            "attention nodes with an open UCX data plane at once");
  flags.Double(
      "verify_fraction", &o.verify_fraction,
      "fraction of batches recomputed with the scalar reference off the hot path (0: off)");
  flags.Bool("measure_limits", &o.measure_limits,
             "measure read bandwidth and FMA peak at start (CPU backend, about 0.4 s)");
  moe::transport::TlsOptions tls;
  moe::AddTlsFlags(flags, &tls);
  if (int rc = flags.Parse(argc, argv); rc >= 0) return rc;
  if (w4a8_h_via_bf16) o.w4a8_h = moe::numerics::W4A8H::kViaBf16;
  return moe::RunServer(
      "expert-svc", [&]() -> absl::StatusOr<std::unique_ptr<moe::expert_svc::ExpertServer>> {
        MOE_RETURN_IF_ERROR(moe::transport::ConfigureProcessTls(tls, /*server=*/true));
        return moe::expert_svc::ExpertServer::Start(o);
      });
}
