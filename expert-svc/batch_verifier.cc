#include "expert-svc/batch_verifier.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "services/numerics/expert_ffn.h"
#include "services/numerics/tolerance.h"

namespace moe::expert_svc {

using tensor::Bf16;

const char* VerifyResultName(VerifyResult r) {
  switch (r) {
    case VerifyResult::kMatch:
      return "match";
    case VerifyResult::kMismatch:
      return "mismatch";
    case VerifyResult::kSkipped:
      return "skipped";
    case VerifyResult::kError:
      break;
  }
  return "error";
}

BatchVerifier::BatchVerifier(const ModelConfig& cfg, const BatchVerifierOptions& options,
                             ReferenceWeights reference, Sink sink)
    : cfg_(cfg), options_(options), reference_(std::move(reference)), sink_(std::move(sink)) {
  thread_ = std::thread([this] { Loop(); });
}

BatchVerifier::~BatchVerifier() {
  int64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    dropped = static_cast<int64_t>(queue_.size());
    queue_.clear();
  }
  cv_.notify_all();
  thread_.join();
  for (int64_t i = 0; i < dropped; ++i) Record(VerifyResult::kSkipped, "server stopping");
}

void BatchVerifier::OnBatch(uint64_t batch_id, int64_t layer, const numerics::Routing& routing,
                            const tensor::Activations& z, const Bf16* y,
                            absl::Span<const int32_t> z_rows) {
  const int64_t rows = static_cast<int64_t>(routing.expert_ids.size());
  if (options_.fraction <= 0 || rows == 0) return;
  int64_t sample_index;
  {
    std::lock_guard<std::mutex> lock(mu_);
    credit_ += options_.fraction;
    if (credit_ < 1.0) return;
    credit_ -= 1.0;
    sample_index = counts_.sampled++;
  }
  // The distinct experts of the batch (rows are grouped by expert); take one in turn.
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, expert)
  for (int64_t r = 0; r < rows; ++r) {
    if (r == 0 || routing.expert_ids[r] != routing.expert_ids[r - 1]) {
      runs.emplace_back(r, routing.expert_ids[r]);
    }
  }
  const auto [first, expert] = runs[static_cast<size_t>(sample_index) % runs.size()];
  int64_t end = first;
  while (end < rows && routing.expert_ids[end] == expert) ++end;
  Sample s;
  s.batch_id = batch_id;
  s.layer = layer;
  s.expert = expert;
  s.batch_rows = rows;
  s.rows = std::min(end - first, options_.max_rows);
  const int64_t d = cfg_.latent;
  std::vector<int32_t> rows_of(static_cast<size_t>(s.rows));
  for (int64_t r = 0; r < s.rows; ++r) {
    rows_of[r] = z_rows.empty() ? static_cast<int32_t>(first + r) : z_rows[first + r];
  }
  s.z = z.Gather(rows_of.data(), s.rows);
  s.y.assign(y + first * d, y + (first + s.rows) * d);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_ && static_cast<int>(queue_.size()) < options_.max_pending) {
      queue_.push_back(std::move(s));
      cv_.notify_one();
      return;
    }
  }
  Record(VerifyResult::kSkipped,
         absl::StrCat("batch ", batch_id, ": the check of expert ", expert, " was skipped (",
                      options_.max_pending, " samples already waiting)"));
}

void BatchVerifier::Loop() {
  for (;;) {
    Sample s;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      s = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    Check(s);
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    idle_cv_.notify_all();
  }
}

void BatchVerifier::Check(const Sample& s) {
  const std::string what =
      absl::StrCat("batch ", s.batch_id, " layer ", s.layer, " expert ", s.expert, ": ", s.rows,
                   " of the batch's ", s.batch_rows, " rows x ", cfg_.latent);
  absl::StatusOr<numerics::MoeLayerWeights> w = reference_(s.layer, s.expert);
  if (!w.ok()) {
    Record(VerifyResult::kError,
           absl::StrCat(what, ": no reference weights: ", w.status().message()));
    return;
  }
  const numerics::ExpertWeights* ew = w->Expert(s.expert);
  if (ew == nullptr) {
    Record(VerifyResult::kError, absl::StrCat(what, ": the reference does not hold the expert"));
    return;
  }
  std::vector<Bf16> want(s.y.size());
  const bool w4a8 = s.z.format() == tensor::ActivationFormat::kMxfp8;
  if (w4a8) {
    numerics::ref::ExpertFfn(*ew, s.z.mxfp8(), cfg_.situ_beta, cfg_.situ_linear_beta, want.data(),
                             options_.w4a8_h);
  } else {
    numerics::ref::ExpertFfn(*ew, s.z.bf16().data(), s.rows, cfg_.situ_beta, cfg_.situ_linear_beta,
                             want.data());
  }
  numerics::UlpStats stats;
  stats.AddRows(s.y.data(), want.data(), s.rows, cfg_.latent);
  if (stats.Within(w4a8 ? numerics::kExpertFfnW4A8Tolerance : numerics::kExpertFfnTolerance)) {
    Record(VerifyResult::kMatch, absl::StrCat(what, ": ", stats.Str()));
    return;
  }
  const int64_t worst = stats.worst_index;
  Record(VerifyResult::kMismatch,
         absl::StrCat(what, ": outside the expert FFN ", w4a8 ? "W4A8 " : "", "tolerance (",
                      stats.Str(), "); worst at row ", worst / cfg_.latent, " column ",
                      worst % cfg_.latent, ": got ", s.y[worst].ToFloat(), ", reference ",
                      want[worst].ToFloat()));
}

void BatchVerifier::Record(VerifyResult r, const std::string& detail) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    switch (r) {
      case VerifyResult::kMatch:
        ++counts_.match;
        break;
      case VerifyResult::kMismatch:
        ++counts_.mismatch;
        break;
      case VerifyResult::kSkipped:
        ++counts_.skipped;
        break;
      case VerifyResult::kError:
        ++counts_.error;
        break;
    }
  }
  if (sink_) sink_(r, detail);
}

void BatchVerifier::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

BatchVerifier::Counts BatchVerifier::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

}  // namespace moe::expert_svc
