#include "services/numerics/dynamic_k.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "services/common/random.h"
#include "services/common/status_macros.h"
#include "services/numerics/qb.h"
#include "services/numerics/wire_codec.h"

namespace moe::numerics {
namespace {

constexpr char kMagic[4] = {'B', 'K', 'H', '1'};
constexpr int64_t kMaxBins = 4096;
constexpr int64_t kMaxCells = int64_t{1} << 22;  // experts * bins: 16 MiB of counts at most
constexpr uint64_t kMaxTokens = uint64_t{1} << 40;

absl::Status Corrupt(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("budget histogram: ", what));
}

absl::Status CheckShape(int64_t n, int64_t k, int64_t k_min, int64_t bins) {
  if (n < 2 || k < 2 || k > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget histogram: k = ", k, " of n = ", n, " experts (need 2 <= k <= n)"));
  }
  if (k_min < 0 || k_min > k) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget histogram: k_min = ", k_min, " outside [0, k = ", k, "]"));
  }
  if (bins < 1 || bins > kMaxBins || n * bins > kMaxCells) {
    return absl::InvalidArgumentError(absl::StrCat("budget histogram: ", bins, " bins for ", n,
                                                   " experts (at most ", kMaxBins, " bins and ",
                                                   kMaxCells, " cells)"));
  }
  return absl::OkStatus();
}

constexpr float kKeepNone = std::numeric_limits<float>::infinity();
constexpr float kKeepAll = 0.0f;  // every sigmoid score is >= 0

}  // namespace

int64_t ApplyBudget(const float* scores, int64_t num_experts, const BudgetRule& rule,
                    bool renormalize, float scaling_factor, Routing* routing, double* kept_mass) {
  const int64_t k = routing->top_k;
  if (rule.thresholds == nullptr && !(rule.top_p > 0)) {
    if (kept_mass != nullptr) *kept_mass += static_cast<double>(routing->tokens);
    return routing->tokens * k;
  }
  int64_t kept_pairs = 0;
  std::vector<int32_t> kept(static_cast<size_t>(k));
  std::vector<int64_t> by_score(static_cast<size_t>(k));
  std::vector<char> take(static_cast<size_t>(k));
  for (int64_t t = 0; t < routing->tokens; ++t) {
    int32_t* ids = routing->expert_ids.data() + t * k;
    float* w = routing->weights.data() + t * k;
    const float* s = scores + t * num_experts;
    int64_t n = 0;
    if (rule.top_p > 0) {
      // The fewest slots, largest score first, whose share reaches top_p (at least k_min).
      int64_t live = 0;
      double total = 0;
      for (int64_t j = 0; j < k; ++j) {
        take[j] = 0;
        if (ids[j] >= 0) {
          by_score[live++] = j;
          total += s[ids[j]];
        }
      }
      std::stable_sort(by_score.begin(), by_score.begin() + live,
                       [&](int64_t a, int64_t b) { return s[ids[a]] > s[ids[b]]; });
      double cum = 0;
      for (int64_t i = 0, taken = 0; i < live; ++i) {
        if (taken >= rule.k_min && cum >= rule.top_p * total) break;
        take[by_score[i]] = 1;
        cum += s[ids[by_score[i]]];
        ++taken;
      }
      for (int64_t j = 0; j < k; ++j) {
        if (take[j]) kept[n++] = ids[j];  // in rank order
      }
    } else {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = ids[j];
        if (e < 0) continue;  // already dropped
        if (j < rule.k_min || s[e] >= rule.thresholds[e]) kept[n++] = e;
      }
    }
    kept_pairs += n;
    if (kept_mass != nullptr) {
      double all = 0, kept_sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        if (ids[j] >= 0) all += s[ids[j]];
      }
      for (int64_t j = 0; j < n; ++j) kept_sum += s[kept[j]];
      *kept_mass += all > 0 ? kept_sum / all : 1.0;
    }
    if (n == k) continue;  // the full routing, untouched
    // The weights as SelectExperts computes them, over the kept slots in rank order.
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += s[kept[j]];
    for (int64_t j = 0; j < k; ++j) {
      if (j < n) {
        const int32_t e = kept[j];
        ids[j] = e;
        w[j] = RouterWeight(s[e], sum, renormalize, scaling_factor);
      } else {
        ids[j] = kDroppedSlot;
        w[j] = 0.0f;
      }
    }
  }
  return kept_pairs;
}

absl::StatusOr<double> TopPForBudget(absl::Span<const float> scores, int64_t m, int64_t n,
                                     absl::Span<const float> bias, int64_t k, int64_t k_min,
                                     double budget) {
  MOE_RETURN_IF_ERROR(ValidateQbInput(scores, m, n, bias, k));
  if (!(budget >= static_cast<double>(std::max<int64_t>(1, k_min))) ||
      budget > static_cast<double>(k)) {
    return absl::InvalidArgumentError(absl::StrCat("top-p for a budget of ", budget,
                                                   " outside [k_min = ", k_min, ", k = ", k, "]"));
  }
  const Routing full = SelectExperts(scores.data(), bias.data(), m, n, k, true, 1.0f);
  auto kept_per_token = [&](double p) {
    Routing r = full;
    BudgetRule rule;
    rule.k_min = k_min;
    rule.top_p = p;
    return static_cast<double>(ApplyBudget(scores.data(), n, rule, true, 1.0f, &r)) /
           static_cast<double>(m);
  };
  double lo = 0, hi = 1;  // kept(hi) = k >= budget
  while (hi - lo > 1e-7) {
    const double mid = 0.5 * (lo + hi);
    (kept_per_token(mid) >= budget ? hi : lo) = mid;
  }
  return hi;
}

namespace {
// The stand-in head [hidden, kTop1Columns], drawn once per width (entries are never erased or
// changed once made, so a reference outlives the lock).
const std::vector<float>& Top1Projection(int64_t hidden) {
  static std::mutex mu;
  static auto* cache = new std::map<int64_t, std::vector<float>>;
  std::lock_guard<std::mutex> lock(mu);
  auto [it, fresh] = cache->try_emplace(hidden);
  if (fresh) {
    Rng rng(kTop1Seed);
    it->second.resize(static_cast<size_t>(hidden * kTop1Columns));
    for (float& v : it->second) v = rng.Normal();
  }
  return it->second;
}
}  // namespace

double Top1Agreement(const float* a, const float* b, int64_t tokens, int64_t hidden) {
  if (tokens <= 0) return 1.0;
  const std::vector<float>& p = Top1Projection(hidden);
  std::vector<double> logits(static_cast<size_t>(kTop1Columns));
  auto top1 = [&](const float* x) {
    std::fill(logits.begin(), logits.end(), 0.0);
    for (int64_t h = 0; h < hidden; ++h) {
      const double xv = x[h];
      const float* row = p.data() + h * kTop1Columns;
      for (int64_t c = 0; c < kTop1Columns; ++c) logits[c] += xv * row[c];
    }
    return std::max_element(logits.begin(), logits.end()) - logits.begin();
  };
  int64_t same = 0;
  for (int64_t t = 0; t < tokens; ++t) same += top1(a + t * hidden) == top1(b + t * hidden);
  return static_cast<double>(same) / static_cast<double>(tokens);
}

double RelativeL2(const float* a, const float* ref, size_t n) {
  double d = 0, norm = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = a[i], y = ref[i];
    d += (x - y) * (x - y);
    norm += y * y;
  }
  return norm > 0 ? std::sqrt(d / norm) : 0.0;
}

std::vector<double> BudgetNeeds(int64_t budget, int64_t k, int64_t tokens,
                                const std::vector<int64_t>& selections,
                                const std::vector<int64_t>& forced) {
  const size_t n = selections.size();
  // kept(lambda) = sum_j clamp(lambda * n_j, f_j, n_j) grows with lambda; at b / k it is at
  // least b * tokens (every expert keeps b / k of its selections or more).
  auto kept = [&](double lambda) {
    double sum = 0;
    for (size_t j = 0; j < n; ++j) {
      const double nj = static_cast<double>(selections[j]), fj = static_cast<double>(forced[j]);
      sum += std::clamp(lambda * nj, fj, std::max(fj, nj));
    }
    return sum;
  };
  const double target = static_cast<double>(budget) * static_cast<double>(tokens);
  double lo = 0, hi = static_cast<double>(budget) / static_cast<double>(k);
  if (kept(hi) > target) {
    for (int i = 0; i < 64; ++i) {
      const double mid = 0.5 * (lo + hi);
      (kept(mid) > target ? hi : lo) = mid;
    }
  }
  std::vector<double> need(n);
  for (size_t j = 0; j < n; ++j) {
    need[j] = hi * static_cast<double>(selections[j]) - static_cast<double>(forced[j]);
  }
  return need;
}

std::vector<int64_t> ApportionKept(const std::vector<double>& need,
                                   const std::vector<int64_t>& free_counts, int64_t total) {
  const size_t n = need.size();
  std::vector<int64_t> c(n, 0);
  std::vector<double> frac(n, 0.0);
  int64_t room = 0, sum = 0;
  for (size_t j = 0; j < n; ++j) {
    const double x = std::clamp(need[j], 0.0, static_cast<double>(free_counts[j]));
    c[j] = static_cast<int64_t>(std::floor(x));
    frac[j] = x - static_cast<double>(c[j]);
    sum += c[j];
    room += free_counts[j];
  }
  total = std::clamp<int64_t>(total, 0, room);
  // Largest fractional part first; equal ones by expert id.
  std::vector<size_t> order(n);
  for (size_t j = 0; j < n; ++j) order[j] = j;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return frac[a] > frac[b]; });
  for (size_t i = 0; sum < total && i < n; ++i) {
    const size_t j = order[i];
    if (c[j] < free_counts[j]) ++c[j], ++sum;
  }
  for (size_t i = n; sum > total && i > 0; --i) {
    const size_t j = order[i - 1];
    if (c[j] > 0) --c[j], --sum;
  }
  return c;
}

namespace {
// The free selections to keep per expert for budget b of a window: ApportionKept's counts.
std::vector<int64_t> KeptCounts(int64_t budget, int64_t k, int64_t tokens,
                                const std::vector<int64_t>& selections,
                                const std::vector<int64_t>& forced,
                                const std::vector<int64_t>& free_counts) {
  int64_t forced_total = 0;
  for (int64_t f : forced) forced_total += f;
  return ApportionKept(BudgetNeeds(budget, k, tokens, selections, forced), free_counts,
                       budget * tokens - forced_total);
}
}  // namespace

double BudgetWindowFloor(int64_t experts, int64_t budget, int64_t tokens) {
  if (tokens <= 0 || budget <= 0) return std::numeric_limits<double>::infinity();
  return NoiseFloorMaxVio(experts, static_cast<double>(budget) * static_cast<double>(tokens) /
                                       static_cast<double>(experts));
}

int64_t BudgetWindowTokens(int64_t experts, int64_t budget, double bound) {
  // NoiseFloorMaxVio(n, q) = sqrt(2 ln n / q) <= bound  <=>  q >= 2 ln n / bound^2.
  const double q = 2.0 * std::log(static_cast<double>(experts)) / (bound * bound);
  int64_t t = static_cast<int64_t>(std::ceil(q * static_cast<double>(experts) /
                                             static_cast<double>(std::max<int64_t>(1, budget))));
  while (t > 1 && BudgetWindowFloor(experts, budget, t - 1) <= bound) --t;  // the rounding
  while (BudgetWindowFloor(experts, budget, t) > bound) ++t;
  return t;
}

absl::StatusOr<std::vector<float>> ExactBudgetThresholds(absl::Span<const float> scores, int64_t m,
                                                         int64_t n, absl::Span<const float> bias,
                                                         int64_t k, int64_t k_min) {
  MOE_RETURN_IF_ERROR(ValidateQbInput(scores, m, n, bias, k));
  MOE_RETURN_IF_ERROR(CheckShape(n, k, k_min, 1));
  const Routing full = SelectExperts(scores.data(), bias.data(), m, n, k, true, 1.0f);
  std::vector<int64_t> forced(static_cast<size_t>(n), 0);
  std::vector<std::vector<float>> free(static_cast<size_t>(n));
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = full.expert_ids[t * k + j];
      if (j < k_min) {
        ++forced[e];
      } else {
        free[e].push_back(scores[t * n + e]);
      }
    }
  }
  for (auto& f : free) std::sort(f.begin(), f.end(), std::greater<float>());
  std::vector<float> table(static_cast<size_t>((k - 1) * n));
  std::vector<int64_t> selections(static_cast<size_t>(n)), free_counts(selections);
  for (int64_t e = 0; e < n; ++e) {
    free_counts[e] = static_cast<int64_t>(free[e].size());
    selections[e] = forced[e] + free_counts[e];
  }
  for (int64_t b = 1; b < k; ++b) {
    const std::vector<int64_t> kept = KeptCounts(b, k, m, selections, forced, free_counts);
    for (int64_t e = 0; e < n; ++e) {
      const int64_t free_count = free_counts[e];
      const int64_t c = kept[e];
      float& theta = table[(b - 1) * n + e];
      if (c <= 0) {
        theta = kKeepNone;
      } else if (c >= free_count) {
        theta = kKeepAll;
      } else {
        theta = free[e][c - 1];
      }
    }
  }
  return table;
}

absl::StatusOr<BudgetHistogram> BudgetHistogram::Create(const BudgetWindow& window,
                                                        int64_t num_experts) {
  MOE_RETURN_IF_ERROR(CheckShape(num_experts, window.top_k, window.k_min, window.bins));
  BudgetHistogram h;
  h.window_ = window;
  h.num_experts_ = num_experts;
  h.forced_.assign(static_cast<size_t>(num_experts), 0);
  h.counts_.assign(static_cast<size_t>(num_experts * window.bins), 0);
  return h;
}

absl::Status BudgetHistogram::Accumulate(const Routing& full, const float* scores) {
  const int64_t k = window_.top_k, n = num_experts_, bins = window_.bins;
  if (full.top_k != k) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget histogram: a routing of k = ", full.top_k, " for k = ", k));
  }
  for (int64_t t = 0; t < full.tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = full.expert_ids[t * k + j];
      if (e < 0 || e >= n) {
        return absl::InvalidArgumentError(absl::StrCat("budget histogram: token ", t, " slot ", j,
                                                       " has expert ", e, " (a full routing)"));
      }
    }
  }
  for (int64_t t = 0; t < full.tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = full.expert_ids[t * k + j];
      if (j < window_.k_min) {
        ++forced_[e];
        continue;
      }
      const float s = scores[t * n + e];
      const int64_t l = std::clamp<int64_t>(static_cast<int64_t>(s * bins), 0, bins - 1);
      ++counts_[e * bins + l];
    }
  }
  tokens_ += full.tokens;
  return absl::OkStatus();
}

absl::Status BudgetHistogram::Merge(const BudgetHistogram& other) {
  const BudgetWindow& a = window_;
  const BudgetWindow& b = other.window_;
  if (a.bias_version != b.bias_version || a.layer != b.layer || a.top_k != b.top_k ||
      a.k_min != b.k_min || a.bins != b.bins || num_experts_ != other.num_experts_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "budget histogram: cannot merge (bias version ", b.bias_version, ", layer ", b.layer,
        ", k ", b.top_k, ", k_min ", b.k_min, ", ", b.bins, " bins, ", other.num_experts_,
        " experts) into (bias version ", a.bias_version, ", layer ", a.layer, ", k ", a.top_k,
        ", k_min ", a.k_min, ", ", a.bins, " bins, ", num_experts_, " experts)"));
  }
  for (size_t i = 0; i < counts_.size(); ++i) {
    if (counts_[i] > std::numeric_limits<uint32_t>::max() - other.counts_[i]) {
      return absl::ResourceExhaustedError("budget histogram: a bin would pass 2^32 counts");
    }
  }
  for (size_t i = 0; i < counts_.size(); ++i) counts_[i] += other.counts_[i];
  for (size_t i = 0; i < forced_.size(); ++i) forced_[i] += other.forced_[i];
  tokens_ += other.tokens_;
  return absl::OkStatus();
}

std::vector<float> BudgetHistogram::SolveTable() const {
  const int64_t k = window_.top_k, n = num_experts_, bins = window_.bins;
  std::vector<float> table(static_cast<size_t>((k - 1) * n), kKeepAll);
  if (tokens_ == 0) return table;
  const double width = 1.0 / static_cast<double>(bins);
  std::vector<int64_t> free_counts(static_cast<size_t>(n), 0), selections(free_counts);
  for (int64_t e = 0; e < n; ++e) {
    for (int64_t l = 0; l < bins; ++l) free_counts[e] += counts_[e * bins + l];
    selections[e] = forced_[e] + free_counts[e];
  }
  std::vector<std::vector<int64_t>> needs;
  for (int64_t b = 1; b < k; ++b) {
    needs.push_back(KeptCounts(b, k, tokens_, selections, forced_, free_counts));
  }
  for (int64_t e = 0; e < n; ++e) {
    const uint32_t* c = counts_.data() + e * bins;
    const int64_t free_count = free_counts[e];
    for (int64_t b = 1; b < k; ++b) {
      const double need = static_cast<double>(needs[b - 1][e]);
      float& theta = table[(b - 1) * n + e];
      if (need <= 0) {
        theta = kKeepNone;
        continue;
      }
      if (need >= static_cast<double>(free_count)) {
        theta = kKeepAll;
        continue;
      }
      double above = 0;
      for (int64_t l = bins - 1; l >= 0; --l) {
        const double h = c[l];
        if (h > 0 && above + h >= need) {
          const double frac = (need - above) / h;
          theta = static_cast<float>((static_cast<double>(l + 1) - frac) * width);
          break;
        }
        above += h;
      }
    }
  }
  return table;
}

std::string BudgetHistogram::Serialize() const {
  std::string out(kMagic, sizeof(kMagic));
  PutFixed<uint64_t>(window_.bias_version, &out);
  PutFixed<int32_t>(window_.layer, &out);
  PutFixed<uint32_t>(static_cast<uint32_t>(num_experts_), &out);
  PutFixed<uint32_t>(static_cast<uint32_t>(window_.top_k), &out);
  PutFixed<uint32_t>(static_cast<uint32_t>(window_.k_min), &out);
  PutFixed<uint32_t>(static_cast<uint32_t>(window_.bins), &out);
  PutVarint(static_cast<uint64_t>(tokens_), &out);
  for (int64_t f : forced_) PutVarint(static_cast<uint64_t>(f), &out);
  // Counts; a zero is followed by the length of its run of zeros.
  for (size_t i = 0; i < counts_.size();) {
    if (counts_[i] != 0) {
      PutVarint(counts_[i++], &out);
      continue;
    }
    size_t run = 0;
    while (i + run < counts_.size() && counts_[i + run] == 0) ++run;
    PutVarint(0, &out);
    PutVarint(run, &out);
    i += run;
  }
  return out;
}

absl::StatusOr<BudgetHistogram> BudgetHistogram::Deserialize(absl::string_view bytes) {
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return Corrupt("bad magic (not a serialized budget histogram)");
  }
  WireReader r(bytes.substr(sizeof(kMagic)));
  BudgetWindow w;
  uint32_t n = 0, k = 0, k_min = 0, bins = 0;
  if (!r.Fixed(&w.bias_version) || !r.Fixed(&w.layer) || !r.Fixed(&n) || !r.Fixed(&k) ||
      !r.Fixed(&k_min) || !r.Fixed(&bins)) {
    return Corrupt("truncated header");
  }
  w.top_k = k;
  w.k_min = k_min;
  w.bins = static_cast<int32_t>(bins);  // a value past 2^31 reads negative: refused below
  MOE_ASSIGN_OR_RETURN(BudgetHistogram h, Create(w, n));
  uint64_t v = 0;
  if (!r.Varint(&v) || v > kMaxTokens) return Corrupt("bad token count");
  h.tokens_ = static_cast<int64_t>(v);
  uint64_t total = 0;
  for (int64_t& f : h.forced_) {
    if (!r.Varint(&v) || v > static_cast<uint64_t>(h.tokens_)) return Corrupt("bad forced count");
    f = static_cast<int64_t>(v);
    total += v;
  }
  for (size_t i = 0; i < h.counts_.size();) {
    if (!r.Varint(&v) || v > static_cast<uint64_t>(h.tokens_)) return Corrupt("bad count");
    if (v != 0) {
      h.counts_[i++] = static_cast<uint32_t>(v);
      total += v;
      continue;
    }
    uint64_t run = 0;
    if (!r.Varint(&run) || run == 0 || run > h.counts_.size() - i) {
      return Corrupt("bad run of zeros");
    }
    i += run;
  }
  if (!r.AtEnd()) return Corrupt("trailing bytes");
  if (total != static_cast<uint64_t>(h.tokens_) * k) {
    return Corrupt(absl::StrCat("counts sum to ", total,
                                ", expected tokens * k = ", static_cast<uint64_t>(h.tokens_) * k));
  }
  return h;
}

}  // namespace moe::numerics
