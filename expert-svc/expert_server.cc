#include "expert-svc/expert_server.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "expert-svc/batch_verifier.h"
#include "expert-svc/expert_backend.h"
#include "moe/v1/expert.grpc.pb.h"
#include "moe/v1/router.grpc.pb.h"
#include "services/checkpoint/checkpoint.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/client/router_link.h"
#include "services/common/status_macros.h"
#include "services/metrics/metrics_server.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/combine.h"
#include "services/numerics/cpu/expert_ffn.h"
#include "services/numerics/cpu/kernels.h"
#include "services/numerics/cpu/machine_limits.h"
#include "services/numerics/cpu/thread_pool.h"
#include "services/numerics/moe_layer.h"
#include "services/placement/placement.h"
#include "services/transport/grpc_server.h"
#include "services/transport/status_convert.h"
#include "services/transport/stream_reactor.h"
#include "services/transport/tensor_codec.h"

namespace moe::expert_svc {

using numerics::MoeLayerWeights;
using tensor::Bf16;

namespace {

using Clock = std::chrono::steady_clock;

// An idle compute thread wakes this often so that the busy ratio decays to 0.
constexpr std::chrono::seconds kIdleTick(1);

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A validated batch, ready to compute.
struct Batch {
  uint64_t batch_id = 0;
  const MoeLayerWeights* layer = nullptr;
  v1::ReplyMode mode = v1::REPLY_MODE_PER_PAIR;
  int64_t rows = 0;
  int64_t experts = 0;        // distinct experts (the request's groups, strictly ascending)
  numerics::Routing routing;  // one row per (token, expert) pair: tokens = rows, top_k = 1
  std::vector<Bf16> z;        // [rows, D]
  std::vector<int32_t> token_index;
  std::vector<float> weights;
  int32_t num_tokens = 0;
  Clock::time_point arrived;
  Clock::time_point expires = Clock::time_point::max();
};

using DispatchReactor = transport::StreamReactor<v1::DispatchRequest, v1::DispatchReply>;

}  // namespace

class ExpertServer::Impl final : public v1::ExpertService::CallbackService {
 public:
  explicit Impl(const ExpertServerOptions& o) : options_(o) {}

  absl::Status Load();
  absl::Status StartServing();
  void Shutdown(absl::Duration grace);

  // Validates a request against what is hosted here (codes as in expert.proto).
  absl::StatusOr<std::unique_ptr<Batch>> Validate(v1::DispatchRequest& req) const;
  // Runs one batch and fills the reply (outputs, timings).
  void Compute(const Batch& b, v1::DispatchReply* reply);
  // Queues a batch for the compute thread: RESOURCE_EXHAUSTED when the queue is full,
  // UNAVAILABLE when shutting down.
  absl::Status Enqueue(std::unique_ptr<Batch> b, DispatchReactor* reactor);

  grpc::ServerBidiReactor<v1::DispatchRequest, v1::DispatchReply>* Dispatch(
      grpc::CallbackServerContext* context) override;
  void OnDispatch(v1::DispatchRequest req, DispatchReactor* stream);
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* context,
                                    const v1::GetExpertInfoRequest* request,
                                    v1::ExpertServerInfo* response) override;

  const std::string& shard() const { return options_.shard; }
  int port() const { return server_ != nullptr ? server_->port() : 0; }
  void Wait() {
    if (server_ != nullptr) server_->Wait();
  }

 private:
  void ComputeLoop();

  ExpertServerOptions options_;
  ModelConfig cfg_;
  std::unique_ptr<checkpoint::Checkpoint> ckpt_;
  std::map<int64_t, MoeLayerWeights> layers_;
  std::map<int64_t, std::unique_ptr<ExpertBackend>> backends_;  // per hosted layer
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
    int64_t ordinal = options_.ordinal;
    if (ordinal < 0) {
      const char* host = std::getenv("HOSTNAME");
      MOE_ASSIGN_OR_RETURN(ordinal, placement::OrdinalFromHostname(host != nullptr ? host : ""));
    }
    MOE_ASSIGN_OR_RETURN(placement::RangeTable table, placement::ParseRangeTable(text));
    MOE_ASSIGN_OR_RETURN(placement::Range range, placement::RangeForOrdinal(table, ordinal));
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
  std::fprintf(stderr, "expert-svc: shard %s, experts [%lld, %lld), backend %s\n",
               options_.shard.c_str(), static_cast<long long>(options_.expert_lo),
               static_cast<long long>(options_.expert_hi),
               backends_.begin()->second->name().c_str());
  // The limits of the CPU the kernels run on, before any traffic (bounded: 512 MiB read, 3 x
  // 50 ms of FMAs, about 0.4 s). A GPU backend's limits are not these.
  if (options_.measure_limits && backends_.begin()->second->name().rfind("cpu", 0) == 0) {
    numerics::cpu::LimitsOptions lo;
    lo.read_bytes = int64_t{512} << 20;
    lo.read_passes = 3;
    lo.fma_seconds = 0.05;
    limits_ = numerics::cpu::MeasureMachineLimits(*kernels_, pool_.get(), lo);
    std::fprintf(stderr,
                 "expert-svc: shard %s, this machine: read %.1f GB/s, %s FMA peak %.1f GFLOP/s "
                 "(%d threads, measured in %.2f s)\n",
                 options_.shard.c_str(), limits_.read_bytes_per_second / 1e9,
                 numerics::cpu::IsaName(limits_.isa), limits_.fma_flops_per_second / 1e9,
                 limits_.threads, limits_.seconds);
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
            std::fprintf(stderr, "expert-svc: shard %s: production check %s: %s\n",
                         options_.shard.c_str(), VerifyResultName(r), detail.c_str());
          }
          if (metrics_ != nullptr) metrics_->Verified(VerifyResultName(r));
        });
  }
  compute_thread_ = std::thread([this] { ComputeLoop(); });
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
    for (const auto& [l, w] : layers_) {
      v1::ExpertRange* r = req.add_ranges();
      r->set_layer(static_cast<int32_t>(l));
      r->set_expert_lo(static_cast<int32_t>(w.expert_lo));
      r->set_expert_hi(static_cast<int32_t>(w.expert_hi));
    }
    router_ = std::make_unique<client::RouterLink>(options_.router);
    router_->KeepRegistered(std::move(req), [this] {
      std::lock_guard<std::mutex> lock(mu_);
      return static_cast<int64_t>(queue_.size());
    });
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Batch>> ExpertServer::Impl::Validate(
    v1::DispatchRequest& req) const {
  const std::string where = absl::StrCat("shard ", options_.shard, ", batch ", req.batch_id());
  auto it = layers_.find(req.layer());
  if (it == layers_.end()) {
    std::vector<int64_t> hosted;
    for (const auto& [l, w] : layers_) hosted.push_back(l);
    return absl::NotFoundError(absl::StrCat(where, ": layer ", req.layer(),
                                            " is not hosted here (layers ",
                                            absl::StrJoin(hosted, ","), ")"));
  }
  auto b = std::make_unique<Batch>();
  b->batch_id = req.batch_id();
  b->layer = &it->second;
  b->mode =
      req.reply_mode() == v1::REPLY_MODE_UNSPECIFIED ? v1::REPLY_MODE_PER_PAIR : req.reply_mode();
  if (b->mode != v1::REPLY_MODE_PER_PAIR && b->mode != v1::REPLY_MODE_PARTIAL_SUM) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": unknown reply_mode ", static_cast<int>(req.reply_mode())));
  }
  if (req.groups_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": no expert groups"));
  }
  int64_t rows = 0;
  int64_t prev = -1;
  for (const v1::ExpertGroup& g : req.groups()) {
    if (g.expert_id() < 0 || g.expert_id() >= cfg_.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": expert id ", g.expert_id(),
                                                     " outside [0, ", cfg_.num_experts, ")"));
    }
    if (!b->layer->HostsExpert(g.expert_id())) {
      return absl::NotFoundError(absl::StrCat(where, ": expert ", g.expert_id(), " of layer ",
                                              req.layer(), " is not hosted here (experts [",
                                              options_.expert_lo, ", ", options_.expert_hi, "))"));
    }
    if (g.expert_id() <= prev) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": expert ids must be strictly ascending (", g.expert_id(), " after ", prev, ")"));
    }
    if (g.token_count() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expert ", g.expert_id(), " has token_count ", g.token_count()));
    }
    prev = g.expert_id();
    rows += g.token_count();
  }
  MOE_ASSIGN_OR_RETURN(transport::Bf16Matrix z,
                       transport::DecodeBf16Matrix(req.activations(), where + ": activations",
                                                   cfg_.latent, /*accept_f32=*/false));
  if (req.row_source_size() == 0 && z.rows != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": activations have ", z.rows, " rows but the groups count ", rows));
  }
  if (req.row_source_size() != 0 && req.row_source_size() != rows) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", req.row_source_size(),
                                                   " row_source entries for ", rows, " rows"));
  }
  b->rows = rows;
  b->experts = req.groups_size();
  b->routing.tokens = rows;
  b->routing.top_k = 1;
  b->routing.expert_ids.reserve(static_cast<size_t>(rows));
  for (const v1::ExpertGroup& g : req.groups()) {
    b->routing.expert_ids.insert(b->routing.expert_ids.end(), g.token_count(), g.expert_id());
  }
  b->routing.weights.assign(static_cast<size_t>(rows), 1.0f);
  // NaN policy: non-finite activations are rejected (they would poison every partial sum).
  const int64_t d = cfg_.latent;
  // bf16 is finite unless all 8 exponent bits are set: one test per value, no conversion.
  uint16_t any_bad = 0;
  for (const Bf16& v : z.values) any_bad |= static_cast<uint16_t>((v.bits & 0x7f80u) == 0x7f80u);
  for (int64_t r = 0; any_bad != 0 && r < z.rows; ++r) {
    for (int64_t c = 0; c < d; ++c) {
      if (!std::isfinite(z.values[r * d + c].ToFloat())) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": activations row ", r,
            req.row_source_size() == 0 ? absl::StrCat(" (expert ", b->routing.expert_ids[r], ")")
                                       : std::string(),
            " column ", c, " is not finite"));
      }
    }
  }
  if (req.row_source_size() == 0) {
    b->z = std::move(z.values);
  } else {
    b->z.resize(static_cast<size_t>(rows * d));
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t src = req.row_source(static_cast<int>(r));
      if (src < 0 || src >= z.rows) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": row_source[", r, "] = ", src, " outside [0, ", z.rows, ")"));
      }
      std::copy_n(z.values.data() + src * d, d, b->z.data() + r * d);
    }
  }
  if (b->mode == v1::REPLY_MODE_PARTIAL_SUM) {
    if (req.token_index_size() != rows || req.weights_size() != rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": partial sums need one token_index and one weight per row (", rows, " rows, ",
          req.token_index_size(), " token_index, ", req.weights_size(), " weights)"));
    }
    if (req.num_tokens() < 1) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": num_tokens must be >= 1"));
    }
    int64_t row = 0;
    for (const v1::ExpertGroup& g : req.groups()) {
      int32_t last = -1;
      for (int32_t i = 0; i < g.token_count(); ++i, ++row) {
        const int32_t t = req.token_index(static_cast<int>(row));
        const float w = req.weights(static_cast<int>(row));
        if (t < 0 || t >= req.num_tokens() || t <= last) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": row ", row, " token_index ", t, " must lie in [0, ",
                           req.num_tokens(), ") and ascend within expert ", g.expert_id()));
        }
        if (!std::isfinite(w)) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": row ", row, " weight is not finite"));
        }
        last = t;
      }
    }
    b->token_index.assign(req.token_index().begin(), req.token_index().end());
    b->weights.assign(req.weights().begin(), req.weights().end());
    b->num_tokens = req.num_tokens();
  }
  b->arrived = Clock::now();
  if (req.timeout_ms() > 0) b->expires = b->arrived + std::chrono::milliseconds(req.timeout_ms());
  return b;
}

void ExpertServer::Impl::Compute(const Batch& b, v1::DispatchReply* reply) {
  const int64_t d = cfg_.latent;
  // y: [rows, D], row i from expert routing.expert_ids[i].
  absl::StatusOr<std::vector<Bf16>> computed =
      backends_.at(b.layer->layer)->Run(b.routing, b.z.data());
  if (!computed.ok()) {
    transport::SetBatchStatus(
        absl::Status(computed.status().code(),
                     absl::StrCat("shard ", options_.shard, ": ", computed.status().message())),
        reply);
    return;
  }
  const std::vector<Bf16>& y = *computed;
  if (verifier_ != nullptr)
    verifier_->OnBatch(b.batch_id, b.layer->layer, b.routing, b.z.data(), y.data());
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
      Compute(*b, &reply);
      reply.set_compute_seconds(Seconds(Clock::now() - start));
    }
    if (metrics_ != nullptr) {
      if (reply.code() == 0) {
        // Each distinct expert's weights stream once per batch (rows are grouped by expert).
        metrics_->BatchDone(b->layer->layer, reply.queue_seconds(), reply.compute_seconds(),
                            b->rows, static_cast<double>(b->experts) * cfg_.ExpertBytes(),
                            6.0 * cfg_.latent * cfg_.intermediate * b->rows);
        metrics_->wire.Add("sent", b->mode == v1::REPLY_MODE_PER_PAIR ? "bf16" : "f32", "attention",
                           static_cast<int64_t>(reply.outputs().data().size()),
                           reply.outputs().shape_size() > 0 ? reply.outputs().shape(0) : 0);
      } else {
        metrics_->common.Error(
            "Dispatch", absl::StatusCodeToString(static_cast<absl::StatusCode>(reply.code())));
      }
    }
    reactor->Reply(std::move(reply), /*ends_work=*/true);
  }
}

grpc::ServerBidiReactor<v1::DispatchRequest, v1::DispatchReply>* ExpertServer::Impl::Dispatch(
    grpc::CallbackServerContext* /*context*/) {
  return new DispatchReactor([this](v1::DispatchRequest&& req, DispatchReactor* stream) {
    OnDispatch(std::move(req), stream);
  });
}

void ExpertServer::Impl::OnDispatch(v1::DispatchRequest req, DispatchReactor* stream) {
  const uint64_t id = req.batch_id();
  auto error_reply = [&](const absl::Status& s) {
    v1::DispatchReply reply;
    reply.set_batch_id(id);
    transport::SetBatchStatus(s, &reply);
    reply.set_shard(options_.shard);
    return reply;
  };
  if (metrics_ != nullptr) {
    metrics_->wire.Add("received", "bf16", "attention",
                       static_cast<int64_t>(req.activations().data().size()),
                       req.activations().shape_size() > 0 ? req.activations().shape(0) : 0);
  }
  absl::StatusOr<std::unique_ptr<Batch>> batch = Validate(req);
  if (!batch.ok()) {
    if (metrics_ != nullptr) {
      metrics_->common.Error("Dispatch", absl::StatusCodeToString(batch.status().code()));
    }
    stream->Reply(error_reply(batch.status()), /*ends_work=*/false);
    return;
  }
  stream->BeginWork();
  if (absl::Status queued = Enqueue(std::move(*batch), stream); !queued.ok()) {
    if (metrics_ != nullptr) {
      metrics_->common.Error("Dispatch", absl::StatusCodeToString(queued.code()));
    }
    stream->Reply(error_reply(queued), /*ends_work=*/true);
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
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
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
