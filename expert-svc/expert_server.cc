// The expert server's gRPC adapter (ExpertService) over its core (expert_core.h): start and
// shutdown, membership checks, the Dispatch stream handing each request to its BatchEndpoint
// (batch_endpoint.h), GetInfo, OpenDataPlane, registration with router-svc.
#include "expert-svc/expert_server.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <shared_mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "expert-svc/batch_endpoint.h"
#include "expert-svc/dataplane/registry.h"
#include "expert-svc/dispatch_batch.h"
#include "expert-svc/expert_core.h"
#include "moe/v1/expert.grpc.pb.h"
#include "moe/v1/router.grpc.pb.h"
#include "services/client/router_link.h"
#include "services/common/logging.h"
#include "services/common/secret_file.h"
#include "services/common/status_macros.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/process_collector.h"
#include "services/metrics/service_metrics.h"
#include "services/transport/grpc_server.h"
#include "services/transport/precision_convert.h"
#include "services/transport/security.h"
#include "services/transport/status_convert.h"

namespace moe::expert_svc {

namespace {

// A Dispatch stream refused before any message is read.
class RefusedDispatch final
    : public grpc::ServerBidiReactor<v1::DispatchRequest, v1::DispatchReply> {
 public:
  explicit RefusedDispatch(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

class ExpertServer::Impl final : public v1::ExpertService::CallbackService {
 public:
  explicit Impl(const ExpertServerOptions& o) : options_(o) {}

  absl::Status Start();
  void Shutdown(absl::Duration grace);

  grpc::ServerBidiReactor<v1::DispatchRequest, v1::DispatchReply>* Dispatch(
      grpc::CallbackServerContext* context) override;
  // OK without a cluster token (no router) or when the call carries it; else UNAUTHENTICATED.
  absl::Status CheckMember(const grpc::CallbackServerContext& context, const char* what) const;
  // The caller holds the attention nodes' token (or no token is configured at all).
  bool FromAttention(const grpc::ServerContextBase& context) const;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* context,
                                    const v1::GetExpertInfoRequest* request,
                                    v1::ExpertServerInfo* response) override;
  grpc::ServerUnaryReactor* OpenDataPlane(grpc::CallbackServerContext* context,
                                          const v1::OpenDataPlaneRequest* request,
                                          v1::OpenDataPlaneReply* response) override;

  int port() const { return server_ != nullptr ? server_->port() : 0; }
  void Wait() {
    if (server_ != nullptr) server_->Wait();
  }

 private:
  absl::Status StartDataPlane();
  // One request off a Dispatch stream: to its endpoint (in band or UCX), then to the core.
  void OnDispatch(v1::DispatchRequest req, DispatchReactor* stream);
  // One batch that came as a data-plane message (authenticated by the backend): to the core.
  void OnBatchMessage(size_t half, const BatchSource& from, std::string_view header,
                      std::string_view activations);
  // The half of `transport` ("": the first); null when not offered. Under dp_mu_.
  ServerHalf* HalfFor(const std::string& transport) const;
  // The lanes of the halves' latest clients, for the router's heartbeat; where several halves
  // have clients, each by name: "ucx (shm (posix)), shm" (only what router-svc takes: letters,
  // digits, spaces and ( ) , . _ -).
  std::string Lanes();
  // What GetInfo and the router say: the first half's name, or "grpc".
  std::string FirstName() const { return dp_.empty() ? "grpc" : dp_[0]->name(); }

  ExpertServerOptions options_;
  std::unique_ptr<ExpertCore> core_;
  std::unique_ptr<transport::GrpcServer> server_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::unique_ptr<prometheus::Registry> own_registry_;  // metrics_ when not exported
  std::unique_ptr<metrics::ExpertMetrics> metrics_;
  std::unique_ptr<client::RouterLink> router_;  // registration and heartbeats
  bool stopped_ = false;

  // The out-of-band data plane's halves (dataplane/server_half.h), one per backend offered,
  // the first the one registered and opened for callers that name none; empty when none is
  // offered, and why. dp_mu_ (shared by the gRPC handlers) keeps them alive while they use
  // them; Shutdown takes it exclusively to stop them.
  std::shared_mutex dp_mu_;
  std::vector<std::unique_ptr<ServerHalf>> dp_;
  std::string no_dp_;
  // The same, for the batch messages' handlers and the compute thread's poll (they run on the
  // backends' threads, which Shutdown joins while holding dp_mu_: they must not take that
  // lock): filled before any client can open and never changed after; usable while dp_live_.
  std::vector<ServerHalf*> dp_raw_;
  std::atomic<bool> dp_live_{false};
  // The half whose batch came last: the one the compute thread polls between batches (the
  // other halves' own threads deliver theirs meanwhile).
  std::atomic<size_t> dp_polled_{0};
  // moe_ucx_messages_dropped_total, read from the halves at every scrape (stopped before they
  // go).
  std::shared_ptr<metrics::ScrapedCounter> dp_drops_;
};

absl::Status ExpertServer::Impl::Start() {
  MOE_ASSIGN_OR_RETURN(core_, ExpertCore::Load(options_));
  options_ = core_->options();  // the range resolved from a ranges file
  // Metrics first: the gRPC port file is the launcher's signal that everything is up.
  std::vector<int64_t> layers;
  for (const auto& [l, w] : core_->layers()) layers.push_back(l);
  if (options_.metrics_port >= 0) {
    MOE_ASSIGN_OR_RETURN(metrics_server_,
                         metrics::MetricsServer::Start(options_.host, options_.metrics_port));
    metrics_ = std::make_unique<metrics::ExpertMetrics>(metrics_server_->registry(), layers,
                                                        options_.shard);
    if (!options_.metrics_port_file.empty()) {
      MOE_RETURN_IF_ERROR(
          transport::WritePortFile(options_.metrics_port_file, metrics_server_->port()));
    }
  } else {
    // Counted all the same, not exported: the metrics are a value, never null.
    own_registry_ = std::make_unique<prometheus::Registry>();
    metrics_ = std::make_unique<metrics::ExpertMetrics>(*own_registry_, layers, options_.shard);
  }
  // Read before anything listens: with a token, Dispatch and OpenDataPlane need it from the
  // first call on.
  if (!options_.cluster_token_file.empty()) {
    MOE_ASSIGN_OR_RETURN(options_.cluster_token, ReadSecretFile(options_.cluster_token_file));
  }
  if (!options_.attention_token_sha256_file.empty()) {
    MOE_ASSIGN_OR_RETURN(options_.attention_token_sha256,
                         ReadSecretFile(options_.attention_token_sha256_file));
  }
  MOE_RETURN_IF_ERROR(StartDataPlane());
  // Between batches the compute thread polls the data plane for a while: the next batch message
  // lands and is admitted on it, with no thread woken in between.
  std::chrono::microseconds poll_spin(0);
  for (ServerHalf* h : dp_raw_) poll_spin = std::max(poll_spin, h->poll_spin());
  if (poll_spin > std::chrono::microseconds(0)) {
    core_->Start(
        metrics_.get(),
        [this](std::chrono::steady_clock::time_point until,
               const std::function<bool()>& work_queued) {
          if (dp_live_.load()) dp_raw_[dp_polled_.load()]->PollUntil(until, work_queued);
        },
        poll_spin, std::chrono::microseconds(std::max(0, options_.ucx_poll_max_us)));
  } else {
    core_->Start(metrics_.get());
  }
  transport::GrpcServerOptions so;
  so.host = options_.host;
  so.port = options_.port;
  so.max_receive_message_bytes = options_.max_message_bytes;
  so.max_send_message_bytes = options_.max_message_bytes;
  so.services = {this};
  MOE_ASSIGN_OR_RETURN(server_, transport::GrpcServer::Start(so));
  server_->SetServing(true);
  if (options_.advertise.empty()) options_.advertise = server_->endpoint();
  if (!options_.port_file.empty()) {
    MOE_RETURN_IF_ERROR(transport::WritePortFile(options_.port_file, server_->port()));
  }
  if (!options_.router.empty()) {
    v1::RegisterExpertServerRequest req;
    req.set_shard(options_.shard);
    req.set_endpoint(options_.advertise);
    req.set_data_plane(FirstName());
    for (const auto& [l, w] : core_->layers()) {
      v1::ExpertRange* r = req.add_ranges();
      r->set_layer(static_cast<int32_t>(l));
      r->set_expert_lo(static_cast<int32_t>(w.expert_lo));
      r->set_expert_hi(static_cast<int32_t>(w.expert_hi));
    }
    router_ = std::make_unique<client::RouterLink>(options_.router, client::RouterLinkTimings{},
                                                   options_.cluster_token);
    router_->KeepRegistered(
        std::move(req), [this] { return core_->queued(); }, [this] { return Lanes(); },
        // Said once per kind of refusal (a restarted shard meets its old lease for up to 3
        // heartbeat intervals; another process under its name for as long as that one lives).
        [this, last = std::string()](const absl::Status& s) mutable {
          const std::string what = absl::StatusCodeToString(s.code());
          if (what == last) return;
          last = what;
          MOE_LOG_WARN("shard {}: router-svc refused the registration or a heartbeat, retrying: {}",
                       options_.shard, s.ToString());
        });
  }
  return absl::OkStatus();
}

bool ExpertServer::Impl::FromAttention(const grpc::ServerContextBase& context) const {
  if (options_.attention_token_sha256.empty()) return options_.cluster_token.empty();
  const auto& md = context.client_metadata();
  auto it = md.find(transport::kClusterTokenMetadata);
  return it != md.end() && SecretEquals(transport::MemberTokenDigest(
                                            std::string(it->second.data(), it->second.size())),
                                        options_.attention_token_sha256);
}

absl::Status ExpertServer::Impl::CheckMember(const grpc::CallbackServerContext& context,
                                             const char* what) const {
  if (FromAttention(context)) {
    // With mutual TLS only attention nodes dispatch (another shard's certificate does not).
    absl::Status s = transport::CheckPeerMember(context, "attention", "",
                                                absl::StrCat(what, " to shard ", options_.shard));
    if (!s.ok()) metrics_->common.Error(what, "PERMISSION_DENIED");
    return s;
  }
  metrics_->common.Error(what, "UNAUTHENTICATED");
  return absl::UnauthenticatedError(absl::StrCat(
      what, " to shard ", options_.shard, " needs the cluster token of an attention member in the ",
      transport::kClusterTokenMetadata, " metadata",
      options_.attention_token_sha256.empty()
          ? " (this shard was started without --attention_token_sha256_file: Dispatch is closed)"
          : ""));
}

grpc::ServerBidiReactor<v1::DispatchRequest, v1::DispatchReply>* ExpertServer::Impl::Dispatch(
    grpc::CallbackServerContext* context) {
  if (absl::Status s = CheckMember(*context, "Dispatch"); !s.ok()) {
    return new RefusedDispatch(transport::ToGrpc(s));
  }
  return new DispatchReactor([this](v1::DispatchRequest&& req, DispatchReactor* stream) {
    OnDispatch(std::move(req), stream);
  });
}

void ExpertServer::Impl::OnDispatch(v1::DispatchRequest req, DispatchReactor* stream) {
  stream->BeginWork();  // every request is answered once, by its BatchReply or its endpoint
  std::shared_lock<std::shared_mutex> dp_lock(dp_mu_);
  EndpointContext ctx;
  ctx.shard = options_.shard;
  ctx.stream = stream;
  ctx.data_plane = HalfFor("");  // a previous protocol's requests: the first backend's
  ctx.on_error = [this](const absl::Status& s) {
    metrics_->common.Error("Dispatch", absl::StatusCodeToString(s.code()));
  };
  std::unique_ptr<BatchEndpoint> endpoint = MakeBatchEndpoint(req, ctx);
  endpoint->Receive(std::move(req), [this](v1::DispatchRequest& r, std::string_view bytes,
                                           std::unique_ptr<BatchReply> reply) {
    core_->Admit(r, bytes, std::move(reply));
  });
}

std::string ExpertServer::Impl::Lanes() {
  std::shared_lock<std::shared_mutex> lock(dp_mu_);
  std::string lanes;
  for (const auto& h : dp_) {
    const std::string l = h->lanes();
    if (l.empty()) continue;
    absl::StrAppend(&lanes, lanes.empty() ? "" : ", ");
    if (dp_.size() == 1) {
      absl::StrAppend(&lanes, l);
    } else {
      absl::StrAppend(&lanes, h->name(), l == h->name() ? "" : absl::StrCat(" (", l, ")"));
    }
  }
  return lanes;
}

ServerHalf* ExpertServer::Impl::HalfFor(const std::string& transport) const {
  for (const auto& h : dp_) {
    if (transport.empty() || transport == h->name()) return h.get();
  }
  return nullptr;
}

void ExpertServer::Impl::OnBatchMessage(size_t half, const BatchSource& from,
                                        std::string_view header, std::string_view activations) {
  if (!dp_live_.load()) return;
  ServerHalf* dp = dp_raw_[half];
  dp_polled_.store(half);
  v1::DispatchRequest req;
  const bool parsed = req.ParseFromArray(header.data(), static_cast<int>(header.size()));
  const v1::OutOfBand& o = req.out_of_band();
  const auto budget = BatchBudget(req.timeout_ms());
  std::unique_ptr<BatchReply> reply =
      MakeMessageReply(dp, from, o.reply_capacity_bytes(), options_.shard,
                       absl::Now() + absl::FromChrono(budget) + absl::Seconds(5));
  if (!parsed || !req.has_out_of_band() || !req.activations().data().empty() ||
      o.activation_bytes() != static_cast<int64_t>(activations.size()) ||
      o.reply_capacity_bytes() < 0 || o.reply_capacity_bytes() > options_.max_message_bytes) {
    const absl::Status s = absl::InvalidArgumentError(
        absl::StrCat("shard ", options_.shard, ", batch ", req.batch_id(),
                     ": a batch message whose header does not describe its payload (",
                     activations.size(), " activation bytes)"));
    metrics_->common.Error("Dispatch", "INVALID_ARGUMENT");
    reply->Send(ErrorReply(req.batch_id(), options_.shard, s));
    return;
  }
  core_->Admit(req, activations, std::move(reply), from.activations_owner);
}

grpc::ServerUnaryReactor* ExpertServer::Impl::GetInfo(grpc::CallbackServerContext* context,
                                                      const v1::GetExpertInfoRequest*,
                                                      v1::ExpertServerInfo* response) {
  const ExpertServerOptions& o = core_->options();
  response->set_shard(o.shard);
  for (const auto& [l, w] : core_->layers()) response->add_layers(static_cast<int32_t>(l));
  response->set_expert_lo(static_cast<int32_t>(o.expert_lo));
  response->set_expert_hi(static_cast<int32_t>(o.expert_hi));
  response->set_num_experts(static_cast<int32_t>(core_->config().num_experts));
  response->set_latent(static_cast<int32_t>(core_->config().latent));
  response->set_backend(core_->backend_name());
  for (numerics::Precision p : core_->precisions()) {
    response->add_precisions(transport::PrecisionToProto(p));
  }
  {
    std::shared_lock<std::shared_mutex> lock(dp_mu_);
    response->set_data_plane(FirstName());
    for (const auto& h : dp_) response->add_data_planes(h->name());
    if (!dp_.empty()) {
      response->set_ucx_tls(dp_[0]->tls());
      // UCX authenticates nobody: the data plane's address only for members.
      if (FromAttention(*context) &&
          transport::CheckPeerMember(*context, "attention", "", "GetInfo").ok()) {
        response->set_ucx_address(dp_[0]->address());
      }
    }
  }
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ExpertServer::Impl::OpenDataPlane(grpc::CallbackServerContext* context,
                                                            const v1::OpenDataPlaneRequest* request,
                                                            v1::OpenDataPlaneReply* response) {
  auto* reactor = context->DefaultReactor();
  auto finish = [&](const absl::Status& s) {
    if (!s.ok()) {
      metrics_->common.Error("OpenDataPlane", absl::StatusCodeToString(s.code()));
    }
    reactor->Finish(transport::ToGrpc(s));
    return reactor;
  };
  if (absl::Status s = CheckMember(*context, "OpenDataPlane"); !s.ok()) {
    reactor->Finish(transport::ToGrpc(s));
    return reactor;
  }
  std::shared_lock<std::shared_mutex> dp_lock(dp_mu_);
  if (dp_.empty()) {
    return finish(absl::FailedPreconditionError(
        absl::StrCat("shard ", options_.shard, " has no out-of-band data plane (", no_dp_, ")")));
  }
  ServerHalf* half = HalfFor(request->transport());
  if (half == nullptr) {
    std::vector<std::string> offered;
    for (const auto& h : dp_) offered.emplace_back(h->name());
    return finish(absl::FailedPreconditionError(absl::StrCat(
        "shard ", options_.shard, " does not offer the ", request->transport().substr(0, 32),
        " data plane (it offers ", absl::StrJoin(offered, ", "),
        no_dp_.empty() ? "" : absl::StrCat("; ", no_dp_), ")")));
  }
  if (absl::Status s = half->Open(request->node(), response); !s.ok()) {
    response->Clear();
    return finish(
        absl::Status(s.code(), absl::StrCat("shard ", options_.shard, ": ", s.message())));
  }
  return finish(absl::OkStatus());
}

absl::Status ExpertServer::Impl::StartDataPlane() {
  if (options_.data_plane.in_band()) {
    no_dp_ = "started with --data_plane=grpc";
    return absl::OkStatus();
  }
  // The first backend offered is the one old callers know (UCX under auto).
  std::vector<std::string> backends = options_.data_plane.backends();
  std::stable_partition(backends.begin(), backends.end(), [](const std::string& b) {
    return b == dataplane::DataPlane::kDefaultBackend;
  });
  std::vector<std::string> missing;
  for (const std::string& backend : backends) {
    ServerHalfOptions o;
    o.shard = options_.shard;
    o.tls = options_.ucx_tls;
    o.bind_host = options_.host;
    o.poll_spin = std::chrono::microseconds(std::max(0, options_.ucx_poll_us));
    o.progress_spin = dataplane::ProgressSpin(options_.ucx_progress_spin_us);
    o.max_clients = options_.max_data_plane_clients;
    o.max_message_bytes = options_.max_message_bytes;
    o.on_event = [this](const std::string& event) { metrics_->DataPlaneEvent(event); };
    if (options_.ucx_batch_messages) {
      o.on_batch = [this, half = dp_.size()](const BatchSource& from, std::string_view header,
                                             std::string_view activations) {
        OnBatchMessage(half, from, header, activations);
      };
    }
    auto dp = StartServerHalf(backend, std::move(o));
    if (!dp.ok()) {
      if (!options_.data_plane.automatic()) {
        return absl::FailedPreconditionError(
            absl::StrCat("--data_plane=", backend, ": ", dp.status().message()));
      }
      missing.push_back(absl::StrCat(backend, ": ", dp.status().message()));
      MOE_LOG_WARN("shard {}: no {} data plane ({})", options_.shard, backend,
                   dp.status().ToString());
      continue;
    }
    MOE_LOG_INFO("shard {}: {} data plane up ({})", options_.shard, (*dp)->name(),
                 (*dp)->Describe());
    std::unique_lock<std::shared_mutex> lock(dp_mu_);
    dp_raw_.push_back(dp->get());
    dp_.push_back(std::move(*dp));
  }
  no_dp_ = absl::StrJoin(missing, "; ");
  if (dp_.empty()) {
    MOE_LOG_WARN("shard {}: in band only", options_.shard);
    return absl::OkStatus();
  }
  dp_live_.store(true);
  if (metrics_server_ != nullptr) {
    dp_drops_ = metrics::UcxMessagesDropped(dp_raw_);
    metrics_server_->Add(dp_drops_);
  }
  return absl::OkStatus();
}

void ExpertServer::Impl::Shutdown(absl::Duration grace) {
  if (stopped_) return;
  stopped_ = true;
  if (router_ != nullptr) router_->Stop();
  // The core answers what is queued (UNAVAILABLE) before the streams are cancelled.
  if (core_ != nullptr) core_->Stop();
  {
    // Unfinished transfers fail (their batches are answered UNAVAILABLE) while the streams live.
    if (dp_drops_ != nullptr) dp_drops_->Stop();
    std::unique_lock<std::shared_mutex> lock(dp_mu_);
    dp_live_.store(false);
    dp_.clear();
  }
  if (server_ != nullptr) server_->Shutdown(grace);
}

ExpertServer::ExpertServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ExpertServer::~ExpertServer() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<ExpertServer>> ExpertServer::Start(
    const ExpertServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  MOE_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<ExpertServer>(new ExpertServer(std::move(impl)));
}

int ExpertServer::port() const { return impl_->port(); }
void ExpertServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }
void ExpertServer::Wait() { impl_->Wait(); }

}  // namespace moe::expert_svc
