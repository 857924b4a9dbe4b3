#include "services/tools/local_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "services/checkpoint/checkpoint.h"
#include "services/client/moe_client.h"
#include "services/common/cpus.h"
#include "services/common/logging.h"
#include "services/common/secret_file.h"
#include "services/common/status_macros.h"
#include "services/common/temp_dir.h"
#include "services/placement/placement.h"
#include "services/transport/local_pki.h"

#ifndef MOE_BIN_DIR
#define MOE_BIN_DIR ""
#endif

namespace moe::tools {

namespace {

// The services next to the running binary when they are there (an installed moe-cli runs its
// own prefix's), else the build tree's (MOE_BIN_DIR: the tests, which live elsewhere).
std::string DefaultBinDir() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::filesystem::path dir = self.parent_path();
    bool all = true;
    for (const char* b : {"router-svc", "expert-svc", "attention-svc"}) {
      all = all && std::filesystem::exists(dir / b, ec);
    }
    if (all) return dir.string();
  }
  return MOE_BIN_DIR;
}

std::string Tail(const std::string& path, size_t max_bytes = 2000) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  return s.size() > max_bytes ? s.substr(s.size() - max_bytes) : s;
}

}  // namespace

transport::TlsOptions ForProcess(transport::TlsOptions tls, const std::string& name) {
  for (std::string* path : {&tls.cert_file, &tls.key_file}) {
    const size_t at = path->find("{name}");
    if (at != std::string::npos) path->replace(at, 6, name);
  }
  return tls;
}

absl::Status LocalCluster::Launch(Child* c, absl::Duration timeout) {
  const std::string port_file = absl::StrCat(options_.work_dir, "/", c->name, ".port");
  const std::string metrics_file = absl::StrCat(options_.work_dir, "/", c->name, ".metrics_port");
  const std::string log_file = absl::StrCat(options_.work_dir, "/", c->name, ".log");
  ::unlink(port_file.c_str());
  ::unlink(metrics_file.c_str());
  std::vector<std::string> args = c->args;
  // Every service exports metrics on a free port; the port files come before the gRPC one.
  args.push_back("--metrics_port=0");
  args.push_back("--metrics_port_file=" + metrics_file);
  args.push_back("--port_file=" + port_file);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // A work dir kept across runs (moe-cli up's) gets each process's log afresh, not appended.
  const int log_flags = O_WRONLY | O_CREAT | (c->launches++ == 0 ? O_TRUNC : O_APPEND);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    // Its own process group: a terminal's Ctrl-C reaches only the launcher, which then stops
    // the children in order (attention first, router last).
    ::setpgid(0, 0);
    if (::getppid() != parent) ::_exit(1);
    const int fd = ::open(log_file.c_str(), log_flags, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
    }
    // Signals blocked by the launcher (sigwait) must not stay blocked in the child.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execv(argv[0], argv.data());
    std::fprintf(stderr, "exec %s failed\n", argv[0]);
    ::_exit(127);
  }
  c->pid = pid;
  const absl::Time until = absl::Now() + timeout;
  while (absl::Now() < until) {
    std::ifstream f(port_file);
    int port = 0;
    if (f >> port && port > 0) {
      c->port = port;
      std::ifstream m(metrics_file);
      if (!(m >> c->metrics_port)) c->metrics_port = 0;
      return absl::OkStatus();
    }
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      c->pid = -1;
      return absl::UnavailableError(absl::StrCat(c->name, " exited during start (status ", status,
                                                 "); log ", log_file, ":\n", Tail(log_file)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      c->name, " did not write its port within the start timeout; log:\n", Tail(log_file)));
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(
    const LocalClusterOptions& options) {
  std::unique_ptr<LocalCluster> c(new LocalCluster());
  c->options_ = options;
  LocalClusterOptions& o = c->options_;
  if (o.bin_dir.empty()) o.bin_dir = DefaultBinDir();
  if (o.work_dir.empty()) {
    MOE_ASSIGN_OR_RETURN(o.work_dir, MakeTempDir("moe-cluster"));
    c->made_work_dir_ = true;  // holds tokens and the local CA's key: removed by Stop()
  } else {
    ::mkdir(o.work_dir.c_str(), 0755);
  }
  MOE_ASSIGN_OR_RETURN(auto ckpt, checkpoint::Checkpoint::Open(o.checkpoint));
  MOE_ASSIGN_OR_RETURN(ModelConfig cfg, ckpt->LoadConfig());
  if (o.shard_ranges.empty()) {
    if (o.num_shards < 1 || o.num_shards > cfg.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("num_shards ", o.num_shards));
    }
    for (const placement::Range& r : placement::EvenSplit(cfg.num_experts, o.num_shards)) {
      o.shard_ranges.emplace_back(r.lo, r.hi);
    }
  }
  // Each shard's name (its certificate, token file, table entry and log): shard-<i>.
  std::vector<std::string> shard_names;
  for (size_t i = 0; i < o.shard_ranges.size(); ++i) {
    shard_names.push_back(absl::StrCat("shard-", i));
  }
  if (o.local_pki && !o.tls.enabled()) {
    const std::string pki = o.work_dir + "/pki";
    std::vector<transport::PkiMember> members = {
        {"router-svc", "router"}, {"attention-svc", "attention"}, {"client", "client"}};
    for (const std::string& shard : shard_names) members.push_back({shard, "expert"});
    MOE_RETURN_IF_ERROR(transport::MakeLocalPki(pki, members, o.tls.trust_domain));
    o.tls.ca_file = pki + "/ca.pem";
    o.tls.cert_file = pki + "/{name}.pem";
    o.tls.key_file = pki + "/{name}.key";
    o.tls.require_client_cert = true;
    o.tls.member_identity = true;
  }
  // One host: the CPUs are shared by the shards and the attention node. Each shard gets its share
  // instead of sizing its pool to the whole machine (2 shards and an attention node on 2 CPUs ran
  // 6 compute threads; with 2 threads each a shard's one-token loop waited for threads of the
  // other processes). The attention node gets every CPU: its router, combine and up-projection
  // run while the shards wait for its next batch, on one thread they left the other cores idle
  // (docs/data-plane.md: T >= 16 6-10% more tokens/s on 2 CPUs, T = 1 unchanged): 0 passed on,
  // attention-svc sizes its pool to the CPUs it may use itself.
  const int shard_threads =
      o.threads > 0 ? o.threads
                    : std::max(1, UsableCpus() / static_cast<int>(o.shard_ranges.size() + 1));
  const std::string threads = absl::StrCat("--threads=", shard_threads);
  const std::string attention_threads = absl::StrCat("--threads=", std::max(0, o.threads));
  // Each process's TLS flags; "{name}" in the certificate and key paths becomes the process's
  // name (router-svc, attention-svc, shard-<i>), so that each presents its own identity.
  auto tls_for = [&o](const std::string& name) -> absl::StatusOr<std::vector<std::string>> {
    if (!o.tls.enabled()) return std::vector<std::string>{};
    const transport::TlsOptions t = ForProcess(o.tls, name);
    MOE_RETURN_IF_ERROR(transport::ValidateTlsOptions(t, /*server=*/true));
    return std::vector<std::string>{
        "--tls_cert_file=" + t.cert_file,
        "--tls_key_file=" + t.key_file,
        "--tls_ca_file=" + t.ca_file,
        absl::StrCat("--tls_require_client_cert=", t.require_client_cert ? "true" : "false"),
        absl::StrCat("--tls_refresh_seconds=", t.refresh_seconds),
        "--tls_trust_domain=" + t.trust_domain,
        absl::StrCat("--tls_member_identity=", t.member_identity ? "true" : "false")};
  };
  MOE_ASSIGN_OR_RETURN(const std::vector<std::string> tls, tls_for("router-svc"));
  c->router_.name = "router-svc";
  const std::string web_file = o.work_dir + "/router-svc.web_port";
  c->router_.args = {o.bin_dir + "/router-svc", "--checkpoint=" + o.checkpoint, "--web_port=0",
                     "--web_port_file=" + web_file};
  // Tokens go in files only this user can read, never on a command line. The cluster token
  // (membership) is made here, fresh for every cluster.
  if (!o.admin_token.empty()) {
    MOE_RETURN_IF_ERROR(WritePrivateFile(o.work_dir + "/admin_token", o.admin_token));
    c->router_.args.push_back("--admin_token_file=" + o.work_dir + "/admin_token");
  }
  // The cluster secret goes to router-svc only; each shard gets its own token
  // (transport::ExpertMemberToken: shard-<i>.token), the attention node its tier's
  // (transport::MemberRoleToken), shards the attention token's digest to check Dispatch with.
  MOE_ASSIGN_OR_RETURN(const std::string cluster_token, RandomSecret());
  MOE_RETURN_IF_ERROR(WritePrivateFile(o.work_dir + "/cluster_token", cluster_token));
  const std::string attention_token = transport::MemberRoleToken(cluster_token, "attention");
  for (const std::string& shard : shard_names) {
    MOE_RETURN_IF_ERROR(WritePrivateFile(absl::StrCat(o.work_dir, "/", shard, ".token"),
                                         transport::ExpertMemberToken(cluster_token, shard)));
  }
  MOE_RETURN_IF_ERROR(WritePrivateFile(o.work_dir + "/attention_token", attention_token));
  MOE_RETURN_IF_ERROR(WritePrivateFile(o.work_dir + "/attention_token.sha256",
                                       transport::MemberTokenDigest(attention_token)));
  c->router_.args.push_back("--cluster_token_file=" + o.work_dir + "/cluster_token");
  const std::string layers =
      o.layers.empty() ? std::string() : "--layers=" + absl::StrJoin(o.layers, ",");
  if (!layers.empty()) c->router_.args.push_back(layers);
  c->router_.args.insert(c->router_.args.end(), tls.begin(), tls.end());
  c->router_.args.insert(c->router_.args.end(), o.router_args.begin(), o.router_args.end());
  const bool own_store = std::any_of(o.router_args.begin(), o.router_args.end(), [](const auto& a) {
    return absl::StartsWith(a, "--state_db") || absl::StartsWith(a, "--etcd");
  });
  bool first_start = false;
  if (o.keep_router_state && !own_store) {
    const std::string db = o.work_dir + "/router.db";
    c->router_.args.push_back("--state_db=" + db);
    first_start = ::access(db.c_str(), F_OK) != 0;
  }
  // The deployment's placement: each shard name with the range it may register.
  {
    nlohmann::json shards = nlohmann::json::object();
    for (size_t i = 0; i < o.shard_ranges.size(); ++i) {
      shards[shard_names[i]] = {o.shard_ranges[i].first, o.shard_ranges[i].second};
    }
    const std::string ranges_file = o.work_dir + "/ranges.json";
    MOE_RETURN_IF_ERROR(WritePrivateFile(ranges_file, nlohmann::json{{"shards", shards}}.dump()));
    c->router_.args.push_back("--ranges_file=" + ranges_file);
  }
  if (first_start) c->router_.args.push_back("--initialize");
  MOE_RETURN_IF_ERROR(c->Launch(&c->router_, o.start_timeout));
  // A restart never initializes: a lost state is an error then, not a new cluster.
  if (first_start) c->router_.args.pop_back();
  c->router_port_ = c->router_.port;
  {
    std::ifstream w(web_file);
    if (!(w >> c->web_port_)) c->web_port_ = 0;
  }
  const std::string router = "--router=" + c->router_endpoint();
  for (size_t i = 0; i < o.shard_ranges.size(); ++i) {
    Child s;
    s.name = shard_names[i];
    s.args = {o.bin_dir + "/expert-svc",
              "--checkpoint=" + o.checkpoint,
              absl::StrCat("--expert_lo=", o.shard_ranges[i].first),
              absl::StrCat("--expert_hi=", o.shard_ranges[i].second),
              "--shard=" + s.name,
              router,
              absl::StrCat("--cluster_token_file=", o.work_dir, "/", s.name, ".token"),
              "--attention_token_sha256_file=" + o.work_dir + "/attention_token.sha256",
              threads};
    if (!layers.empty()) s.args.push_back(layers);
    MOE_ASSIGN_OR_RETURN(const std::vector<std::string> shard_tls, tls_for(s.name));
    s.args.insert(s.args.end(), shard_tls.begin(), shard_tls.end());
    s.args.insert(s.args.end(), o.expert_args.begin(), o.expert_args.end());
    if (auto own = o.shard_args.find(static_cast<int>(i)); own != o.shard_args.end()) {
      s.args.insert(s.args.end(), own->second.begin(), own->second.end());
    }
    c->shards_.push_back(std::move(s));
  }
  for (Child& s : c->shards_) MOE_RETURN_IF_ERROR(c->Launch(&s, o.start_timeout));
  c->attention_.name = "attention-svc";
  const std::string http_file = o.work_dir + "/attention-svc.http_port";
  ::unlink(http_file.c_str());
  c->attention_.args = {o.bin_dir + "/attention-svc",
                        "--checkpoint=" + o.checkpoint,
                        router,
                        "--cluster_token_file=" + o.work_dir + "/attention_token",
                        "--reply_mode=" + o.reply_mode,
                        attention_threads};
  if (!layers.empty()) c->attention_.args.push_back(layers);
  if (!o.tls.enabled()) {  // the REST front is plain HTTP: not on a TLS cluster
    c->attention_.args.push_back("--http_port=0");
    c->attention_.args.push_back("--http_port_file=" + http_file);
  }
  MOE_ASSIGN_OR_RETURN(const std::vector<std::string> attention_tls, tls_for("attention-svc"));
  c->attention_.args.insert(c->attention_.args.end(), attention_tls.begin(), attention_tls.end());
  c->attention_.args.insert(c->attention_.args.end(), o.attention_args.begin(),
                            o.attention_args.end());
  MOE_RETURN_IF_ERROR(c->Launch(&c->attention_, o.start_timeout));
  c->attention_port_ = c->attention_.port;
  {  // written before the gRPC port file, which Launch waited for
    std::ifstream h(http_file);
    if (!(h >> c->attention_http_port_)) c->attention_http_port_ = 0;
  }
  if (o.wait_ready) MOE_RETURN_IF_ERROR(c->WaitReady(o.start_timeout));
  return c;
}

client::ClientOptions LocalCluster::client_options() const {
  client::ClientOptions co;
  co.attention = attention_endpoint();
  co.router = router_endpoint();
  co.tls = ForProcess(options_.tls, "client");
  return co;
}

absl::Status LocalCluster::WaitReady(absl::Duration timeout) {
  client::ClientOptions co = client_options();
  co.router.clear();
  co.timeout = absl::Seconds(2);
  MOE_ASSIGN_OR_RETURN(auto client, client::MoeClient::Create(co));
  const absl::Time until = absl::Now() + timeout;
  absl::Status last;
  while (absl::Now() < until) {
    absl::StatusOr<bool> serving = client->AttentionServing();
    if (serving.ok() && *serving) return absl::OkStatus();
    last = serving.ok() ? absl::UnavailableError("NOT_SERVING") : serving.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("attention-svc not SERVING (placement incomplete, or its readiness canary "
                   "failing: see its log): ",
                   last.ToString()));
}

absl::Status LocalCluster::SignalShard(int i, int sig) {
  if (i < 0 || i >= num_shards() || shards_[i].pid <= 0) {
    return absl::NotFoundError(absl::StrCat("no running shard ", i));
  }
  return Signal(&shards_[i], sig);
}

absl::Status LocalCluster::SignalRouter(int sig) {
  if (router_.pid <= 0) return absl::NotFoundError("router-svc is not running");
  return Signal(&router_, sig);
}

absl::Status LocalCluster::RestartRouter() {
  // The same port: every member was started with --router=<it>.
  MOE_RETURN_IF_ERROR(RestartOnItsPort(&router_, router_port_));
  std::ifstream w(options_.work_dir + "/router-svc.web_port");
  if (!(w >> web_port_)) web_port_ = 0;
  return absl::OkStatus();
}

std::vector<std::pair<std::string, pid_t>> LocalCluster::Processes() const {
  std::vector<std::pair<std::string, pid_t>> out;
  for (const Child* c : {&router_, &attention_}) {
    if (c->pid > 0) out.emplace_back(c->name, c->pid);
  }
  for (const Child& s : shards_) {
    if (s.pid > 0) out.emplace_back(s.name, s.pid);
  }
  return out;
}

absl::Status LocalCluster::SignalAttention(int sig) {
  if (attention_.pid <= 0) return absl::NotFoundError("attention-svc is not running");
  return Signal(&attention_, sig);
}

absl::Status LocalCluster::RestartAttention() {
  // The same port: clients know it by that.
  return RestartOnItsPort(&attention_, attention_port_);
}

absl::Status LocalCluster::RestartOnItsPort(Child* c, int port) {
  if (c->pid > 0) return absl::FailedPreconditionError(absl::StrCat(c->name, " is still running"));
  Child again = *c;
  again.args.push_back(absl::StrCat("--port=", port));
  MOE_RETURN_IF_ERROR(Launch(&again, options_.start_timeout));
  c->pid = again.pid;
  c->metrics_port = again.metrics_port;
  return absl::OkStatus();
}

absl::Status LocalCluster::Signal(Child* c, int sig) {
  const pid_t pid = c->pid;
  if (::kill(pid, sig) != 0) return absl::InternalError("kill failed");
  if (sig == SIGKILL) {
    ::waitpid(pid, nullptr, 0);
    c->pid = -1;
  }
  if (sig == SIGSTOP || sig == SIGCONT) {
    // Signals arrive asynchronously: wait (bounded) until /proc shows the new state, so the
    // caller's next step really meets a stopped (or running) process.
    const char want_stopped = sig == SIGSTOP;
    for (int tries = 0; tries < 400; ++tries) {
      std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
      std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      const size_t paren = stat.rfind(')');
      if (paren != std::string::npos && paren + 2 < stat.size()) {
        const bool stopped = stat[paren + 2] == 'T';
        if (stopped == static_cast<bool>(want_stopped)) return absl::OkStatus();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return absl::DeadlineExceededError(absl::StrCat(c->name, " did not change state"));
  }
  return absl::OkStatus();
}

absl::Status LocalCluster::StopShard(int i, absl::Duration grace) {
  if (i < 0 || i >= num_shards() || shards_[i].pid <= 0) {
    return absl::NotFoundError(absl::StrCat("no running shard ", i));
  }
  Child& c = shards_[i];
  ::kill(c.pid, SIGCONT);  // a stopped process cannot handle SIGTERM
  ::kill(c.pid, SIGTERM);
  const absl::Time until = absl::Now() + grace;
  while (::waitpid(c.pid, nullptr, WNOHANG) != c.pid) {
    if (absl::Now() > until) {
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, nullptr, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  c.pid = -1;
  return absl::OkStatus();
}

absl::Status LocalCluster::RestartShard(int i, const std::vector<std::string>& more_args) {
  if (i < 0 || i >= num_shards()) return absl::NotFoundError(absl::StrCat("no shard ", i));
  if (shards_[i].pid > 0) return absl::FailedPreconditionError("shard is still running");
  shards_[i].args.insert(shards_[i].args.end(), more_args.begin(), more_args.end());
  return Launch(&shards_[i], options_.start_timeout);
}

void LocalCluster::Stop(absl::Duration grace) {
  if (stopped_) return;
  stopped_ = true;
  std::vector<Child*> all = {&attention_};
  for (Child& s : shards_) all.push_back(&s);
  all.push_back(&router_);
  for (Child* c : all) {
    if (c->pid > 0) {
      ::kill(c->pid, SIGCONT);  // a stopped child cannot handle SIGTERM
      ::kill(c->pid, SIGTERM);
    }
  }
  const absl::Time until = absl::Now() + grace;
  for (Child* c : all) {
    while (c->pid > 0) {
      if (::waitpid(c->pid, nullptr, WNOHANG) == c->pid) {
        c->pid = -1;
      } else if (absl::Now() > until) {
        MOE_LOG_WARN("local cluster: {} did not stop in time, SIGKILL", c->name);
        ::kill(c->pid, SIGKILL);
        ::waitpid(c->pid, nullptr, 0);
        c->pid = -1;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }
  if (made_work_dir_) RemoveTree(options_.work_dir);
}

std::string LocalCluster::DescribeJson() const {
  nlohmann::json j;
  j["router"] = router_endpoint();
  j["router_metrics"] = router_metrics();
  j["web"] = web_endpoint();
  j["attention"] = attention_endpoint();
  j["attention_metrics"] = attention_metrics();
  j["attention_http"] = attention_http_endpoint();
  j["router_pid"] = router_.pid;
  j["attention_pid"] = attention_.pid;
  j["admin_token"] = options_.admin_token;
  j["work_dir"] = options_.work_dir;
  if (options_.tls.enabled()) {
    const transport::TlsOptions t = ForProcess(options_.tls, "client");
    j["tls"] = {{"ca_file", t.ca_file}, {"cert_file", t.cert_file}, {"key_file", t.key_file}};
  }
  j["shards"] = nlohmann::json::array();
  for (const Child& s : shards_) {
    j["shards"].push_back({{"name", s.name},
                           {"endpoint", Endpoint(s.port)},
                           {"metrics", Endpoint(s.metrics_port)},
                           {"pid", s.pid}});
  }
  return j.dump();
}

LocalCluster::~LocalCluster() { Stop(); }

absl::StatusOr<client::ClientOptions> ClusterClientOptions(const std::string& cluster_json) {
  std::ifstream f(cluster_json);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", cluster_json));
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  const auto text = [&j](const nlohmann::json& o, const char* key) {
    return o.is_object() && o.contains(key) && o[key].is_string() ? o[key].get<std::string>()
                                                                  : std::string();
  };
  client::ClientOptions co;
  co.attention = text(j, "attention");
  co.router = text(j, "router");
  co.admin_token = text(j, "admin_token");
  if (co.attention.empty() || co.router.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(cluster_json, " is not a cluster.json (no attention and router endpoints)"));
  }
  if (j.contains("tls")) {
    co.tls.ca_file = text(j["tls"], "ca_file");
    co.tls.cert_file = text(j["tls"], "cert_file");
    co.tls.key_file = text(j["tls"], "key_file");
    if (!co.tls.enabled()) {
      return absl::InvalidArgumentError(absl::StrCat(cluster_json, ": \"tls\" without a ca_file"));
    }
  }
  return co;
}

}  // namespace moe::tools
