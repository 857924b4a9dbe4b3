// What every service main() shares: the serving and weight flags (flags.h), and RunServer, which
// starts a server, waits for SIGINT/SIGTERM and shuts it down cleanly. Flags live only in
// main.cc files (STYLE.md "Configuration").
//
//   SvcFlags flags("expert-svc", "Serves experts.");
//   AddServingFlags(flags, &o);
//   if (int rc = flags.Parse(argc, argv); rc >= 0) return rc;
//   return RunServer("expert-svc", [&] { return ExpertServer::Start(o); });
#ifndef MOE_SERVICES_COMMON_SVC_MAIN_H_
#define MOE_SERVICES_COMMON_SVC_MAIN_H_

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/common/allocator.h"
#include "services/common/cpus.h"
#include "services/common/flags.h"
#include "services/common/logging.h"

namespace moe {

// The flags every server has: where it listens and where it writes its ports (Options fields
// host, port, port_file, metrics_port, metrics_port_file).
template <typename Options>
void AddServingFlags(SvcFlags& flags, Options* o) {
  flags.String("host", &o->host, "listen address");
  flags.Int("port", &o->port, "listen port (0: any free port)");
  flags.String("port_file", &o->port_file, "write the bound port here");
  flags.Int("metrics_port", &o->metrics_port, "Prometheus /metrics port (-1: off, 0: any)");
  flags.String("metrics_port_file", &o->metrics_port_file, "write the metrics port here");
}

// The weights of a server that computes: a checkpoint, or a synthetic layer from preset, seed
// and router skew; the layers it hosts (Options fields checkpoint, preset, seed, router_skew,
// layers).
template <typename Options>
void AddWeightFlags(SvcFlags& flags, Options* o) {
  flags.String("checkpoint", &o->checkpoint, "checkpoint directory (empty: synthetic in memory)");
  flags.String("preset", &o->preset, "synthetic preset when no checkpoint: k3|mid|tiny");
  flags.Uint64("seed", &o->seed, "synthetic seed");
  flags.Double("router_skew", &o->router_skew, "synthetic router skew");
  flags.IntList("layers", &o->layers, "MoE layers to host, comma-separated (empty: first)");
}

// TLS of every gRPC channel and server of the process (transport/security.h TlsOptions fields;
// the files are watched, so a rotated certificate needs no restart).
template <typename Tls>
void AddTlsFlags(SvcFlags& flags, Tls* tls) {
  flags.String("tls_cert_file", &tls->cert_file, "this process's certificate chain (PEM)");
  flags.String("tls_key_file", &tls->key_file, "its private key (PEM, chmod 600)");
  flags.String("tls_ca_file", &tls->ca_file,
               "CA bundle that peers are verified against (PEM); empty: plaintext");
  flags.Bool("tls_require_client_cert", &tls->require_client_cert,
             "servers refuse clients without a certificate from the CA (mutual TLS)");
  flags.Int("tls_refresh_seconds", &tls->refresh_seconds,
            "how often the TLS files are checked for a new version");
  flags.String("tls_trust_domain", &tls->trust_domain,
               "members' certificates name spiffe://<this>/<expert|attention>/<name>");
  flags.Bool("tls_member_identity", &tls->member_identity,
             "with mutual TLS a member acts only as the identity its certificate names (false: "
             "one certificate shared by every member, all equal)");
}

// Blocks SIGINT and SIGTERM in every thread (call before starting any), then waits for one.
void BlockTerminationSignals();
int WaitForTerminationSignal();

// start() returns a server with Shutdown(). Prints one line when serving and one on exit.
template <typename StartFn>
int RunServer(const char* name, StartFn start) {
  BlockTerminationSignals();
  InitLogging(name);
  auto server = start();
  if (!server.ok()) {
    MOE_LOG_ERROR("cannot start: {}", server.status().ToString());
    return 1;
  }
  MOE_LOG_INFO("ready: serving on port {} (allocator: {}; CPUs: {})", (*server)->port(),
               AllocatorName(), ReadCpuBudget().Describe());
  const int sig = WaitForTerminationSignal();
  MOE_LOG_INFO("signal {}, shutting down", sig);
  (*server)->Shutdown();
  server->reset();
  MOE_LOG_INFO("stopped");
  return 0;
}

}  // namespace moe

#endif  // MOE_SERVICES_COMMON_SVC_MAIN_H_
