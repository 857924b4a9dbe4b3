#include "services/numerics/qb.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/numerics/qb_rows.h"
#include "services/numerics/router.h"
#include "services/numerics/wire_codec.h"

namespace moe::numerics {
namespace {

using qb_rows::AddRowChecked;
using qb_rows::BinRow;
using qb_rows::Finite;
using qb_rows::KeepAbove;
using qb_rows::KeptMargins;

constexpr char kMagic[4] = {'Q', 'B', 'H', '1'};

// Top-(k+1) of the biased scores of one token: routes (first k) and the cutoff alpha. False
// (nothing routed) when a score is not finite: the steps check the scores as they route them
// (one pass over memory, not two) and report the culprit after (ValidateQbInput).
bool RouteToken(const float* s, const float* bias, int64_t n, int64_t k, float* biased,
                int32_t* top) {
  if (!AddRowChecked(s, bias, n, biased)) return false;
  TopK(biased, n, k + 1, top);
  return true;
}

absl::Status Corrupt(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("QB histogram: ", what));
}

// The QB steps' threads: every core up to 8 (router-svc's step and an attention node's report
// are short bursts), at most one per kMinRowsPerThread rows.
constexpr int64_t kMinRowsPerThread = 1024;
int QbThreads(int64_t rows) {
  const int64_t cores = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 8);
  return static_cast<int>(std::clamp<int64_t>(rows / kMinRowsPerThread, 1, cores));
}

// fn(part, lo, hi) on `parts` contiguous pieces of [0, count), the first on this thread. Each
// piece writes its own outputs: the result does not depend on the split.
template <typename Fn>
void SplitWork(int64_t count, int parts, Fn fn) {
  parts = static_cast<int>(std::clamp<int64_t>(parts, 1, std::max<int64_t>(1, count)));
  std::vector<std::thread> threads;
  for (int p = 1; p < parts; ++p) {
    threads.emplace_back(fn, p, count * p / parts, count * (p + 1) / parts);
  }
  fn(0, 0, count / parts);
  for (std::thread& t : threads) t.join();
}

}  // namespace

namespace {

// Everything ValidateQbInput checks but the scores' values.
absl::Status ValidateQbShapes(size_t count, int64_t m, int64_t n, absl::Span<const float> bias,
                              int64_t k) {
  if (n < 2) return absl::InvalidArgumentError(absl::StrCat("QB needs n >= 2 experts, got ", n));
  if (k < 1 || k >= n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QB needs 1 <= k < n (the (k+1)-th score is the cutoff); got k = ", k, ", n = ", n));
  }
  if (m < 0 || static_cast<int64_t>(count) != m * n) {
    return absl::InvalidArgumentError(
        absl::StrCat("scores hold ", count, " values; [", m, ", ", n, "] needs ", m * n));
  }
  if (static_cast<int64_t>(bias.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("bias has ", bias.size(), " entries; there are ", n, " experts"));
  }
  for (int64_t j = 0; j < n; ++j) {
    if (!std::isfinite(bias[j])) {
      return absl::InvalidArgumentError(absl::StrCat("bias of expert ", j, " is not finite"));
    }
    // Scores lie in [0, 1]; a bias this large only breaks the histogram's range (its +-1 margin
    // vanishes in double arithmetic and the bins collapse to width 0).
    if (std::fabs(bias[j]) > kMaxQbBias) {
      return absl::InvalidArgumentError(absl::StrCat("bias of expert ", j, " is ", bias[j],
                                                     ": |bias| must be at most ", kMaxQbBias));
    }
  }
  return absl::OkStatus();
}

// The error of scores a step found not finite while routing them (ValidateQbInput names the
// first culprit).
absl::Status NonFinite(absl::Span<const float> scores, int64_t m, int64_t n,
                       absl::Span<const float> bias, int64_t k) {
  absl::Status s = ValidateQbInput(scores, m, n, bias, k);
  return s.ok() ? absl::InternalError("QB: a score was not finite, then was") : s;
}

}  // namespace

absl::Status ValidateQbInput(absl::Span<const float> scores, int64_t m, int64_t n,
                             absl::Span<const float> bias, int64_t k) {
  MOE_RETURN_IF_ERROR(ValidateQbShapes(scores.size(), m, n, bias, k));
  // A branch-free scan first (vectorized, over the QB threads); locate the culprit only then.
  const int parts = QbThreads(m);
  std::vector<char> finite(static_cast<size_t>(parts), 1);
  SplitWork(m, parts, [&](int part, int64_t lo, int64_t hi) {
    finite[part] = Finite(scores.data() + lo * n, (hi - lo) * n);
  });
  const bool non_finite = std::find(finite.begin(), finite.end(), 0) != finite.end();
  for (size_t i = 0; non_finite && i < scores.size(); ++i) {
    if (!std::isfinite(scores[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("score of token ", i / n, ", expert ", i % n, " is not finite"));
    }
  }
  return absl::OkStatus();
}

std::vector<int64_t> RouteLoads(absl::Span<const float> scores, int64_t m, int64_t n,
                                absl::Span<const float> bias, int64_t k) {
  const int parts = QbThreads(m);
  std::vector<std::vector<int64_t>> part_loads(static_cast<size_t>(parts),
                                               std::vector<int64_t>(static_cast<size_t>(n), 0));
  SplitWork(m, parts, [&](int part, int64_t lo, int64_t hi) {
    std::vector<int64_t>& loads = part_loads[part];
    std::vector<float> biased(static_cast<size_t>(n));
    std::vector<int32_t> top(static_cast<size_t>(k));
    for (int64_t i = lo; i < hi; ++i) {
      const float* s = scores.data() + i * n;
      AddRowChecked(s, bias.data(), n, biased.data());  // RouteLoads does not validate
      TopK(biased.data(), n, k, top.data());
      for (int64_t r = 0; r < k; ++r) ++loads[top[r]];
    }
  });
  std::vector<int64_t> loads = std::move(part_loads[0]);
  for (int p = 1; p < parts; ++p) {
    for (int64_t j = 0; j < n; ++j) loads[j] += part_loads[p][j];
  }
  return loads;
}

std::vector<float> CenterBias(absl::Span<const float> bias) {
  double mean = 0;
  for (float b : bias) mean += b;
  mean /= std::max<size_t>(1, bias.size());
  std::vector<float> out(bias.size());
  for (size_t j = 0; j < bias.size(); ++j) out[j] = static_cast<float>(bias[j] - mean);
  return out;
}

absl::StatusOr<QbStep> QbExactStep(absl::Span<const float> scores, int64_t m, int64_t n,
                                   absl::Span<const float> bias, int64_t k) {
  // The scores' values are checked as they are routed (below).
  MOE_RETURN_IF_ERROR(ValidateQbShapes(scores.size(), m, n, bias, k));
  QbStep step;
  step.loads.assign(static_cast<size_t>(n), 0);
  if (m == 0) {
    step.raw_bias.assign(bias.begin(), bias.end());
    step.bias = step.raw_bias;
    return step;
  }
  step.routes.resize(static_cast<size_t>(m * k));
  step.cutoffs.resize(static_cast<size_t>(m));
  const int parts = QbThreads(m);
  // b-hat_j = -(the (floor(q)+1)-th largest margin of column j), margin = s_ij - cutoff_i,
  // exactly (ties counted) and without a transposed copy of the scores: a sample of every 16th
  // token (routed first, for its cutoff) sets a per-column threshold above which about twice the
  // needed margins lie; one pass over the tokens routes each and keeps its margins above the
  // thresholds (most columns of a row are passed over in blocks of 16); nth_element picks the
  // value among the kept ones. A column whose threshold kept too few (an unlucky sample) is
  // done again in full.
  const double q = static_cast<double>(m) * k / n;
  const int64_t rank = static_cast<int64_t>(std::floor(q));  // 0-based, descending
  constexpr int64_t kStride = 16;
  const int64_t sampled = (m + kStride - 1) / kStride;
  // The sample's rank of the threshold: about twice the expected count above the needed value,
  // at most 31 when that is still 1.5 times it (then TopK's fast form selects it: K3's window
  // expects 18.3 and takes 31, where a column falls short with probability about 0.3%).
  const double expected = static_cast<double>(sampled) * (rank + 1) / m;
  int64_t want = std::min(sampled - 1, 2 * (rank + 1) / kStride + 2);
  if (want > 31 && 31 >= 1.5 * expected) want = 31;
  std::vector<float> threshold(static_cast<size_t>(n), -std::numeric_limits<float>::infinity());
  if (want < sampled - 1) {
    std::vector<float> sample(static_cast<size_t>(n * sampled));  // [n, sampled]
    // Tiles of 16 sampled tokens, written column by column as whole cache lines.
    constexpr int64_t kTile = 16;
    SplitWork((sampled + kTile - 1) / kTile, parts, [&](int, int64_t b0, int64_t b1) {
      std::vector<float> biased(static_cast<size_t>(n)), tile(static_cast<size_t>(kTile * n));
      std::vector<int32_t> top(static_cast<size_t>(k + 1));
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t t0 = b * kTile, rows = std::min(kTile, sampled - t0);
        for (int64_t t = 0; t < rows; ++t) {
          const float* s = scores.data() + (t0 + t) * kStride * n;
          if (!RouteToken(s, bias.data(), n, k, biased.data(), top.data())) {
            // Not finite: samples as never kept (no NaN reaches a selection; the main pass
            // refuses the input).
            for (int64_t j = 0; j < n; ++j) {
              tile[j * kTile + t] = -std::numeric_limits<float>::infinity();
            }
            continue;
          }
          const float cutoff = biased[top[k]];
          for (int64_t j = 0; j < n; ++j) tile[j * kTile + t] = s[j] - cutoff;
        }
        for (int64_t j = 0; j < n; ++j) {
          std::copy(tile.begin() + j * kTile, tile.begin() + j * kTile + rows,
                    sample.begin() + j * sampled + t0);
        }
      }
    });
    SplitWork(n, parts, [&](int, int64_t j0, int64_t j1) {
      std::vector<int32_t> order(static_cast<size_t>(want + 1));
      for (int64_t j = j0; j < j1; ++j) {
        float* col = sample.data() + j * sampled;
        if (want < 32) {  // the (want+1)-th largest value either way
          TopK(col, sampled, want + 1, order.data());
          threshold[j] = col[order[want]];
        } else {
          std::nth_element(col, col + want, col + sampled, std::greater<float>());
          threshold[j] = col[want];
        }
      }
    });
  }
  // Tokens in contiguous pieces, one per thread: routes and cutoffs per token, loads and the
  // kept margins per piece.
  std::vector<std::vector<int64_t>> part_loads(static_cast<size_t>(parts),
                                               std::vector<int64_t>(static_cast<size_t>(n), 0));
  std::vector<KeptMargins> kept(static_cast<size_t>(parts));
  std::vector<char> bad(static_cast<size_t>(parts), 0);
  SplitWork(m, parts, [&](int part, int64_t lo, int64_t hi) {
    std::vector<float> biased(static_cast<size_t>(n));
    std::vector<int32_t> top(static_cast<size_t>(k + 1));
    std::vector<int64_t>& loads = part_loads[part];
    for (int64_t i = lo; i < hi; ++i) {
      const float* s = scores.data() + i * n;
      if (!RouteToken(s, bias.data(), n, k, biased.data(), top.data())) {
        bad[part] = 1;
        return;
      }
      for (int64_t r = 0; r < k; ++r) {
        step.routes[i * k + r] = top[r];
        ++loads[top[r]];
      }
      const float cutoff = biased[top[k]];
      step.cutoffs[i] = cutoff;
      KeepAbove(s, cutoff, threshold.data(), n, &kept[part]);
    }
  });
  if (std::find(bad.begin(), bad.end(), 1) != bad.end()) return NonFinite(scores, m, n, bias, k);
  for (int p = 0; p < parts; ++p) {
    for (int64_t j = 0; j < n; ++j) step.loads[j] += part_loads[p][j];
  }
  // The kept margins grouped by column (a counting sort of the pairs).
  std::vector<int64_t> start(static_cast<size_t>(n + 1), 0);
  for (const KeptMargins& kp : kept) {
    for (int64_t x = 0; x < kp.size; ++x) ++start[kp.column[x] + 1];
  }
  for (int64_t j = 0; j < n; ++j) start[j + 1] += start[j];
  std::vector<float> grouped(static_cast<size_t>(start[n]));
  {
    std::vector<int64_t> at(start.begin(), start.end() - 1);
    for (const KeptMargins& kp : kept) {
      for (int64_t x = 0; x < kp.size; ++x) grouped[at[kp.column[x]]++] = kp.value[x];
    }
  }
  step.raw_bias.resize(static_cast<size_t>(n));
  SplitWork(n, parts, [&](int, int64_t j0, int64_t j1) {
    std::vector<float> column;
    for (int64_t j = j0; j < j1; ++j) {
      column.assign(grouped.begin() + start[j], grouped.begin() + start[j + 1]);
      if (static_cast<int64_t>(column.size()) <= rank) {  // too few above: the whole column
        column.resize(static_cast<size_t>(m));
        for (int64_t i = 0; i < m; ++i) column[i] = scores[i * n + j] - step.cutoffs[i];
      }
      std::nth_element(column.begin(), column.begin() + rank, column.end(), std::greater<float>());
      step.raw_bias[j] = -column[rank];
    }
  });
  step.bias = CenterBias(step.raw_bias);
  return step;
}

std::vector<float> SignRuleStep(absl::Span<const float> bias, absl::Span<const int64_t> loads,
                                float gamma) {
  int64_t total = 0;
  for (int64_t l : loads) total += l;
  const double q = static_cast<double>(total) / std::max<size_t>(1, loads.size());
  std::vector<float> out(bias.begin(), bias.end());
  for (size_t j = 0; j < out.size(); ++j) {
    const double d = q - static_cast<double>(loads[j]);
    out[j] += d > 0 ? gamma : (d < 0 ? -gamma : 0.0f);
  }
  return out;
}

absl::StatusOr<QbHistogram> QbHistogram::Create(const QbWindow& window,
                                                absl::Span<const float> routing_bias) {
  const int64_t n = static_cast<int64_t>(routing_bias.size());
  MOE_RETURN_IF_ERROR(ValidateQbInput({}, 0, n, routing_bias, window.top_k));
  if (window.bins < 1 || window.bins > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("QB histogram bins must be in [1, 2^20], got ", window.bins));
  }
  QbHistogram h;
  h.window_ = window;
  h.num_experts_ = n;
  h.bias_.assign(routing_bias.begin(), routing_bias.end());
  const auto [mn, mx] = std::minmax_element(routing_bias.begin(), routing_bias.end());
  h.lo_ = static_cast<double>(*mn) - 1.0;
  h.hi_ = static_cast<double>(*mx) + 1.0;
  h.loads_.assign(static_cast<size_t>(n), 0);
  h.counts_.assign(static_cast<size_t>(n * window.bins), 0);
  return h;
}

absl::Status QbHistogram::Accumulate(absl::Span<const float> scores, int64_t m) {
  const int64_t n = num_experts_, k = window_.top_k, bins = window_.bins;
  // The scores' values are checked as they are routed (below).
  MOE_RETURN_IF_ERROR(ValidateQbShapes(scores.size(), m, n, bias_, k));
  const double inv_w = bins / (hi_ - lo_);
  if (QbThreads(m) == 1) return AccumulateDirect(scores, m, inv_w);
  // Tokens in pieces over the cores, each counted into its own histogram, added to this one
  // only when every token was finite (integer sums: the result does not depend on the split;
  // refused input changes nothing).
  // A piece counts in 16 bits (half the cache footprint of the n x bins table: 1.8 MB at K3
  // with 1000 bins, within a core's L2) and moves its counts into 32 bits before one could
  // overflow (every 65535 tokens).
  const int parts = QbThreads(m);
  std::vector<std::vector<int64_t>> part_loads(static_cast<size_t>(parts));
  std::vector<std::vector<uint16_t>> part_counts(static_cast<size_t>(parts));
  std::vector<std::vector<uint32_t>> part_wide(static_cast<size_t>(parts));
  std::vector<char> bad(static_cast<size_t>(parts), 0);
  SplitWork(m, parts, [&](int part, int64_t lo, int64_t hi) {
    part_loads[part].assign(static_cast<size_t>(n), 0);
    part_counts[part].assign(counts_.size(), 0);
    int64_t* loads = part_loads[part].data();
    uint16_t* counts = part_counts[part].data();
    int64_t since_flush = 0;
    std::vector<float> biased(static_cast<size_t>(n));
    std::vector<int32_t> top(static_cast<size_t>(k + 1));
    // Bins of a tile of tokens first (vectorized), then the counts expert by expert: a tile's
    // increments of one expert fall in that expert's row of bins (4 KB at 1000 bins), not all
    // over the n x bins table (3.6 MB at K3, past L2) as token by token.
    constexpr int64_t kTile = 32;
    std::vector<int32_t> bin(static_cast<size_t>(kTile * n));
    for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
      const int64_t rows = std::min(kTile, hi - t0);
      if (since_flush + rows > 65535) {
        std::vector<uint32_t>& wide = part_wide[part];
        if (wide.empty()) wide.assign(counts_.size(), 0);
        for (size_t i = 0; i < wide.size(); ++i) wide[i] += counts[i];
        std::fill(part_counts[part].begin(), part_counts[part].end(), 0);
        since_flush = 0;
      }
      since_flush += rows;
      for (int64_t t = 0; t < rows; ++t) {
        const float* s = scores.data() + (t0 + t) * n;
        if (!RouteToken(s, bias_.data(), n, k, biased.data(), top.data())) {
          bad[part] = 1;
          return;
        }
        for (int64_t r = 0; r < k; ++r) ++loads[top[r]];
        BinRow(s, biased[top[k]], lo_, inv_w, bins, n, bin.data() + t * n);
      }
      for (int64_t j = 0; j < n; ++j) {
        uint16_t* row = counts + j * bins;
        for (int64_t t = 0; t < rows; ++t) ++row[bin[t * n + j]];
      }
    }
  });
  if (std::find(bad.begin(), bad.end(), 1) != bad.end()) {
    return NonFinite(scores, m, n, bias_, k);
  }
  for (int p = 0; p < parts; ++p) {
    for (size_t i = 0; i < counts_.size(); ++i) counts_[i] += part_counts[p][i];
    for (size_t i = 0; i < part_wide[p].size(); ++i) counts_[i] += part_wide[p][i];
    for (int64_t j = 0; j < n; ++j) loads_[j] += part_loads[p][j];
  }
  tokens_ += m;
  return absl::OkStatus();
}

absl::Status QbHistogram::AccumulateDirect(absl::Span<const float> scores, int64_t m,
                                           double inv_w) {
  const int64_t n = num_experts_, k = window_.top_k, bins = window_.bins;
  // Every token routed (and so checked) before anything is counted: refused input changes
  // nothing. Then the counts go straight into the window's table, a tile's increments expert by
  // expert as below: the same integer sums as the pieces' tables.
  std::vector<float> biased(static_cast<size_t>(n)), cut(static_cast<size_t>(m));
  std::vector<int32_t> top(static_cast<size_t>(m * (k + 1)));
  for (int64_t t = 0; t < m; ++t) {
    int32_t* tt = top.data() + t * (k + 1);
    if (!RouteToken(scores.data() + t * n, bias_.data(), n, k, biased.data(), tt)) {
      return NonFinite(scores, m, n, bias_, k);
    }
    cut[t] = biased[tt[k]];
  }
  constexpr int64_t kTile = 32;
  std::vector<int32_t> bin(static_cast<size_t>(std::min(kTile, m) * n));
  for (int64_t t0 = 0; t0 < m; t0 += kTile) {
    const int64_t rows = std::min(kTile, m - t0);
    for (int64_t t = 0; t < rows; ++t) {
      const int32_t* tt = top.data() + (t0 + t) * (k + 1);
      for (int64_t r = 0; r < k; ++r) ++loads_[tt[r]];
      BinRow(scores.data() + (t0 + t) * n, cut[t0 + t], lo_, inv_w, bins, n, bin.data() + t * n);
    }
    for (int64_t j = 0; j < n; ++j) {
      uint32_t* row = counts_.data() + j * bins;
      for (int64_t t = 0; t < rows; ++t) ++row[bin[t * n + j]];
    }
  }
  tokens_ += m;
  return absl::OkStatus();
}

absl::Status QbHistogram::Merge(const QbHistogram& o) {
  if (o.window_.window_id != window_.window_id) {
    return absl::FailedPreconditionError(absl::StrCat("QB statistics are for window ",
                                                      o.window_.window_id, ", this window is ",
                                                      window_.window_id));
  }
  if (o.window_.bias_version != window_.bias_version) {
    return absl::FailedPreconditionError(
        absl::StrCat("QB statistics were routed with bias version ", o.window_.bias_version,
                     ", this window uses version ", window_.bias_version));
  }
  if (o.window_.layer != window_.layer || o.window_.top_k != window_.top_k ||
      o.window_.bins != window_.bins || o.num_experts_ != num_experts_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "QB statistics shape (layer ", o.window_.layer, ", n ", o.num_experts_, ", k ",
        o.window_.top_k, ", bins ", o.window_.bins, ") differs from this window's (layer ",
        window_.layer, ", n ", num_experts_, ", k ", window_.top_k, ", bins ", window_.bins, ")"));
  }
  if (o.lo_ != lo_ || o.hi_ != hi_) {
    return absl::FailedPreconditionError(absl::StrCat("QB statistics range [", o.lo_, ", ", o.hi_,
                                                      "] differs from this window's [", lo_, ", ",
                                                      hi_, "]"));
  }
  for (size_t i = 0; i < counts_.size(); ++i) counts_[i] += o.counts_[i];
  for (size_t j = 0; j < loads_.size(); ++j) loads_[j] += o.loads_[j];
  tokens_ += o.tokens_;
  return absl::OkStatus();
}

std::vector<float> QbHistogram::Solve() const {
  if (tokens_ == 0) return bias_;
  const int64_t n = num_experts_, bins = window_.bins;
  const double q = static_cast<double>(tokens_) * window_.top_k / n;
  const int64_t need = static_cast<int64_t>(std::ceil(q));
  const double w = bin_width();
  std::vector<float> raw(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* row = counts_.data() + j * bins;
    int64_t before = 0;
    int64_t l = 0;
    for (; l < bins - 1 && before + row[l] < need; ++l) before += row[l];
    const double h = row[l];
    const double frac = h > 0 ? std::clamp((q - before) / h, 0.0, 1.0) : 0.0;
    raw[j] = static_cast<float>(lo_ + (l + frac) * w);
  }
  return CenterBias(raw);
}

std::vector<double> QbHistogram::PredictLoads(absl::Span<const float> bias) const {
  const int64_t n = num_experts_, bins = window_.bins;
  std::vector<double> loads(static_cast<size_t>(n), 0.0);
  if (tokens_ == 0 || static_cast<int64_t>(bias.size()) != n) return loads;
  // prefix[j * (bins + 1) + l]: count of expert j's values in bins [0, l).
  std::vector<int64_t> prefix(static_cast<size_t>(n * (bins + 1)));
  for (int64_t j = 0; j < n; ++j) {
    int64_t* p = prefix.data() + j * (bins + 1);
    p[0] = 0;
    for (int64_t l = 0; l < bins; ++l) p[l + 1] = p[l] + counts_[j * bins + l];
  }
  const double w = bin_width();
  auto load_at = [&](int64_t j, double b) {
    const int64_t* p = prefix.data() + j * (bins + 1);
    const double pos = (b - lo_) / w;
    if (pos <= 0) return 0.0;
    if (pos >= static_cast<double>(bins)) return static_cast<double>(p[bins]);
    const int64_t l = static_cast<int64_t>(pos);
    return p[l] + (pos - l) * static_cast<double>(p[l + 1] - p[l]);
  };
  const double target = static_cast<double>(tokens_) * window_.top_k;
  auto total_at = [&](double c) {
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += load_at(j, bias[j] + c);
    return sum;
  };
  const auto [bmin, bmax] = std::minmax_element(bias.begin(), bias.end());
  double c_lo = lo_ - *bmax, c_hi = hi_ - *bmin;  // total 0 at c_lo, tokens * n at c_hi
  for (int it = 0; it < 64; ++it) {
    const double mid = 0.5 * (c_lo + c_hi);
    (total_at(mid) < target ? c_lo : c_hi) = mid;
  }
  for (int64_t j = 0; j < n; ++j) loads[j] = load_at(j, bias[j] + c_hi);
  return loads;
}

std::string QbHistogram::Serialize() const {
  std::string out(kMagic, sizeof(kMagic));
  PutFixed<uint64_t>(window_.window_id, &out);
  PutFixed<uint64_t>(window_.bias_version, &out);
  PutFixed<int32_t>(window_.layer, &out);
  PutFixed<uint32_t>(static_cast<uint32_t>(num_experts_), &out);
  PutFixed<uint32_t>(static_cast<uint32_t>(window_.top_k), &out);
  PutFixed<uint32_t>(static_cast<uint32_t>(window_.bins), &out);
  for (float b : bias_) PutFixed<float>(b, &out);
  PutVarint(static_cast<uint64_t>(tokens_), &out);
  for (int64_t l : loads_) PutVarint(static_cast<uint64_t>(l), &out);
  for (uint32_t c : counts_) PutVarint(c, &out);
  return out;
}

absl::StatusOr<QbHistogram> QbHistogram::Deserialize(absl::string_view bytes) {
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return Corrupt("bad magic (not a serialized QB histogram)");
  }
  WireReader r(bytes.substr(sizeof(kMagic)));
  QbWindow w;
  uint32_t n = 0, k = 0, bins = 0;
  if (!r.Fixed(&w.window_id) || !r.Fixed(&w.bias_version) || !r.Fixed(&w.layer) || !r.Fixed(&n) ||
      !r.Fixed(&k) || !r.Fixed(&bins)) {
    return Corrupt("truncated header");
  }
  if (n < 2 || n > (1u << 20) || bins < 1 || bins > (1u << 20) ||
      static_cast<uint64_t>(n) * bins > (uint64_t{1} << 28)) {
    return Corrupt(absl::StrCat("implausible shape n = ", n, ", bins = ", bins));
  }
  w.top_k = k;
  w.bins = static_cast<int32_t>(bins);
  // Every bias is 4 bytes and every varint at least one: a message too short for its shape is
  // refused before the n x bins counts are allocated (28 bytes must not claim 1 GiB).
  const uint64_t least = sizeof(kMagic) + 32 + 4ull * n + 1 + n + uint64_t{n} * bins;
  if (bytes.size() < least) {
    return Corrupt(absl::StrCat("truncated: ", bytes.size(), " bytes, n = ", n,
                                " and bins = ", bins, " need at least ", least));
  }
  std::vector<float> bias(n);
  for (float& b : bias) {
    if (!r.Fixed(&b)) return Corrupt("truncated bias");
  }
  MOE_ASSIGN_OR_RETURN(QbHistogram h, Create(w, bias));
  uint64_t v;
  if (!r.Varint(&v) || v > (uint64_t{1} << 40)) return Corrupt("bad token count");
  h.tokens_ = static_cast<int64_t>(v);
  int64_t load_sum = 0;
  for (int64_t& l : h.loads_) {
    if (!r.Varint(&v) || v > static_cast<uint64_t>(h.tokens_)) return Corrupt("bad load count");
    l = static_cast<int64_t>(v);
    load_sum += l;
  }
  if (load_sum != h.tokens_ * static_cast<int64_t>(k)) {
    return Corrupt(absl::StrCat("loads sum to ", load_sum,
                                ", expected tokens * k = ", h.tokens_ * static_cast<int64_t>(k)));
  }
  for (uint32_t j = 0; j < n; ++j) {
    uint64_t row = 0;
    for (uint32_t l = 0; l < bins; ++l) {
      if (!r.Varint(&v) || v > 0xffffffffull) return Corrupt("bad bin count");
      h.counts_[static_cast<size_t>(j) * bins + l] = static_cast<uint32_t>(v);
      row += v;
    }
    if (row != static_cast<uint64_t>(h.tokens_)) {
      return Corrupt(
          absl::StrCat("row of expert ", j, " sums to ", row, ", expected ", h.tokens_, " tokens"));
    }
  }
  if (!r.AtEnd()) return Corrupt("trailing bytes");
  return h;
}

BalanceMetrics ComputeBalance(absl::Span<const int64_t> loads,
                              absl::Span<const int32_t> shard_of_expert) {
  BalanceMetrics m;
  const size_t n = loads.size();
  if (n == 0) return m;
  double total = 0;
  for (int64_t l : loads) total += static_cast<double>(l);
  m.target = total / n;
  if (m.target <= 0) return m;
  const auto [mn, mx] = std::minmax_element(loads.begin(), loads.end());
  m.max_vio = *mx / m.target - 1.0;
  m.min_over_target = *mn / m.target;
  double var = 0;
  for (int64_t l : loads) {
    var += (l - m.target) * (l - m.target);
    m.dead += l == 0;
  }
  m.cv = std::sqrt(var / n) / m.target;
  m.shard_max_over_mean = 1.0;
  if (shard_of_expert.size() == n) {
    const int32_t shards = *std::max_element(shard_of_expert.begin(), shard_of_expert.end()) + 1;
    std::vector<double> per(static_cast<size_t>(shards), 0.0);
    for (size_t j = 0; j < n; ++j) per[shard_of_expert[j]] += static_cast<double>(loads[j]);
    m.shard_max_over_mean = *std::max_element(per.begin(), per.end()) / (total / shards);
  }
  return m;
}

double NoiseFloorMaxVio(int64_t n, double q) {
  return q > 0 ? std::sqrt(2.0 * std::log(static_cast<double>(n))) / std::sqrt(q) : 0.0;
}

}  // namespace moe::numerics
