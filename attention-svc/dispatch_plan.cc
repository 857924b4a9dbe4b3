#include "attention-svc/dispatch_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "services/numerics/combine.h"

namespace moe::attention_svc {

using tensor::Bf16;

absl::StatusOr<DispatchPlan> PlanDispatch(const numerics::Routing& routing,
                                          const tensor::Activations& z, const LayerRoute& route,
                                          const DispatchSpec& spec) {
  if (z.rows() != routing.tokens || z.cols() != spec.latent) {
    return absl::InvalidArgumentError(absl::StrCat("activations [", z.rows(), ", ", z.cols(),
                                                   "] for ", routing.tokens, " tokens of latent ",
                                                   spec.latent));
  }
  DispatchPlan plan;
  plan.mode = spec.mode;
  plan.tokens = routing.tokens;
  plan.top_k = routing.top_k;
  plan.latent = spec.latent;
  const int64_t k = routing.top_k, d = spec.latent;
  // (token, slot) pairs of each expert, ascending.
  const std::vector<std::vector<int64_t>> pairs =
      numerics::PairsByExpert(routing, spec.num_experts);
  plan.per_expert.resize(pairs.size());
  for (size_t e = 0; e < pairs.size(); ++e) {
    plan.per_expert[e] = static_cast<int64_t>(pairs[e].size());
  }
  // Each shard's routed experts, ascending.
  std::vector<std::vector<int32_t>> experts_of(route.shards.size());
  for (int32_t e = 0; e < static_cast<int32_t>(spec.num_experts); ++e) {
    if (pairs[e].empty()) continue;
    if (static_cast<size_t>(e) < spec.skip.size() && spec.skip[e]) continue;
    const int32_t o = e < static_cast<int32_t>(route.owner.size()) ? route.owner[e] : -1;
    if (o < 0) {
      return absl::UnavailableError(
          absl::StrCat("no expert shard hosts expert ", e, " of layer ", route.layer));
    }
    const ShardRef& s = route.shards[o];
    if (!s.healthy) {
      return absl::UnavailableError(absl::StrCat(
          "expert shard ", s.shard, " (", s.endpoint, ") serving experts [", s.lo, ", ", s.hi,
          ") of layer ", route.layer, " is unhealthy: no heartbeat for ", s.last_seen_ms, " ms"));
    }
    experts_of[o].push_back(e);
  }
  // Messages: a shard's experts in order, a new message whenever the reply would pass the byte
  // budget; whole experts only, so every expert sees all its rows in one batch (the same kernel
  // path as in process).
  const int64_t reply_row_bytes = d * (spec.mode == ReplyMode::kPerPair ? 2 : 4);
  for (size_t si = 0; si < route.shards.size(); ++si) {
    if (experts_of[si].empty()) continue;
    int64_t shard_rows = 0;
    std::vector<std::vector<int32_t>> chunks(1);
    int64_t rows = 0;
    for (int32_t e : experts_of[si]) {
      const int64_t n = plan.per_expert[e];
      if (!chunks.back().empty() && (rows + n) * reply_row_bytes > spec.max_message_bytes) {
        chunks.emplace_back();
        rows = 0;
      }
      chunks.back().push_back(e);
      rows += n;
      shard_rows += n;
    }
    plan.shard_rows.emplace_back(route.shards[si].shard, shard_rows);
    for (const std::vector<int32_t>& experts : chunks) {
      DispatchMessage m;
      m.shard = si;
      // Each distinct token's z once (row_source maps the rows to it).
      std::vector<int32_t> row_of_token(static_cast<size_t>(routing.tokens), -1);
      for (int32_t e : experts) {
        for (int64_t p : pairs[e]) row_of_token[p / k] = 0;
      }
      for (int64_t t = 0; t < routing.tokens; ++t) {
        if (row_of_token[t] < 0) continue;
        row_of_token[t] = static_cast<int32_t>(m.tokens.size());
        m.tokens.push_back(t);
      }
      // The message's tokens' rows, in the batch's format (MXFP8: quantized once per token).
      std::vector<int32_t> src(m.tokens.begin(), m.tokens.end());
      m.z = z.Gather(src.data(), static_cast<int64_t>(src.size()));
      for (int32_t e : experts) {
        m.groups.emplace_back(e, static_cast<int32_t>(pairs[e].size()));
        for (int64_t p : pairs[e]) {
          const int64_t t = p / k;
          m.pairs.push_back(p);
          m.row_source.push_back(row_of_token[t]);
          if (spec.mode == ReplyMode::kPartialSum) {
            m.token_index.push_back(static_cast<int32_t>(t));
            m.weights.push_back(routing.weights[p]);
          }
        }
      }
      plan.messages.push_back(std::move(m));
    }
  }
  return plan;
}

std::vector<int32_t> DegradeRouting(const LayerRoute& route, numerics::Routing* routing,
                                    std::vector<bool>* skip, int64_t* degraded_pairs) {
  const int64_t k = routing->top_k;
  std::vector<int32_t> missing;
  skip->assign(route.owner.size(), false);
  *degraded_pairs = 0;
  for (size_t e = 0; e < route.owner.size(); ++e) {
    const int32_t o = route.owner[e];
    (*skip)[e] = o < 0 || !route.shards[o].healthy;  // the owner is the healthiest replica
  }
  std::vector<bool> seen(route.owner.size(), false);
  for (int64_t t = 0; t < routing->tokens; ++t) {
    float all = 0, kept = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = routing->expert_ids[t * k + j];
      const float w = routing->weights[t * k + j];
      all += w;
      if (e < 0 || !(*skip)[e]) kept += w;  // e < 0: dropped by the budget, weight 0
    }
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = routing->expert_ids[t * k + j];
      float& w = routing->weights[t * k + j];
      if (e < 0) continue;
      if ((*skip)[e]) {
        w = 0;
        ++*degraded_pairs;
        if (!seen[e]) missing.push_back(e);
        seen[e] = true;
      } else if (kept < all) {
        w = kept > 0 ? w * (all / kept) : 0;
      }
    }
  }
  std::sort(missing.begin(), missing.end());
  return missing;
}

std::vector<float> DegradeLost(const std::vector<bool>& lost, numerics::Routing* routing,
                               int64_t* degraded_pairs, std::vector<int32_t>* missing) {
  const int64_t k = routing->top_k;
  std::vector<float> scale(static_cast<size_t>(routing->tokens), 1.0f);
  std::vector<bool> seen(lost.size(), false);
  for (int64_t t = 0; t < routing->tokens; ++t) {
    float all = 0, kept = 0;  // fp32 sums in slot order, as DegradeRouting's
    bool hit = false;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = routing->expert_ids[t * k + j];
      const float w = routing->weights[t * k + j];
      all += w;
      const bool gone = e >= 0 && static_cast<size_t>(e) < lost.size() && lost[e];
      if (!gone) kept += w;
      hit |= gone && w != 0;
    }
    if (!hit) continue;
    scale[t] = kept > 0 ? all / kept : 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = routing->expert_ids[t * k + j];
      float& w = routing->weights[t * k + j];
      if (e < 0) continue;
      if (static_cast<size_t>(e) < lost.size() && lost[e]) {
        if (w != 0) ++*degraded_pairs;
        w = 0;
        if (!seen[e]) missing->push_back(e);
        seen[e] = true;
      } else if (kept < all) {
        w = kept > 0 ? w * (all / kept) : 0;
      }
    }
  }
  return scale;
}

void ExpertReply::Own(std::vector<Bf16> values) {
  auto v = std::make_shared<const std::vector<Bf16>>(std::move(values));
  bf16 = absl::MakeConstSpan(*v);
  held = std::move(v);
}

ExpertReply ZeroReply(const DispatchMessage& m, bool partial_sums, int64_t latent) {
  ExpertReply r;
  if (partial_sums) {
    r.rows = static_cast<int64_t>(m.tokens.size());
    r.f32.assign(static_cast<size_t>(r.rows * latent), 0.0f);
  } else {
    r.rows = m.rows();
    r.Own(std::vector<Bf16>(static_cast<size_t>(r.rows * latent)));
  }
  return r;
}

absl::StatusOr<std::vector<Bf16>> Gather(const DispatchPlan& plan, const numerics::Routing& routing,
                                         const LayerRoute& route,
                                         const std::vector<ExpertReply>& replies,
                                         ThreadPool* pool) {
  const int64_t d = plan.latent, k = plan.top_k;
  if (replies.size() != plan.messages.size()) {
    return absl::InternalError(
        absl::StrCat(replies.size(), " replies for ", plan.messages.size(), " dispatch messages"));
  }
  std::vector<Bf16> r(static_cast<size_t>(plan.tokens * d));
  if (plan.mode == ReplyMode::kPerPair) {
    // Each pair's row where its reply holds it (slot order [T, k]); a slot no message carries
    // (dropped by the budget, or degraded) is not read.
    std::vector<const Bf16*> rows(static_cast<size_t>(plan.tokens * k), nullptr);
    for (size_t i = 0; i < replies.size(); ++i) {
      const DispatchMessage& m = plan.messages[i];
      const ExpertReply& rep = replies[i];
      if (rep.rows != m.rows() || static_cast<int64_t>(rep.bf16.size()) != m.rows() * d) {
        return absl::InternalError(absl::StrCat("shard ", route.shards[m.shard].shard, " returned ",
                                                rep.rows, " rows for ", m.rows()));
      }
      for (int64_t row = 0; row < m.rows(); ++row) rows[m.pairs[row]] = rep.bf16.data() + row * d;
    }
    numerics::CombineRows(routing, rows.data(), d, r.data(), pool);
    return r;
  }
  // Partial sums: messages are in ascending expert order, the order of the cross-server sum.
  std::vector<float> acc(static_cast<size_t>(plan.tokens * d), 0.0f);
  for (size_t i = 0; i < replies.size(); ++i) {
    const DispatchMessage& m = plan.messages[i];
    const ExpertReply& rep = replies[i];
    const int64_t want = static_cast<int64_t>(m.tokens.size());
    if (rep.rows != want || static_cast<int64_t>(rep.f32.size()) != want * d) {
      return absl::InternalError(absl::StrCat("shard ", route.shards[m.shard].shard, " returned ",
                                              rep.rows, " partial sums for ", want, " tokens"));
    }
    numerics::AddPartialSums(rep.f32.data(), m.tokens, d, acc.data());
  }
  for (size_t i = 0; i < acc.size(); ++i) r[i] = Bf16::FromFloat(acc[i]);
  return r;
}

}  // namespace moe::attention_svc
