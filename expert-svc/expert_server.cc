#include "expert-svc/expert_server.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "expert-svc/batch_verifier.h"
#include "expert-svc/dispatch_batch.h"
#include "expert-svc/expert_backend.h"
#include "expert-svc/ucx_data_plane.h"
#include "moe/v1/expert.grpc.pb.h"
#include "moe/v1/router.grpc.pb.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/router_link.h"
#include "services/common/logging.h"
#include "services/common/progress.h"
#include "services/common/secret_file.h"
#include "services/common/status_macros.h"
#include "services/dataplane/ucx_worker.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/combine.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernels.h"
#include "services/numerics/cpu/machine_limits.h"
#include "services/numerics/cpu/thread_pool.h"
#include "services/numerics/moe_layer.h"
#include "services/numerics/precision_mode.h"
#include "services/placement/placement.h"
#include "services/transport/grpc_server.h"
#include "services/transport/precision_convert.h"
#include "services/transport/status_convert.h"
#include "services/transport/stream_reactor.h"
#include "services/transport/tensor_codec.h"

namespace moe::expert_svc {

using numerics::MoeLayerWeights;
using tensor::Bf16;

namespace {

// An idle compute thread wakes this often so that the busy ratio decays to 0.
constexpr std::chrono::seconds kIdleTick(1);

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// How long past a batch's budget its reply payload may take to be taken by the caller.
constexpr absl::Duration kReplySendGrace = absl::Seconds(5);

using DispatchReactor = transport::StreamReactor<v1::DispatchRequest, v1::DispatchReply>;

// The wire dtype label of a batch's activations (the moe_wire_* metrics).
const char* WireDtype(const v1::Tensor& t) {
  return t.dtype() == v1::DTYPE_MXFP8 ? "mxfp8" : "bf16";
}

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
  explicit Impl(const ExpertServerOptions& o) : options_(o), precisions_(o.precisions) {}

  absl::Status Load();
  absl::Status StartServing();
  void Shutdown(absl::Duration grace);

  // Runs one batch and fills the reply (outputs, timings).
  void Compute(const Batch& b, v1::DispatchReply* reply);
  // Queues a batch for the compute thread: RESOURCE_EXHAUSTED when the queue is full,
  // UNAVAILABLE when shutting down.
  absl::Status Enqueue(std::unique_ptr<Batch> b, DispatchReactor* reactor);

  grpc::ServerBidiReactor<v1::DispatchRequest, v1::DispatchReply>* Dispatch(
      grpc::CallbackServerContext* context) override;
  void OnDispatch(v1::DispatchRequest req, DispatchReactor* stream);
  // OK without a cluster token (no router) or when the call carries it; else UNAUTHENTICATED.
  absl::Status CheckMember(const grpc::CallbackServerContext& context, const char* what) const;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* context,
                                    const v1::GetExpertInfoRequest* request,
                                    v1::ExpertServerInfo* response) override;
  grpc::ServerUnaryReactor* OpenDataPlane(grpc::CallbackServerContext* context,
                                          const v1::OpenDataPlaneRequest* request,
                                          v1::OpenDataPlaneReply* response) override;

  const std::string& shard() const { return options_.shard; }
  int port() const { return server_ != nullptr ? server_->port() : 0; }
  void Wait() {
    if (server_ != nullptr) server_->Wait();
  }

 private:
  void ComputeLoop();
  absl::Status StartDataPlane();
  // The batch's payload is on its way over UCX: receive it, then validate and queue the batch
  // (stream->BeginWork() already counted it).
  void ReceiveOutOfBand(v1::DispatchRequest req, DispatchReactor* stream);
  // Validates and queues a batch whose payload is here; answers errors on the stream.
  void Admit(v1::DispatchRequest& req, DispatchReactor* stream, bool work_begun, const Batch* oob,
             const std::string_view* oob_bytes = nullptr);
  // Sends an out-of-band reply's payload, then the reply header (compute thread).
  void ReplyOutOfBand(const Batch& b, v1::DispatchReply reply, DispatchReactor* reactor);
  v1::DispatchReply ErrorReply(uint64_t batch_id, const absl::Status& s) const;

  ExpertServerOptions options_;
  ModelConfig cfg_;
  std::unique_ptr<checkpoint::Checkpoint> ckpt_;
  std::map<int64_t, MoeLayerWeights> layers_;
  std::map<int64_t, std::unique_ptr<ExpertBackend>> backends_;  // per hosted layer
  std::vector<numerics::Precision> precisions_;                 // served, the default first
  const numerics::cpu::KernelTable* kernels_ = nullptr;
  std::unique_ptr<numerics::cpu::ThreadPool> pool_;
  std::unique_ptr<transport::GrpcServer> server_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::unique_ptr<metrics::ExpertMetrics> metrics_;
  numerics::cpu::MachineLimits limits_;  // zero when not measured
  std::unique_ptr<BatchVerifier> verifier_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::unique_ptr<Batch>, DispatchReactor*>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread compute_thread_;
  std::unique_ptr<client::RouterLink> router_;  // registration and heartbeats

  // The UCX data plane: null when not offered. ucx_mu_ (shared by the gRPC handlers) keeps it
  // alive while they use it; Shutdown takes it exclusively to stop it.
  std::shared_mutex ucx_mu_;
  std::unique_ptr<UcxDataPlane> ucx_;
};

namespace {

// The reference weights of the production check: regenerated from the seed (independent of the
// serving copy in memory), or read through a mapping of the checkpoint of our own (read-only
// pages: what the file holds).
BatchVerifier::ReferenceWeights ReferenceWeightsFor(const ExpertServerOptions& o,
                                                    const ModelConfig& cfg) {
  if (o.checkpoint.empty()) {
    checkpoint::SyntheticOptions so;
    so.seed = o.seed;
    so.router_skew = o.router_skew;
    return [cfg, so](int64_t layer, int64_t e) -> absl::StatusOr<MoeLayerWeights> {
      return checkpoint::SyntheticExperts(cfg, layer, e, e + 1, so);
    };
  }
  auto ckpt = std::make_shared<std::unique_ptr<checkpoint::Checkpoint>>();
  auto mu = std::make_shared<std::mutex>();
  return [dir = o.checkpoint, cfg, ckpt, mu](int64_t layer,
                                             int64_t e) -> absl::StatusOr<MoeLayerWeights> {
    std::lock_guard<std::mutex> lock(*mu);
    if (*ckpt == nullptr) {
      MOE_ASSIGN_OR_RETURN(*ckpt, checkpoint::Checkpoint::Open(dir));
    }
    checkpoint::LoadOptions lo;
    lo.dense = false;
    lo.expert_lo = e;
    lo.expert_hi = e + 1;
    return checkpoint::LoadMoeLayer(**ckpt, cfg, layer, lo);
  };
}

}  // namespace

absl::Status ExpertServer::Impl::Load() {
  if (!options_.ranges_file.empty()) {
    std::ifstream f(options_.ranges_file);
    if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", options_.ranges_file));
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const char* host = std::getenv("HOSTNAME");
    MOE_ASSIGN_OR_RETURN(placement::Range range,
                         placement::PodRange(text, options_.ordinal, host != nullptr ? host : ""));
    options_.expert_lo = range.lo;
    options_.expert_hi = range.hi;
  }
  std::vector<int64_t> layers = options_.layers;
  if (!options_.checkpoint.empty()) {
    MOE_ASSIGN_OR_RETURN(ckpt_, checkpoint::Checkpoint::Open(options_.checkpoint));
    MOE_ASSIGN_OR_RETURN(cfg_, ckpt_->LoadConfig());
  } else {
    MOE_ASSIGN_OR_RETURN(cfg_, PresetConfig(options_.preset));
  }
  if (layers.empty()) layers.push_back(cfg_.first_moe_layer);
  const int64_t lo = options_.expert_lo;
  const int64_t hi = options_.expert_hi < 0 ? cfg_.num_experts : options_.expert_hi;
  if (lo < 0 || lo >= hi || hi > cfg_.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("expert range [", lo, ", ", hi,
                                                   ") is not inside [0, ", cfg_.num_experts, ")"));
  }
  options_.expert_hi = hi;
  for (int64_t layer : layers) {
    if (!cfg_.IsMoeLayer(layer)) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " is not a MoE layer"));
    }
    MoeLayerWeights w;
    if (ckpt_ != nullptr) {
      checkpoint::LoadOptions lo_opt;
      lo_opt.dense = false;
      lo_opt.expert_lo = lo;
      lo_opt.expert_hi = hi;
      Progress progress(absl::StrCat("shard ", options_.shard, ": loading layer ", layer,
                                     " experts [", lo, ", ", hi, ")"),
                        (hi - lo) * cfg_.ExpertBytes());
      lo_opt.on_expert_loaded = [&](int64_t bytes) { progress.Add(bytes); };
      MOE_ASSIGN_OR_RETURN(w, checkpoint::LoadMoeLayer(*ckpt_, cfg_, layer, lo_opt));
    } else {
      checkpoint::SyntheticOptions so;
      so.seed = options_.seed;
      so.router_skew = options_.router_skew;
      // Only this server's range (the whole k3 layer would be 15.7 GB).
      w = checkpoint::SyntheticExperts(cfg_, layer, lo, hi, so);
    }
    // Checks the shapes of every expert of the range (need_experts would demand all E).
    MOE_RETURN_IF_ERROR(numerics::ValidateLayerWeights(cfg_, w, /*need_dense=*/false,
                                                       /*need_experts=*/false));
    layers_[layer] = std::move(w);
  }
  kernels_ = &numerics::cpu::KernelsFor(numerics::cpu::CapIsa(options_.isa));
  pool_ = std::make_unique<numerics::cpu::ThreadPool>(options_.threads);
  for (const auto& [layer, w] : layers_) {
    MOE_ASSIGN_OR_RETURN(backends_[layer],
                         MakeExpertBackend(options_.backend, cfg_, w, *kernels_, pool_.get()));
  }
  {
    const std::vector<numerics::Precision> can = backends_.begin()->second->precisions();
    if (precisions_.empty()) precisions_ = can;
    for (numerics::Precision p : precisions_) {
      if (std::find(can.begin(), can.end(), p) == can.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "--precision ", PrecisionList(precisions_), ": backend ",
            backends_.begin()->second->name(), " computes ", PrecisionList(can), " only"));
      }
    }
  }
  MOE_LOG_INFO("shard {}: experts [{}, {}) of layers {} loaded, backend {}", options_.shard,
               options_.expert_lo, options_.expert_hi, fmt::join(layers, ","),
               backends_.begin()->second->name());
  // The limits of the CPU the kernels run on, before any traffic (bounded: 512 MiB read, 3 x
  // 50 ms of FMAs, about 0.4 s). A GPU backend's limits are not these.
  if (options_.measure_limits && backends_.begin()->second->name().rfind("cpu", 0) == 0) {
    numerics::cpu::LimitsOptions lo;
    lo.read_bytes = int64_t{512} << 20;
    lo.read_passes = 3;
    lo.fma_seconds = 0.05;
    limits_ = numerics::cpu::MeasureMachineLimits(*kernels_, pool_.get(), lo);
    MOE_LOG_INFO(
        "shard {}: this machine: read {:.1f} GB/s, {} FMA peak {:.1f} GFLOP/s ({} threads, "
        "measured in {:.2f} s)",
        options_.shard, limits_.read_bytes_per_second / 1e9, numerics::cpu::IsaName(limits_.isa),
        limits_.fma_flops_per_second / 1e9, limits_.threads, limits_.seconds);
  }
  return absl::OkStatus();
}

absl::Status ExpertServer::Impl::StartServing() {
  // Metrics first: the gRPC port file is the launcher's signal that everything is up.
  std::vector<int64_t> layers;
  for (const auto& [l, w] : layers_) layers.push_back(l);
  if (options_.metrics_port >= 0) {
    MOE_ASSIGN_OR_RETURN(metrics_server_,
                         metrics::MetricsServer::Start(options_.host, options_.metrics_port));
    metrics_ = std::make_unique<metrics::ExpertMetrics>(metrics_server_->registry(), layers,
                                                        options_.shard);
    if (!options_.metrics_port_file.empty()) {
      MOE_RETURN_IF_ERROR(
          transport::WritePortFile(options_.metrics_port_file, metrics_server_->port()));
    }
  }
  if (metrics_ != nullptr && limits_.threads > 0) {
    metrics_->SetMachineLimits(limits_.read_bytes_per_second, limits_.fma_flops_per_second,
                               numerics::cpu::IsaName(limits_.isa));
  }
  if (options_.verify_fraction > 0) {
    BatchVerifierOptions vo;
    vo.fraction = options_.verify_fraction;
    verifier_ = std::make_unique<BatchVerifier>(
        cfg_, vo, ReferenceWeightsFor(options_, cfg_),
        [this](VerifyResult r, const std::string& detail) {
          if (r == VerifyResult::kMismatch || r == VerifyResult::kError) {
            MOE_LOG_ERROR("shard {}: production check {}: {}", options_.shard, VerifyResultName(r),
                          detail);
          }
          if (metrics_ != nullptr) metrics_->Verified(VerifyResultName(r));
        });
  }
  // Read before anything listens: with a token, Dispatch and OpenDataPlane need it from the
  // first call on.
  if (!options_.cluster_token_file.empty()) {
    MOE_ASSIGN_OR_RETURN(options_.cluster_token, ReadSecretFile(options_.cluster_token_file));
  }
  compute_thread_ = std::thread([this] { ComputeLoop(); });
  transport::GrpcServerOptions so;
  so.host = options_.host;
  so.port = options_.port;
  so.max_receive_message_bytes = options_.max_message_bytes;
  so.max_send_message_bytes = options_.max_message_bytes;
  so.services = {this};
  MOE_RETURN_IF_ERROR(StartDataPlane());
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
    req.set_data_plane(ucx_ != nullptr ? "ucx" : "grpc");
    for (const auto& [l, w] : layers_) {
      v1::ExpertRange* r = req.add_ranges();
      r->set_layer(static_cast<int32_t>(l));
      r->set_expert_lo(static_cast<int32_t>(w.expert_lo));
      r->set_expert_hi(static_cast<int32_t>(w.expert_hi));
    }
    router_ = std::make_unique<client::RouterLink>(options_.router, client::RouterLinkTimings{},
                                                   options_.cluster_token);
    router_->KeepRegistered(std::move(req), [this] {
      std::lock_guard<std::mutex> lock(mu_);
      return static_cast<int64_t>(queue_.size());
    });
  }
  return absl::OkStatus();
}

void ExpertServer::Impl::Compute(const Batch& b, v1::DispatchReply* reply) {
  const int64_t d = cfg_.latent;
  // y: [rows, D], row i from expert routing.expert_ids[i].
  ExpertBackend& backend = *backends_.at(b.layer->layer);
  absl::StatusOr<std::vector<Bf16>> computed = backend.Run(b.routing, b.z);
  if (!computed.ok()) {
    transport::SetBatchStatus(
        absl::Status(computed.status().code(),
                     absl::StrCat("shard ", options_.shard, ": ", computed.status().message())),
        reply);
    return;
  }
  const std::vector<Bf16>& y = *computed;
  reply->set_precision(transport::PrecisionToProto(b.precision));
  if (verifier_ != nullptr) {
    verifier_->OnBatch(b.batch_id, b.layer->layer, b.routing, b.z, y.data());
  }
  if (b.mode == v1::REPLY_MODE_PER_PAIR) {
    transport::EncodeBf16Into(y, b.rows, d, reply->mutable_outputs());
    return;
  }
  // Partial sums per distinct token (ascending), over the token's experts in ascending expert
  // id (the groups' order): numerics/combine.h.
  std::vector<float> acc;
  const std::vector<int64_t> distinct = numerics::PartialSums(
      y.data(), b.rows, d, b.token_index.data(), b.weights.data(), b.num_tokens, &acc);
  *reply->mutable_outputs() = transport::EncodeF32(acc, static_cast<int64_t>(distinct.size()), d);
}

absl::Status ExpertServer::Impl::Enqueue(std::unique_ptr<Batch> b, DispatchReactor* reactor) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) {
    return absl::UnavailableError(absl::StrCat("shard ", options_.shard, " is shutting down"));
  }
  if (static_cast<int>(queue_.size()) >= options_.max_queued_batches) {
    return absl::ResourceExhaustedError(absl::StrCat("shard ", options_.shard,
                                                     ": compute queue full (",
                                                     options_.max_queued_batches, " batches)"));
  }
  queue_.emplace_back(std::move(b), reactor);
  if (metrics_ != nullptr) metrics_->common.QueueDepth(static_cast<int64_t>(queue_.size()));
  cv_.notify_one();
  return absl::OkStatus();
}

void ExpertServer::Impl::ComputeLoop() {
  for (;;) {
    std::unique_ptr<Batch> b;
    DispatchReactor* reactor = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (!cv_.wait_for(lock, kIdleTick, [&] { return stopping_ || !queue_.empty(); })) {
        if (metrics_ != nullptr) metrics_->Tick();  // the busy ratio decays while idle
      }
      if (queue_.empty()) return;  // stopping, nothing left
      b = std::move(queue_.front().first);
      reactor = queue_.front().second;
      queue_.pop_front();
      if (metrics_ != nullptr) metrics_->common.QueueDepth(static_cast<int64_t>(queue_.size()));
    }
    v1::DispatchReply reply;
    reply.set_batch_id(b->batch_id);
    reply.set_shard(options_.shard);
    const auto start = Clock::now();
    reply.set_queue_seconds(Seconds(start - b->arrived));
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping = stopping_;
    }
    if (stopping) {
      transport::SetBatchStatus(
          absl::UnavailableError(absl::StrCat("shard ", options_.shard, " is shutting down")),
          &reply);
    } else if (start > b->expires) {
      transport::SetBatchStatus(absl::DeadlineExceededError(
                                    absl::StrCat("shard ", options_.shard, ": batch ", b->batch_id,
                                                 " waited past its deadline in the queue")),
                                &reply);
    } else {
      if (metrics_ != nullptr) metrics_->common.Started("Dispatch");
      Compute(*b, &reply);
      reply.set_compute_seconds(Seconds(Clock::now() - start));
      if (metrics_ != nullptr) metrics_->common.Finished("Dispatch", reply.code() == 0);
    }
    if (metrics_ != nullptr) {
      if (reply.code() == 0) {
        // Each distinct expert's weights stream once per batch (rows are grouped by expert).
        metrics_->BatchDone(b->layer->layer, reply.queue_seconds(), reply.compute_seconds(),
                            b->rows, static_cast<double>(b->experts) * cfg_.ExpertBytes(),
                            6.0 * cfg_.latent * cfg_.intermediate * b->rows);
        metrics_->wire.Add("sent", b->mode == v1::REPLY_MODE_PER_PAIR ? "bf16" : "f32", "attention",
                           static_cast<int64_t>(reply.outputs().data().size()),
                           reply.outputs().shape_size() > 0 ? reply.outputs().shape(0) : 0,
                           b->out_of_band != nullptr ? "ucx" : "grpc");
      } else {
        metrics_->common.Error(
            "Dispatch", absl::StatusCodeToString(static_cast<absl::StatusCode>(reply.code())));
      }
    }
    if (b->out_of_band != nullptr && reply.code() == 0) {
      ReplyOutOfBand(*b, std::move(reply), reactor);
    } else {
      reactor->Reply(std::move(reply), /*ends_work=*/true);
    }
  }
}

absl::Status ExpertServer::Impl::CheckMember(const grpc::CallbackServerContext& context,
                                             const char* what) const {
  if (options_.cluster_token.empty() ||
      transport::HasSecretMetadata(context, transport::kClusterTokenMetadata,
                                   options_.cluster_token)) {
    return absl::OkStatus();
  }
  if (metrics_ != nullptr) metrics_->common.Error(what, "UNAUTHENTICATED");
  return absl::UnauthenticatedError(absl::StrCat(what, " to shard ", options_.shard,
                                                 " needs the cluster token in the ",
                                                 transport::kClusterTokenMetadata, " metadata"));
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

v1::DispatchReply ExpertServer::Impl::ErrorReply(uint64_t batch_id, const absl::Status& s) const {
  v1::DispatchReply reply;
  reply.set_batch_id(batch_id);
  transport::SetBatchStatus(s, &reply);
  reply.set_shard(options_.shard);
  return reply;
}

void ExpertServer::Impl::OnDispatch(v1::DispatchRequest req, DispatchReactor* stream) {
  if (req.has_out_of_band()) {
    stream->BeginWork();
    ReceiveOutOfBand(std::move(req), stream);
    return;
  }
  if (metrics_ != nullptr) {
    metrics_->wire.Add("received", WireDtype(req.activations()), "attention",
                       static_cast<int64_t>(req.activations().data().size()),
                       req.activations().shape_size() > 0 ? req.activations().shape(0) : 0);
  }
  Admit(req, stream, /*work_begun=*/false, nullptr);
}

void ExpertServer::Impl::Admit(v1::DispatchRequest& req, DispatchReactor* stream, bool work_begun,
                               const Batch* oob, const std::string_view* oob_bytes) {
  absl::StatusOr<std::unique_ptr<Batch>> batch =
      ValidateDispatch(req, oob_bytes,
                       DispatchLimits{options_.shard, cfg_.num_experts, cfg_.latent,
                                      options_.max_message_bytes, precisions_},
                       layers_);
  if (!batch.ok()) {
    if (metrics_ != nullptr) {
      metrics_->common.Error("Dispatch", absl::StatusCodeToString(batch.status().code()));
    }
    stream->Reply(ErrorReply(req.batch_id(), batch.status()), /*ends_work=*/work_begun);
    return;
  }
  if (oob != nullptr) {
    (*batch)->out_of_band = oob->out_of_band;
    (*batch)->receive_seconds = oob->receive_seconds;
    (*batch)->arrived = oob->arrived;
    (*batch)->expires = oob->expires;
  }
  if (!work_begun) stream->BeginWork();
  if (absl::Status queued = Enqueue(std::move(*batch), stream); !queued.ok()) {
    if (metrics_ != nullptr) {
      metrics_->common.Error("Dispatch", absl::StatusCodeToString(queued.code()));
    }
    stream->Reply(ErrorReply(req.batch_id(), queued), /*ends_work=*/true);
  }
}

void ExpertServer::Impl::ReceiveOutOfBand(v1::DispatchRequest req, DispatchReactor* stream) {
  const v1::OutOfBand& o = req.out_of_band();
  auto h = std::make_shared<OutOfBandHeader>();
  h->batch_id = req.batch_id();
  h->client_id = o.client_id();
  h->tag = o.tag();
  h->activation_bytes = o.activation_bytes();
  h->reply_tag = o.reply_tag();
  h->reply_bytes = o.reply_capacity_bytes();
  h->sequence = o.sequence();
  h->activation_mac = o.activation_mac();
  std::shared_lock<std::shared_mutex> ucx_lock(ucx_mu_);
  if (ucx_ == nullptr) {
    const absl::Status s = absl::FailedPreconditionError(
        absl::StrCat("shard ", options_.shard, ", batch ", req.batch_id(),
                     ": this server has no UCX data plane (send the batch in band)"));
    if (metrics_ != nullptr) metrics_->common.Error("Dispatch", absl::StatusCodeToString(s.code()));
    stream->Reply(ErrorReply(req.batch_id(), s), /*ends_work=*/true);
    return;
  }
  auto info = std::make_shared<Batch>();
  info->out_of_band = h;
  info->arrived = Clock::now();
  const auto budget = BatchBudget(req.timeout_ms());
  info->expires = info->arrived + budget;
  const absl::Time deadline = absl::Now() + absl::FromChrono(budget);
  auto shared_req = std::make_shared<v1::DispatchRequest>(std::move(req));
  // Runs on the UCX progress thread once the payload is in and its MAC matched (or not).
  ucx_->Receive(*h, deadline,
                [this, shared_req, stream, info](const absl::Status& s, std::string_view bytes) {
                  if (!s.ok()) {
                    if (metrics_ != nullptr) {
                      metrics_->common.Error("Dispatch", absl::StatusCodeToString(s.code()));
                    }
                    stream->Reply(ErrorReply(shared_req->batch_id(), s), /*ends_work=*/true);
                    return;
                  }
                  info->receive_seconds = Seconds(Clock::now() - info->arrived);
                  if (metrics_ != nullptr) {
                    const v1::Tensor& a = shared_req->activations();
                    metrics_->wire.Add("received", WireDtype(a), "attention",
                                       static_cast<int64_t>(bytes.size()),
                                       a.shape_size() > 0 ? a.shape(0) : 0, "ucx");
                  }
                  // Validated and copied into the batch straight from the registered buffer.
                  Admit(*shared_req, stream, /*work_begun=*/true, info.get(), &bytes);
                });
}

void ExpertServer::Impl::ReplyOutOfBand(const Batch& b, v1::DispatchReply reply,
                                        DispatchReactor* reactor) {
  reply.set_receive_seconds(b.receive_seconds);
  const OutOfBandHeader& h = *b.out_of_band;
  const absl::Time deadline = (b.expires == Clock::time_point::max()
                                   ? absl::Now() + absl::FromChrono(kNoBudget)
                                   : absl::Now() + absl::FromChrono(b.expires - Clock::now())) +
                              kReplySendGrace;
  auto header = std::make_shared<v1::DispatchReply>();
  const std::string& data = reply.outputs().data();
  std::shared_lock<std::shared_mutex> ucx_lock(ucx_mu_);
  if (ucx_ == nullptr) {
    transport::SetBatchStatus(absl::UnavailableError(absl::StrCat(
                                  "shard ", options_.shard, " is shutting down its data plane")),
                              &reply);
    reactor->Reply(std::move(reply), /*ends_work=*/true);
    return;
  }
  const int64_t n = static_cast<int64_t>(data.size());
  // The header goes out once UCX is done with the payload (on the progress thread).
  const absl::Status sent = ucx_->Reply(
      h, data, deadline,
      [&](const std::string& mac) {
        v1::DispatchReply r = reply;  // the outputs' bytes travel out of band
        r.mutable_outputs()->clear_data();
        r.set_out_of_band(true);
        r.set_output_bytes(n);
        r.set_output_mac(mac);
        *header = std::move(r);
      },
      [this, header, reactor, batch_id = b.batch_id](const absl::Status& s) {
        if (!s.ok()) {
          header->Clear();
          header->set_batch_id(batch_id);
          header->set_shard(options_.shard);
          transport::SetBatchStatus(absl::UnavailableError(absl::StrCat(
                                        "shard ", options_.shard, ", batch ", batch_id,
                                        ": the reply payload did not go out: ", s.message())),
                                    header.get());
        }
        reactor->Reply(std::move(*header), /*ends_work=*/true);
      });
  if (!sent.ok()) {
    reply.mutable_outputs()->Clear();
    transport::SetBatchStatus(sent, &reply);
    reactor->Reply(std::move(reply), /*ends_work=*/true);
  }
}

grpc::ServerUnaryReactor* ExpertServer::Impl::GetInfo(grpc::CallbackServerContext* context,
                                                      const v1::GetExpertInfoRequest*,
                                                      v1::ExpertServerInfo* response) {
  response->set_shard(options_.shard);
  for (const auto& [l, w] : layers_) response->add_layers(static_cast<int32_t>(l));
  response->set_expert_lo(static_cast<int32_t>(options_.expert_lo));
  response->set_expert_hi(static_cast<int32_t>(options_.expert_hi));
  response->set_num_experts(static_cast<int32_t>(cfg_.num_experts));
  response->set_latent(static_cast<int32_t>(cfg_.latent));
  response->set_backend(backends_.begin()->second->name());
  for (numerics::Precision p : precisions_) {
    response->add_precisions(transport::PrecisionToProto(p));
  }
  {
    std::shared_lock<std::shared_mutex> lock(ucx_mu_);
    response->set_data_plane(ucx_ != nullptr ? "ucx" : "grpc");
    if (ucx_ != nullptr) {
      response->set_ucx_tls(ucx_->tls());
      // UCX authenticates nobody: its address only for members.
      if (options_.cluster_token.empty() ||
          transport::HasSecretMetadata(*context, transport::kClusterTokenMetadata,
                                       options_.cluster_token)) {
        response->set_ucx_address(ucx_->address());
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
    if (!s.ok() && metrics_ != nullptr) {
      metrics_->common.Error("OpenDataPlane", absl::StatusCodeToString(s.code()));
    }
    reactor->Finish(transport::ToGrpc(s));
    return reactor;
  };
  if (absl::Status s = CheckMember(*context, "OpenDataPlane"); !s.ok()) {
    reactor->Finish(transport::ToGrpc(s));
    return reactor;
  }
  std::shared_lock<std::shared_mutex> ucx_lock(ucx_mu_);
  if (ucx_ == nullptr) {
    return finish(absl::FailedPreconditionError(absl::StrCat(
        "shard ", options_.shard, " has no UCX data plane (",
        dataplane::UcxBuilt() ? "started with --data_plane=grpc" : "built without UCX", ")")));
  }
  const absl::StatusOr<DataPlaneClient> client = ucx_->Open(request->node());
  if (!client.ok()) {
    return finish(absl::Status(client.status().code(), absl::StrCat("shard ", options_.shard, ": ",
                                                                    client.status().message())));
  }
  response->set_client_id(client->id);
  response->set_worker_address(ucx_->address());
  response->set_tls(ucx_->tls());
  response->set_hello_secret(client->hello_secret);
  response->set_ack_tag(client->ack_tag);
  response->set_mac_key(client->mac_key);
  response->set_chunk_bytes(static_cast<int64_t>(ucx_->chunk_bytes()));
  return finish(absl::OkStatus());
}

absl::Status ExpertServer::Impl::StartDataPlane() {
  if (options_.data_plane == dataplane::DataPlane::kGrpc) return absl::OkStatus();
  UcxDataPlaneOptions uo;
  uo.shard = options_.shard;
  uo.tls = options_.ucx_tls;
  uo.max_clients = options_.max_data_plane_clients;
  uo.max_message_bytes = options_.max_message_bytes;
  uo.on_event = [this](const std::string& event) {
    if (metrics_ != nullptr) metrics_->DataPlaneEvent(event);
  };
  auto w = UcxDataPlane::Start(std::move(uo));
  if (!w.ok()) {
    if (options_.data_plane == dataplane::DataPlane::kUcx) {
      return absl::FailedPreconditionError(
          absl::StrCat("--data_plane=ucx: ", w.status().message()));
    }
    MOE_LOG_WARN("shard {}: no UCX data plane ({}): in band only", options_.shard,
                 w.status().ToString());
    return absl::OkStatus();
  }
  std::unique_lock<std::shared_mutex> lock(ucx_mu_);
  ucx_ = std::move(*w);
  MOE_LOG_INFO("shard {}: UCX data plane up (UCX_TLS {})", options_.shard, ucx_->tls());
  return absl::OkStatus();
}

void ExpertServer::Impl::Shutdown(absl::Duration grace) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    cv_.notify_all();
  }
  if (router_ != nullptr) router_->Stop();
  // The compute thread answers what is queued (UNAVAILABLE) before the streams are cancelled.
  if (compute_thread_.joinable()) compute_thread_.join();
  verifier_.reset();  // finishes the check in progress; what waits is counted as skipped
  {
    // Unfinished transfers fail (their batches are answered UNAVAILABLE) while the streams live.
    std::unique_lock<std::shared_mutex> lock(ucx_mu_);
    ucx_.reset();
  }
  if (server_ != nullptr) server_->Shutdown(grace);
}

ExpertServer::ExpertServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ExpertServer::~ExpertServer() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<ExpertServer>> ExpertServer::Start(
    const ExpertServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  MOE_RETURN_IF_ERROR(impl->Load());
  MOE_RETURN_IF_ERROR(impl->StartServing());
  return std::unique_ptr<ExpertServer>(new ExpertServer(std::move(impl)));
}

int ExpertServer::port() const { return impl_->port(); }
void ExpertServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }
void ExpertServer::Wait() { impl_->Wait(); }

}  // namespace moe::expert_svc
