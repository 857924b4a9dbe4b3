// moe-cli: the command line on the client SDK.
//
//   moe-cli forward   --attention HOST:PORT --layer L --input x.npy|x.safetensors [--output y.npy]
//   moe-cli stats     --router HOST:PORT --layer L
//   moe-cli rebalance --router HOST:PORT --layer L [--dry_run] [--admin_token_file F]
//   moe-cli rollback  --router HOST:PORT --layer L --to V [--admin_token_file F]
//   moe-cli release   --router HOST:PORT --shard NAME [--admin_token_file F]
//   moe-cli mode      --router HOST:PORT --layer L --mode frozen|rebalance|continuous
//   moe-cli loadgen   --attention HOST:PORT --layer L --checkpoint DIR [--concurrency --tokens ...]
//   moe-cli cluster   --checkpoint DIR [--shards N --duration S ...]   (the main job)
//   moe-cli up        --checkpoint DIR [--work_dir D] [--insecure]   (a cluster kept up, mutual
//                     TLS on a fresh local CA unless --insecure; D/cluster.json)
// Every client command also takes --cluster D/cluster.json (endpoints, admin token, client
// certificate) instead of --attention, --router, --admin_token_file and --tls_*.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/util/json_util.h"
#include "services/checkpoint/checkpoint.h"
#include "services/client/moe_client.h"
#include "services/common/model_config.h"
#include "services/common/secret_file.h"
#include "services/common/status_macros.h"
#include "services/common/svc_main.h"
#include "services/common/version.h"
#include "services/numerics/precision_mode.h"
#include "services/numerics/qb.h"
#include "services/tools/load_generator.h"
#include "services/tools/local_cluster.h"
#include "services/tools/tensor_file.h"
#include "services/transport/channel.h"
#include "services/transport/health_check.h"
#include "services/transport/security.h"

namespace moe::tools {
namespace {

std::atomic<bool> g_stop{false};

void OnSignal(int) { g_stop.store(true); }

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "moe-cli: %s\n", s.ToString().c_str());
  return 1;
}

struct Common {
  std::string cluster, attention, router, admin_token_file;
  int64_t layer = 1;
  double timeout_s = 30;
  transport::TlsOptions tls;
  void Register(SvcFlags& f) {
    AddTlsFlags(f, &tls);
    f.String("cluster", &cluster,
             "a local cluster's cluster.json (moe-cli up): its endpoints, admin token and client "
             "certificate, for whatever the other flags leave unset");
    f.String("attention", &attention, "attention-svc host:port");
    f.String("router", &router, "router-svc host:port");
    f.String("admin_token_file", &admin_token_file,
             "file with the admin token for rebalance/rollback/mode (chmod 600)");
    f.Int64("layer", &layer, "MoE layer");
    f.Double("timeout", &timeout_s, "deadline of each call in seconds");
  }
  absl::StatusOr<std::unique_ptr<client::MoeClient>> Client() const {
    client::ClientOptions o;
    if (!cluster.empty()) {
      MOE_ASSIGN_OR_RETURN(o, ClusterClientOptions(cluster));
    }
    if (!attention.empty()) o.attention = attention;
    if (!router.empty()) o.router = router;
    if (!admin_token_file.empty()) {
      MOE_ASSIGN_OR_RETURN(o.admin_token, ReadSecretFile(admin_token_file));
    }
    o.timeout = absl::Seconds(timeout_s);
    if (tls.enabled()) o.tls = tls;
    return client::MoeClient::Create(o);
  }
};

// What a request asks of the server; "server": whatever the server's default is.
// --threads of `up` and `cluster` (LocalClusterOptions::threads).
constexpr char kThreadsHelp[] =
    "compute threads per process (0: each shard the CPUs moe-cli may use over the cluster's "
    "processes, at least 1; the attention node all of them)";

constexpr EnumNames<v1::ReplyMode, 3> kReplyModeFlag{
    "--reply_mode",
    {{{v1::REPLY_MODE_UNSPECIFIED, "server"},
      {v1::REPLY_MODE_PER_PAIR, "per_pair"},
      {v1::REPLY_MODE_PARTIAL_SUM, "partial_sum"}}}};
// The modes by the names precision_mode.h spells.
constexpr EnumNames<v1::Precision, 3> kPrecisionFlag{
    "--precision",
    {{{v1::PRECISION_UNSPECIFIED, "server"},
      {v1::PRECISION_W4A16, numerics::kPrecisionNames[0]},
      {v1::PRECISION_W4A8, numerics::kPrecisionNames[1]}}}};

// --precision: "" (the server's), w4a16 or w4a8.

void PrintBalance(const char* what, const v1::Balance& b) {
  std::printf("  %-18s MaxVio %.3f  CV %.3f  min/q %.2f  dead %lld  shard max/mean %.3f\n", what,
              b.max_vio(), b.cv(), b.min_over_target(), static_cast<long long>(b.dead()),
              b.shard_max_over_mean());
}

void PrintStats(const v1::LoadStats& s) {
  std::printf("layer %d: bias version %llu (%s), rebalances %lld\n", s.layer(),
              static_cast<unsigned long long>(s.bias_version()),
              v1::BiasMode_Name(s.mode()).c_str(), static_cast<long long>(s.rebalances()));
  std::printf("  window %lld tokens, total %lld tokens\n",
              static_cast<long long>(s.window_tokens()), static_cast<long long>(s.total_tokens()));
  PrintBalance("window balance", s.window_balance());
  for (int i = 0; i < s.shard_names_size(); ++i) {
    std::printf("  %-10s %lld routed (token, expert) pairs in the window\n",
                s.shard_names(i).c_str(), static_cast<long long>(s.shard_loads(i)));
  }
  std::vector<std::pair<int64_t, int>> hot;
  for (int j = 0; j < s.window_loads_size(); ++j) hot.emplace_back(s.window_loads(j), j);
  std::sort(hot.rbegin(), hot.rend());
  std::printf("  hottest experts (window):");
  for (size_t i = 0; i < std::min<size_t>(8, hot.size()); ++i) {
    std::printf(" %d:%lld", hot[i].second, static_cast<long long>(hot[i].first));
  }
  std::printf("\n");
}

void PrintRebalance(const v1::RebalanceResponse& r) {
  std::printf("rebalance layer %d from %lld tokens: %s version %llu\n", r.layer(),
              static_cast<long long>(r.window_tokens()), r.applied() ? "applied" : "dry run,",
              static_cast<unsigned long long>(r.new_bias().version()));
  PrintBalance("before", r.before());
  PrintBalance("predicted after", r.predicted_after());
  // The prediction holds each token's cutoff fixed on the same window, where QB's bias meets
  // every quantile (about 0); new traffic adds sampling noise of about the floor.
  std::printf(
      "  noise floor MaxVio %.3f (the prediction is on this window at fixed per-token cutoffs, "
      "where the new bias hits every expert's quantile; on new traffic expect MaxVio near the "
      "floor)\n",
      r.noise_floor_max_vio());
}

absl::StatusOr<ModelConfig> ConfigOf(const std::string& checkpoint) {
  auto ckpt = checkpoint::Checkpoint::Open(checkpoint);
  if (!ckpt.ok()) return ckpt.status();
  return (*ckpt)->LoadConfig();
}

absl::StatusOr<int64_t> HiddenOf(const std::string& checkpoint, const std::string& preset) {
  if (!checkpoint.empty()) {
    auto ckpt = checkpoint::Checkpoint::Open(checkpoint);
    if (!ckpt.ok()) return ckpt.status();
    auto cfg = (*ckpt)->LoadConfig();
    if (!cfg.ok()) return cfg.status();
    return cfg->hidden;
  }
  auto cfg = PresetConfig(preset);
  if (!cfg.ok()) return cfg.status();
  return cfg->hidden;
}

int Forward(int argc, char** argv) {
  Common c;
  std::string input, tensor_name, output;
  bool routing = false;
  SvcFlags f("moe-cli forward", "One Forward call from a .npy or .safetensors file.");
  c.Register(f);
  f.String("input", &input, "x [T, H]: .npy (<f4 or <u2 bf16 bits) or .safetensors");
  f.String("tensor", &tensor_name, "tensor name inside a .safetensors file");
  f.String("output", &output, "write the output [T, H] as float32 .npy here");
  client::ForwardOptions fo;
  f.Enum("reply_mode", &fo.reply_mode, kReplyModeFlag, "the experts' replies");
  f.Enum("precision", &fo.precision, kPrecisionFlag, "the routed experts' precision");
  f.Int("expert_budget", &fo.expert_budget,
        "dynamic k: at most this many experts per token on average (0: the layer's budget)");
  f.Bool("routing", &routing, "print the experts of the first tokens");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  auto x = ReadMatrix(input, tensor_name);
  if (!x.ok()) return Fail(x.status());
  auto client = c.Client();
  if (!client.ok()) return Fail(client.status());
  fo.return_routing = routing;
  auto y = (*client)->Forward(static_cast<int32_t>(c.layer), x->values, x->rows, x->cols, fo);
  if (!y.ok()) return Fail(y.status());
  const v1::StageSeconds& s = y->seconds;
  std::printf(
      "output [%lld, %lld], %s, bias version %llu, expert budget %d (%lld routed pairs); ms: "
      "router %.2f down %.2f dispatch %.2f combine+norm %.2f up %.2f shared %.2f\n",
      static_cast<long long>(y->tokens), static_cast<long long>(y->width),
      y->precision == v1::PRECISION_W4A8 ? "w4a8" : "w4a16",
      static_cast<unsigned long long>(y->bias_version), y->expert_budget,
      static_cast<long long>(y->routed_pairs), 1e3 * s.router(), 1e3 * s.down_proj(),
      1e3 * s.dispatch(), 1e3 * s.combine_norm(), 1e3 * s.up_proj(), 1e3 * s.shared());
  if (routing) {
    for (int64_t t = 0; t < std::min<int64_t>(4, y->tokens); ++t) {
      std::printf("  token %lld:", static_cast<long long>(t));
      for (int64_t j = 0; j < y->top_k; ++j) {
        std::printf(" %d(%.3f)", y->expert_ids[t * y->top_k + j], y->weights[t * y->top_k + j]);
      }
      std::printf("\n");
    }
  }
  if (!output.empty()) {
    std::vector<float> out(y->out.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = y->out[i].ToFloat();
    if (absl::Status st = WriteNpyF32(output, out, y->tokens, y->width); !st.ok()) return Fail(st);
    std::printf("wrote %s\n", output.c_str());
  }
  return 0;
}

int Stats(int argc, char** argv) {
  Common c;
  bool json = false;
  SvcFlags f("moe-cli stats", "Load statistics of a layer from router-svc.");
  c.Register(f);
  f.Bool("json", &json, "print the LoadStats message as proto3 JSON (64-bit ints as strings)");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  auto client = c.Client();
  if (!client.ok()) return Fail(client.status());
  auto s = (*client)->GetLoadStats(static_cast<int32_t>(c.layer));
  if (!s.ok()) return Fail(s.status());
  if (json) {
    std::string out;
    google::protobuf::util::JsonPrintOptions o;
    o.always_print_primitive_fields = true;
    if (!google::protobuf::util::MessageToJsonString(*s, &out, o).ok()) {
      return Fail(absl::InternalError("cannot print JSON"));
    }
    std::printf("%s\n", out.c_str());
    return 0;
  }
  PrintStats(*s);
  return 0;
}

// Starts a local cluster and keeps it up until SIGINT/SIGTERM (or --max_seconds): for the
// observability tests and for poking at the page by hand. Writes <work_dir>/cluster.json.
// A health probe over TLS where kubelet's own gRPC probe cannot go (it speaks plaintext only):
// exit 0 when the service is SERVING, 1 otherwise.
int Health(int argc, char** argv) {
  std::string endpoint = "127.0.0.1:50051", service;
  double timeout_s = 2;
  transport::TlsOptions tls;
  SvcFlags f("moe-cli health", "gRPC health check of one server (a Kubernetes exec probe).");
  f.String("endpoint", &endpoint, "host:port of the server");
  f.String("service", &service, "health service name (\"\": readiness; moe.liveness)");
  f.Double("timeout", &timeout_s, "seconds");
  AddTlsFlags(f, &tls);
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (tls.enabled()) {
    auto c = transport::MakeChannelCredentials(tls);
    if (!c.ok()) return Fail(c.status());
    creds = *std::move(c);
  }
  auto serving = transport::CheckHealth(
      transport::MakeChannel(endpoint, transport::kDefaultMaxMessageBytes, creds),
      absl::Seconds(timeout_s), service);
  if (!serving.ok()) return Fail(serving.status());
  std::printf("%s%s%s: %s\n", endpoint.c_str(), service.empty() ? "" : " ", service.c_str(),
              *serving ? "SERVING" : "NOT_SERVING");
  return *serving ? 0 : 1;
}

int Up(int argc, char** argv) {
  LocalClusterOptions co;
  std::string work_dir;
  double max_seconds = 3600;
  std::string attention_args, router_args, expert_args;
  SvcFlags f("moe-cli up", "Start a local cluster and keep it running.");
  f.String("checkpoint", &co.checkpoint, "checkpoint directory");
  f.Int("shards", &co.num_shards, "expert-svc shards (equal expert ranges)");
  f.String("work_dir", &work_dir,
           "logs, port files and cluster.json (default: a temp dir, removed when the cluster "
           "stops)");
  std::string admin_token_file;
  f.String("admin_token_file", &admin_token_file,
           "file with router-svc's admin token (chmod 600; empty: admin calls refused)");
  f.Int("threads", &co.threads, kThreadsHelp);
  f.IntList("layers", &co.layers,
            "MoE layers every process serves, comma-separated (empty: the checkpoint's first)");
  f.String("attention_args", &attention_args, "extra attention-svc flags, space-separated");
  f.String("router_args", &router_args, "extra router-svc flags, space-separated");
  f.String("expert_args", &expert_args, "extra expert-svc flags, space-separated");
  f.Double("max_seconds", &max_seconds, "stop by itself after this long");
  bool insecure = false;
  f.Bool("insecure", &insecure,
         "plaintext, with member tokens only (default: a fresh local CA in <work_dir>/pki and "
         "mutual TLS, each process its own identity; the --tls_* flags: your own PKI)");
  f.Bool("keep_router_state", &co.keep_router_state,
         "router-svc's state in <work_dir>/router.db, kept across router restarts and later `up`s "
         "on the same work_dir (false: in memory)");
  AddTlsFlags(f, &co.tls);  // every process, and this one's readiness check
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  if (!admin_token_file.empty()) {
    auto token = ReadSecretFile(admin_token_file);
    if (!token.ok()) return Fail(token.status());
    co.admin_token = *std::move(token);
  }
  co.work_dir = work_dir;
  co.local_pki = !insecure && !co.tls.enabled();
  if (insecure && co.tls.enabled()) {
    return Fail(absl::InvalidArgumentError("--insecure with --tls_ca_file: one or the other"));
  }
  co.attention_args = absl::StrSplit(attention_args, ' ', absl::SkipEmpty());
  co.router_args = absl::StrSplit(router_args, ' ', absl::SkipEmpty());
  co.expert_args = absl::StrSplit(expert_args, ' ', absl::SkipEmpty());
  auto cluster = LocalCluster::Start(co);
  if (!cluster.ok()) return Fail(cluster.status());
  const std::string json = (*cluster)->DescribeJson();
  const std::string path = (*cluster)->work_dir() + "/cluster.json";
  // It may hold the admin token: readable by this user only.
  if (absl::Status s = WritePrivateFile(path, json + "\n"); !s.ok()) return Fail(s);
  std::printf("%s\n", json.c_str());
  std::fflush(stdout);
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(1000 * max_seconds));
  while (!g_stop.load() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  (*cluster)->Stop();
  std::fprintf(stderr, "moe-cli up: cluster stopped\n");
  return 0;
}

int Rebalance(int argc, char** argv) {
  Common c;
  bool dry_run = false;
  SvcFlags f("moe-cli rebalance", "One Quantile Balancing step for a layer.");
  c.Register(f);
  f.Bool("dry_run", &dry_run, "predict only");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  auto client = c.Client();
  if (!client.ok()) return Fail(client.status());
  auto r = (*client)->Rebalance(static_cast<int32_t>(c.layer), dry_run);
  if (!r.ok()) return Fail(r.status());
  PrintRebalance(*r);
  return 0;
}

int Rollback(int argc, char** argv) {
  Common c;
  uint64_t to = 0;
  SvcFlags f("moe-cli rollback", "Make an earlier bias version current again.");
  c.Register(f);
  f.Uint64("to", &to, "bias version");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  auto client = c.Client();
  if (!client.ok()) return Fail(client.status());
  auto r = (*client)->RollbackBias(static_cast<int32_t>(c.layer), to);
  if (!r.ok()) return Fail(r.status());
  std::printf("layer %d: bias version %llu (%s)\n", r->layer(),
              static_cast<unsigned long long>(r->version()), r->reason().c_str());
  return 0;
}

int Release(int argc, char** argv) {
  Common c;
  std::string shard;
  SvcFlags f("moe-cli release",
             "Lift the quarantine of a shard a twin audit caught answering wrong bytes (after "
             "its weights were fixed; docs/operations.md). Needs the admin token.");
  c.Register(f);
  f.String("shard", &shard, "the shard's name");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  auto client = c.Client();
  if (!client.ok()) return Fail(client.status());
  auto r = (*client)->ReleaseShard(shard);
  if (!r.ok()) return Fail(r.status());
  std::printf("shard %s: %s\n", shard.c_str(), *r ? "released" : "was not quarantined");
  return 0;
}

int Budget(int argc, char** argv) {
  Common c;
  int k_avg = 0;
  SvcFlags f("moe-cli budget",
             "Set a layer's expert budget (dynamic k, docs/math.md section 4.1): experts per "
             "token on average, 1..top-k (top-k: none). Needs the admin token.");
  c.Register(f);
  f.Int("k_avg", &k_avg, "the budget");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  auto client = c.Client();
  if (!client.ok()) return Fail(client.status());
  auto r = (*client)->SetExpertBudget(static_cast<int32_t>(c.layer), k_avg);
  if (!r.ok()) return Fail(r.status());
  std::printf("layer %d: expert budget %d, bias version %llu (%s)\n", r->layer(),
              r->budget().k_avg(), static_cast<unsigned long long>(r->version()),
              r->reason().c_str());
  return 0;
}

int Mode(int argc, char** argv) {
  Common c;
  std::string mode;
  int64_t every = 0;
  SvcFlags f("moe-cli mode", "Set a layer's bias mode.");
  c.Register(f);
  f.String("mode", &mode, "frozen|rebalance|continuous");
  f.Int64("continuous_tokens", &every, "continuous: rebalance every this many tokens");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  v1::BiasMode m = v1::BIAS_MODE_UNSPECIFIED;
  if (mode == "frozen") m = v1::BIAS_MODE_FROZEN;
  if (mode == "rebalance") m = v1::BIAS_MODE_REBALANCE;
  if (mode == "continuous") m = v1::BIAS_MODE_CONTINUOUS;
  auto client = c.Client();
  if (!client.ok()) return Fail(client.status());
  auto r = (*client)->SetBiasMode(static_cast<int32_t>(c.layer), m, every);
  if (!r.ok()) return Fail(r.status());
  std::printf("layer %d: mode %s, bias version %llu\n", r->layer(),
              v1::BiasMode_Name(r->mode()).c_str(), static_cast<unsigned long long>(r->version()));
  return 0;
}

struct LoadFlags {
  int concurrency = 4;
  int64_t tokens = 64;
  double duration_s = 10;
  uint64_t seed = 1;
  int batches = 16;
  v1::ReplyMode reply_mode = v1::REPLY_MODE_UNSPECIFIED;
  v1::Precision precision = v1::PRECISION_UNSPECIFIED;
  int expert_budget = 0;
  void Register(SvcFlags& f) {
    f.Int("expert_budget", &expert_budget,
          "dynamic k: at most this many experts per token on average (0: the layer's budget)");
    f.Int("batches", &batches, "distinct synthetic input batches to cycle through");
    f.Int("concurrency", &concurrency, "requests in flight");
    f.Int64("tokens", &tokens, "tokens per request");
    f.Double("duration", &duration_s, "seconds of traffic");
    f.Uint64("seed", &seed, "input seed");
    f.Enum("reply_mode", &reply_mode, kReplyModeFlag, "the experts' replies");
    f.Enum("precision", &precision, kPrecisionFlag, "the routed experts' precision");
  }
  LoadOptions Options(int64_t layer, int64_t hidden) const {
    LoadOptions o;
    o.layer = static_cast<int32_t>(layer);
    o.hidden = hidden;
    o.concurrency = concurrency;
    o.tokens = tokens;
    o.duration = absl::Seconds(duration_s);
    o.seed = seed;
    o.distinct_batches = batches;
    o.forward.reply_mode = reply_mode;
    o.forward.precision = precision;
    o.forward.expert_budget = expert_budget;
    o.stop = &g_stop;
    return o;
  }
};

int Loadgen(int argc, char** argv) {
  Common c;
  LoadFlags l;
  std::string checkpoint, preset = "mid";
  SvcFlags f("moe-cli loadgen", "Closed-loop Forward traffic: tokens/s, latency, errors.");
  c.Register(f);
  l.Register(f);
  f.String("checkpoint", &checkpoint, "checkpoint (for H)");
  f.String("preset", &preset, "preset (for H) when no checkpoint");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  auto hidden = HiddenOf(checkpoint, preset);
  if (!hidden.ok()) return Fail(hidden.status());
  auto client = c.Client();
  if (!client.ok()) return Fail(client.status());
  auto r = RunLoad(**client, l.Options(c.layer, *hidden));
  if (!r.ok()) return Fail(r.status());
  std::printf("%s\n", r->Format().c_str());
  return r->ok > 0 ? 0 : 1;
}

// The main job: a local cluster, traffic, imbalance, then Rebalance and traffic again until
// MaxVio is within 1.5x of the window's noise floor (at most --max_rebalances times), report.
// Quantile Balancing converges in a few steps (docs/quantile-balancing.md): `moe-cli cluster`
// rebalances on each window until its MaxVio is within kNearFloor of the window's noise floor.
constexpr double kNearFloor = 1.5;
struct RebalanceStep {
  double max_vio, floor;
  int64_t tokens;
  uint64_t version;
};

// The floor of a window: the MaxVio the sampling noise alone gives its loads.
double WindowFloor(const ModelConfig& cfg, const v1::LoadStats& st) {
  return numerics::NoiseFloorMaxVio(
      cfg.num_experts, static_cast<double>(st.window_tokens()) * cfg.top_k / cfg.num_experts);
}

void PrintConvergence(const std::vector<RebalanceStep>& steps, bool converged, int max_rebalances) {
  std::printf("\n== summary: MaxVio per window (noise floor: what sampling alone gives)\n");
  for (size_t i = 0; i < steps.size(); ++i) {
    std::printf("  %-28s version %-3llu MaxVio %.3f  floor %.3f  (%.2fx)\n",
                i == 0 ? "checkpoint's bias" : absl::StrCat("after Rebalance ", i).c_str(),
                static_cast<unsigned long long>(steps[i].version), steps[i].max_vio, steps[i].floor,
                steps[i].max_vio / steps[i].floor);
  }
  const RebalanceStep& last = steps.back();
  if (converged) {
    std::printf("converged: MaxVio within %.1fx of the noise floor after %zu Rebalance%s\n",
                kNearFloor, steps.size() - 1, steps.size() == 2 ? "" : "s");
  } else {
    std::printf(
        "not converged: MaxVio %.3f is %.2fx the floor after %zu Rebalances (at most %d, "
        "--max_rebalances): each QB step re-routes tokens and so moves every token's cutoff, "
        "and near the floor a step corrects about as much as it disturbs "
        "(docs/quantile-balancing.md); a window of %lld tokens has a low floor that takes "
        "more steps to reach than a short one\n",
        last.max_vio, last.max_vio / last.floor, steps.size() - 1, max_rebalances,
        static_cast<long long>(last.tokens));
  }
}

// The lanes each shard's data plane last reported to router-svc (its heartbeat): which backend
// the traffic took (by backend where a shard offers several: "shm" on one host by default,
// "ucx (shm (posix))"; "" in band).
void PrintDataPlanes(client::MoeClient& c) {
  absl::StatusOr<v1::Placement> p = c.GetPlacement();
  if (!p.ok()) return;
  for (const v1::ShardInfo& s : p->shards()) {
    std::printf("  %-10s data plane lanes: %s\n", s.shard().c_str(),
                s.data_plane_lanes().empty() ? "none (in band)" : s.data_plane_lanes().c_str());
  }
}

// Every service's --data_plane, where one is given (empty: the services' default).
void UseDataPlane(const std::string& data_plane, LocalClusterOptions* co) {
  if (data_plane.empty()) return;
  co->expert_args.push_back("--data_plane=" + data_plane);
  co->attention_args.push_back("--data_plane=" + data_plane);
}

// Where the cluster's processes listen and log.
void PrintWhere(const LocalCluster& c) {
  std::printf("router-svc %s, attention-svc %s, logs in %s\n", c.router_endpoint().c_str(),
              c.attention_endpoint().c_str(), c.work_dir().c_str());
  for (int i = 0; i < c.num_shards(); ++i) {
    std::printf("  %s at %s\n", c.shard_name(i).c_str(), c.shard_endpoint(i).c_str());
  }
}

int Cluster(int argc, char** argv) {
  LoadFlags l;
  LocalClusterOptions co;
  int64_t layer = 1;
  std::string work_dir;
  double settle_s = 1.0;
  SvcFlags f("moe-cli cluster",
             "Starts router-svc, expert-svc shards and attention-svc on loopback, runs traffic, "
             "rebalances, and reports.");
  l.Register(f);
  f.String("checkpoint", &co.checkpoint, "checkpoint directory");
  f.Int("shards", &co.num_shards, "expert-svc shards (equal expert ranges)");
  f.String("cluster_reply_mode", &co.reply_mode, "attention-svc default reply mode");
  f.Int("threads", &co.threads, kThreadsHelp);
  f.String("bin_dir", &co.bin_dir,
           "where the service binaries are (default: next to moe-cli, else the build's)");
  f.String("work_dir", &work_dir, "logs and port files (default: a temp dir, removed at stop)");
  f.Int64("layer", &layer, "MoE layer to drive");
  f.Double("settle", &settle_s, "seconds to wait for the last statistics report");
  int max_rebalances = 4;
  f.Int("max_rebalances", &max_rebalances,
        "Rebalance after each window until MaxVio is within 1.5x of the noise floor, at most "
        "this often");
  std::string data_plane;
  f.String("data_plane", &data_plane,
           "every service's --data_plane (auto, grpc, ucx, shm: docs/data-plane.md; empty: the "
           "services' default, auto)");
  if (int rc = f.Parse(argc, argv, 2); rc >= 0) return rc;
  UseDataPlane(data_plane, &co);
  co.work_dir = work_dir;
  co.admin_token = "local-admin";
  co.router_args = {"--window_tokens=1000000"};
  co.keep_router_state = false;  // one run, reported from the checkpoint's bias on
  auto hidden = HiddenOf(co.checkpoint, "");
  if (!hidden.ok()) return Fail(hidden.status());
  auto cfg = ConfigOf(co.checkpoint);
  if (!cfg.ok()) return Fail(cfg.status());
  std::printf("starting the local cluster (%d expert shards) from %s ...\n", co.num_shards,
              co.checkpoint.c_str());
  auto cluster = LocalCluster::Start(co);
  if (!cluster.ok()) return Fail(cluster.status());
  PrintWhere(**cluster);
  client::ClientOptions cl;
  cl.attention = (*cluster)->attention_endpoint();
  cl.router = (*cluster)->router_endpoint();
  cl.admin_token = co.admin_token;
  auto client = client::MoeClient::Create(cl);
  if (!client.ok()) return Fail(client.status());
  const LoadOptions lo = l.Options(layer, *hidden);
  int rc = 0;
  auto phase = [&](const char* name) -> absl::StatusOr<v1::LoadStats> {
    std::printf("\n== %s: %d concurrent requests of %lld tokens for %.0f s\n", name, lo.concurrency,
                static_cast<long long>(lo.tokens), l.duration_s);
    auto r = RunLoad(**client, lo);
    if (!r.ok()) return r.status();
    std::printf("%s\n", r->Format().c_str());
    if (r->ok == 0) rc = 1;
    if (g_stop.load()) return absl::CancelledError("interrupted");
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(1000 * settle_s)));
    auto s = (*client)->GetLoadStats(static_cast<int32_t>(layer));
    if (!s.ok()) return s.status();
    PrintStats(*s);
    return s;
  };
  auto floor_of = [&](const v1::LoadStats& st) { return WindowFloor(*cfg, st); };
  auto before = phase("traffic with the checkpoint's bias");
  if (!before.ok() && !g_stop.load()) return Fail(before.status());
  if (before.ok()) PrintDataPlanes(**client);
  if (before.ok() && !g_stop.load()) {
    std::vector<RebalanceStep> steps{{before->window_balance().max_vio(), floor_of(*before),
                                      before->window_tokens(), before->bias_version()}};
    bool converged = steps.back().max_vio <= kNearFloor * steps.back().floor;
    for (int i = 1; i <= max_rebalances && !converged && !g_stop.load(); ++i) {
      std::printf("\n== Rebalance %d (Quantile Balancing on the window)\n", i);
      auto rb = (*client)->Rebalance(static_cast<int32_t>(layer), /*dry_run=*/false);
      if (!rb.ok()) return Fail(rb.status());
      PrintRebalance(*rb);
      auto after = phase(absl::StrCat("traffic after Rebalance ", i).c_str());
      if (!after.ok()) {
        if (g_stop.load()) break;
        return Fail(after.status());
      }
      steps.push_back({after->window_balance().max_vio(), floor_of(*after), after->window_tokens(),
                       after->bias_version()});
      const RebalanceStep& st = steps.back();
      std::printf(
          "step %d: bias version %llu, MaxVio %.3f on %lld new tokens, %.2fx the "
          "window's noise floor %.3f\n",
          i, static_cast<unsigned long long>(st.version), st.max_vio,
          static_cast<long long>(st.tokens), st.max_vio / st.floor, st.floor);
      converged = st.max_vio <= kNearFloor * st.floor;
    }
    if (!g_stop.load()) PrintConvergence(steps, converged, max_rebalances);
  }
  if (g_stop.load()) std::printf("\ninterrupted: stopping the cluster\n");
  (*cluster)->Stop();
  std::printf("cluster stopped\n");
  return g_stop.load() ? 130 : rc;
}

int Usage() {
  std::fprintf(stderr,
               "usage: moe-cli "
               "forward|stats|rebalance|rollback|release|mode|budget|loadgen|cluster|up|health "
               "[flags] (--help on each)\n");
  return 2;
}

}  // namespace
}  // namespace moe::tools

int main(int argc, char** argv) {
  using namespace moe::tools;
  if (argc < 2) return Usage();
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  const std::string cmd = argv[1];
  if (cmd == "--help" || cmd == "-h") {
    std::printf(
        "usage: moe-cli "
        "forward|stats|rebalance|rollback|release|mode|budget|loadgen|cluster|up|health "
        "[flags] (--help on each)\n");
    return 0;
  }
  if (cmd == "--version") {
    std::printf("moe-cli %s\n", moe::BuildVersion());
    return 0;
  }
  if (cmd == "forward") return Forward(argc, argv);
  if (cmd == "stats") return Stats(argc, argv);
  if (cmd == "rebalance") return Rebalance(argc, argv);
  if (cmd == "rollback") return Rollback(argc, argv);
  if (cmd == "release") return Release(argc, argv);
  if (cmd == "mode") return Mode(argc, argv);
  if (cmd == "budget") return Budget(argc, argv);
  if (cmd == "loadgen") return Loadgen(argc, argv);
  if (cmd == "cluster") return Cluster(argc, argv);
  if (cmd == "up") return Up(argc, argv);
  if (cmd == "health") return Health(argc, argv);
  std::fprintf(stderr, "moe-cli: unknown command '%s'\n", cmd.c_str());
  return Usage();
}
