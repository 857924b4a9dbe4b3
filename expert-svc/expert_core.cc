#include "expert-svc/expert_core.h"

#include <pthread.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "prometheus/registry.h"
#include "services/checkpoint/layer_loader.h"
#include "services/checkpoint/synthetic.h"
#include "services/common/logging.h"
#include "services/common/progress.h"
#include "services/common/status_macros.h"
#include "services/metrics/service_metrics.h"
#include "services/numerics/combine.h"
#include "services/numerics/cpu/kernels.h"
#include "services/numerics/moe_layer.h"
#include "services/placement/placement.h"
#include "services/transport/precision_convert.h"
#include "services/transport/status_convert.h"
#include "services/transport/tensor_codec.h"

namespace moe::expert_svc {

using numerics::MoeLayerWeights;
using tensor::Bf16;

namespace {

// An idle compute thread wakes this often so that the busy ratio decays to 0.
constexpr std::chrono::seconds kIdleTick(1);

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The wire dtype label of a batch's activations (the moe_wire_* metrics).
const char* WireDtype(const v1::Tensor& t) {
  return t.dtype() == v1::DTYPE_MXFP8 ? "mxfp8" : "bf16";
}

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

absl::StatusOr<std::unique_ptr<ExpertCore>> ExpertCore::Load(const ExpertServerOptions& options) {
  auto core = std::unique_ptr<ExpertCore>(new ExpertCore(options));
  MOE_RETURN_IF_ERROR(core->LoadWeights());
  return core;
}

ExpertCore::ExpertCore(const ExpertServerOptions& o) : options_(o), precisions_(o.precisions) {}
ExpertCore::~ExpertCore() { Stop(); }

absl::Status ExpertCore::ResolveRangeFile() {
  if (options_.ranges_file.empty()) return absl::OkStatus();
  std::ifstream f(options_.ranges_file);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", options_.ranges_file));
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const char* host = std::getenv("HOSTNAME");
  MOE_ASSIGN_OR_RETURN(placement::Range range,
                       placement::PodRange(text, options_.ordinal, host != nullptr ? host : ""));
  options_.expert_lo = range.lo;
  options_.expert_hi = range.hi;
  return absl::OkStatus();
}

absl::StatusOr<MoeLayerWeights> ExpertCore::LoadRange(int64_t layer, int64_t lo, int64_t hi) {
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
  return w;
}

absl::Status ExpertCore::LoadWeights() {
  MOE_RETURN_IF_ERROR(ResolveRangeFile());
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
    MOE_ASSIGN_OR_RETURN(layers_[layer], LoadRange(layer, lo, hi));
  }
  MOE_RETURN_IF_ERROR(MakeBackends());
  MOE_LOG_INFO("shard {}: experts [{}, {}) of layers {} loaded, backend {}", options_.shard,
               options_.expert_lo, options_.expert_hi, fmt::join(layers, ","),
               backends_.begin()->second->name());
  if (!backends_.begin()->second->note.empty()) {
    MOE_LOG_WARN("shard {}: {}", options_.shard, backends_.begin()->second->note);
  }
  MeasureLimits();
  return absl::OkStatus();
}

absl::Status ExpertCore::MakeBackends() {
  pool_ = std::make_unique<ThreadPool>(options_.threads, "expert-pool");
  if (options_.backend != Backend::kEcho) {
    // The kernel sets of this CPU timed at the served shape (or read from this machine's cache).
    numerics::cpu::KernelChoiceOptions ko;
    ko.sets = options_.isa;
    ko.latent = cfg_.latent;
    ko.intermediate = cfg_.intermediate;
    ko.pool = pool_.get();
    kernel_choice_ = &numerics::cpu::ChooseKernels(ko);
    kernels_ = &kernel_choice_->table;
  } else {
    kernels_ = &numerics::cpu::KernelsFor(numerics::cpu::Isa::kScalar);
  }
  for (const auto& [layer, w] : layers_) {
    MOE_ASSIGN_OR_RETURN(backends_[layer], MakeExpertBackend(options_.backend, cfg_, w, *kernels_,
                                                             pool_.get(), options_.w4a8_h));
  }
  const std::vector<numerics::Precision> can = backends_.begin()->second->precisions();
  if (precisions_.empty()) precisions_ = can;
  for (numerics::Precision p : precisions_) {
    if (std::find(can.begin(), can.end(), p) == can.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--precision ", PrecisionList(precisions_), ": backend ",
          backends_.begin()->second->name(), " computes ", PrecisionList(can), " only"));
    }
  }
  return absl::OkStatus();
}

void ExpertCore::MeasureLimits() {
  // The limits of the CPU the kernels run on, before any traffic (bounded: 512 MiB read, 3 x
  // 50 ms of FMAs, about 0.4 s). A GPU backend's limits are not these.
  if (!options_.measure_limits || backends_.begin()->second->name().rfind("cpu", 0) != 0) return;
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

void ExpertCore::Start(metrics::ExpertMetrics* metrics, IdlePoll idle_poll,
                       std::chrono::microseconds idle_spin,
                       std::chrono::microseconds idle_spin_max) {
  if (metrics == nullptr) {
    // Not exported, but counted all the same: every component holds its stats as a value.
    std::vector<int64_t> layers;
    for (const auto& [l, w] : layers_) layers.push_back(l);
    own_registry_ = std::make_unique<prometheus::Registry>();
    own_metrics_ = std::make_unique<metrics::ExpertMetrics>(*own_registry_, layers, options_.shard);
    metrics = own_metrics_.get();
  }
  metrics_ = metrics;
  metrics_->Backend(backends_.begin()->second->name(), backends_.begin()->second->note);
  if (kernel_choice_ != nullptr && backends_.begin()->second->name().rfind("cpu", 0) == 0) {
    std::vector<metrics::ExpertMetrics::KernelProbe> probes;
    for (const numerics::cpu::KernelTiming& t : kernel_choice_->timings) {
      probes.push_back({numerics::cpu::IsaName(t.isa), t.panel ? "panel" : "rows", t.tokens,
                        t.flops_per_second});
    }
    const auto& c = *kernel_choice_;
    metrics_->KernelChoice(
        numerics::cpu::IsaName(c.decode), numerics::cpu::IsaName(c.prefill),
        c.panel_from >= numerics::cpu::kNoPanel ? "never" : std::to_string(c.panel_from), c.source,
        probes);
  }
  if (limits_.threads > 0) {
    metrics_->LimitsProbed();
    metrics_->SetMachineLimits(limits_.read_bytes_per_second, limits_.fma_flops_per_second,
                               numerics::cpu::IsaName(limits_.isa));
  }
  // The echo backend computes nothing a reference could check.
  if (options_.verify_fraction > 0 && options_.backend != Backend::kEcho) {
    BatchVerifierOptions vo;
    vo.fraction = options_.verify_fraction;
    vo.w4a8_h = options_.w4a8_h;
    verifier_ = std::make_unique<BatchVerifier>(
        cfg_, vo, ReferenceWeightsFor(options_, cfg_),
        [this](VerifyResult r, const std::string& detail) {
          if (r == VerifyResult::kMismatch || r == VerifyResult::kError) {
            MOE_LOG_ERROR("shard {}: production check {}: {}", options_.shard, VerifyResultName(r),
                          detail);
          }
          metrics_->Verified(VerifyResultName(r));
        });
  }
  idle_poll_ = std::move(idle_poll);
  idle_window_ = std::make_unique<PollWindow>(idle_spin, idle_spin_max);
  compute_thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "expert-compute");  // for top -H and profilers
    ComputeLoop();
  });
}

void ExpertCore::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    has_work_.store(true);
    cv_.notify_all();
  }
  // The compute thread answers what is queued (UNAVAILABLE) before the streams are cancelled.
  if (compute_thread_.joinable()) compute_thread_.join();
  verifier_.reset();  // finishes the check in progress; what waits is counted as skipped
}

int64_t ExpertCore::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(queue_.size());
}

void ExpertCore::Admit(const v1::DispatchRequest& req, std::string_view activations,
                       std::unique_ptr<BatchReply> reply,
                       std::shared_ptr<const void> activations_owner) {
  metrics_->wire.Add("received", WireDtype(req.activations()), "attention",
                     static_cast<int64_t>(activations.size()),
                     req.activations().shape_size() > 0 ? req.activations().shape(0) : 0,
                     reply->transport());
  const auto arrived = Clock::now() - std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(reply->receive_seconds));
  absl::StatusOr<std::unique_ptr<Batch>> batch =
      ValidateDispatch(req, &activations,
                       DispatchLimits{options_.shard, cfg_.num_experts, cfg_.latent,
                                      options_.max_message_bytes, precisions_, cfg_.top_k},
                       layers_, std::move(activations_owner));
  if (batch.ok()) {
    // The batch's budget runs from its header's arrival (before an out-of-band payload's).
    (*batch)->arrived = arrived;
    if (req.timeout_ms() > 0) (*batch)->expires = arrived + BatchBudget(req.timeout_ms());
    // Enqueue takes the reply only when it queued the batch.
    absl::Status queued = Enqueue(std::move(*batch), reply);
    if (queued.ok()) return;
    batch = queued;
  }
  metrics_->common.Error("Dispatch", absl::StatusCodeToString(batch.status().code()));
  if (reply != nullptr) reply->Send(ErrorReply(req.batch_id(), options_.shard, batch.status()));
}

void ExpertCore::Compute(const Batch& b, BatchReply& out, v1::DispatchReply* reply) {
  const int64_t d = cfg_.latent;
  // y: [rows, D], row i from expert routing.expert_ids[i]. Per pair, the backend writes it
  // where the reply is sent from when the transport has such a place (a data plane's
  // registered buffer), else into the reply itself: no copy after the compute.
  ExpertBackend& backend = *backends_.at(b.layer->layer);
  const size_t n = static_cast<size_t>(b.rows * d) * sizeof(Bf16);
  std::vector<Bf16> per_pair;  // partial sums: y is an intermediate
  Bf16* y = nullptr;
  if (b.mode == v1::REPLY_MODE_PER_PAIR) {
    y = reinterpret_cast<Bf16*>(transport::EncodeRawPlace(
        n, v1::DTYPE_BF16, b.rows, d, out.OutputBuffer(n), reply->mutable_outputs()));
  } else {
    per_pair.resize(static_cast<size_t>(b.rows * d));
    y = per_pair.data();
  }
  const absl::Status computed =
      backend.Run(b.routing, b.z, b.z_rows, absl::MakeSpan(y, static_cast<size_t>(b.rows * d)));
  if (!computed.ok()) {
    reply->clear_outputs();
    transport::SetBatchStatus(absl::Status(computed.code(), absl::StrCat("shard ", options_.shard,
                                                                         ": ", computed.message())),
                              reply);
    return;
  }
  reply->set_precision(transport::PrecisionToProto(b.precision));
  if (verifier_ != nullptr)
    verifier_->OnBatch(b.batch_id, b.layer->layer, b.routing, b.z, y, b.z_rows);
  if (b.mode == v1::REPLY_MODE_PER_PAIR) return;
  // Partial sums per distinct token (ascending), over the token's experts in ascending expert
  // id (the groups' order): numerics/combine.h.
  std::vector<float> acc;
  const std::vector<int64_t> distinct = numerics::PartialSums(y, b.rows, d, b.token_index.data(),
                                                              b.weights.data(), b.num_tokens, &acc);
  const size_t sum_bytes = acc.size() * sizeof(float);
  transport::EncodeRawInto(acc.data(), sum_bytes, v1::DTYPE_F32,
                           static_cast<int64_t>(distinct.size()), d, out.OutputBuffer(sum_bytes),
                           reply->mutable_outputs());
}

absl::Status ExpertCore::Enqueue(std::unique_ptr<Batch> b, std::unique_ptr<BatchReply>& reply) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) {
    return absl::UnavailableError(absl::StrCat("shard ", options_.shard, " is shutting down"));
  }
  if (static_cast<int>(queue_.size()) >= options_.max_queued_batches) {
    return absl::ResourceExhaustedError(absl::StrCat("shard ", options_.shard,
                                                     ": compute queue full (",
                                                     options_.max_queued_batches, " batches)"));
  }
  queue_.emplace_back(std::move(b), std::move(reply));
  has_work_.store(true);
  metrics_->common.QueueDepth(static_cast<int64_t>(queue_.size()));
  cv_.notify_one();
  return absl::OkStatus();
}

void ExpertCore::ComputeLoop() {
  for (;;) {
    std::unique_ptr<Batch> b;
    std::unique_ptr<BatchReply> out;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Poll the data plane for a while after a batch: the next one is admitted right here.
      // The window is learned from the gaps between batches (a gap is measured from the end of
      // one batch to the start of the next, slept through or not).
      const auto idle_until = last_batch_end_ + idle_window_->Window();
      if (idle_poll_ && queue_.empty() && !stopping_ && Clock::now() < idle_until) {
        lock.unlock();
        idle_poll_(idle_until, [this] { return has_work_.load(); });
        lock.lock();
      }
      while (!cv_.wait_for(lock, kIdleTick, [&] { return stopping_ || !queue_.empty(); })) {
        metrics_->Tick();  // the busy ratio decays while idle
        lock.unlock();     // batches queue meanwhile; they wait at most one probe (~0.2 s)
        RemeasureLimitsWhenIdle();
        lock.lock();
      }
      if (queue_.empty()) return;  // stopping, nothing left
      b = std::move(queue_.front().first);
      out = std::move(queue_.front().second);
      queue_.pop_front();
      idle_window_->Record(Clock::now() - last_batch_end_);
      has_work_.store(!queue_.empty() || stopping_);
      metrics_->common.QueueDepth(static_cast<int64_t>(queue_.size()));
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
      metrics_->common.Started("Dispatch");
      Compute(*b, *out, &reply);
      reply.set_compute_seconds(Seconds(Clock::now() - start));
      metrics_->common.Finished("Dispatch", reply.code() == 0);
    }
    if (reply.code() == 0) {
      // Each distinct expert's weights stream once per batch (rows are grouped by expert).
      metrics_->BatchDone(b->layer->layer, reply.queue_seconds(), reply.compute_seconds(), b->rows,
                          static_cast<double>(b->experts) * cfg_.ExpertBytes(),
                          6.0 * cfg_.latent * cfg_.intermediate * b->rows);
      // The outputs' bytes may be in the data plane's buffer: counted from their shape.
      const v1::Tensor& y = reply.outputs();
      const bool bf16 = b->mode == v1::REPLY_MODE_PER_PAIR;
      const int64_t rows = y.shape_size() == 2 ? y.shape(0) : 0;
      metrics_->wire.Add("sent", bf16 ? "bf16" : "f32", "attention",
                         rows * cfg_.latent * (bf16 ? 2 : 4), rows, out->transport());
    } else {
      metrics_->common.Error("Dispatch",
                             absl::StatusCodeToString(static_cast<absl::StatusCode>(reply.code())));
    }
    out->Send(std::move(reply));
    last_batch_end_ = Clock::now();
  }
}

void ExpertCore::RemeasureLimitsWhenIdle() {
  // After limits_idle_ms without a batch, at most every limits_every_ms, a shorter probe than at
  // start.
  const auto kIdle = std::chrono::milliseconds(options_.limits_idle_ms);
  const auto kEvery = std::chrono::milliseconds(options_.limits_every_ms);
  const auto now = Clock::now();
  if (limits_.threads == 0 || now - last_batch_end_ < kIdle || now - limits_measured_ < kEvery) {
    return;
  }
  limits_measured_ = now;
  numerics::cpu::LimitsOptions lo;
  lo.read_bytes = int64_t{256} << 20;
  lo.read_passes = 2;
  lo.fma_seconds = 0.03;
  const numerics::cpu::MachineLimits again =
      numerics::cpu::MeasureMachineLimits(*kernels_, pool_.get(), lo);
  metrics_->LimitsProbed();
  if (again.read_bytes_per_second <= limits_.read_bytes_per_second &&
      again.fma_flops_per_second <= limits_.fma_flops_per_second) {
    return;
  }
  limits_.read_bytes_per_second =
      std::max(limits_.read_bytes_per_second, again.read_bytes_per_second);
  limits_.fma_flops_per_second = std::max(limits_.fma_flops_per_second, again.fma_flops_per_second);
  MOE_LOG_INFO("shard {}: measured again while idle: read {:.1f} GB/s, FMA peak {:.1f} GFLOP/s",
               options_.shard, limits_.read_bytes_per_second / 1e9,
               limits_.fma_flops_per_second / 1e9);
  metrics_->SetMachineLimits(limits_.read_bytes_per_second, limits_.fma_flops_per_second,
                             numerics::cpu::IsaName(limits_.isa));
}

}  // namespace moe::expert_svc
