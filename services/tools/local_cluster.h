// Starts a whole cluster as child processes on loopback: router-svc, N expert-svc shards and
// one attention-svc, each on a free port (port 0 + a port file), from one checkpoint. Used by
// the main job (`moe-cli cluster`), the multi-process tests and the cluster benchmark.
//
// Children get SIGTERM when this process dies (PR_SET_PDEATHSIG), log to work_dir/<name>.log,
// and are stopped with SIGTERM (then SIGKILL after a grace period) by Stop() or the destructor.
//
//   LocalClusterOptions o; o.checkpoint = "out/mid"; o.shard_ranges = {{0, 40}, {40, 128}};
//   MOE_ASSIGN_OR_RETURN(auto cluster, LocalCluster::Start(o));
//   client options: cluster->attention_endpoint(), cluster->router_endpoint()
#ifndef MOE_SERVICES_TOOLS_LOCAL_CLUSTER_H_
#define MOE_SERVICES_TOOLS_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/client/moe_client.h"
#include "services/transport/security.h"

namespace moe::tools {

struct LocalClusterOptions {
  // holds router-svc, expert-svc, attention-svc (default: the running binary's directory when
  // it holds them, e.g. an installed moe-cli's prefix, else the build tree's MOE_BIN_DIR)
  std::string bin_dir;
  std::string checkpoint;  // a checkpoint directory (config.json + weights)
  // Expert ranges [lo, hi) of the shards; empty: num_shards equal ranges over all experts.
  std::vector<std::pair<int64_t, int64_t>> shard_ranges;
  int num_shards = 2;
  // Port files, logs, tokens, the local CA (created); empty: a fresh temp dir under $TMPDIR,
  // removed by Stop() (give one to keep the logs).
  std::string work_dir;
  std::string reply_mode = "per_pair";
  std::string admin_token;  // empty: router-svc refuses admin calls
  // MoE layers every process serves (--layers of each service); empty: the checkpoint's first.
  std::vector<int64_t> layers;
  // Compute threads per process; 0: each shard the CPUs this process may use over the cluster's
  // processes, the attention node all of them.
  int threads = 0;
  std::vector<std::string> router_args, expert_args, attention_args;  // extra flags
  // Extra flags of shard i alone, after expert_args (a later flag wins: e.g. another
  // --checkpoint, a shard serving other weights in a test).
  std::map<int, std::vector<std::string>> shard_args;
  // router-svc keeps its state in <work_dir>/router.db (--state_db), made with --initialize when
  // the file does not exist yet at Start (never on RestartRouter): a router restart, or a new
  // `up` on the same work_dir, keeps the bias. Off: in memory. Ignored when router_args name a
  // --state_db or --etcd of their own.
  bool keep_router_state = true;
  // TLS for every process (--tls_* flags) and for this process's own calls to the cluster
  // (WaitReady; client_options()). "{name}" in cert_file and key_file becomes each process's
  // name (router-svc, attention-svc, shard-<i>; "client" for this process), so that with
  // mutual TLS each member presents its own identity (spiffe://<domain>/<role>/<name>).
  transport::TlsOptions tls;
  // Without tls: make a fresh CA and one certificate per process in <work_dir>/pki
  // (transport::MakeLocalPki: spiffe://moe/<role>/<name>, and "client" for this process and the
  // cluster's users) and run every process with mutual TLS on them, members bound to their
  // identities. What `moe-cli up` does unless told --insecure.
  bool local_pki = false;
  absl::Duration start_timeout = absl::Seconds(120);
  // Start returns once attention-svc is ready (placed on healthy shards and its readiness
  // canary matched); false: once every process is up (a cluster that cannot be ready, tested).
  bool wait_ready = true;
};

// Client options from a cluster's cluster.json (LocalCluster::DescribeJson, what `moe-cli up`
// writes): both endpoints, the admin token, and with TLS the CA and the client certificate.
// NOT_FOUND for an unreadable file, INVALID_ARGUMENT for one that is not such JSON.
absl::StatusOr<client::ClientOptions> ClusterClientOptions(const std::string& cluster_json);

// tls with "{name}" in its certificate and key paths replaced by name.
transport::TlsOptions ForProcess(transport::TlsOptions tls, const std::string& name);

class LocalCluster {
 public:
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const LocalClusterOptions& options);
  ~LocalCluster();

  std::string router_endpoint() const { return Endpoint(router_port_); }
  // Prometheus /metrics of each process and router-svc's load-balance page (host:port).
  std::string router_metrics() const { return Endpoint(router_.metrics_port); }
  std::string attention_metrics() const { return Endpoint(attention_.metrics_port); }
  std::string shard_metrics(int i) const { return Endpoint(shards_[i].metrics_port); }
  std::string web_endpoint() const { return Endpoint(web_port_); }
  // The whole cluster as JSON (endpoints, metrics endpoints, page, work dir, and with TLS the
  // CA and a client certificate and key: "tls": {"ca_file", "cert_file", "key_file"}).
  std::string DescribeJson() const;
  std::string attention_endpoint() const { return Endpoint(attention_port_); }
  // The Open Inference Protocol's REST front of attention-svc (--http_port).
  std::string attention_http_endpoint() const { return Endpoint(attention_http_port_); }
  std::string shard_endpoint(int i) const { return Endpoint(shards_[i].port); }
  std::string shard_name(int i) const { return shards_[i].name; }
  int num_shards() const { return static_cast<int>(shards_.size()); }
  const std::string& work_dir() const { return options_.work_dir; }
  // Client options for this cluster: both endpoints and its TLS.
  client::ClientOptions client_options() const;

  // Sends a signal to shard i (SIGKILL to crash it, SIGSTOP/SIGCONT to stall it).
  absl::Status SignalShard(int i, int sig);
  // Starts shard i again (after a kill), on a new free port, and waits for its port file;
  // more_args are added to its flags from now on (a later flag wins: e.g. another --checkpoint).
  absl::Status RestartShard(int i, const std::vector<std::string>& more_args = {});
  // SIGTERM to shard i (a graceful stop, as a rolling restart does), SIGKILL after `grace`;
  // waits for it, so that RestartShard can start it again.
  absl::Status StopShard(int i, absl::Duration grace = absl::Seconds(10));
  // The same for router-svc, on its old port (the members know it by that).
  absl::Status SignalRouter(int sig);
  absl::Status RestartRouter();
  // And attention-svc, on its old port (the clients know it by that).
  absl::Status SignalAttention(int sig);
  absl::Status RestartAttention();
  // pids of every running child, by name (router-svc, attention-svc, shard-N): for sampling.
  std::vector<std::pair<std::string, pid_t>> Processes() const;
  // Waits until attention-svc reports SERVING (every expert has a healthy shard).
  absl::Status WaitReady(absl::Duration timeout);
  // SIGTERM to every child, SIGKILL after `grace`; waits for all; removes a work dir it made.
  // Idempotent.
  void Stop(absl::Duration grace = absl::Seconds(10));

 private:
  struct Child {
    std::string name;
    pid_t pid = -1;
    int port = 0;
    int metrics_port = 0;
    std::vector<std::string> args;
    int launches = 0;  // its log starts empty at the first, restarts append
  };
  LocalCluster() = default;
  static std::string Endpoint(int port) { return "127.0.0.1:" + std::to_string(port); }
  absl::Status Launch(Child* c, absl::Duration timeout);
  absl::Status Signal(Child* c, int sig);
  absl::Status RestartOnItsPort(Child* c, int port);

  LocalClusterOptions options_;
  bool made_work_dir_ = false;
  Child router_;
  std::vector<Child> shards_;
  Child attention_;
  int router_port_ = 0, attention_port_ = 0, web_port_ = 0, attention_http_port_ = 0;
  bool stopped_ = false;
};

}  // namespace moe::tools

#endif  // MOE_SERVICES_TOOLS_LOCAL_CLUSTER_H_
