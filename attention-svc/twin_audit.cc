#include "attention-svc/twin_audit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/numerics/combine.h"
#include "services/numerics/expert_ffn.h"

namespace moe::attention_svc {

using tensor::Bf16;

struct TwinAuditor::Disputed {
  std::vector<int64_t> rows;  // per pair: message rows; partial sums: indices into m.tokens
  // [rows, D] each: the reference (per pair W4A8: one per h order, an honest shard matches the
  // order its backend computes), the two replies' rows, and partial sums' scale rows.
  std::vector<std::vector<Bf16>> want;
  std::array<std::vector<Bf16>, 2> got;
  std::vector<Bf16> scale;
  numerics::Tolerance tolerance{};
};

namespace {

// The expert of each row of m (its groups in order).
std::vector<int32_t> RowExperts(const DispatchMessage& m) {
  std::vector<int32_t> out;
  out.reserve(m.pairs.size());
  for (const auto& [expert, rows] : m.groups) out.insert(out.end(), rows, expert);
  return out;
}

// Up to n rows of [rows, d] where a and b differ most (largest max |a - b|), ascending.
template <typename T>
std::vector<int64_t> MostDifferent(absl::Span<const T> a, absl::Span<const T> b, int64_t rows,
                                   int64_t d, int64_t n) {
  std::vector<std::pair<double, int64_t>> diff;
  for (int64_t r = 0; r < rows; ++r) {
    double worst = 0;
    for (int64_t c = 0; c < d; ++c) {
      const size_t i = static_cast<size_t>(r * d + c);
      double x, y;
      if constexpr (std::is_same_v<T, Bf16>) {
        x = a[i].ToFloat(), y = b[i].ToFloat();
      } else {
        x = a[i], y = b[i];
      }
      double e = std::fabs(x - y);
      if (std::isnan(e)) e = std::isnan(x) && std::isnan(y) ? 0 : INFINITY;  // NaN on one side
      worst = std::max(worst, e);
    }
    if (worst > 0) diff.push_back({worst, r});
  }
  std::sort(diff.begin(), diff.end(),
            [](const auto& p, const auto& q) { return p.first > q.first; });
  std::vector<int64_t> out;
  for (size_t i = 0; i < diff.size() && static_cast<int64_t>(i) < n; ++i) {
    out.push_back(diff[i].second);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// One row's reference y = ExpertFfn(z row) for each h order asked.
void ReferenceRow(const numerics::ExpertWeights& w, const tensor::Activations& z1,
                  const ModelConfig& cfg, bool w4a8, std::vector<std::vector<Bf16>>* ys) {
  const size_t d = static_cast<size_t>(cfg.latent);
  if (!w4a8) {
    ys->emplace_back(d);
    numerics::ref::ExpertFfn(w, z1.bf16().data(), 1, cfg.situ_beta, cfg.situ_linear_beta,
                             ys->back().data());
    return;
  }
  for (numerics::W4A8H h : {numerics::W4A8H::kFromFp32, numerics::W4A8H::kViaBf16}) {
    ys->emplace_back(d);
    numerics::ref::ExpertFfn(w, z1.mxfp8(), cfg.situ_beta, cfg.situ_linear_beta, ys->back().data(),
                             h);
  }
}

}  // namespace

TwinAuditor::TwinAuditor(const ModelConfig& cfg, const TwinAuditOptions& options,
                         ReferenceWeights reference, Sink sink, Observer observe)
    : cfg_(cfg),
      options_(options),
      reference_(std::move(reference)),
      sink_(std::move(sink)),
      observe_(std::move(observe)) {}

bool TwinAuditor::Sample(int32_t layer, int32_t lo, int32_t hi) {
  if (options_.share <= 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return sampled_[{layer, lo, hi}]++ % static_cast<uint64_t>(options_.share) == 0;
}

void TwinAuditor::Answered(const ShardRef& shard) {
  std::lock_guard<std::mutex> lock(mu_);
  ++suspect_[Key(shard)];
}

void TwinAuditor::Skipped() { Count(TwinOutcome::kSkipped); }

bool TwinAuditor::Quarantined(const ShardRef& shard) const {
  std::lock_guard<std::mutex> lock(mu_);
  return quarantined_.count(Key(shard)) > 0;
}

TwinAuditor::Counts TwinAuditor::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

void TwinAuditor::Count(TwinOutcome o) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_.outcomes[o];
  }
  if (observe_) observe_(o);
}

absl::StatusOr<TwinAuditor::Disputed> TwinAuditor::Recompute(
    const DispatchHeader& header, const DispatchMessage& m,
    const std::array<const ExpertReply*, 2>& replies) const {
  const numerics::MoeLayerWeights* w = reference_ ? reference_(header.layer) : nullptr;
  if (w == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("this node holds no reference experts for layer ", header.layer));
  }
  const int64_t d = cfg_.latent;
  const bool w4a8 = m.precision() == numerics::Precision::kW4A8;
  const bool partial = header.mode == ReplyMode::kPartialSum;
  const std::vector<int32_t> experts = RowExperts(m);
  Disputed out;
  const int64_t n = std::max<int64_t>(1, options_.max_rows);
  out.rows = partial ? MostDifferent<float>(replies[0]->f32, replies[1]->f32,
                                            static_cast<int64_t>(m.tokens.size()), d, n)
                     : MostDifferent<Bf16>(replies[0]->bf16, replies[1]->bf16, m.rows(), d, n);
  // The hard bound alone: the suite's fractions are stated over whole batches, not over the
  // few rows picked because they differ most.
  out.tolerance = numerics::HardBound(partial ? kPartialSumAuditTolerance
                                      : w4a8  ? numerics::kExpertFfnW4A8Tolerance
                                              : numerics::kExpertFfnTolerance);
  if (partial && w4a8) out.tolerance.max_row_ulps *= 2;  // as W4A8's own bound is twice W4A16's
  const size_t variants = w4a8 ? 2 : 1;
  out.want.resize(variants);
  for (int64_t r : out.rows) {
    // The message rows that make this disputed row: itself per pair, the token's rows for a sum.
    std::vector<int64_t> rows;
    if (partial) {
      for (int64_t i = 0; i < m.rows(); ++i) {
        if (m.row_source[static_cast<size_t>(i)] == r) rows.push_back(i);
      }
    } else {
      rows.push_back(r);
    }
    std::vector<std::vector<float>> acc(variants, std::vector<float>(static_cast<size_t>(d), 0.0f));
    std::vector<float> scale(static_cast<size_t>(d), 0.0f);
    for (int64_t i : rows) {
      const numerics::ExpertWeights* ew = w->Expert(experts[static_cast<size_t>(i)]);
      if (ew == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("the reference does not hold expert ", experts[static_cast<size_t>(i)]));
      }
      const int32_t src = m.row_source[static_cast<size_t>(i)];
      std::vector<std::vector<Bf16>> ys;
      ReferenceRow(*ew, m.z.Gather(&src, 1), cfg_, w4a8, &ys);
      for (size_t v = 0; v < variants; ++v) {
        if (!partial) {
          out.want[v].insert(out.want[v].end(), ys[v].begin(), ys[v].end());
          continue;
        }
        // numerics::PartialSums' order: ascending expert, each product rounded before the add.
        const float wt = m.weights[static_cast<size_t>(i)];
        for (int64_t c = 0; c < d; ++c) {
          const float p = ys[v][static_cast<size_t>(c)].ToFloat() * wt;
          acc[v][static_cast<size_t>(c)] += p;
          if (v == 0) scale[static_cast<size_t>(c)] += std::fabs(p);
        }
      }
    }
    for (int k = 0; k < 2; ++k) {
      if (partial) {
        for (int64_t c = 0; c < d; ++c) {
          out.got[k].push_back(Bf16::FromFloat(replies[k]->f32[static_cast<size_t>(r * d + c)]));
        }
      } else {
        const Bf16* row = replies[k]->bf16.data() + r * d;
        out.got[k].insert(out.got[k].end(), row, row + d);
      }
    }
    if (partial) {
      for (size_t v = 0; v < variants; ++v) {
        for (float x : acc[v]) out.want[v].push_back(Bf16::FromFloat(x));
      }
      for (float x : scale) out.scale.push_back(Bf16::FromFloat(x));
    }
  }
  return out;
}

TwinVerdict TwinAuditor::Judge(const DispatchHeader& header, const DispatchMessage& m,
                               const std::array<const ShardRef*, 2>& shards,
                               const std::array<const ExpertReply*, 2>& replies) {
  TwinVerdict v;
  const std::string what = absl::StrCat("layer ", header.layer, ", ", m.rows(), " rows of ",
                                        m.groups.size(), " experts (", ReplyModeName(header.mode),
                                        "), ", shards[0]->shard, " against ", shards[1]->shard);
  const ExpertReply& a = *replies[0];
  const ExpertReply& b = *replies[1];
  if (a.bf16.size() == b.bf16.size() && a.f32.size() == b.f32.size() &&
      std::memcmp(a.bf16.data(), b.bf16.data(), a.bf16.size() * sizeof(Bf16)) == 0 &&
      std::memcmp(a.f32.data(), b.f32.data(), a.f32.size() * sizeof(float)) == 0) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      suspect_.erase(Key(*shards[0]));
      suspect_.erase(Key(*shards[1]));
    }
    Count(TwinOutcome::kAgree);
    v.detail = what + ": bit-identical";
    return v;
  }
  absl::StatusOr<Disputed> dis = Recompute(header, m, replies);
  if (!dis.ok()) {
    Count(TwinOutcome::kUnresolved);
    v.outcome = TwinOutcome::kUnresolved;
    v.detail =
        absl::StrCat(what, ": the replies differ and cannot be judged: ", dis.status().message());
    return v;
  }
  const int64_t rows = static_cast<int64_t>(dis->rows.size());
  std::array<bool, 2> right{false, false};
  std::array<std::string, 2> stats;
  for (int k = 0; k < 2; ++k) {
    for (const std::vector<Bf16>& want : dis->want) {
      numerics::UlpStats s;
      s.AddRows(dis->got[k].data(), want.data(), rows, cfg_.latent,
                dis->scale.empty() ? nullptr : dis->scale.data());
      if (stats[k].empty() || s.Within(dis->tolerance)) stats[k] = s.Str();
      right[k] = right[k] || s.Within(dis->tolerance);
    }
  }
  v.detail =
      absl::StrCat(what, ": they differ; on the ", rows, " rows that differ most, against ",
                   "the reference: ", shards[0]->shard, " ", stats[0], ", ", shards[1]->shard, " ",
                   stats[1], " (bound ", dis->tolerance.max_row_ulps, " ulps of the row scale)");
  if (right[0] == right[1]) {
    v.outcome = right[0] ? TwinOutcome::kWithinBound : TwinOutcome::kUnresolved;
    if (right[0]) {
      std::lock_guard<std::mutex> lock(mu_);
      suspect_.erase(Key(*shards[0]));
      suspect_.erase(Key(*shards[1]));
    }
    Count(v.outcome);
    return v;
  }
  v.outcome = TwinOutcome::kCaught;
  v.use = right[0] ? 0 : 1;
  const ShardRef& liar = *shards[1 - v.use];
  ShardQuarantine q{liar, header.layer, v.detail, 0};
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    suspect_.erase(Key(*shards[v.use]));
    auto it = suspect_.find(Key(liar));
    q.suspect_answers = it != suspect_.end() ? it->second : 0;
    first = quarantined_.insert(Key(liar)).second;
    if (first) counts_.quarantined.push_back(liar.shard);
  }
  Count(TwinOutcome::kCaught);
  if (first && sink_) sink_(q);
  return v;
}

}  // namespace moe::attention_svc
