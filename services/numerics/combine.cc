#include "services/numerics/combine.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "services/common/thread_pool.h"

namespace moe::numerics::ref {

void Combine(const Routing& routing, const tensor::Bf16* y, int64_t latent, tensor::Bf16* r) {
  const int64_t k = routing.top_k;
  std::vector<int64_t> slots(static_cast<size_t>(k));
  std::vector<float> acc(static_cast<size_t>(latent));
  for (int64_t t = 0; t < routing.tokens; ++t) {
    const int32_t* ids = routing.expert_ids.data() + t * k;
    std::iota(slots.begin(), slots.end(), 0);
    std::sort(slots.begin(), slots.end(), [ids](int64_t a, int64_t b) { return ids[a] < ids[b]; });
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t slot : slots) {
      if (ids[slot] < 0) continue;  // dropped by the budget (dynamic_k.h)
      const float w = routing.weights[t * k + slot];
      const tensor::Bf16* ys = y + (t * k + slot) * latent;
      for (int64_t d = 0; d < latent; ++d) {
        const float product = ys[d].ToFloat() * w;
        acc[d] = acc[d] + product;
      }
    }
    for (int64_t d = 0; d < latent; ++d) r[t * latent + d] = tensor::Bf16::FromFloat(acc[d]);
  }
}

}  // namespace moe::numerics::ref

namespace moe::numerics {
namespace {

// One token: its slots in ascending expert id (ref::Combine's order), each product rounded to
// fp32 before it is added (no FMA: -ffp-contract=off), from 0.0f. Columns in blocks of 16 with a
// fixed inner count so that the compiler vectorizes them (lanes are columns: the order of each
// column's sum is unchanged).
void CombineToken(const int32_t* ids, const float* weights, const tensor::Bf16* const* rows,
                  int64_t k, int64_t latent, int64_t* slots, float* acc, tensor::Bf16* out) {
  int64_t n = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (ids[j] < 0) continue;  // dropped by the budget (dynamic_k.h)
    int64_t at = n++;
    for (; at > 0 && ids[slots[at - 1]] > ids[j]; --at) slots[at] = slots[at - 1];
    slots[at] = j;
  }
  std::fill(acc, acc + latent, 0.0f);
  constexpr int64_t kBlock = 16;
  const int64_t whole = latent - latent % kBlock;
  for (int64_t i = 0; i < n; ++i) {
    const float w = weights[slots[i]];
    const tensor::Bf16* y = rows[slots[i]];
    if (y == nullptr) {  // a row no one sent: zeros, as in a zeroed [T, k, D] gather
      for (int64_t c = 0; c < latent; ++c) acc[c] = acc[c] + 0.0f * w;
      continue;
    }
    for (int64_t c = 0; c < whole; c += kBlock) {
      for (int64_t b = 0; b < kBlock; ++b) {
        const float product = y[c + b].ToFloat() * w;
        acc[c + b] = acc[c + b] + product;
      }
    }
    for (int64_t c = whole; c < latent; ++c) {
      const float product = y[c].ToFloat() * w;
      acc[c] = acc[c] + product;
    }
  }
  for (int64_t c = 0; c < latent; ++c) out[c] = tensor::Bf16::FromFloat(acc[c]);
}

}  // namespace

void CombineRows(const Routing& routing, const tensor::Bf16* const* rows, int64_t latent,
                 tensor::Bf16* r, ThreadPool* pool) {
  const int64_t k = routing.top_k, tokens = routing.tokens;
  // Blocks of tokens worth a hand-off: ~64K products each (a wake-up here costs ~10-20 us).
  const int64_t per_block =
      std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, k * latent));
  const int64_t blocks = (tokens + per_block - 1) / per_block;
  auto block = [&](int64_t b) {
    std::vector<float> acc(static_cast<size_t>(latent));
    std::vector<int64_t> slots(static_cast<size_t>(k));
    const int64_t end = std::min(tokens, (b + 1) * per_block);
    for (int64_t t = b * per_block; t < end; ++t) {
      CombineToken(routing.expert_ids.data() + t * k, routing.weights.data() + t * k, rows + t * k,
                   k, latent, slots.data(), acc.data(), r + t * latent);
    }
  };
  if (pool == nullptr || blocks < 2 || !pool->TryParallelFor(blocks, block)) {
    for (int64_t b = 0; b < blocks; ++b) block(b);
  }
}

std::vector<int64_t> PartialSums(const tensor::Bf16* y, int64_t rows, int64_t latent,
                                 const int32_t* token_index, const float* weights,
                                 int64_t num_tokens, std::vector<float>* out) {
  // Memory in the rows, never in num_tokens (a caller's claim: a small batch may say 2^30).
  (void)num_tokens;
  std::vector<int64_t> distinct(token_index, token_index + rows);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  out->assign(distinct.size() * static_cast<size_t>(latent), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot =
        std::lower_bound(distinct.begin(), distinct.end(), int64_t{token_index[r]}) -
        distinct.begin();
    float* a = out->data() + slot * latent;
    const tensor::Bf16* yr = y + r * latent;
    const float w = weights[r];
    for (int64_t c = 0; c < latent; ++c) a[c] += yr[c].ToFloat() * w;
  }
  return distinct;
}

void AddPartialSums(const float* part, const std::vector<int64_t>& tokens, int64_t latent,
                    float* acc) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    float* a = acc + tokens[i] * latent;
    const float* p = part + static_cast<int64_t>(i) * latent;
    for (int64_t c = 0; c < latent; ++c) a[c] += p[c];
  }
}

}  // namespace moe::numerics
